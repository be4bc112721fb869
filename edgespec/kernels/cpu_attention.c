/* Long-prompt attention on the CPU device (edgespec/kernels/attention.py, loaded and checked
 * by edgespec/kernels/native.py): two kernels.
 *
 * edgespec_softmax_rows: softmax numerators of attention score rows, in place, the pass
 * between two BLAS products where the fused kernel below does not apply (a boolean mask,
 * a soft-cap, a head size that is not a multiple of 16).
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

#include "cpu_simd.h"

static inline float row_max(const float *row, int64_t n) {
    const int64_t full = n - n % W;
    vf vm = splat(-__builtin_inff());
    for (int64_t j = 0; j < full; j += W) {
        vf v = load(row + j);
        vm = (vf)(((vi)vm & (vi)(vm >= v)) | ((vi)v & (vi)(vm < v)));
    }
    float m = -__builtin_inff();
    for (int i = 0; i < W; i++) m = vm[i] > m ? vm[i] : m;
    for (int64_t j = full; j < n; j++) m = row[j] > m ? row[j] : m;
    return m;
}

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
        const int64_t full = n - n % W;
        const float m = row_max(row, n);
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

/* ---------------------------------------------------------------------------------------
 * Fused attention of a block of query rows: S = q K^T, online softmax, O = P V, without
 * the score block leaving the core's cache (the two BLAS products of the path above each
 * pack their big operand, the score block, and stream it through memory).
 *
 * q: rows x D (row stride ldq), already scaled; kp: the keys packed by
 * edgespec.kernels.attention (panels of 16 keys, kp[p][d][c] = key p * 16 + c, dim d; zero
 * past n); v: n x D (row stride ldv); out: rows x D (row stride ldo). Row r sees keys
 * [0, lim_r), lim_r = n, or min(n, first + r / group + 1) when first >= 0 (causal, as the
 * softmax above). D a multiple of 16. A row that sees nothing gets zeros.
 *
 * Keys go by tiles of NT; for each tile every group of MR rows computes its MR x NT scores
 * with a register-blocked product (MR rows x 16 keys: 12 accumulators), updates its
 * running max and total (flash attention's rescaling), turns the scores into exp(s - max)
 * in place and adds P V into its MR x D accumulator (MR rows x 16 dims at a time). A tile
 * of K and V (2 x NT x D floats) stays in L2 while all the block's row groups use it.
 * Returns 0, or -1 where memory for the scratch could not be had.
 */
#include <stdlib.h>

#define MR 6 /* rows a register block: 12 accumulators (6 x 2 vectors), 2 loads, 1 broadcast */
#define NT 256 /* keys a tile (K and V tiles stay in L2); MR = 4, NT = 128 or 512 were no faster here */

