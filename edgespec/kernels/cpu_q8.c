/* A Llama-style decoder's forward pass with int8 weights, for drafting on the CPU device
 * (edgespec/drafters/quantized.py, edgespec/kernels/q8.py).
 *
 * A drafting step of a small model is bound by reading its weights: SmolLM2-135M's are 540 MB
 * in float32 and 135 MB in int8 with one scale an output row, which agree with the float32
 * model's next token about 98% of the time (docs/drafters.md). MLX's CPU backend has no fast
 * int8 product (a quantized copy of the model stepped slower than the float one), so this
 * file runs the whole pass in one call: no graph, no per-op dispatch.
 *
 * The pass reads the keys and values of the positions before it from the verifier's own
 * cache (float32, exact) and keeps those of the positions it adds in a scratch of its own.
 *
 * Products: y[t][o] = scale[o] * sum_i w[o][i] * x[t][i] (W row-major (out, in), int8),
 * 16 lanes of partial sums (GCC/Clang vector extensions: one AVX-512 register, two AVX2 or
 * four NEON), rows of the weight streamed once for all tokens of the call. The weights
 * are split by output rows between the calling thread and `threads - 1` workers. */
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "cpu_simd.h"

#define L16 16
typedef float v16 __attribute__((vector_size(L16 * sizeof(float))));

static inline v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float hsum16(v16 v) {
    float s = 0.0f;
    for (int j = 0; j < L16; j++) s += v[j];
    return s;
}

/* 16 int8 weights as floats (compilers scalarize a vector-extension conversion from int8, so
 * the instructions are named where they exist: vpmovsxbd + vcvtdq2ps on x86-64, sxtl + scvtf on
 * arm64). */
static inline v16 widen16(const int8_t *p) {
    v16 out;
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&out, &f, sizeof out);
#elif defined(__AVX2__)
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8))));
    memcpy(&out, &lo, sizeof lo);
    memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
#elif defined(__ARM_NEON)
    const int8x16_t b = vld1q_s8(p);
    const int16x8_t l = vmovl_s8(vget_low_s8(b)), h = vmovl_s8(vget_high_s8(b));
    const float32x4_t f[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(l))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(l))),
                              vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(h)))};
    memcpy(&out, f, sizeof out);
#else
    for (int j = 0; j < L16; j++) out[j] = (float)p[j];
#endif
    return out;
}

#define MAXT 4 /* tokens a product takes at once; more go in rounds */

/* One output row against TN token rows: TN accumulators held in registers. */
#define ROW_DOT(TN)                                                                              \
    static inline void dot_##TN(const int8_t *row, int64_t body, int64_t in, const float *x,       \
                                int64_t ldx, float *out) {                                      \
        v16 acc[TN];                                                                            \
        for (int t = 0; t < TN; t++) acc[t] = (v16){0};                                         \
        for (int64_t i = 0; i < body; i += L16) {                                               \
            const v16 wf = widen16(row + i);                                                    \
            for (int t = 0; t < TN; t++) acc[t] += wf * load16(x + t * ldx + i);                \
        }                                                                                       \
        for (int t = 0; t < TN; t++) {                                                          \
            float s = hsum16(acc[t]);                                                           \
            for (int64_t i = body; i < in; i++) s += (float)row[i] * x[t * ldx + i];            \
            out[t] = s;                                                                         \
        }                                                                                       \
    }
ROW_DOT(1)
ROW_DOT(2)
ROW_DOT(3)
ROW_DOT(4)

