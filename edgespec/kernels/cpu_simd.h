/* The vector helpers the native CPU kernels share (cpu_attention.c, cpu_exact.c): W-lane
 * float and int vectors (GCC/Clang vector extensions: AVX2 with -march=native on x86-64,
 * NEON on arm64), broadcast, unaligned load/store, and exp(x) for x <= 0 lane-wise (see
 * cpu_attention.c's notes for its polynomial; the same operations in every lane, so a
 * value's result does not depend on its lane, which bitwise verification relies on).
 * Included by file name: edgespec/kernels/native.py hashes it with each source. */
#ifndef EDGESPEC_CPU_SIMD_H
#define EDGESPEC_CPU_SIMD_H
#include <stdint.h>
#include <string.h>

#define W 8
typedef float vf __attribute__((vector_size(W * sizeof(float))));
typedef int32_t vi __attribute__((vector_size(W * sizeof(int32_t))));

static inline vf splat(float x) {
    return x - (vf){}; /* a broadcast (vbroadcastss); x - 0 keeps the sign of -0 */
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

/* max(row[0:n]), -inf for n = 0 */

#endif
