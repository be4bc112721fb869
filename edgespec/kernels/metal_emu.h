// Emulation of the subset of the Metal Shading Language that edgespec's kernels use,
// so the exact kernel source strings passed to mx.fast.metal_kernel compile as C++17
// and run on the CPU (see edgespec/kernels/emulate.py).
//
// Covered: address-space qualifiers (device, constant, thread, threadgroup) as no-ops,
// the [[kernel]] / [[buffer(i)]] / [[thread_position_in_grid]] attributes (ignored by
// g++ with -Wno-attributes), uint / uint2 / uint3 / int2 / int3 vector types with
// .x .y .z members, metal::min / max / clamp / abs, and the float functions exp, tanh,
// sqrt, rsqrt, fma that the delta-rule, expert and bitwise kernels use (INFINITY from <cmath>),
// and Metal's 16-bit floats `half` (IEEE binary16) and `bfloat` (bfloat16) with the names MLX
// writes into a kernel's signature (`float16_t`, `bfloat16_t`). Their semantics are Metal's:
// float -> half / bfloat rounds to nearest, ties to even (overflow -> inf, NaN stays NaN;
// half keeps subnormals); half / bfloat -> float is exact; an operation on two halves
// (two bfloats) is computed in float and rounded once to half (bfloat), which is the correctly
// rounded result since float has more than twice their precision; with a float operand
// the result is float. Stored as 16 bits, so buffers are the bits MLX hands a kernel.
// Not covered (the kernels must not use them): threadgroup memory shared between
// threads, barriers, simdgroup functions, atomics, vector math, half/bfloat vector types.
// The emulator runs grid threads one after another, so a kernel whose threads read
// what other threads write (a race on a GPU) is NOT detected here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

typedef unsigned int uint;

struct uint2 { uint x, y; };
struct uint3 { uint x, y, z; };
struct int2 { int x, y; };
struct int3 { int x, y, z; };

namespace metal {
using std::abs;
using std::exp;
using std::fma;
using std::sqrt;
using std::tanh;
using std::max;
using std::min;
template <typename T>
inline T clamp(T x, T lo, T hi) { return std::min(std::max(x, lo), hi); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
}  // namespace metal
using namespace metal;

// Address spaces carry no meaning on a CPU: one flat memory.
#define device
#define constant
#define thread
#define threadgroup


// ---------------------------------------------------------------- half and bfloat

inline uint32_t emu_bits(float f) { uint32_t x; std::memcpy(&x, &f, 4); return x; }
inline float emu_float(uint32_t x) { float f; std::memcpy(&f, &x, 4); return f; }

inline uint16_t emu_float_to_half_bits(float f) {
  uint32_t x = emu_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
    float scaled = emu_float(ax) * 16777216.0f;  // exact: a power of two
    return uint16_t(sign | uint32_t(std::nearbyint(scaled)));  // the default mode: ties to even
  }
  uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);  // ties to even; a carry moves the exponent
  return uint16_t(sign | ((rounded >> 13) - (112u << 10)));
}

inline float emu_half_bits_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    float v = float(m) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (e == 31) return emu_float(sign | 0x7f800000u | (m << 13));
  return emu_float(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t emu_float_to_bfloat_bits(float f) {
  uint32_t x = emu_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t(0x7fc0u);  // NaN (as MLX's bfloat does)
  x += 0x7fffu + ((x >> 16) & 1u);  // ties to even
  return uint16_t(x >> 16);
}

inline float emu_bfloat_bits_to_float(uint16_t b) { return emu_float(uint32_t(b) << 16); }

#define EMU_FLOAT16_TYPE(T, TO_BITS, TO_FLOAT)                                              \
  struct T {                                                                                 \
    uint16_t bits;                                                                           \
    T() = default;                                                                           \
    T(float f) : bits(TO_BITS(f)) {}                                                         \
    T(double f) : bits(TO_BITS(float(f))) {}                                                 \
    T(int i) : bits(TO_BITS(float(i))) {}                                                    \
    T(uint i) : bits(TO_BITS(float(i))) {}                                                   \
    operator float() const { return TO_FLOAT(bits); }                                        \
    T& operator+=(T o) { return *this = T(float(*this) + float(o)); }                        \
    T& operator-=(T o) { return *this = T(float(*this) - float(o)); }                        \
    T& operator*=(T o) { return *this = T(float(*this) * float(o)); }                        \
    T& operator/=(T o) { return *this = T(float(*this) / float(o)); }                        \
    T operator-() const { T r; r.bits = uint16_t(bits ^ 0x8000u); return r; }               \
  };                                                                                         \
  inline T operator+(T a, T b) { return T(float(a) + float(b)); }                           \
  inline T operator-(T a, T b) { return T(float(a) - float(b)); }                           \
  inline T operator*(T a, T b) { return T(float(a) * float(b)); }                           \
  inline T operator/(T a, T b) { return T(float(a) / float(b)); }                           \
  inline float operator+(T a, float b) { return float(a) + b; }                             \
  inline float operator-(T a, float b) { return float(a) - b; }                             \
  inline float operator*(T a, float b) { return float(a) * b; }                             \
  inline float operator/(T a, float b) { return float(a) / b; }                             \
  inline float operator+(float a, T b) { return a + float(b); }                             \
  inline float operator-(float a, T b) { return a - float(b); }                             \
  inline float operator*(float a, T b) { return a * float(b); }                             \
  inline float operator/(float a, T b) { return a / float(b); }                             \
  inline bool operator<(T a, T b) { return float(a) < float(b); }                           \
  inline bool operator>(T a, T b) { return float(a) > float(b); }                           \
  inline bool operator<=(T a, T b) { return float(a) <= float(b); }                         \
  inline bool operator>=(T a, T b) { return float(a) >= float(b); }                         \
  inline bool operator==(T a, T b) { return float(a) == float(b); }                         \
  inline bool operator!=(T a, T b) { return float(a) != float(b); }                         \
  inline T exp(T a) { return T(std::exp(float(a))); }                                       \
  inline T tanh(T a) { return T(std::tanh(float(a))); }                                     \
  inline T sqrt(T a) { return T(std::sqrt(float(a))); }                                     \
  inline T abs(T a) { T r; r.bits = uint16_t(a.bits & 0x7fffu); return r; }                  \
  inline T fma(T a, T b, T c) { return T(std::fma(float(a), float(b), float(c))); }

EMU_FLOAT16_TYPE(half, emu_float_to_half_bits, emu_half_bits_to_float)
EMU_FLOAT16_TYPE(bfloat, emu_float_to_bfloat_bits, emu_bfloat_bits_to_float)
#undef EMU_FLOAT16_TYPE

static_assert(sizeof(half) == 2 && sizeof(bfloat) == 2, "16-bit floats must be 16 bits");
typedef half float16_t;
typedef bfloat bfloat16_t;