/* y[t * ldy + o] (= or +=) scale[o] * dot(w[o], x[t]) for o in [o0, o1), t < T. */
static void q8_rows(const int8_t *w, const float *scale, int64_t in, int64_t o0, int64_t o1,
                    const float *x, int64_t T, int64_t ldx, float *y, int64_t ldy, int add) {
    const int64_t body = in - in % L16;
    float s[MAXT];
    if (T == 1) { /* a drafting step: four rows at once, four independent sums in flight */
        for (; o0 + 4 <= o1; o0 += 4) {
            const int8_t *r0 = w + o0 * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t i = 0; i < body; i += L16) {
                const v16 xv = load16(x + i);
                a0 += widen16(r0 + i) * xv;
                a1 += widen16(r1 + i) * xv;
                a2 += widen16(r2 + i) * xv;
                a3 += widen16(r3 + i) * xv;
            }
            float t4[4] = {hsum16(a0), hsum16(a1), hsum16(a2), hsum16(a3)};
            for (int r = 0; r < 4; r++) {
                const int8_t *row = w + (o0 + r) * in;
                for (int64_t i = body; i < in; i++) t4[r] += (float)row[i] * x[i];
                float *dst = y + o0 + r;
                *dst = add ? *dst + scale[o0 + r] * t4[r] : scale[o0 + r] * t4[r];
            }
        }
    }
    for (int64_t o = o0; o < o1; o++) {
        const int8_t *row = w + o * in;
        for (int64_t t0 = 0; t0 < T; t0 += MAXT) {
            const int64_t tn = T - t0 < MAXT ? T - t0 : MAXT;
            const float *xt = x + t0 * ldx;
            switch (tn) {
            case 1: dot_1(row, body, in, xt, ldx, s); break;
            case 2: dot_2(row, body, in, xt, ldx, s); break;
            case 3: dot_3(row, body, in, xt, ldx, s); break;
            default: dot_4(row, body, in, xt, ldx, s); break;
            }
            for (int64_t t = 0; t < tn; t++) {
                float *dst = y + (t0 + t) * ldy + o;
                *dst = add ? *dst + scale[o] * s[t] : scale[o] * s[t];
            }
        }
    }
}


#if !defined(EDGESPEC_Q8_FLOAT) && ((defined(__AVX512VNNI__) && defined(__AVX512BW__)) || defined(__AVX2__))
/* Where the CPU has AVX-512 VNNI or AVX2 the products take the activations in int16 instead (one
 * scale a token, |x| <= amax(in), so a row's whole sum of int8 x int16 products stays inside
 * int32). AVX-512 VNNI: vpmovsxbw + vpdpwssd, two instructions for 32 weights against six for the
 * float path's conversion and products (an int8 row streamed at 8.3 GB/s a core against 6.5,
 * measured on such a host). AVX2: vpmovsxbw + vpmaddwd + vpaddd for 16 weights against the float
 * path's six. EDGESPEC_Q8_FLOAT (a build flag) keeps the float path, for comparisons. */
#define Q16 1

static int32_t amax16(int64_t in) {
    const int64_t m = (int64_t)2147483647 / (127 * (in > 0 ? in : 1));
    return (int32_t)(m < 32767 ? m : 32767);
}

static void quantize16(const float *x, int64_t T, int64_t ldx, int64_t in, int16_t *xq, float *sx) {
    const float top = (float)amax16(in);
    for (int64_t t = 0; t < T; t++) {
        const float *r = x + t * ldx;
        float m = 0.0f;
        for (int64_t i = 0; i < in; i++) m = fabsf(r[i]) > m ? fabsf(r[i]) : m;
        const float s = m > 0.0f ? m / top : 1.0f, inv = 1.0f / s;
        sx[t] = s;
        for (int64_t i = 0; i < in; i++) xq[t * in + i] = (int16_t)lrintf(r[i] * inv);
    }
}

static inline int32_t dot16_tail(const int8_t *row, const int16_t *xq, int64_t body, int64_t in) {
    int32_t s = 0;
    for (int64_t i = body; i < in; i++) s += (int32_t)row[i] * xq[i];
    return s;
}

/* One q16_rows for both instruction sets: QSTEP int16 lanes a step, an accumulator of int32 sums. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QSTEP 32
typedef __m512i qacc;
#define QZERO() _mm512_setzero_si512()
#define QLOADX(p) _mm512_loadu_si512((const void *)(p))
#define QROW(p) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(p)))
#define QMADD(acc, w, x) _mm512_dpwssd_epi32((acc), (w), (x))
#define QSUM(v) _mm512_reduce_add_epi32(v)
#else /* AVX2 */
#define QSTEP 16
typedef __m256i qacc;
#define QZERO() _mm256_setzero_si256()
#define QLOADX(p) _mm256_loadu_si256((const __m256i *)(p))
#define QROW(p) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p)))
#define QMADD(acc, w, x) _mm256_add_epi32((acc), _mm256_madd_epi16((w), (x)))

