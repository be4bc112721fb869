// Emulation of the subset of the Metal Shading Language that edgespec's kernels use,
// so the exact kernel source strings passed to mx.fast.metal_kernel compile as C++17
// and run on the CPU (see edgespec/kernels/emulate.py).
//
// Covered: address-space qualifiers (device, constant, thread, threadgroup) as no-ops,
// the [[kernel]] / [[buffer(i)]] / [[thread_position_in_grid]] attributes (ignored by
// g++ with -Wno-attributes), uint / uint2 / uint3 / int2 / int3 vector types with
// .x .y .z members, metal::min / max / clamp / abs, and the float functions exp, tanh,
// sqrt, rsqrt, fma that the delta-rule, expert and bitwise kernels use (INFINITY from <cmath>).
// Not covered (the kernels must not use them): threadgroup memory shared between
// threads, barriers, simdgroup functions, atomics, half / bfloat types, vector math.
// The emulator runs grid threads one after another, so a kernel whose threads read
// what other threads write (a race on a GPU) is NOT detected here.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

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
