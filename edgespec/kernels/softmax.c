/* Softmax numerators of attention score rows, in place: the CPU long-prompt attention's
 * pass between its two matrix products (edgespec/kernels/attention.py, edgespec/kernels/native.py).
 *
 * For each row r of a (rows x cols) float32 block with row stride ld:
 *     n    = cols, or min(cols, first + r / group + 1) when first >= 0 (causal: the row's
 *            query sees slots up to first + r / group; rows are queries x grouped heads)
 *     m    = max(row[0:n])
 *     row[j] = exp(row[j] - m) for j < n, 0 for n <= j < cols
 *     sums[r] = sum(row[0:cols]), when sums is not NULL (0 for a row that sees nothing)
 * A row whose visible scores are all -inf (it may see nothing) becomes zeros. The sum is
 * taken in the exp pass, in registers (W partial sums a row): the caller's P.V product
 * then needs only the D value columns (a column of ones for the totals cost 8 more, as
 * BLAS wants multiples of 8: 12% of the product at D = 64).
 *
 * numpy does this in three passes over the whole block (max, subtract, exp; the block is
 * megabytes, so each pass streams memory) with a scalar float32 exp on CPUs without
 * AVX-512. Here each row is read twice while it sits in the core's cache (max, then exp),
 * and exp is evaluated W lanes at a time: GCC/Clang vector extensions, so the same source
 * compiles to AVX2 on x86-64 with -march=native, NEON on arm64, plain SSE elsewhere.
 *
 * exp(x), x <= 0: x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2, ln2 split in a
 * high part exact in float and a low correction; e^r from the degree-7 polynomial
 * 1 + r + r^2 P(r) whose coefficients are Cephes' expf ones (S. Moshier, "Methods and
 * Programs for Mathematical Functions"), relative error about 1e-7 (float rounding);
 * 2^n from the exponent bits. Inputs below -87 give exactly 0 (e^-87 is 1.6e-38, at
 * float's smallest normal): masked slots (-inf) among them.
 */
#include <stdint.h>
#include <string.h>

#define W 8
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf splat(float x) {
    vf v;
    for (int i = 0; i < W; i++) v[i] = x;
    return v;
}

static inline vf vexp_neg(vf x) {
    const vf lo = splat(-87.0f);
    const vi dead = x < lo; /* all ones where x < -87 (and -inf) */
    x = (vf)(((vi)x & ~dead) | ((vi)lo & dead));
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf t = x * splat(1.44269504088896341f) + magic;
    vf n = t - magic;
    vf r = x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f);
    vf z = r * r;
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * z + r + splat(1.0f);
    /* t's bits are 0x4B400000 + n for |n| < 2^22; 2^n is (n + 127) << 23 (n >= -126 here) */
    vi e = ((vi)t - 0x4B400000 + 127) << 23;
    vf y = p * (vf)e;
    return (vf)((vi)y & ~dead);
}

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

__attribute__((visibility("default")))
void edgespec_softmax_rows(float *s, int64_t rows, int64_t cols, int64_t ld, int64_t first, int64_t group,
                           float *sums) {
    const float ninf = -__builtin_inff();
    for (int64_t r = 0; r < rows; r++) {
        float *row = s + r * ld;
        int64_t n = cols;
        if (first >= 0) {
            n = first + r / group + 1;
            if (n > cols) n = cols;
            if (n < 0) n = 0;
        }
        int64_t full = n - n % W;
        vf vm = splat(ninf);
        for (int64_t j = 0; j < full; j += W) {
            vf v = load(row + j);
            vm = (vf)(((vi)vm & (vi)(vm >= v)) | ((vi)v & (vi)(vm < v)));
        }
        float m = ninf;
        for (int i = 0; i < W; i++) m = vm[i] > m ? vm[i] : m;
        for (int64_t j = full; j < n; j++) m = row[j] > m ? row[j] : m;
        if (m == ninf) { /* sees nothing (or nothing finite): zeros */
            memset(row, 0, (size_t)cols * sizeof(float));
            if (sums) sums[r] = 0.0f;
            continue;
        }
        const vf sm = splat(m);
        vf acc = splat(0.0f);
        for (int64_t j = 0; j < full; j += W) {
            vf e = vexp_neg(load(row + j) - sm);
            acc += e;
            store(row + j, e);
        }
        if (full < n) { /* the last partial vector, padded with -inf (-> 0) */
            vf v = splat(ninf);
            memcpy(&v, row + full, (size_t)(n - full) * sizeof(float));
            v = vexp_neg(v - sm);
            acc += v;
            memcpy(row + full, &v, (size_t)(n - full) * sizeof(float));
        }
        if (n < cols) memset(row + n, 0, (size_t)(cols - n) * sizeof(float));
        if (sums) {
            float total = 0.0f;
            for (int i = 0; i < W; i++) total += acc[i];
            sums[r] = total;
        }
    }
}