static inline int32_t QSUM(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

static void q16_rows(const int8_t *w, const float *scale, int64_t in, int64_t o0, int64_t o1, const int16_t *xq,
                     const float *sx, int64_t T, float *y, int64_t ldy, int add) {
    const int64_t body = in - in % QSTEP;
    if (T == 1) { /* four rows at once: four independent sums in flight */
        for (; o0 + 4 <= o1; o0 += 4) {
            const int8_t *r0 = w + o0 * in, *r1 = r0 + in, *r2 = r1 + in, *r3 = r2 + in;
            qacc a0 = QZERO(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t i = 0; i < body; i += QSTEP) {
                const qacc xv = QLOADX(xq + i);
                a0 = QMADD(a0, QROW(r0 + i), xv);
                a1 = QMADD(a1, QROW(r1 + i), xv);
                a2 = QMADD(a2, QROW(r2 + i), xv);
                a3 = QMADD(a3, QROW(r3 + i), xv);
            }
            const int32_t t4[4] = {QSUM(a0) + dot16_tail(r0, xq, body, in), QSUM(a1) + dot16_tail(r1, xq, body, in),
                                   QSUM(a2) + dot16_tail(r2, xq, body, in), QSUM(a3) + dot16_tail(r3, xq, body, in)};
            for (int r = 0; r < 4; r++) {
                const float v = scale[o0 + r] * sx[0] * (float)t4[r];
                y[o0 + r] = add ? y[o0 + r] + v : v;
            }
        }
    }
    for (int64_t o = o0; o < o1; o++) {
        const int8_t *row = w + o * in;
        for (int64_t t = 0; t < T; t++) {
            const int16_t *xt = xq + t * in;
            qacc acc = QZERO();
            for (int64_t i = 0; i < body; i += QSTEP) acc = QMADD(acc, QROW(row + i), QLOADX(xt + i));
            const float v = scale[o] * sx[t] * (float)(QSUM(acc) + dot16_tail(row, xt, body, in));
            float *dst = y + t * ldy + o;
            *dst = add ? *dst + v : v;
        }
    }
}
#endif

/* ------------------------------------------------------------------ worker threads */

typedef struct {
    const int8_t *w;
    const float *scale;
    int64_t in, out;
    const float *x;
    int64_t T, ldx;
    float *y;
    int64_t ldy;
    int add;
    const int16_t *xq; /* the activations in int16 (Q16), or NULL */
    const float *sx;
} product_t;

/* The workers wait for a product spinning for up to SPIN_NS (a pass's products come tens of
 * microseconds apart: a futex wake-up for each would cost more than the spin), then sleep on a
 * condition variable until the next one. The caller spins until its workers are done. */
#define SPIN_NS 200000

static pthread_mutex_t MU = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t GO = PTHREAD_COND_INITIALIZER;
static product_t JOB;
static _Atomic int64_t EPOCH;  /* bumped (after JOB is written) for each product handed out */
static _Atomic int PENDING;    /* workers still on the current product */
static _Atomic int SLEEPING;   /* workers asleep on GO */
static int THREADS = 1, STARTED;
static pthread_t IDS[7];
static int PARTS[8] = {0, 1, 2, 3, 4, 5, 6, 7};

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void run_share(const product_t *p, int part, int parts) {
    /* shares in whole blocks of 16 rows */
    const int64_t blocks = (p->out + 15) / 16;
    const int64_t b0 = blocks * part / parts, b1 = blocks * (part + 1) / parts;
    int64_t o0 = b0 * 16, o1 = b1 * 16;
    if (o1 > p->out) o1 = p->out;
    if (o0 >= o1) return;
#ifdef Q16
    if (p->xq != NULL) {
        q16_rows(p->w, p->scale, p->in, o0, o1, p->xq, p->sx, p->T, p->y, p->ldy, p->add);
        return;
    }
#endif
    q8_rows(p->w, p->scale, p->in, o0, o1, p->x, p->T, p->ldx, p->y, p->ldy, p->add);
}

static void *worker(void *arg) {
    const int part = *(const int *)arg;
    int64_t seen = atomic_load(&EPOCH);
    for (;;) {
        int64_t e = atomic_load(&EPOCH);
        if (e == seen) {
            const int64_t until = now_ns() + SPIN_NS;
            for (int i = 0; (e = atomic_load(&EPOCH)) == seen; i++) {
                relax();
                if ((i & 63) == 63 && now_ns() > until) {
                    pthread_mutex_lock(&MU);
                    atomic_fetch_add(&SLEEPING, 1);
                    while ((e = atomic_load(&EPOCH)) == seen) pthread_cond_wait(&GO, &MU);
                    atomic_fetch_sub(&SLEEPING, 1);
                    pthread_mutex_unlock(&MU);
                    break;
                }
            }
        }
        seen = e;
        const product_t job = JOB;
        const int parts = THREADS;
        if (part < parts) run_share(&job, part, parts);
        atomic_fetch_sub(&PENDING, 1);
    }
    return NULL;
}

/* A child process forked after the workers started has none of them: it computes alone. */
static void forked_child(void) {
    pthread_mutex_init(&MU, NULL);
    pthread_cond_init(&GO, NULL);
    STARTED = 0, THREADS = 1;
    atomic_store(&SLEEPING, 0);
    atomic_store(&PENDING, 0);
}

/* Sets the number of threads products use (1..8, the caller included); returns it. Workers are
 * started once and kept; fewer threads leave the others idle. */
__attribute__((visibility("default"))) int edgespec_q8_threads(int n) {
    static int registered;
    if (n < 1) n = 1;
    if (n > 8) n = 8;
    if (!registered) registered = pthread_atfork(NULL, NULL, forked_child) == 0;
    pthread_mutex_lock(&MU);
    while (STARTED < n - 1 && pthread_create(&IDS[STARTED], NULL, worker, &PARTS[STARTED + 1]) == 0) STARTED++;
    THREADS = STARTED + 1 < n ? STARTED + 1 : n;
    n = THREADS;
    pthread_mutex_unlock(&MU);
    return n;
}

static int16_t *XQ; /* the caller's int16 activations (Q16), grown as needed */
static int64_t XQ_N;

static void product(const int8_t *w, const float *scale, int64_t in, int64_t out, const float *x, int64_t T,
                    int64_t ldx, float *y, int64_t ldy, int add) {
    product_t p = {w, scale, in, out, x, T, ldx, y, ldy, add, NULL, NULL};
#ifdef Q16
    float sx[MAXT * 64];
    if (T <= MAXT * 64) {
        if (XQ_N < T * in) {
            int16_t *grown = realloc(XQ, sizeof(int16_t) * T * in);
            if (grown != NULL) XQ = grown, XQ_N = T * in;
        }
        if (XQ_N >= T * in) {
            quantize16(x, T, ldx, in, XQ, sx);
            p.xq = XQ, p.sx = sx;
        }
    }
#endif
    /* small products are not worth a hand-over */
    if (THREADS <= 1 || out * in < (1 << 16)) {
        run_share(&p, 0, 1);
        return;
    }
    JOB = p;
    atomic_store(&PENDING, STARTED);
    atomic_fetch_add(&EPOCH, 1);
    if (atomic_load(&SLEEPING) > 0) {
        pthread_mutex_lock(&MU);
        pthread_cond_broadcast(&GO);
        pthread_mutex_unlock(&MU);
    }
    run_share(&p, 0, THREADS);
    while (atomic_load(&PENDING) > 0) relax();
}

/* ------------------------------------------------------------------ the pass */

/* dot(a, b) over n floats, 16 lanes at a time */
static inline float dot(const float *a, const float *b, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + L16 <= n; i += L16) acc += load16(a + i) * load16(b + i);
    float s = hsum16(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += a * x over n floats */
static inline void axpy(float a, const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + L16 <= n; i += L16) {
        v16 v = load16(y + i) + (a - (v16){0}) * load16(x + i);
        memcpy(y + i, &v, sizeof v);
    }
    for (; i < n; i++) y[i] += a * x[i];
}

/* s[j] = exp(s[j] - top) for j < n (vexp_neg, 8 lanes: cpu_simd.h); returns their sum */
static float exp_shifted(float *s, int64_t n, float top) {
    float total = 0.0f;
    int64_t j = 0;
    for (; j + W <= n; j += W) {
        vf x;
        memcpy(&x, s + j, sizeof x);
        x = vexp_neg(x - splat(top));
        memcpy(s + j, &x, sizeof x);
        for (int i = 0; i < W; i++) total += x[i];
    }
    for (; j < n; j++) {
        s[j] = expf(s[j] - top);
        total += s[j];
    }
    return total;
}

static void rms_norm(const float *x, const float *weight, int64_t E, float eps, float *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < E; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / E) + eps);
    for (int64_t i = 0; i < E; i++) y[i] = x[i] * r * weight[i];
}

