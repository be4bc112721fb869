/* Few-row float products for the CBLAS shim (cblas_forward.c).
 *
 * A decoding pass multiplies a few rows (its tokens: 1 for a plain step, 2-32 for a verify
 * pass) by every weight matrix of the model. OpenBLAS answers such a product with its
 * general kernel, which on this project's CPU streams the weights at 6-9 GB/s whatever
 * the row count (benchmarks/cpu_kernels.py --only weights with EDGESPEC_SKINNY=0: SmolLM2's
 * 538 MB of weights in 64-91 ms for 1, 4 or 8 rows). Here each weight row is read once and
 * multiplied by all the activation rows while it is in registers, with the weight stream
 * prefetched ahead: the same 538 MB in 26 ms for 1 row, 30 ms for 4, 38 ms for 8
 * (docs/batching.md). Every pass is faster, and a few more tokens add less to it.
 *
 * Taken: row-major C = alpha A B^T + beta C (MLX's x @ W.T and W @ x.T), and C = alpha A B +
 * beta C with B's few columns (MLX's W @ x.T once x.T was copied), where the activation side
 * has at most SK_MAX_ROWS rows and the weight side at least SK_MIN_WEIGHT_ROWS; everything
 * else goes to OpenBLAS.
 *
 * Each output element is the same sum in the same order whatever the number of activation
 * rows, the split between threads or the call's form: a row of a verify pass is bitwise the
 * row a one-token pass computes (tests/test_cpu_blas.py).
 *
 * Threads: products of at least SK_SPLIT_FLOATS weights are split in two, the second half
 * run by one helper thread (this library serves 2-core machines well; more helpers would
 * follow the same pattern). The helper spins up to SK_SPIN_NS after each job (a pass's next
 * product follows within microseconds) and then sleeps on a condition variable. One caller
 * uses the helper at a time; a concurrent caller computes its product alone. After fork()
 * the child starts without a helper and makes its own. EDGESPEC_SKINNY=0 in the environment,
 * or edgespec_cblas_skinny(0), sends every product to OpenBLAS (for comparisons). */
#ifndef EDGESPEC_CBLAS_SKINNY_H
#define EDGESPEC_CBLAS_SKINNY_H
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define SK_MAX_ROWS 32
#define SK_CHUNK 16               /* activation rows a weight row meets at once (accumulators in registers) */
#define SK_WBLOCK 4               /* weight rows that stay in L1 while every chunk of rows passes them */
#define SK_PAIR_MAX 8             /* up to this many activation rows, two weight rows at a time */
#define SK_CHUNK_NARROW 4         /* the same two where a clone has 16 vector registers (AVX2) */
#define SK_PAIR_MAX_NARROW 2
#define SK_LANES 16               /* floats a vector: one AVX-512 register, two AVX2 ones */
#define SK_MIN_WEIGHT_ROWS 64     /* a smaller "weight" (attention's blocks) stays with OpenBLAS */
#define SK_PREFETCH 2048          /* floats ahead of the weight rows read (8 KiB) */
#define SK_SPLIT_FLOATS (1L << 18) /* weights from which the helper takes half */
#define SK_SPIN_NS 200000L

#if defined(__x86_64__) || defined(__i386__)
#define SK_PAUSE() __builtin_ia32_pause()
/* x86-64-v3 (AVX2, FMA, ...) is chosen by the CPU's features: "arch=haswell" would be chosen by the
 * CPU's model, i.e. never on an AMD CPU, which then ran the plain SSE2 clone. */
#define SK_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#elif defined(__aarch64__)
#define SK_PAUSE() __asm__ __volatile__("yield")
#define SK_CLONES
#else
#define SK_PAUSE() ((void)0)
#define SK_CLONES
#endif

typedef float skv __attribute__((vector_size(SK_LANES * sizeof(float))));

