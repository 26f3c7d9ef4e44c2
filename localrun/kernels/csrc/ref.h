// The scalar reference: one 32-value group of a weight row at a time, as codes and a, b per half
// (see blocks.h), a dot product over quantized activations, and dequantization. Plain C++, no
// intrinsics: the SIMD paths are tested against it, and it runs where no SIMD path exists.
#pragma once
#include "blocks.h"

namespace localrun {

struct Group {
    int16_t q[32];        // codes (signed for Q8_0)
    float a[2], b[2];     // w = a[h] * q + b[h] for values 16h..16h+15
};

// Group g (32 values from value 32 g) of a weight row of the given type.
inline void decode_group(int qtype, const uint8_t* row, int64_t g, Group& out) {
    auto set_ab = [&](float a, float b) { out.a[0] = out.a[1] = a; out.b[0] = out.b[1] = b; };
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0) {
        int values, bytes; block_shape(qtype, values, bytes);
        const uint8_t* blk = row + g * bytes;
        float d = read_f16(blk);
        if (qtype == Q8_0) {
            for (int j = 0; j < 32; j++) out.q[j] = (int8_t)blk[2 + j];
            set_ab(d, 0.f);
            return;
        }
        const uint8_t* qs = blk + (qtype == Q4_0 ? 2 : qtype == Q4_1 ? 4 : qtype == Q5_0 ? 6 : 8);
        uint32_t qh = 0;
        if (qtype == Q5_0) std::memcpy(&qh, blk + 2, 4);
        if (qtype == Q5_1) std::memcpy(&qh, blk + 4, 4);
        for (int j = 0; j < 16; j++) {
            out.q[j] = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
            out.q[j + 16] = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
        }
        if (qtype == Q4_0) set_ab(d, -8.f * d);
        else if (qtype == Q5_0) set_ab(d, -16.f * d);
        else set_ab(d, read_f16(blk + 2));
        return;
    }
    const int64_t sb = g / 8;          // super-block
    const int j = (int)(g % 8);        // 32-group inside it
    if (qtype == Q4_K || qtype == Q5_K) {
        const uint8_t* blk = row + sb * (qtype == Q4_K ? 144 : 176);
        float d = read_f16(blk), dmin = read_f16(blk + 2);
        int sc, m; scale_min_k4(j, blk + 4, sc, m);
        const uint8_t* qs = blk + (qtype == Q4_K ? 16 : 48) + 32 * (j / 2);
        const uint8_t* qh = blk + 16;
        for (int l = 0; l < 32; l++) {
            int q = (j % 2 == 0) ? (qs[l] & 0x0F) : (qs[l] >> 4);
            if (qtype == Q5_K) q |= ((qh[l] >> j) & 1) << 4;
            out.q[l] = (int16_t)q;
        }
        set_ab(d * sc, -dmin * m);
        return;
    }
    if (qtype == Q6_K) {
        const uint8_t* blk = row + sb * 210;
        const int h = j / 4, k = j % 4;              // half of the super-block, group in the half
        const uint8_t* ql = blk + 64 * h + 32 * (k % 2);
        const uint8_t* qh = blk + 128 + 32 * h;
        const int8_t* sc = (const int8_t*)(blk + 192) + 8 * h + 2 * k;
        float d = read_f16(blk + 208);
        for (int l = 0; l < 32; l++) {
            int lo = (k < 2) ? (ql[l] & 0x0F) : (ql[l] >> 4);
            out.q[l] = (int16_t)(lo | (((qh[l] >> (2 * k)) & 3) << 4));
        }
        for (int half = 0; half < 2; half++) { out.a[half] = d * sc[half]; out.b[half] = -32.f * d * sc[half]; }
        return;
    }
}

// Quantize one row of x (K floats) to the activation format (blocks.h): round half to even.
inline void quantize_row_ref(const float* x, int64_t K, int8_t* qs, float* d, int32_t* s) {
    for (int64_t b = 0; b < K / 32; b++) {
        float amax = 0.f;
        for (int j = 0; j < 32; j++) amax = std::fmax(amax, std::fabs(x[32 * b + j]));
        float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        d[b] = scale;
        int32_t s0 = 0, s1 = 0;
        for (int j = 0; j < 32; j++) {
            int q = (int)std::nearbyint(x[32 * b + j] * inv);
            qs[32 * b + j] = (int8_t)q;
            (j < 16 ? s0 : s1) += q;
        }
        s[2 * b] = s0; s[2 * b + 1] = s1;
    }
}

// sum over the row of w * x, with x as quantized activations (row m of qx).
inline float dot_row_ref(int qtype, const uint8_t* row, const QX& qx, int64_t m) {
    const int8_t* xq = qx.qs + m * qx.K;
    const float* xd = qx.d + m * (qx.K / 32);
    const int32_t* xs = qx.s + m * (qx.K / 16);
    double sum = 0.0;
    Group grp;
    for (int64_t g = 0; g < qx.K / 32; g++) {
        decode_group(qtype, row, g, grp);
        for (int h = 0; h < 2; h++) {
            int64_t isum = 0;
            for (int l = 16 * h; l < 16 * h + 16; l++) isum += (int64_t)grp.q[l] * xq[32 * g + l];
            sum += (double)xd[g] * ((double)grp.a[h] * isum + (double)grp.b[h] * xs[2 * g + h]);
        }
    }
    return (float)sum;
}

inline void dequantize_row_ref(int qtype, const uint8_t* row, int64_t K, float* out) {
    Group grp;
    for (int64_t g = 0; g < K / 32; g++) {
        decode_group(qtype, row, g, grp);
        for (int l = 0; l < 32; l++) out[32 * g + l] = grp.a[l / 16] * grp.q[l] + grp.b[l / 16];
    }
}

}  // namespace localrun