/* Rotates the first `rot` dims of one head vector at a position (cos, sin: rot/2 each). */
static void rotate(float *v, int64_t rot, int traditional, const float *c, const float *s) {
    const int64_t h = rot / 2;
    if (traditional) {
        for (int64_t i = 0; i < h; i++) {
            const float a = v[2 * i], b = v[2 * i + 1];
            v[2 * i] = a * c[i] - b * s[i];
            v[2 * i + 1] = a * s[i] + b * c[i];
        }
    } else {
        for (int64_t i = 0; i < h; i++) {
            const float a = v[i], b = v[i + h];
            v[i] = a * c[i] - b * s[i];
            v[i + h] = a * s[i] + b * c[i];
        }
    }
}

enum { C_E, C_H, C_HK, C_D, C_F, C_V, C_L, C_ROT, C_TRAD, C_N };
enum { P_QKV, P_SQKV, P_O, P_SO, P_GU, P_SGU, P_DOWN, P_SDOWN, P_N1, P_N2, P_N };

/* One pass over T new tokens at positions n_ctx + n_scr .. + T - 1.
 *
 * cfg: E, H, Hk, D, F (intermediate), V (vocabulary), L (layers), rot (rotary dims),
 *      traditional (RoPE layout). fcfg: rms eps, attention scale.
 * layers: P_N pointers a layer: fused q|k|v weight (H*D + 2*Hk*D, E) int8 and its scales,
 *      o (E, H*D), fused gate|up (2F, E), down (E, F), each with scales; the two norms' weights.
 * head: (V, E) int8, head_scale (V), final_norm (E). h: the tokens' embeddings (T, E), overwritten.
 * ctx_k/ctx_v: per layer, the verifier cache's keys/values (float32), positions 0..n_ctx-1,
 *      element [g][p][d] at base + g * hs[l] + p * ps[l] + d.
 * scr_k/scr_v: the scratch, (L, Hk, cap, D) float32, n_scr positions held; the T new ones are
 *      written after them (the caller checks n_scr + T <= cap).
 * cosv/sinv: (T, rot/2) for the new positions. logits: (out_rows, V) for the last out_rows tokens.
 * Returns 0, or -1 when scratch memory could not be had. */