__attribute__((visibility("default")))
int edgespec_attention_rows(const float *q, int64_t rows, int64_t ldq, const float *kp, const float *v,
                            int64_t ldv, int64_t n, int64_t D, int64_t first, int64_t group,
                            float *out, int64_t ldo) {
    if (rows <= 0) return 0;
    const int64_t groups = (rows + MR - 1) / MR;
    const int64_t padded = groups * MR;
    float *acc = calloc((size_t)(padded * D), sizeof(float));
    float *mx = malloc((size_t)padded * sizeof(float));
    float *tot = calloc((size_t)padded, sizeof(float));
    float *zero = calloc((size_t)D, sizeof(float));
    float *s = malloc((size_t)(MR * NT) * sizeof(float));
    int64_t *lim = malloc((size_t)padded * sizeof(int64_t));
    if (!acc || !mx || !tot || !zero || !s || !lim) {
        free(acc); free(mx); free(tot); free(zero); free(s); free(lim);
        return -1;
    }
    const float ninf = -__builtin_inff();
    for (int64_t r = 0; r < padded; r++) {
        int64_t rr = r < rows ? r : rows - 1; /* padding rows repeat the last row's limit */
        int64_t l = n;
        if (first >= 0) {
            l = first + rr / group + 1;
            if (l > n) l = n;
            if (l < 0) l = 0;
        }
        lim[r] = l;
        mx[r] = ninf;
    }
    int64_t reach = 0; /* keys any row sees */
    for (int64_t r = 0; r < padded; r++) reach = lim[r] > reach ? lim[r] : reach;

    for (int64_t j0 = 0; j0 < reach; j0 += NT) {
        for (int64_t g = 0; g < groups; g++) {
            const int64_t r0 = g * MR;
            int64_t see = 0; /* keys of this tile the group's rows see */
            for (int i = 0; i < MR; i++) {
                int64_t c = lim[r0 + i] - j0;
                if (c > see) see = c;
            }
            if (see <= 0) continue;
            if (see > NT) see = NT;
            const float *qr[MR];
            for (int i = 0; i < MR; i++) qr[i] = r0 + i < rows ? q + (r0 + i) * ldq : zero;
            /* scores: MR rows x `see` keys, 16 at a time */
            const int64_t panels = (see + 15) / 16;
            for (int64_t p = 0; p < panels; p++) {
                const float *kpp = kp + ((j0 / 16 + p) * D) * 16;
                vf a0[MR], a1[MR];
                for (int i = 0; i < MR; i++) { a0[i] = splat(0.0f); a1[i] = splat(0.0f); }
                for (int64_t d = 0; d < D; d++) {
                    const vf b0 = load(kpp + d * 16), b1 = load(kpp + d * 16 + 8);
                    for (int i = 0; i < MR; i++) {
                        const vf x = splat(qr[i][d]);
                        a0[i] += x * b0;
                        a1[i] += x * b1;
                    }
                }
                for (int i = 0; i < MR; i++) {
                    store(s + i * NT + p * 16, a0[i]);
                    store(s + i * NT + p * 16 + 8, a1[i]);
                }
            }
            const int64_t width = panels * 16; /* columns written; those >= see are masked below */
            /* online softmax, row by row */
            for (int i = 0; i < MR; i++) {
                float *row = s + i * NT;
                int64_t c = lim[r0 + i] - j0;
                if (c < 0) c = 0;
                if (c > see) c = see;
                for (int64_t j = c; j < width; j++) row[j] = ninf;
                float m = row_max(row, c);
                float *o = acc + (r0 + i) * D;
                const float old = mx[r0 + i];
                if (m == ninf || old >= m) m = old;
                if (m == ninf) { /* nothing seen yet: the tile adds nothing */
                    memset(row, 0, (size_t)width * sizeof(float));
                    continue;
                }
                if (old != m) {
                    const float alpha = old == ninf ? 0.0f : vexp_neg(splat(old - m))[0];
                    tot[r0 + i] *= alpha;
                    for (int64_t d = 0; d < D; d++) o[d] *= alpha;
                    mx[r0 + i] = m;
                }
                const vf sm = splat(m);
                vf sum = splat(0.0f);
                for (int64_t j = 0; j < width; j += W) { /* width is a multiple of 16 */
                    vf e = vexp_neg(load(row + j) - sm);
                    sum += e;
                    store(row + j, e);
                }
                float t = 0.0f;
                for (int k = 0; k < W; k++) t += sum[k];
                tot[r0 + i] += t;
            }
            /* acc += P V: MR rows x 16 dims at a time over the tile's keys */
            const float *vt = v + j0 * ldv;
            for (int64_t c0 = 0; c0 < D; c0 += 16) {
                vf o0[MR], o1[MR];
                for (int i = 0; i < MR; i++) {
                    o0[i] = load(acc + (r0 + i) * D + c0);
                    o1[i] = load(acc + (r0 + i) * D + c0 + 8);
                }
                for (int64_t j = 0; j < see; j++) {
                    const vf b0 = load(vt + j * ldv + c0), b1 = load(vt + j * ldv + c0 + 8);
                    for (int i = 0; i < MR; i++) {
                        const vf x = splat(s[i * NT + j]);
                        o0[i] += x * b0;
                        o1[i] += x * b1;
                    }
                }
                for (int i = 0; i < MR; i++) {
                    store(acc + (r0 + i) * D + c0, o0[i]);
                    store(acc + (r0 + i) * D + c0 + 8, o1[i]);
                }
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float t = tot[r] > 0.0f ? 1.0f / tot[r] : 0.0f;
        for (int64_t d = 0; d < D; d++) out[r * ldo + d] = acc[r * D + d] * t;
    }
    free(acc); free(mx); free(tot); free(zero); free(s); free(lim);
    return 0;
}
