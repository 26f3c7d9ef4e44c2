// Eight-float vectors (GCC vector extensions) shared by the kernels that are not per-ISA files:
// the code is written once and compiled for each instruction set through target attributes
// (a function with __attribute__((target("avx2,fma"))) that calls these gets AVX2 code).
#pragma once
#include <cstdint>
#include <cstring>

namespace localrun {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define ALWAYS_INLINE inline __attribute__((always_inline))

ALWAYS_INLINE v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
ALWAYS_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
ALWAYS_INLINE v8 splat8(float x) { return v8{x, x, x, x, x, x, x, x}; }
ALWAYS_INLINE float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// e^x: 2^n * p(r) with Cephes' expf polynomial (within 2 ulp of expf); x clamped to [-87, 88].
ALWAYS_INLINE v8 exp8(v8 x) {
    x = x < splat8(-87.f) ? splat8(-87.f) : x;
    x = x > splat8(88.f) ? splat8(88.f) : x;
    const v8 t = x * splat8(1.44269504088896341f) + splat8(0.5f);
    v8 n = __builtin_convertvector(__builtin_convertvector(t, v8i), v8);
    n = n > t ? n - splat8(1.f) : n;                                          // floor
    const v8 r = x - n * splat8(0.693359375f) + n * splat8(2.12194440e-4f);
    v8 p = splat8(1.9875691500E-4f);
    p = p * r + splat8(1.3981999507E-3f);
    p = p * r + splat8(8.3334519073E-3f);
    p = p * r + splat8(4.1665795894E-2f);
    p = p * r + splat8(1.6666665459E-1f);
    p = p * r + splat8(5.0000001201E-1f);
    p = p * r * r + r + splat8(1.f);
    const v8i bits = (__builtin_convertvector(n, v8i) + 127) << 23;
    v8 scale; std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

}  // namespace localrun
