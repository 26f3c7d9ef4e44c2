// GGUF block layouts (as ggml stores them) and the one activation format the kernels use.
//
// Every weight row is a run of blocks; a block covers 32 values (QK = 32) or, for the
// K-quants, a super-block of 256 (QK_K = 256) made of 32-value sub-blocks. All scales are
// IEEE half floats. The kernels see each block as groups of 32 values: unsigned codes q
// (0..2^bits-1, or signed for Q8_0) with  w = a * q + b,  where a and b may differ between
// the group's two halves of 16 values (Q6_K has one scale per 16 values).
//
//   Q4_0  { f16 d; u8 qs[16]; }                      w = d * (q - 8)                 18 B / 32
//   Q4_1  { f16 d, m; u8 qs[16]; }                   w = d * q + m                   20 B / 32
//   Q5_0  { f16 d; u8 qh[4]; u8 qs[16]; }            w = d * (q - 16), q 5-bit       22 B / 32
//   Q5_1  { f16 d, m; u8 qh[4]; u8 qs[16]; }         w = d * q + m                   24 B / 32
//   Q8_0  { f16 d; i8 qs[32]; }                      w = d * q (signed)              34 B / 32
//   Q4_K  { f16 d, dmin; u8 scales[12]; u8 qs[128]; }           per 32: w = d*sc*q - dmin*m     144 B / 256
//   Q5_K  { f16 d, dmin; u8 scales[12]; u8 qh[32]; u8 qs[128]; } per 32: same, q 5-bit        176 B / 256
//   Q6_K  { u8 ql[128]; u8 qh[64]; i8 scales[16]; f16 d; }      per 16: w = d*sc*(q - 32)       210 B / 256
//
// In 32-value blocks, qs[j] holds value j in its low nibble and value j + 16 in its high one;
// a 5th bit for value j is bit j of qh (little-endian u32). Q4_K/Q5_K: each 64 values share 32
// bytes of qs, low nibbles first 32 values, high nibbles the next 32; the 6-bit scales and mins
// of the 8 sub-blocks are packed in 12 bytes (get_scale_min_k4). Q6_K: see q6k_code below.
//
// Activations (QX): each row of x (K floats) is quantized once per call to 32-value blocks
//   qs int8 [K]  (-127..127),  d float [K/32]  (x ~ d * qs),  s int32 [K/16] (sum of qs per 16),
// so a group's dot product is  a * d * sum(q * qs) + b * d * sum(qs)  per half, with the
// integer part done by u8 x s8 dot-product instructions.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>

namespace localrun {

// ggml's type ids (GGMLQuantizationType in gguf-py)
enum QType : int { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
                   Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30 };

constexpr int QK = 32;
constexpr int QK_K = 256;

// Values per block and bytes per block of each supported type (0, 0 if unsupported).
inline void block_shape(int qtype, int& values, int& bytes) {
    switch (qtype) {
        case Q4_0: values = 32; bytes = 18; return;
        case Q4_1: values = 32; bytes = 20; return;
        case Q5_0: values = 32; bytes = 22; return;
        case Q5_1: values = 32; bytes = 24; return;
        case Q8_0: values = 32; bytes = 34; return;
        case Q4_K: values = 256; bytes = 144; return;
        case Q5_K: values = 256; bytes = 176; return;
        case Q6_K: values = 256; bytes = 210; return;
        default: values = 0; bytes = 0; return;
    }
}

inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) { bits = sign; }
        else {                                     // subnormal: renormalize
            exp = 127 - 15 + 1;
            while (!(mant & 0x400)) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000 | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f; std::memcpy(&f, &bits, 4); return f;
}

inline float read_f16(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return f16_to_f32(h); }

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
    if (j < 4) { sc = q[j] & 63; m = q[j + 4] & 63; }
    else { sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

// Activations quantized for one call: M rows of K values.
struct QX {
    const int8_t* qs;      // (M, K)
    const float* d;        // (M, K/32)
    const int32_t* s;      // (M, K/16)
    int64_t K;
    const float* dxv;      // (M, K/32, 8): d in every lane (AVX-512 path)
    const float* sxv;      // (M, K/32, 8): d * s[half] / 4 in the half's 4 lanes (AVX-512 path)
    const float* sxh;      // (M, K/16): d * s per half (AVX2 path)
    const float* sxg;      // (M, K/32): d * (s of both halves) per group (AVX2 path)
};

}  // namespace localrun
