/* Width-invariant attention on the CPU device for bitwise verification (edgespec/kernels/
 * exact.py; built, loaded and checked by edgespec/kernels/native.py).
 *
 * A query row's result is a function of its own query, the keys and values it may see, and
 * their order, and of nothing else: not how many other queries share the call, not how many
 * keys it may not see, nor where those sit among the slots. So a verifier pass over T tokens
 * (a chain, a tree under its mask, a prompt chunk) gives each row bitwise what a one-token
 * pass over the same prefix gives. The reductions, per query row:
 *
 *   visible  = the slots j < S the row may see, in slot order (causal: j <= first + t;
 *              else mask[t * S + j] != 0); r = 0, 1, ... numbers them (the row's rank)
 *   s_r      = sum_d (q[d] * scale) * k[j_r][d]: d = 0..D-1 in order, one accumulator.
 *              Computed for W keys at once (one key a lane, lanes never mixed), so which
 *              keys share a vector does not change any key's score
 *   s_r      = cap * tanh(s_r / cap) when cap > 0 (Gemma 2's soft-cap)
 *   m        = max_r s_r (exact in any order)
 *   p_r      = exp(s_r - m) (a lane-wise polynomial: the same for a value in any lane)
 *   l        = sum_r p_r: W partial sums by rank (rank r goes to partial r mod W), then the
 *              partials added in a fixed order
 *   out[d]   = (sum_r p_r * v[j_r][d]) / l: r in order, one accumulator per d
 *
 * Every reduction is ordered by rank among the visible keys, and a one-token pass over the
 * prefix of a tree node sees the same keys in the same rank order (the cached prefix, then
 * the node's ancestors, which have smaller slots than their children, then the node). The
 * file is compiled with -ffp-contract=off so no product-and-sum is fused in one place and
 * not another. A row that sees nothing gives zeros.
 *
 * q: (rows, D) with rows = T * group (query-major: rows t*group .. t*group+group-1 are the
 * heads sharing this key/value head); k, v: (S, D) with row strides ldk, ldv; mask: NULL
 * (causal, `first` = S - T) or (T, S) bytes; out: (rows, D). Returns 0, or -1 when the
 * scratch could not be allocated.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_simd.h"

__attribute__((visibility("default"))) int edgespec_exact_attention(
    const float *q, int64_t rows, int64_t group, const float *k, int64_t ldk, const float *v, int64_t ldv,
    int64_t S, int64_t D, const uint8_t *mask, int64_t first, float scale, float cap, float *out) {
    int64_t S8 = (S + W - 1) / W * W;
    /* kt: the keys transposed (D x S8, zero past S), so W keys' scores are W lanes;
     * idx: a row's visible slots; s: their scores, then weights (S8 each, zero padded). */
    float *kt = malloc(sizeof(float) * (size_t)(D * S8 + S8 + D));
    int64_t *idx = malloc(sizeof(int64_t) * (size_t)(S > 0 ? S : 1));
    if (!kt || !idx) {
        free(kt);
        free(idx);
        return -1;
    }
    float *s = kt + D * S8, *qs = s + S8;
    for (int64_t d = 0; d < D; d++) {
        float *row = kt + d * S8;
        for (int64_t j = 0; j < S; j++) row[j] = k[j * ldk + d];
        for (int64_t j = S; j < S8; j++) row[j] = 0.0f;
    }
    for (int64_t r = 0; r < rows; r++) {
        int64_t t = r / group;
        const float *qr = q + r * D;
        float *o = out + r * D;
        for (int64_t d = 0; d < D; d++) qs[d] = qr[d] * scale;
        /* the visible slots, in order */
        int64_t n = 0;
        if (mask == NULL) {
            int64_t end = first + t + 1;
            if (end > S) end = S;
            for (int64_t j = 0; j < end; j++) idx[n++] = j;
        } else {
            const uint8_t *mr = mask + t * S;
            for (int64_t j = 0; j < S; j++)
                if (mr[j]) idx[n++] = j;
        }
        if (n == 0) {
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            continue;
        }
        /* scores of all slots W at a time (a key's lane arithmetic is the same in any lane),
         * then gathered by rank */
        int64_t lastslot = idx[n - 1] + 1;
        for (int64_t j0 = 0; j0 < lastslot; j0 += W) {
            vf acc = splat(0.0f);
            for (int64_t d = 0; d < D; d++) acc = acc + splat(qs[d]) * load(kt + d * S8 + j0);
            store(s + j0, acc);
        }
        /* s[j] now holds slot j's score for j < lastslot; compact by rank in place (r <= j) */
        for (int64_t i = 0; i < n; i++) s[i] = s[idx[i]];
        if (cap > 0.0f)
            for (int64_t i = 0; i < n; i++) s[i] = cap * tanhf(s[i] / cap);
        float m = s[0];
        for (int64_t i = 1; i < n; i++) m = s[i] > m ? s[i] : m;
        int64_t n8 = (n + W - 1) / W * W;
        if (m == -INFINITY) {
            for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
            continue;
        }
        for (int64_t i = n; i < n8; i++) s[i] = -INFINITY;
        vf part = splat(0.0f);
        for (int64_t i = 0; i < n8; i += W) {
            vf p = vexp_neg(load(s + i) - splat(m));
            store(s + i, p);
            part = part + p;
        }
        float lanes[W];
        store(lanes, part);
        float l = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            float p = s[i];
            const float *vr = v + idx[i] * ldv;
            for (int64_t d = 0; d < D; d++) o[d] = o[d] + p * vr[d];
        }
        for (int64_t d = 0; d < D; d++) o[d] = o[d] / l;
    }
    free(kt);
    free(idx);
    return 0;
}
