/* The gated delta rule's recurrent form on the CPU (edgespec/kernels/cpu_delta.py loads it).
 *
 * For heads bh in [bh0, bh1) of a pass of T positions (layouts as edgespec.caches.recurrent.delta_rule:
 * q, k (B, T, Hk, Dk), v (B, T, H, Dv), g, beta (B, T, H), state (B, H, Dk, Dv), float32,
 * contiguous), per position t from its parent's state (parents[t]; t - 1 for a chain, -1 the
 * state before the pass):
 *     S <- exp(g) S;  mem = k^T S;  delta = beta (v - mem);  S <- S + k delta^T;  out = q^T S
 * in two passes over the head's state (Dk x Dv floats, 64 KB at 128 x 128: it stays in the
 * core's cache across the pass), each row of S vectorised over its Dv columns:
 *     pass 1: S[i] *= exp(g); mem += k[i] S[i]
 *     pass 2: S[i] += k[i] delta; out += q[i] S[i]
 * MLX's composition (edgespec.caches.recurrent.delta_step) runs six operations over the whole
 * (H, Dk, Dv) state per position, each streaming it through memory.
 *
 * Tree passes: each position's state is saved in `saved` ((T, Dk, Dv) floats per call, the
 * caller's buffer, or NULL for a chain) for its children to start from.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__)
#define EXPORT __attribute__((visibility("default")))
#else
#define EXPORT
#endif

EXPORT void edgespec_delta_rule(const float *q, const float *k, const float *v, const float *g, const float *beta,
                                const float *state_in, const int32_t *parents, int64_t T, int64_t H, int64_t Hk,
                                int64_t Dk, int64_t Dv, int64_t bh0, int64_t bh1, float *out, float *state_out,
                                float *saved, float *work /* 2 Dv floats */) {
    const int64_t DD = Dk * Dv;
    float *mem = work, *delta = work + Dv;
    for (int64_t bh = bh0; bh < bh1; ++bh) {
        const int64_t b = bh / H, h = bh % H, hk = h / (H / Hk);
        const float *S0 = state_in + bh * DD;
        float *S = state_out + bh * DD;
        memcpy(S, S0, (size_t)DD * sizeof(float));
        for (int64_t t = 0; t < T; ++t) {
            const int32_t p = parents[t];
            if (p != t - 1)
                memcpy(S, p < 0 ? S0 : saved + (int64_t)p * DD, (size_t)DD * sizeof(float));
            const int64_t bth = (b * T + t) * H + h;
            const float *kt = k + ((b * T + t) * Hk + hk) * Dk;
            const float *qt = q + ((b * T + t) * Hk + hk) * Dk;
            const float *vt = v + bth * Dv;
            float *ot = out + bth * Dv;
            const float decay = expf(g[bth]), bt = beta[bth];
            for (int64_t j = 0; j < Dv; ++j)
                mem[j] = 0.0f;
            for (int64_t i = 0; i < Dk; ++i) {
                float *row = S + i * Dv;
                const float ki = kt[i];
                for (int64_t j = 0; j < Dv; ++j) {
                    row[j] *= decay;
                    mem[j] += ki * row[j];
                }
            }
            for (int64_t j = 0; j < Dv; ++j) {
                delta[j] = (vt[j] - mem[j]) * bt;
                ot[j] = 0.0f;
            }
            for (int64_t i = 0; i < Dk; ++i) {
                float *row = S + i * Dv;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < Dv; ++j) {
                    row[j] += ki * delta[j];
                    ot[j] += qi * row[j];
                }
            }
            if (saved)
                memcpy(saved + t * DD, S, (size_t)DD * sizeof(float));
        }
    }
}