__attribute__((visibility("default")))
int edgespec_q8_forward(const int64_t *cfg, const float *fcfg, void *const *layers, const int8_t *head,
                        const float *head_scale, const float *final_norm, float *h, int64_t T,
                        const float *const *ctx_k, const float *const *ctx_v, const int64_t *hs, const int64_t *ps,
                        int64_t n_ctx, float *scr_k, float *scr_v, int64_t n_scr, int64_t cap,
                        const float *cosv, const float *sinv, float *logits, int64_t out_rows) {
    const int64_t E = cfg[C_E], H = cfg[C_H], Hk = cfg[C_HK], D = cfg[C_D], F = cfg[C_F], V = cfg[C_V],
                  L = cfg[C_L], rot = cfg[C_ROT];
    const int trad = (int)cfg[C_TRAD];
    const float eps = fcfg[0], scale = fcfg[1];
    const int64_t G = H / Hk, QKV = (H + 2 * Hk) * D, S = n_ctx + n_scr + T;
    float *x = malloc(sizeof(float) * T * E);
    float *qkv = malloc(sizeof(float) * T * QKV);
    float *att = malloc(sizeof(float) * T * H * D);
    float *gu = malloc(sizeof(float) * T * 2 * F);
    float *act = malloc(sizeof(float) * T * F);
    float *sc = malloc(sizeof(float) * (S > 0 ? S : 1));
    if (!x || !qkv || !att || !gu || !act || !sc) {
        free(x), free(qkv), free(att), free(gu), free(act), free(sc);
        return -1;
    }
    for (int64_t l = 0; l < L; l++) {
        void *const *p = layers + l * P_N;
        for (int64_t t = 0; t < T; t++) rms_norm(h + t * E, (const float *)p[P_N1], E, eps, x + t * E);
        product((const int8_t *)p[P_QKV], (const float *)p[P_SQKV], E, QKV, x, T, E, qkv, QKV, 0);
        float *lk = scr_k + l * Hk * cap * D, *lv = scr_v + l * Hk * cap * D;
        for (int64_t t = 0; t < T; t++) {
            float *row = qkv + t * QKV;
            const float *c = cosv + t * (rot / 2), *s = sinv + t * (rot / 2);
            for (int64_t hh = 0; hh < H + Hk; hh++) rotate(row + hh * D, rot, trad, c, s); /* q heads, then k heads */
            for (int64_t g = 0; g < Hk; g++) {
                memcpy(lk + (g * cap + n_scr + t) * D, row + (H + g) * D, sizeof(float) * D);
                memcpy(lv + (g * cap + n_scr + t) * D, row + (H + Hk + g) * D, sizeof(float) * D);
            }
        }
        const float *ck = ctx_k[l], *cv = ctx_v[l];
        for (int64_t t = 0; t < T; t++) {
            const int64_t seen = n_ctx + n_scr + t + 1; /* keys this token sees */
            for (int64_t hh = 0; hh < H; hh++) {
                const int64_t g = hh / G;
                const float *q = qkv + t * QKV + hh * D;
                float top = -INFINITY;
                for (int64_t j = 0; j < seen; j++) {
                    const float *k = j < n_ctx ? ck + g * hs[l] + j * ps[l] : lk + (g * cap + j - n_ctx) * D;
                    const float d = dot(q, k, D) * scale;
                    sc[j] = d;
                    top = d > top ? d : top;
                }
                const float total = exp_shifted(sc, seen, top);
                float *o = att + t * H * D + hh * D;
                for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
                for (int64_t j = 0; j < seen; j++) {
                    const float *v = j < n_ctx ? cv + g * hs[l] + j * ps[l] : lv + (g * cap + j - n_ctx) * D;
                    axpy(sc[j] / total, v, o, D);
                }
            }
        }
        product((const int8_t *)p[P_O], (const float *)p[P_SO], H * D, E, att, T, H * D, h, E, 1);
        for (int64_t t = 0; t < T; t++) rms_norm(h + t * E, (const float *)p[P_N2], E, eps, x + t * E);
        product((const int8_t *)p[P_GU], (const float *)p[P_SGU], E, 2 * F, x, T, E, gu, 2 * F, 0);
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < F; i++) {
                const float g = gu[t * 2 * F + i], u = gu[t * 2 * F + F + i];
                act[t * F + i] = g / (1.0f + expf(-g)) * u;
            }
        product((const int8_t *)p[P_DOWN], (const float *)p[P_SDOWN], F, E, act, T, F, h, E, 1);
    }
    if (out_rows > T) out_rows = T;
    const int64_t first = T - out_rows;
    for (int64_t t = first; t < T; t++) rms_norm(h + t * E, final_norm, E, eps, x + (t - first) * E);
    product(head, head_scale, E, V, x, out_rows, E, logits, V, 0);
    free(x), free(qkv), free(att), free(gu), free(act), free(sc);
    return 0;
}