static inline __attribute__((always_inline)) skv sk_load(const float *p) {
    skv v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) float sk_sum(skv v) {
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* One product: weight rows w[r * ldw] (r < rows), activation rows x[i * ldx] (i < n), both
 * k long; out(r, i) = alpha * dot + beta * out at c[r * rs + i * is]. */
typedef struct {
    const float *w, *x;
    float *c;
    long ldw, ldx, rs, is;
    int n, k;
    float alpha, beta;
} sk_job;

static inline __attribute__((always_inline)) void sk_store(const sk_job *j, long r, int i, float s) {
    for (int t = j->k & ~(SK_LANES - 1); t < j->k; t++) s += j->w[r * j->ldw + t] * j->x[i * j->ldx + t];
    float *o = j->c + r * j->rs + i * j->is;
    *o = j->beta == 0.0f ? j->alpha * s : j->alpha * s + j->beta * *o;
}

/* Weight rows r0..r1 against exactly N activation rows: N is a constant in each instance, so
 * the accumulators stay in registers. */
static inline __attribute__((always_inline)) void sk_rows_n(const sk_job *j, long r0, long r1, const int N) {
    const int k16 = j->k & ~(SK_LANES - 1);
    const float *x = j->x;
    const long ldx = j->ldx;
    long r = r0;
    for (; N <= SK_PAIR_MAX && r + 1 < r1; r += 2) { /* two weight rows share each activation load */
        const float *w0 = j->w + r * j->ldw, *w1 = w0 + j->ldw;
        skv a0[SK_PAIR_MAX], a1[SK_PAIR_MAX];
        for (int i = 0; i < N; i++) a0[i] = a1[i] = (skv){0};
        for (int t = 0; t < k16; t += SK_LANES) {
            skv v0 = sk_load(w0 + t), v1 = sk_load(w1 + t);
            __builtin_prefetch(w0 + t + SK_PREFETCH, 0, 2);
            __builtin_prefetch(w1 + t + SK_PREFETCH, 0, 2);
            for (int i = 0; i < N; i++) {
                skv xv = sk_load(x + i * ldx + t);
                a0[i] += v0 * xv;
                a1[i] += v1 * xv;
            }
        }
        for (int i = 0; i < N; i++) {
            sk_store(j, r, i, sk_sum(a0[i]));
            sk_store(j, r + 1, i, sk_sum(a1[i]));
        }
    }
    for (; r < r1; r++) {
        const float *w0 = j->w + r * j->ldw;
        skv a0[SK_CHUNK];
        for (int i = 0; i < N; i++) a0[i] = (skv){0};
        for (int t = 0; t < k16; t += SK_LANES) {
            skv v0 = sk_load(w0 + t);
            __builtin_prefetch(w0 + t + SK_PREFETCH, 0, 2);
            for (int i = 0; i < N; i++) a0[i] += v0 * sk_load(x + i * ldx + t);
        }
        for (int i = 0; i < N; i++) sk_store(j, r, i, sk_sum(a0[i]));
    }
}

static inline __attribute__((always_inline)) void sk_rows_any(const sk_job *j, long r0, long r1) {
    switch (j->n) {
#define SK_CASE(n) case n: sk_rows_n(j, r0, r1, n); break;
    SK_CASE(1) SK_CASE(2) SK_CASE(3) SK_CASE(4) SK_CASE(5) SK_CASE(6) SK_CASE(7) SK_CASE(8)
    SK_CASE(9) SK_CASE(10) SK_CASE(11) SK_CASE(12) SK_CASE(13) SK_CASE(14) SK_CASE(15)
#undef SK_CASE
    default: sk_rows_n(j, r0, r1, SK_CHUNK); break;
    }
}

/* The same sums where a vector register holds 8 floats (AVX2): each SK_LANES accumulator kept as
 * two 8-lane halves. GCC keeps arrays of 64-byte vectors in memory on such a target (every step a
 * load and a store per accumulator), halves in registers. Lane by lane the same products are added
 * in the same order, and sk_sum adds the halves first: the same bits as the 16-lane form. With 16
 * registers a chunk is 4 rows, and two weight rows share a load up to 2 rows. */
typedef float skh __attribute__((vector_size(8 * sizeof(float))));

static inline __attribute__((always_inline)) skh sk_loadh(const float *p) {
    skh v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) float sk_sum_halves(skh lo, skh hi) {
    typedef float v4 __attribute__((vector_size(16)));
    skh a = lo + hi;
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

static inline __attribute__((always_inline)) void sk_rows_h(const sk_job *j, long r0, long r1, const int N) {
    const int k16 = j->k & ~(SK_LANES - 1);
    const float *x = j->x;
    const long ldx = j->ldx;
    long r = r0;
    for (; N <= SK_PAIR_MAX_NARROW && r + 1 < r1; r += 2) {
        const float *w0 = j->w + r * j->ldw, *w1 = w0 + j->ldw;
        skh a0l[SK_PAIR_MAX_NARROW], a0h[SK_PAIR_MAX_NARROW], a1l[SK_PAIR_MAX_NARROW], a1h[SK_PAIR_MAX_NARROW];
        for (int i = 0; i < N; i++) a0l[i] = a0h[i] = a1l[i] = a1h[i] = (skh){0};
        for (int t = 0; t < k16; t += SK_LANES) {
            skh v0l = sk_loadh(w0 + t), v0h = sk_loadh(w0 + t + 8), v1l = sk_loadh(w1 + t), v1h = sk_loadh(w1 + t + 8);
            __builtin_prefetch(w0 + t + SK_PREFETCH, 0, 2);
            __builtin_prefetch(w1 + t + SK_PREFETCH, 0, 2);
            for (int i = 0; i < N; i++) {
                skh xl = sk_loadh(x + i * ldx + t), xh = sk_loadh(x + i * ldx + t + 8);
                a0l[i] += v0l * xl;
                a0h[i] += v0h * xh;
                a1l[i] += v1l * xl;
                a1h[i] += v1h * xh;
            }
        }
        for (int i = 0; i < N; i++) {
            sk_store(j, r, i, sk_sum_halves(a0l[i], a0h[i]));
            sk_store(j, r + 1, i, sk_sum_halves(a1l[i], a1h[i]));
        }
    }
    for (; r < r1; r++) {
        const float *w0 = j->w + r * j->ldw;
        skh al[SK_CHUNK_NARROW], ah[SK_CHUNK_NARROW];
        for (int i = 0; i < N; i++) al[i] = ah[i] = (skh){0};
        for (int t = 0; t < k16; t += SK_LANES) {
            skh vl = sk_loadh(w0 + t), vh = sk_loadh(w0 + t + 8);
            __builtin_prefetch(w0 + t + SK_PREFETCH, 0, 2);
            for (int i = 0; i < N; i++) {
                al[i] += vl * sk_loadh(x + i * ldx + t);
                ah[i] += vh * sk_loadh(x + i * ldx + t + 8);
            }
        }
        for (int i = 0; i < N; i++) sk_store(j, r, i, sk_sum_halves(al[i], ah[i]));
    }
}

static inline __attribute__((always_inline)) void sk_rows_any_h(const sk_job *j, long r0, long r1) {
    switch (j->n) {
    case 1: sk_rows_h(j, r0, r1, 1); break;
    case 2: sk_rows_h(j, r0, r1, 2); break;
    case 3: sk_rows_h(j, r0, r1, 3); break;
    default: sk_rows_h(j, r0, r1, SK_CHUNK_NARROW); break;
    }
}

/* Which form a clone runs: the 16-lane one with 32 vector registers (AVX-512; NEON's 32 of 4
 * floats), the halves with AVX2's 16. Which rows meet a weight row together never changes an
 * output's sum (each is its own), so the chunking may differ too. */
static int sk_narrow = -1;
static inline int sk_is_narrow(void) {
#if defined(__x86_64__) || defined(__i386__)
    if (sk_narrow < 0) {
        __builtin_cpu_init();
        sk_narrow = !__builtin_cpu_supports("avx512f");
    }
    return sk_narrow;
#else
    return 0;
#endif
}

/* More than SK_CHUNK activation rows: a few weight rows at a time, each block met by every
 * chunk of SK_CHUNK rows while it is still in L1, so the weights are streamed from memory once.
 * Every output is the sum sk_rows_n computes for it alone, so the bits do not depend on n. */
SK_CLONES static void sk_rows(const sk_job *j, long r0, long r1) {
    const int narrow = sk_is_narrow();
    const int chunk = narrow ? SK_CHUNK_NARROW : SK_CHUNK;
    if (j->n <= chunk) {
        if (narrow)
            sk_rows_any_h(j, r0, r1);
        else
            sk_rows_any(j, r0, r1);
        return;
    }
    for (long rb = r0; rb < r1; rb += SK_WBLOCK) {
        long re = rb + SK_WBLOCK < r1 ? rb + SK_WBLOCK : r1;
        for (int i0 = 0; i0 < j->n; i0 += chunk) {
            sk_job c = *j;
            c.x = j->x + i0 * j->ldx;
            c.c = j->c + i0 * j->is;
            c.n = j->n - i0 < chunk ? j->n - i0 : chunk;
            if (narrow)
                sk_rows_any_h(&c, rb, re);
            else
                sk_rows_any(&c, rb, re);
        }
    }
}

/* ---------------------------------------------------------------- the helper thread */
static pthread_mutex_t sk_lock = PTHREAD_MUTEX_INITIALIZER; /* held by the caller using the helper */
static pthread_mutex_t sk_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t sk_cv = PTHREAD_COND_INITIALIZER;
static atomic_long sk_posted, sk_done;
static sk_job sk_cur;
static long sk_r0, sk_r1;
static int sk_started, sk_atfork;
static atomic_int sk_on = 1;
/* Bit m-1 set: products of m activation rows are taken here (m <= SK_MAX_ROWS); the others go to
 * OpenBLAS. Set from the host's verdicts (cpu_blas.py: apply_verdicts): only where it wins. */
static atomic_uint sk_rows_mask = 0xffffffffu;
static atomic_int sk_align = 1; /* copy misaligned activation rows (sk_aligned_rows) */
static atomic_long sk_calls; /* products taken here (for the build's check) */

static long sk_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *sk_helper(void *arg) {
    (void)arg;
    long seen = 0;
    for (;;) {
        long until = sk_now_ns() + SK_SPIN_NS;
        for (unsigned spins = 0; atomic_load_explicit(&sk_posted, memory_order_acquire) == seen; spins++) {
            if ((spins & 255) != 255 || sk_now_ns() < until) {
                SK_PAUSE();
                continue;
            }
            pthread_mutex_lock(&sk_mu);
            while (atomic_load_explicit(&sk_posted, memory_order_acquire) == seen) pthread_cond_wait(&sk_cv, &sk_mu);
            pthread_mutex_unlock(&sk_mu);
        }
        seen = atomic_load_explicit(&sk_posted, memory_order_acquire);
        sk_rows(&sk_cur, sk_r0, sk_r1);
        atomic_store_explicit(&sk_done, seen, memory_order_release);
    }
    return NULL;
}

static void sk_after_fork_child(void) { /* the helper thread is not in the child */
    sk_started = 0;
    atomic_store(&sk_posted, 0);
    atomic_store(&sk_done, 0);
    pthread_mutex_init(&sk_lock, NULL);
    pthread_mutex_init(&sk_mu, NULL);
    pthread_cond_init(&sk_cv, NULL);
}

static int sk_start_helper(void) {
    pthread_t t;
    pthread_attr_t at;
    if (pthread_attr_init(&at) != 0) return 0;
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int ok = pthread_create(&t, &at, sk_helper, NULL) == 0;
    pthread_attr_destroy(&at);
    if (ok && !sk_atfork) sk_atfork = 1, pthread_atfork(NULL, NULL, sk_after_fork_child);
    return ok;
}

static void sk_run(const sk_job *j, long rows) {
    atomic_fetch_add_explicit(&sk_calls, 1, memory_order_relaxed);
    if (rows * j->k < SK_SPLIT_FLOATS || pthread_mutex_trylock(&sk_lock) != 0) {
        sk_rows(j, 0, rows); /* small, or another caller has the helper */
        return;
    }
    if (!sk_started && !(sk_started = sk_start_helper())) {
        pthread_mutex_unlock(&sk_lock);
        sk_rows(j, 0, rows);
        return;
    }
    long half = rows / 2;
    sk_cur = *j;
    sk_r0 = half, sk_r1 = rows;
    pthread_mutex_lock(&sk_mu);
    long ticket = atomic_fetch_add_explicit(&sk_posted, 1, memory_order_acq_rel) + 1;
    pthread_cond_signal(&sk_cv);
    pthread_mutex_unlock(&sk_mu);
    sk_rows(j, 0, half);
    while (atomic_load_explicit(&sk_done, memory_order_acquire) != ticket) SK_PAUSE();
    pthread_mutex_unlock(&sk_lock);
}

/* ---------------------------------------------------------------- the entry point */
/* The activation rows, copied into this thread's buffer: 64-byte aligned rows, SK_LANES-
 * padded. MLX's CPU arrays are 8-byte aligned, so each 64-byte load of a row as stored
 * spans two cache lines; with two or more rows the loads of x, not the weight stream, set
 * the pace (benchmarks/cpu_kernels.py --only align). The copy is exact, and the sum each
 * output takes is unchanged. `transposed`: x is given as x.T (k x n, leading dimension ld).
 * NULL if the buffer cannot grow. */
static const float *sk_aligned_rows(const float *x, long ld, long n, long k, int transposed, long *ldx) {
    static __thread float *buf;
    static __thread long cap;
    long stride = (k + SK_LANES - 1) & ~(long)(SK_LANES - 1);
    if (cap < n * stride) {
        free(buf);
        buf = aligned_alloc(64, (size_t)(n * stride) * sizeof(float));
        cap = buf ? n * stride : 0;
        if (!buf) return NULL;
    }
    if (transposed)
        for (long t = 0; t < k; t++)
            for (long i = 0; i < n; i++) buf[i * stride + t] = x[t * ld + i];
    else
        for (long i = 0; i < n; i++) memcpy(buf + i * stride, x + i * ld, (size_t)k * sizeof(float));
    *ldx = stride;
    return buf;
}

static int sk_misaligned(const float *x, long ld) { return ((uintptr_t)x | (uintptr_t)(ld * sizeof(float))) & 63; }

/* Row-major C = alpha op(A) op(B) + beta C (CBLAS enums: 101 row-major, 111 no transpose,
 * 112 transpose). 1 when computed here, 0 when OpenBLAS should. */
static int sk_gemm(int order, int ta, int tb, long m, long n, long k, float alpha, const float *a, long lda,
                   const float *b, long ldb, float beta, float *c, long ldc) {
    if (!atomic_load_explicit(&sk_on, memory_order_relaxed) || order != 101 || ta != 111 || k < SK_LANES)
        return 0;
    sk_job j = {.k = (int)k, .alpha = alpha, .beta = beta};
    const float *x;
    long ldx, weight_rows;
    int transposed = 0;
    if (tb == 112 && m <= SK_MAX_ROWS && n >= SK_MIN_WEIGHT_ROWS) { /* x (m x k) @ W.T, W (n x k) */
        j.w = b, j.ldw = ldb, x = a, ldx = lda, j.n = (int)m, j.c = c, j.rs = 1, j.is = ldc, weight_rows = n;
    } else if (m >= SK_MIN_WEIGHT_ROWS && n <= SK_MAX_ROWS && (tb == 112 || tb == 111)) {
        /* W (m x k) @ x.T, c (m x n); x (n x k) as stored, or x.T (k x n) as stored */
        j.w = a, j.ldw = lda, x = b, ldx = ldb, j.n = (int)n, j.c = c, j.rs = ldc, j.is = 1, weight_rows = m;
        transposed = tb == 111;
    } else {
        return 0;
    }
    if (!((atomic_load_explicit(&sk_rows_mask, memory_order_relaxed) >> (j.n - 1)) & 1u)) return 0;
    /* One row: the loads of x are not the limit (as many as the weight's). */
    if (transposed || (j.n > 1 && sk_misaligned(x, ldx) && atomic_load_explicit(&sk_align, memory_order_relaxed))) {
        x = sk_aligned_rows(x, ldx, j.n, k, transposed, &ldx);
        if (!x) return 0;
    }
    j.x = x, j.ldx = ldx;
    sk_run(&j, weight_rows);
    return 1;
}

__attribute__((visibility("default"))) void edgespec_cblas_skinny(int on) { atomic_store(&sk_on, on != 0); }

/* The most activation rows a product taken here has, 0 while off (cpu_blas.py: few_row_kernel). */
__attribute__((visibility("default"))) int edgespec_cblas_skinny_rows(void) {
    unsigned mask = atomic_load(&sk_rows_mask);
    int most = 0;
    for (int m = 1; m <= SK_MAX_ROWS; m++)
        if ((mask >> (m - 1)) & 1u) most = m;
    return atomic_load(&sk_on) ? most : 0;
}

/* Which row counts are taken here: bit m-1 for m rows (cpu_blas.py: apply_verdicts). */
__attribute__((visibility("default"))) void edgespec_cblas_skinny_mask(unsigned mask) { atomic_store(&sk_rows_mask, mask); }
__attribute__((visibility("default"))) unsigned edgespec_cblas_skinny_get_mask(void) { return atomic_load(&sk_rows_mask); }

/* For comparisons in one process (benchmarks/cpu_kernels.py --only align): 0 leaves
 * misaligned activation rows where they are. */
__attribute__((visibility("default"))) void edgespec_cblas_skinny_align(int on) { atomic_store(&sk_align, on != 0); }

__attribute__((visibility("default"))) long edgespec_cblas_skinny_calls(void) { return atomic_load(&sk_calls); }

__attribute__((constructor)) static void sk_init(void) {
    const char *env = getenv("EDGESPEC_SKINNY");
    if (env && env[0] == '0') atomic_store(&sk_on, 0);
}

#endif
