// Eight-float vectors (GCC vector extensions) shared by the kernels that are not per-ISA files:
// the code is written once and compiled for each instruction set through target attributes
// (a function with __attribute__((target("avx2,fma"))) that calls these gets AVX2 code).
#pragma once
#include <cstdint>
#include <cstring>

namespace localrun {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
// sixteen-float vectors, for code compiled for AVX-512 (expv<v16, v16i>)
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
#define ALWAYS_INLINE inline __attribute__((always_inline))

ALWAYS_INLINE v8 load8(const float* p) { v8 v; std::memcpy(&v, p, sizeof v); return v; }
ALWAYS_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }
// a shuffle of lane 0, not an eight-lane initializer: GCC builds the latter with eight inserts
// where the former is one vbroadcastss
ALWAYS_INLINE v8 splat8(float x) { const v8 t = {x}; return __builtin_shufflevector(t, t, 0, 0, 0, 0, 0, 0, 0, 0); }
ALWAYS_INLINE float hsum8(v8 v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

// (sum of s[0], sum of s[1], ..., sum of s[7]) by a transposing tree (fixed order)
ALWAYS_INLINE v8 transpose_sum8(const v8* s) {
    v8 t[4], u[2];
    for (int k = 0; k < 4; k++)
        t[k] = __builtin_shufflevector(s[2 * k], s[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(s[2 * k], s[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; k++)
        u[k] = __builtin_shufflevector(t[2 * k], t[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(t[2 * k], t[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    // u[0] = [s0 s1 s2 s3 (lanes 0-3) | s0 s1 s2 s3 (lanes 4-7)], u[1] the same for s4..s7
    return __builtin_shufflevector(u[0], u[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u[0], u[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

typedef uint16_t u16x8 __attribute__((vector_size(16)));

// Eight float16 values (IEEE binary16 bit patterns) widened exactly: the 15 magnitude bits
// shifted into a float's place are the value times 2^-112 (subnormals included), so one
// multiply by 2^112 fixes the exponent; inf and NaN get the all-ones exponent; the sign last.
ALWAYS_INLINE v8 half8(const uint16_t* p) {
    u16x8 h; std::memcpy(&h, p, sizeof h);
    const v8i x = __builtin_convertvector(h, v8i), em = (x & 0x7fff) << 13;
    v8 f; std::memcpy(&f, &em, sizeof f);
    f = f * splat8(0x1p112f);
    v8i bits; std::memcpy(&bits, &f, sizeof bits);
    bits |= (em >= (0x7c00 << 13)) & (0xff << 23);
    bits |= (x & 0x8000) << 16;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}

// Eight bfloat16 values widened exactly: they are a float's upper 16 bits.
ALWAYS_INLINE v8 bf16x8(const uint16_t* p) {
    u16x8 h; std::memcpy(&h, p, sizeof h);
    const v8i bits = __builtin_convertvector(h, v8i) << 16;
    v8 f; std::memcpy(&f, &bits, sizeof f);
    return f;
}

ALWAYS_INLINE float max8(v8 v) {
    float m = v[0];
    for (int i = 1; i < 8; i++) m = v[i] > m ? v[i] : m;
    return m;
}

// e^x: 2^n * p(r) with Cephes' expf polynomial (within 2 ulp of expf); x clamped to [-87, 88].
// Written for any width of float vector V (and its int32 vector VI): each lane's steps are the
// same whatever the width, so exp16 gives exp8's bits lane for lane.
template <typename V, typename VI>
ALWAYS_INLINE V expv(V x) {
    const V zero = {}, lo = zero - 87.f, hi = zero + 88.f;   // splats of V's width
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    const V t = x * 1.44269504088896341f + 0.5f;
    V n = __builtin_convertvector(__builtin_convertvector(t, VI), V);
    n = n > t ? n - 1.f : n;                                                  // floor
    const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
    V p = zero + 1.9875691500E-4f;
    p = p * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * r * r + r + 1.f;
    const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
    V scale; std::memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}
ALWAYS_INLINE v8 exp8(v8 x) { return expv<v8, v8i>(x); }

}  // namespace localrun
