// The SIMD body of the quantized matmul, compiled once per instruction set: qmatmul_avx2.cpp
// (AVX2 + FMA + F16C: maddubs/madd), qmatmul_avxvnni.cpp (the AVX2 kernels with AVX-VNNI's
// vpdpbusd for maddubs + madd: Intel client cores from Alder Lake on, which lack AVX-512) and
// qmatmul_avx512.cpp (adds AVX-512 VL/BW/VNNI: vpdpbusd, 512-bit kernels of their own).
// All use 256-bit vectors, one 32-value group per register. Each weight group is decoded to
// u8 codes once and multiplied by up to ROWS_TILE_MAX activation rows; every row runs the same
// instructions in the same order whatever the tile, so a row's result never depends on the
// other rows of a call (bit for bit). Both also have a lane layout (below: eight weight rows
// side by side), which a weight's kernel type asks for; it too gives every row the same bits
// whatever shares the call, and the same bits in either build (its integer sums are exact).
//
// Include after defining ISA_NS (the namespace) and, for AVX-512 VNNI, LOCALRUN_VNNI, or, for
// AVX-VNNI, LOCALRUN_AVXVNNI.
#include <immintrin.h>
#include <algorithm>
#include <vector>
#include "blocks.h"

namespace localrun { namespace ISA_NS {

#ifdef LOCALRUN_AVXVNNI
// acc + the u8 x s8 products of each 4 bytes, summed into int32 lanes: vpdpbusd in its VEX form
// (AVX-VNNI). qmatmul_avxvnni_evex.cpp builds the same kernels with the EVEX form (AVX-512 VNNI
// + VL), the same instruction on the same registers, so that an AVX-512 host can run and test
// them (LOCALRUN_ISA=avxvnni). The sums are exact, as maddubs + madd's are where their int16
// pair sums cannot saturate (STEPS), so these kernels give the AVX2 build's bits.
static inline __attribute__((always_inline)) __m256i dpbusd_avx(__m256i acc, __m256i q, __m256i x) {
#ifdef __AVX512VNNI__
    return _mm256_dpbusd_epi32(acc, q, x);
#else
    return _mm256_dpbusd_avx_epi32(acc, q, x);
#endif
}
#endif

// u8 codes x s8 activations -> 8 int32 lanes (lane i: bytes 4i..4i+3)
static inline __m256i dot_us(__m256i q, __m256i x) {
#ifdef LOCALRUN_VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, x);
#elif defined(LOCALRUN_AVXVNNI)
    return dpbusd_avx(_mm256_setzero_si256(), q, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, x), _mm256_set1_epi16(1));
#endif
}

// s8 codes x s8 activations (activations are never -128)
static inline __m256i dot_ss(__m256i q, __m256i x) {
    return dot_us(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
}

static inline float f16(const uint8_t* p) {
    uint16_t h; std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 32 bits -> 32 bytes, 0xFF where the bit is set (byte i <- bit i)
static inline __m256i bytes_from_bits(const uint8_t* p) {
    uint32_t bits; std::memcpy(&bits, p, 4);
    const __m256i shuffle = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                              0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), shuffle);
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
}

static inline __m256i nibbles(const uint8_t* qs16) {   // 16 bytes -> 32 codes: low nibbles, then high
    __m128i v = _mm_loadu_si128((const __m128i*)qs16);
    __m128i m = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// Per activation row and group, 8 lanes matching the 8 int32 lanes of a group's dot product:
// dxv = d (the block's scale) in every lane; sxv = d * (sum of the half's codes) / 4 in the
// half's 4 lanes, so that  sum over lanes of (isum * a * dxv + b * sxv)  is the group's
// a * d * sum(q * x) + b * d * sum(x), all in vector registers.
constexpr int LANES = 8;

#ifdef LOCALRUN_VNNI
// AVX-512: two groups per 512-bit register.
struct Pair { __m512i q; __m512 a, b; };

static inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512 join(__m256 lo, __m256 hi) { return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1); }

template <bool SIGNED, int R>
static inline void pair_rows(const Pair& p, int64_t g, const int8_t* const* xq, const float* const* dxv,
                             const float* const* sxv, __m512* acc) {
    for (int r = 0; r < R; r++) {
        const __m512i x = _mm512_loadu_si512((const void*)(xq[r] + 32 * g));
        __m512i isum;
        if (SIGNED) isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(p.q),
                                               _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(p.q), _mm512_setzero_si512(), x));
        else isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), p.q, x);
        const __m512 scale = _mm512_mul_ps(p.a, _mm512_loadu_ps(dxv[r] + LANES * g));
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
        if (!SIGNED) acc[r] = _mm512_fmadd_ps(p.b, _mm512_loadu_ps(sxv[r] + LANES * g), acc[r]);
    }
}
#else
template <bool SIGNED, int R>
static inline void group_rows(__m256i q, __m256 a, __m256 b, int64_t g, const int8_t* const* xq,
                              const float* const* dxv, const float* const* sxv, __m256* acc) {
    for (int r = 0; r < R; r++) {
        const __m256i x = _mm256_loadu_si256((const __m256i*)(xq[r] + 32 * g));
        const __m256i isum = SIGNED ? dot_ss(q, x) : dot_us(q, x);
        const __m256 scale = _mm256_mul_ps(a, _mm256_loadu_ps(dxv[r] + LANES * g));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
        if (!SIGNED) acc[r] = _mm256_fmadd_ps(b, _mm256_loadu_ps(sxv[r] + LANES * g), acc[r]);
    }
}
#endif


static inline __m256 halves(float lo, float hi) { return _mm256_set_m128(_mm_set1_ps(hi), _mm_set1_ps(lo)); }

// Visit every group of a weight row: f(g, codes, a, b) with a, b per lane (halves(lo, hi) or broadcast).
template <int QT, class F>
static inline void for_each_group(const uint8_t* row, int64_t K, F&& f) {
    if constexpr (QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1) {
        constexpr int bytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : 24;
        constexpr int qs_at = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
        for (int64_t g = 0; g < K / 32; g++) {
            const uint8_t* blk = row + g * bytes;
            __m256i q = nibbles(blk + qs_at);
            if constexpr (QT == Q5_0 || QT == Q5_1) {
                __m256i hi = _mm256_and_si256(bytes_from_bits(blk + (QT == Q5_0 ? 2 : 4)), _mm256_set1_epi8(0x10));
                q = _mm256_or_si256(q, hi);
            }
            const float d = f16(blk);
            const float b = QT == Q4_0 ? -8.f * d : QT == Q5_0 ? -16.f * d : f16(blk + 2);
            f(g, q, _mm256_set1_ps(d), _mm256_set1_ps(b));
        }
    } else if constexpr (QT == Q8_0) {
        for (int64_t g = 0; g < K / 32; g++) {
            const uint8_t* blk = row + g * 34;
            const float d = f16(blk);
            f(g, _mm256_loadu_si256((const __m256i*)(blk + 2)), _mm256_set1_ps(d), _mm256_setzero_ps());
        }
    } else if constexpr (QT == Q4_K || QT == Q5_K) {
        constexpr int bytes = QT == Q4_K ? 144 : 176;
        const __m256i low4 = _mm256_set1_epi8(0x0F);
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t* blk = row + sb * bytes;
            const float d = f16(blk), dmin = f16(blk + 2);
            const uint8_t* qs = blk + (QT == Q4_K ? 16 : 48);
            __m256i qh = QT == Q5_K ? _mm256_loadu_si256((const __m256i*)(blk + 16)) : _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                for (int half = 0; half < 2; half++) {
                    const int j = 2 * c + half;
                    __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(v, 4) : v, low4);
                    if constexpr (QT == Q5_K) {
                        __m256i bit = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
                        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
                    }
                    int sc, m; scale_min_k4(j, blk + 4, sc, m);
                    const float a = d * (float)sc, b = -dmin * (float)m;
                    f(sb * 8 + j, q, _mm256_set1_ps(a), _mm256_set1_ps(b));
                }
            }
        }
    } else if constexpr (QT == Q6_K) {
        const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t* blk = row + sb * 210;
            const float d = f16(blk + 208);
            for (int h = 0; h < 2; h++) {
                const __m256i ql0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
                const __m256i ql1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
                const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
                const int8_t* sc = (const int8_t*)(blk + 192) + 8 * h;
                for (int k = 0; k < 4; k++) {
                    const __m256i ql = (k % 2) ? ql1 : ql0;
                    __m256i lo = _mm256_and_si256(k < 2 ? ql : _mm256_srli_epi16(ql, 4), low4);
                    __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * k), low2);
                    __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
                    const float alo = d * (float)sc[2 * k], ahi = d * (float)sc[2 * k + 1];
                    f(sb * 8 + h * 4 + k, q, halves(alo, ahi), halves(-32.f * alo, -32.f * ahi));
                }
            }
        }
    }
}

#ifdef LOCALRUN_VNNI
// Types whose pairs of groups decode straight into one 512-bit register (for_each_pair); the
// others (Q8_0, Q6_K) join two 256-bit groups from for_each_group.
template <int QT> constexpr bool PAIRED = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q4_K || QT == Q5_K;

// Visit every pair of groups (2p, 2p + 1) of a weight row: f(p, codes, a, b) with group 2p's 32
// codes in the low 256 bits and group 2p + 1's in the high ones, a and b in the matching 8 lanes
// each: the same register pair_rows gets from joining two for_each_group groups, decoded in
// about half the instructions (scales as one half-float vector, no per-group broadcasts).
// 32-value types need an even number of groups (the caller checks).
template <int QT, class F>
static inline void for_each_pair(const uint8_t* row, int64_t K, F&& f) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    if constexpr (QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1) {
        constexpr int bytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : 24;
        constexpr int qs_at = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
        constexpr bool MIN = QT == Q4_1 || QT == Q5_1;           // d and m, else d only
        const __m512i pick_a = MIN ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                                   : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m512i pick_b = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
        for (int64_t p = 0; p < K / 64; p++) {
            const uint8_t* b0 = row + 2 * p * bytes;
            const uint8_t* b1 = b0 + bytes;
            const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(b0 + qs_at))),
                                                      _mm_loadu_si128((const __m128i*)(b1 + qs_at)), 1);
            // [qs0 | qs1 | qs0 >> 4 | qs1 >> 4] -> [lo0 | hi0 | lo1 | hi1] (128-bit lanes 0, 2, 1, 3)
            __m512i z = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
            __m512i q = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
            if constexpr (QT == Q5_0 || QT == Q5_1) {               // 5th bits: byte i <- bit i of qh0, qh1
                uint32_t h0, h1;
                std::memcpy(&h0, b0 + (QT == Q5_0 ? 2 : 4), 4); std::memcpy(&h1, b1 + (QT == Q5_0 ? 2 : 4), 4);
                q = _mm512_mask_add_epi8(q, _cvtu64_mask64((uint64_t)h0 | ((uint64_t)h1 << 32)), q, _mm512_set1_epi8(0x10));
            }
            __m512 a, b;
            if constexpr (MIN) {                                     // [d0 m0 d1 m1]
                uint32_t dm0, dm1; std::memcpy(&dm0, b0, 4); std::memcpy(&dm1, b1, 4);
                const __m512 h = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int)dm0), (int)dm1, 1)));
                a = _mm512_permutexvar_ps(pick_a, h);
                b = _mm512_permutexvar_ps(pick_b, h);
            } else {                                                 // [d0 d1]
                uint16_t d0, d1; std::memcpy(&d0, b0, 2); std::memcpy(&d1, b1, 2);
                const __m512 h = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)d0 | ((uint32_t)d1 << 16)))));
                a = _mm512_permutexvar_ps(pick_a, h);
                b = _mm512_mul_ps(a, _mm512_set1_ps(QT == Q4_0 ? -8.f : -16.f));
            }
            f(p, q, a, b);
        }
    } else if constexpr (QT == Q4_K || QT == Q5_K) {
        // a 32-byte chunk c of qs holds sub-block 2c in its low nibbles and 2c + 1 in its high ones
        constexpr int bytes = QT == Q4_K ? 144 : 176;
        const __m512i halves_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        for (int64_t sb = 0; sb < K / 256; sb++) {
            const uint8_t* blk = row + sb * bytes;
            const float d = f16(blk), dmin = f16(blk + 2);
            alignas(32) float av[8], bv[8];
            for (int j = 0; j < 8; j++) {
                int sc, m; scale_min_k4(j, blk + 4, sc, m);
                av[j] = d * (float)sc; bv[j] = -dmin * (float)m;
            }
            const __m512 A = _mm512_castps256_ps512(_mm256_load_ps(av)), B = _mm512_castps256_ps512(_mm256_load_ps(bv));
            const uint8_t* qs = blk + (QT == Q4_K ? 16 : 48);
            __m512i qh2;
            if constexpr (QT == Q5_K) {
                const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
                qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1);
            }
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * c));
                __m512i q = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), low4);
                if constexpr (QT == Q5_K) {                          // bit j of qh byte i: value i of sub-block j
                    const __m512i shift = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 1)), 1);
                    const __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(qh2, shift), _mm512_set1_epi8(1));
                    q = _mm512_or_si512(q, _mm512_slli_epi16(bit, 4));
                }
                const __m512i idx = _mm512_add_epi32(halves_idx, _mm512_set1_epi32(2 * c));
                f(sb * 4 + c, q, _mm512_permutexvar_ps(idx, A), _mm512_permutexvar_ps(idx, B));
            }
        }
    }
}
#endif

// y[m, n] for rows m in [m0, m0 + R) of qx and weight rows n in [n0, n1); y has row stride ldy.
template <int QT, int R>
static void rows_tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QX& qx, int64_t m0,
                      float* y, int64_t ldy) {
    constexpr bool SIGNED = QT == Q8_0;
    const int64_t G = qx.K / 32;
    const int8_t* xq[R]; const float* dxv[R]; const float* sxv[R];
    for (int r = 0; r < R; r++) {
        xq[r] = qx.qs + (m0 + r) * qx.K;
        dxv[r] = qx.dxv + (m0 + r) * G * LANES;
        sxv[r] = qx.sxv + (m0 + r) * G * LANES;
    }
    for (int64_t n = n0; n < n1; n++) {
#ifdef LOCALRUN_VNNI
        __m512 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        __m256i q0 = _mm256_setzero_si256(); __m256 a0 = _mm256_setzero_ps(), b0 = _mm256_setzero_ps();
        if (PAIRED<QT> && G % 2 == 0) {
            for_each_pair<QT>(w + n * row_bytes, qx.K, [&](int64_t p, __m512i q, __m512 a, __m512 b) {
                pair_rows<SIGNED, R>(Pair{q, a, b}, 2 * p, xq, dxv, sxv, acc);
            });
        } else {
            for_each_group<QT>(w + n * row_bytes, qx.K, [&](int64_t g, __m256i q, __m256 a, __m256 b) {
                if (g % 2 == 0) { q0 = q; a0 = a; b0 = b; return; }
                const Pair p{join(q0, q), join(a0, a), join(b0, b)};
                pair_rows<SIGNED, R>(p, g - 1, xq, dxv, sxv, acc);
            });
        }
        float tail[R] = {};
        if (G % 2) {            // the last group alone, in the low half
            for (int r = 0; r < R; r++) {
                __m256 t = _mm256_setzero_ps();
                const __m256i x = _mm256_loadu_si256((const __m256i*)(xq[r] + 32 * (G - 1)));
                const __m256i isum = SIGNED ? dot_ss(q0, x) : dot_us(q0, x);
                t = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(a0, _mm256_loadu_ps(dxv[r] + LANES * (G - 1))), t);
                if (!SIGNED) t = _mm256_fmadd_ps(b0, _mm256_loadu_ps(sxv[r] + LANES * (G - 1)), t);
                tail[r] = hsum(t);
            }
        }
        for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = _mm512_reduce_add_ps(acc[r]) + tail[r];
#else
        __m256 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for_each_group<QT>(w + n * row_bytes, qx.K, [&](int64_t g, __m256i q, __m256 a, __m256 b) {
            group_rows<SIGNED, R>(q, a, b, g, xq, dxv, sxv, acc);
        });
        for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = hsum(acc[r]);
#endif
    }
}

// Activation rows per pass over a weight row, at most. A call's rows are cut into tiles of as
// even a size as this allows (7 rows: 4 + 3, not 6 + 1): a one-row tile runs at about half the
// rate per row of a fuller one, and every tile decodes the weight group again.
#ifdef LOCALRUN_VNNI
constexpr int ROWS_TILE_MAX = 8;
#else
constexpr int ROWS_TILE_MAX = 6;   // 16 vector registers: K-quants spill at 8
#endif

template <int QT, int R = ROWS_TILE_MAX>
static void rows_tile_of(int r, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QX& qx,
                         int64_t m0, float* y, int64_t ldy) {
    if constexpr (R >= 1) {
        if (r == R) rows_tile<QT, R>(w, row_bytes, n0, n1, qx, m0, y, ldy);
        else rows_tile_of<QT, R - 1>(r, w, row_bytes, n0, n1, qx, m0, y, ldy);
    }
}

template <int QT>
static void rows_all(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const QX& qx, int64_t M,
                     float* y, int64_t ldy) {
    constexpr int64_t NCHUNK = 16;       // weight rows kept hot in L1 while every tile passes over them
    if (M <= 0) return;
    const int64_t tiles = (M + ROWS_TILE_MAX - 1) / ROWS_TILE_MAX, base = M / tiles, longer = M % tiles;
    for (int64_t nc = n0; nc < n1; nc += NCHUNK) {
        const int64_t ne = nc + NCHUNK < n1 ? nc + NCHUNK : n1;
        for (int64_t t = 0, m = 0; t < tiles; t++) {
            const int r = (int)(base + (t < longer));
            rows_tile_of<QT>(r, w, row_bytes, nc, ne, qx, m, y, ldy);
            m += r;
        }
    }
}

// ---- The lane layout (a weight's kernel type with LANES set, ops.cpp) ----
//
// Eight weight rows side by side, one per 32-bit lane, as ggml's repacked GEMMs lay them
// out, but transposed on the fly from the file's blocks into a per-thread tile (Tile8) that
// every activation row then reads. A group's integer dot products for the 8 rows come out in
// the 8 lanes of one register: per step of 4 codes, one maddubs of the rows' codes against the
// activation's 4 bytes broadcast, int16 sums over STEPS steps, one madd (AVX-512 VNNI: one
// vpdpbusd per step into int32, the same exact sums, so the same bits). The scales multiply
// whole lanes, so nothing is summed across lanes, and a lane's arithmetic (one row times one
// activation row) is the same whatever rows share the tile or the call.

// Activation rows per pass over a tile, and the most a call takes straight from the file
// (direct_rows): 6 in AVX2's 16 vector registers (steps_sum_rows keeps 6 int16 sums, 6 float sums
// and a step's codes there; 4 before 2026-12-04), 8 in AVX-512's 32
#ifdef LOCALRUN_VNNI
constexpr int LANES_TILE = 8;
#else
constexpr int LANES_TILE = 6;
#endif

// Steps of 4 codes whose u8 x s8 pair sums add up in int16 without saturating (activations are
// -127..127): 2 * 15 * 127 * 8, 2 * 31 * 127 * 4 and 2 * 63 * 127 * 2 stay under 32767.
template <int QT> constexpr int STEPS = QT == Q6_K ? 2 : (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) ? 4 : 8;
template <int QT> constexpr bool HALVES = QT == Q6_K;     // a and b differ between a group's halves

struct Tile8 {                    // 8 weight rows of K values
    std::vector<__m256i> q;       // (K/32, 8): q[8g + j], lane i = codes 4j..4j+3 of group g of row i
    std::vector<float> ab;        // (K/32, 4, 8): a of half 0, a of half 1, b of half 0, b of half 1; lane i = row i
};

// 8 x 8 transposition of 32-bit words: out[j] lane i = word j of in[i]
static inline void transpose8(const __m256i* in, __m256i* out) {
    __m256i t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(in[i], in[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(in[i], in[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        out[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
        out[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
    }
}

// The 32-bit words at byte offset `at` of the 8 rows, lane i = row i (built in registers: eight
// narrow stores and one wide load would stall store-to-load forwarding).
static inline __m256i words8(const uint8_t* const* rp, int64_t at) {
    auto word = [&](int i) { int32_t v; std::memcpy(&v, rp[i] + at, 4); return v; };
    return _mm256_set_epi32(word(7), word(6), word(5), word(4), word(3), word(2), word(1), word(0));
}

// The two half floats at the start of each row's block (d and m, or d and whatever follows),
// as 8 floats each: lane i = row i.
static inline void halfs8(const uint8_t* const* rp, int64_t at, __m256& first, __m256& second) {
    const __m256i w = words8(rp, at);
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i h = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, split), _MM_SHUFFLE(3, 1, 2, 0));
    first = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    second = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
}

// The 32-value types decode group g of 8 rows at once, straight into the transposed form:
// a block's 16 bytes of nibbles hold values l (low) and l + 16 (high) in byte l, so word j of
// the bytes gives steps j (low nibbles) and j + 4 (high ones).
template <int QT> constexpr bool LOCKSTEP = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1;

template <int QT>
static inline void group8(const uint8_t* const* rp, int64_t g, __m256i* q, float* ab) {
    constexpr int bytes = QT == Q4_0 ? 18 : QT == Q4_1 ? 20 : QT == Q5_0 ? 22 : 24;
    const int64_t at = g * bytes;
    constexpr int qs_at = QT == Q4_0 ? 2 : QT == Q4_1 ? 4 : QT == Q5_0 ? 6 : 8;
    __m256i r[4];
    for (int k = 0; k < 4; k++)
        r[k] = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(rp[k + 4] + at + qs_at)),
                                _mm_loadu_si128((const __m128i*)(rp[k] + at + qs_at)));
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i words[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),
                              _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; j++) {
        q[j] = _mm256_and_si256(words[j], low4);
        q[j + 4] = _mm256_and_si256(_mm256_srli_epi16(words[j], 4), low4);
    }
    if constexpr (QT == Q5_0 || QT == Q5_1) {       // bit l of qh: the 5th bit of value l
        constexpr int qh_at = QT == Q5_0 ? 2 : 4;
        const __m256i h = words8(rp, at + qh_at);
        // byte k of step j's word <- bit 4j + k of its row's qh, as 0x10: bits 4j .. 4j + 3 are
        // nibble j % 2 of byte j / 2, so one shuffle (that byte into all four of its word's) serves
        // steps 2b and 2b + 1, each testing its own nibble's bits (one per byte)
        const __m256i spread = _mm256_set_epi8(12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0,
                                               12, 12, 12, 12, 8, 8, 8, 8, 4, 4, 4, 4, 0, 0, 0, 0);
        const __m256i bits[2] = {_mm256_set1_epi32(0x08040201), _mm256_set1_epi32((int)0x80402010)};
        const __m256i fifth = _mm256_set1_epi8(0x10);
        for (int b = 0; b < 4; b++) {
            const __m256i byte = _mm256_shuffle_epi8(h, _mm256_add_epi8(spread, _mm256_set1_epi8((char)b)));
            for (int n = 0; n < 2; n++) {
                const int j = 2 * b + n;
#ifdef LOCALRUN_VNNI      // AVX-512 BW/VL: a byte mask, and the bit added under it
                q[j] = _mm256_mask_add_epi8(q[j], _mm256_test_epi8_mask(byte, bits[n]), q[j], fifth);   // bit 4 is clear
#else
                const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(byte, bits[n]), bits[n]);
                q[j] = _mm256_or_si256(q[j], _mm256_and_si256(set, fifth));
#endif
            }
        }
    }
    __m256 a, b;
    halfs8(rp, at, a, b);
    if constexpr (QT == Q4_0) b = _mm256_mul_ps(a, _mm256_set1_ps(-8.f));
    if constexpr (QT == Q5_0) b = _mm256_mul_ps(a, _mm256_set1_ps(-16.f));
    _mm256_storeu_ps(ab, a); _mm256_storeu_ps(ab + 8, a);
    _mm256_storeu_ps(ab + 16, b); _mm256_storeu_ps(ab + 24, b);
}

// The 32 bytes at byte offset `at` of the 8 rows, transposed: out[s] lane i = bytes 4s .. 4s + 3
// of row i's 32.
static inline void words32x8(const uint8_t* const* rp, int64_t at, __m256i* out) {
    __m256i r[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i*)(rp[i] + at));
    transpose8(r, out);
}

// The scales of super-block sb of 8 Q4_K or Q5_K rows (bytes per super-block), as Tile8's ab:
// a = d * sc_j, b = -dmin * m_j for sub-block j, lane i = row i. The 12 bytes of 6-bit scales and
// mins (scale_min_k4) are read as three words a row, one lane each, and unpacked 8 rows at a time:
// the same integers, the same float products as the scalar unpacking (8 x 8 scale_min_k4 calls and
// 256 stores a super-block, a large part of a one-row call's time).
static inline void scales8_k4(const uint8_t* const* rp, int64_t sb, int bytes, float* ab) {
    const int64_t at = sb * bytes;
    // each row's first 16 bytes (d, dmin, the 12 bytes of scales and mins) as four words a lane:
    // rows i and i + 4 in one register, then a 4 x 4 word transposition per 128-bit half (eight
    // loads and 12 shuffles where four words8 took 32 loads and their inserts)
    __m256i r[4];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(rp[i + 4] + at)), _mm_loadu_si128((const __m128i*)(rp[i] + at)));
    const __m256i t0 = _mm256_unpacklo_epi32(r[0], r[1]), t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    const __m256i t2 = _mm256_unpacklo_epi32(r[2], r[3]), t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    const __m256i w = _mm256_unpacklo_epi64(t0, t2), h0 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i h1 = _mm256_unpacklo_epi64(t1, t3), h2 = _mm256_unpackhi_epi64(t1, t3);
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    const __m256i hf = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(w, split), _MM_SHUFFLE(3, 1, 2, 0));
    const __m256 d = _mm256_cvtph_ps(_mm256_castsi256_si128(hf)), dmin = _mm256_cvtph_ps(_mm256_extracti128_si256(hf, 1));
    const __m256 neg_dmin = _mm256_xor_ps(dmin, _mm256_set1_ps(-0.0f));
    const __m256i m63 = _mm256_set1_epi32(63), m15 = _mm256_set1_epi32(15), m3 = _mm256_set1_epi32(3);
    auto put = [&](int j, __m256i sc, __m256i m) {      // a and b of half 0 (Q4_K and Q5_K have no halves)
        float* o = ab + 32 * j;
        _mm256_storeu_ps(o, _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)));
        _mm256_storeu_ps(o + 16, _mm256_mul_ps(neg_dmin, _mm256_cvtepi32_ps(m)));
    };
    for (int k = 0; k < 4; k++) {       // sub-blocks k (bytes k and k + 4) and k + 4 (byte k + 8, high bits of k, k + 4)
        const __m256i b0 = _mm256_srli_epi32(h0, 8 * k), b1 = _mm256_srli_epi32(h1, 8 * k), b2 = _mm256_srli_epi32(h2, 8 * k);
        put(k, _mm256_and_si256(b0, m63), _mm256_and_si256(b1, m63));
        put(k + 4,
            _mm256_or_si256(_mm256_and_si256(b2, m15), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b0, 6), m3), 4)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(b2, 4), m15),
                            _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(b1, 6), m3), 4)));
    }
}

// The scales of super-block sb of 8 Q6_K rows: a = d * sc per 16 values, b = -32 a (as
// for_each_group), 8 rows per vector: each row's 16 int8 scales as 4 words a lane. stride: the
// floats between groups in ab (32: Tile8's; 64: two tiles' lanes side by side, q6k_row_read16).
static inline void scales8_q6k(const uint8_t* const* rp, int64_t sb, float* ab, int stride = 32) {
    const int64_t at = sb * 210;
    auto half = [&](int i) { uint16_t v; std::memcpy(&v, rp[i] + at + 208, 2); return (short)v; };
    const __m256 d = _mm256_cvtph_ps(_mm_set_epi16(half(7), half(6), half(5), half(4), half(3), half(2), half(1), half(0)));
    for (int w = 0; w < 4; w++) {
        const __m256i v = words8(rp, at + 192 + 4 * w);          // scales 4w .. 4w + 3 of each row
        for (int u = 0; u < 4; u++) {
            const int t = 4 * w + u;                               // scale t: group t / 2, half t % 2
            const __m256i sc = _mm256_srai_epi32(_mm256_slli_epi32(v, 24 - 8 * u), 24);
            const __m256 a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
            float* o = ab + stride * (t / 2) + stride / 4 * (t % 2);
            _mm256_storeu_ps(o, a);
            _mm256_storeu_ps(o + stride / 2, _mm256_mul_ps(a, _mm256_set1_ps(-32.f)));
        }
    }
}

// Super-block sb of 8 Q4_K or Q5_K rows in the transposed form: q[8j + s] (j < 8 groups, s < 8
// steps), ab[32j ..] as Tile8's. A super-block's 32-byte chunk c of codes holds group 2c in its
// low nibbles and 2c + 1 in its high ones, value l in byte l: word s of the chunk is step s of both.
template <int QT>
static inline void superblock8_k4(const uint8_t* const* rp, int64_t sb, __m256i* q, float* ab) {
    constexpr int bytes = QT == Q4_K ? 144 : 176, qs_at = QT == Q4_K ? 16 : 48;
    const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    scales8_k4(rp, sb, bytes, ab);
    __m256i qh[8];                     // Q5_K: bit j of qh byte l is the fifth bit of value l of group j
    if constexpr (QT == Q5_K) words32x8(rp, sb * bytes + 16, qh);
    for (int c = 0; c < 4; c++) {
        __m256i words[8];
        words32x8(rp, sb * bytes + qs_at + 32 * c, words);
        __m256i* lo = q + 8 * (2 * c);
        for (int s = 0; s < 8; s++) {
            lo[s] = _mm256_and_si256(words[s], low4);
            lo[8 + s] = _mm256_and_si256(_mm256_srli_epi16(words[s], 4), low4);
            if constexpr (QT == Q5_K) {
                lo[s] = _mm256_or_si256(lo[s], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh[s], 2 * c), one), 4));
                lo[8 + s] = _mm256_or_si256(lo[8 + s], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh[s], 2 * c + 1), one), 4));
            }
        }
    }
}

// Super-block sb of 8 Q6_K rows in the same form, decoded after the transposition: a code's low
// bits (ql) and high bits (qh) lie at the same byte position in their 32-byte chunks, so the
// chunks' 8 x 8 word transpositions give each step's bytes, and the byte operations of
// for_each_group then act on 8 rows at once.
static inline void superblock8_q6k(const uint8_t* const* rp, int64_t sb, __m256i* q, float* ab) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), low2 = _mm256_set1_epi8(0x03);
    for (int h = 0; h < 2; h++) {
        __m256i ql[2][8], qh[8];
        for (int c = 0; c < 2; c++) words32x8(rp, sb * 210 + 64 * h + 32 * c, ql[c]);
        words32x8(rp, sb * 210 + 128 + 32 * h, qh);
        for (int k = 0; k < 4; k++) {
            __m256i* out = q + 8 * (4 * h + k);
            for (int st = 0; st < 8; st++) {
                const __m256i l = ql[k % 2][st];
                const __m256i lo = _mm256_and_si256(k < 2 ? l : _mm256_srli_epi16(l, 4), low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh[st], 2 * k), low2);
                out[st] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
            }
        }
    }
    scales8_q6k(rp, sb, ab);
}

#if defined(LOCALRUN_VNNI) || defined(LOCALRUN_AVXVNNI)
// Group g of 8 Q8_0 rows (VNNI only: AVX-512's or AVX-VNNI's): the signed codes transposed and
// offset by 128, unsigned for vpdpbusd, with b = -128 d taking the offset back out through the
// activation's sum (d * sum((q + 128) x) - 128 d * sum(x) = d * sum(q x), the integer sums
// exact). AVX2's maddubs would saturate on these sums (2 x 255 x 127), so Q8_0 keeps the row
// layout there: its Q8_0 bits differ between the builds, as the row layout's always have.
static inline void group8_q8(const uint8_t* const* rp, int64_t g, __m256i* q, float* ab) {
    const int64_t at = g * 34;
    words32x8(rp, at + 2, q);
    for (int st = 0; st < 8; st++) q[st] = _mm256_xor_si256(q[st], _mm256_set1_epi8((char)0x80));
    __m256 a, unused;
    halfs8(rp, at, a, unused);
    const __m256 b = _mm256_mul_ps(a, _mm256_set1_ps(-128.f));
    _mm256_storeu_ps(ab, a); _mm256_storeu_ps(ab + 8, a);
    _mm256_storeu_ps(ab + 16, b); _mm256_storeu_ps(ab + 24, b);
}
#endif

// The lane kernels decode 8 rows a unit at a time: a group of the 32-value types, a super-block
// (8 groups) of the K-quants. decode_unit writes unit u's UNIT_GROUPS groups in Tile8's form.
template <int QT> constexpr int UNIT_GROUPS = (LOCKSTEP<QT> || QT == Q8_0) ? 1 : 8;

template <int QT>
static inline void decode_unit(const uint8_t* const* rp, int64_t u, __m256i* q, float* ab) {
    if constexpr (LOCKSTEP<QT>) group8<QT>(rp, u, q, ab);
#if defined(LOCALRUN_VNNI) || defined(LOCALRUN_AVXVNNI)
    else if constexpr (QT == Q8_0) group8_q8(rp, u, q, ab);
#endif
    else if constexpr (QT == Q6_K) superblock8_q6k(rp, u, q, ab);
    else superblock8_k4<QT>(rp, u, q, ab);
}

// Reading 8 rows side by side defeats the hardware prefetcher (8 streams a thread), so the next
// tile's rows (the next_rows after rows n0 .. n0 + 7, contiguous) are asked for, a few lines in
// each of `parts` steps (groups, or super-blocks) of the current tile; and each tile's rows are
// first read once in address order (touch_lines), one load a cache line, which the hardware
// prefetcher follows as one sequential stream from tile to tile. Without that read, on 2 Zen 4
// cores whose memory was contended by other tenants, a one-sequence decode step took 1.7-1.9x
// as long (SmolLM2 10.8 against 6.4 ms, gemma-3 20.6 against 11.0; the rows layout, which reads
// each row straight through, kept its speed); on a quiet host 1.02-1.11x (SmolLM2) and 1.30x
// (gemma-3, its 262k-row Q8_0 head), 2026-12-05, docs/kernels.md.
static inline void touch_lines(const uint8_t* p, int64_t bytes) {
    uint8_t sink = 0;
    for (int64_t off = 0; off < bytes; off += 64) sink ^= *(volatile const uint8_t*)(p + off);
    __asm__ volatile("" : : "r"(sink));       // the loads are the point: nothing uses their bytes
}
struct NextTile {
    const uint8_t* p;
    int64_t span, per;
    NextTile(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t next_rows, int64_t parts)
        : p(next_rows ? w + (n0 + 8) * row_bytes : w), span(next_rows * row_bytes),
          per(((span + 63) / 64 + parts - 1) / parts * 64) {}
    template <int HINT = _MM_HINT_T0>
    void prefetch(int64_t part) const {
        for (int64_t off = part * per; off < std::min(span, (part + 1) * per); off += 64)
            _mm_prefetch((const char*)(p + off), (_mm_hint)HINT);
    }
};

// Rows n0 .. n0 + rows - 1 (rows <= 8) of a weight into t. The lanes past `rows` repeat the last
// row (each lane is computed on its own, and those are never stored). next_rows: how many rows
// of the next tile (the 8 after these) the caller will ask for, which are prefetched.
template <int QT>
static void build_tile(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows, int64_t K, Tile8& t, int64_t next_rows) {
    const int64_t G = K / 32;
    t.q.resize(8 * G); t.ab.resize(32 * G);
    __m256i* const tq = t.q.data();    // plain pointers in the loops (the tile is thread_local: tile_rows)
    float* const tab = t.ab.data();
    const uint8_t* rp[8];
    for (int i = 0; i < 8; i++) rp[i] = w + (n0 + std::min(i, rows - 1)) * row_bytes;
    const int64_t units = G / UNIT_GROUPS<QT>;
    const NextTile next(w, row_bytes, n0, next_rows, units);
    touch_lines(w + n0 * row_bytes, rows * row_bytes);
    for (int64_t u = 0; u < units; u++) {
        next.prefetch(u);
        decode_unit<QT>(rp, u, tq + 8 * UNIT_GROUPS<QT> * u, tab + 32 * UNIT_GROUPS<QT> * u);
    }
}

#ifdef LOCALRUN_VNNI
// vpdpbusd with the activation's 4 bytes as an embedded broadcast operand ({1to8}, {1to16}):
// written out because GCC loads them with a vpbroadcastd of its own, one more operation on the
// vector pipes for every vpdpbusd. Engine steps, one process alternating the two (SmolLM2 and
// gemma-3-270m, 2 Zen 4 threads, 2026-12-05): 4 sequences 0.94-0.96 of the time, 16 sequences
// 0.97-0.99; one sequence's two dependent chains 1.01-1.012 slower with it, so a call of one row
// keeps the broadcast op (EMB false: the same integer sums either way).
static inline __attribute__((always_inline)) __m256i dpbusd_b8(__m256i acc, __m256i q, const uint8_t* x4) {
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t*)x4));
    return acc;
}
static inline __attribute__((always_inline)) __m512i dpbusd_b16(__m512i acc, __m512i q, const uint8_t* x4) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t*)x4));
    return acc;
}

// The int32 lanes of steps j0 .. j1 - 1 of a group for one activation row: codes q[j] (8 rows)
// times the activation's 4 bytes x + 4j broadcast, each step's four products summed straight
// into int32 by VNNI (two chains, even and odd steps, joined at the end). The integer sums are
// exact, so these are the AVX2 build's bits (steps_sum_rows). EMB: the broadcasts embedded.
template <int QT, bool EMB>
static inline __attribute__((always_inline)) __m256i steps_sum(const __m256i* q, const uint8_t* x, int j0, int j1) {
    __m256i even = _mm256_setzero_si256(), odd = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = j0; j < j1; j += 2) {
        if constexpr (EMB) {
            even = dpbusd_b8(even, _mm256_load_si256(q + j), x + 4 * j);
            odd = dpbusd_b8(odd, _mm256_load_si256(q + j + 1), x + 4 * j + 4);
        } else {
            uint32_t x0, x1; std::memcpy(&x0, x + 4 * j, 4); std::memcpy(&x1, x + 4 * j + 4, 4);
            even = _mm256_dpbusd_epi32(even, _mm256_load_si256(q + j), _mm256_set1_epi32((int)x0));
            odd = _mm256_dpbusd_epi32(odd, _mm256_load_si256(q + j + 1), _mm256_set1_epi32((int)x1));
        }
    }
    return _mm256_add_epi32(even, odd);
}
#else
// AVX2: steps j0 .. j1 - 1 for R activation rows at once, each step's codes loaded once and
// multiplied against every row's broadcast (the step outside, the rows inside: R int16 sums
// and R int32 sums in registers, nothing spilled). Integer sums are exact in any order and the
// int16 ones cannot saturate (STEPS), so each row's int32 lanes are the VNNI build's. The empty asm
// keeps each row's int16 chain in order: without it GCC re-associated the sums of all rows into
// trees and spilled the products to the stack (a variant without it measured slower than the
// rows-inside loop it replaced).
template <int QT, int R>
static inline __attribute__((always_inline)) void steps_sum_rows(const __m256i* q, const uint8_t* const* x, int j0, int j1,
                                                                 __m256i ones, __m256i* s32) {
#ifdef LOCALRUN_AVXVNNI
    // AVX-VNNI: each step's four products summed straight into each row's int32 lanes (one
    // vpdpbusd where maddubs, an int16 add and, every STEPS steps, madd and an int32 add). Few
    // rows get C chains each (step k into chain k % C, added at the end), so that vpdpbusd's
    // latency does not serialize a one-row call; the integer sums are exact in any order.
    constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
    __m256i acc[R][C];
#pragma GCC unroll 8
    for (int k = j0; k < j1; k++) {
        const __m256i qk = _mm256_load_si256(q + k);
        const int c = (k - j0) % C;
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            uint32_t x4; std::memcpy(&x4, x[r] + 4 * k, 4);
            acc[r][c] = dpbusd_avx(k - j0 < C ? _mm256_setzero_si256() : acc[r][c], qk, _mm256_set1_epi32((int)x4));
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        s32[r] = acc[r][0];
        for (int c = 1; c < C && c < j1 - j0; c++) s32[r] = _mm256_add_epi32(s32[r], acc[r][c]);
    }
#else
#pragma GCC unroll 8
    for (int j = j0; j < j1; j += STEPS<QT>) {
        __m256i p[R];
#pragma GCC unroll 8
        for (int k = j; k < j + STEPS<QT>; k++) {
            const __m256i qk = _mm256_load_si256(q + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                uint32_t x4; std::memcpy(&x4, x[r] + 4 * k, 4);
                const __m256i m = _mm256_maddubs_epi16(qk, _mm256_set1_epi32((int)x4));
                p[r] = k == j ? m : _mm256_add_epi16(p[r], m);
                __asm__("" : "+x"(p[r]));     // keep GCC from re-associating the sums into a tree (spills)
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256i m = _mm256_madd_epi16(p[r], ones);
            s32[r] = j == j0 ? m : _mm256_add_epi32(s32[r], m);
        }
    }
#endif
}
#endif

// The float steps of a lane-layout product, shared by both builds so that their bits stay equal:
// a part's int32 sums s times its weight scales a (8 lanes) and the activation's scale d, and a
// half's weight offsets b (8 lanes) times the activation's code sum term sx.
static inline __attribute__((always_inline)) void lane_scaled(__m256& acc, __m256i s, const float* a, __m256 d) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(_mm256_loadu_ps(a), d), acc);
}
static inline __attribute__((always_inline)) void lane_offset(__m256& acc, const float* b, const float* sx) {
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(b), _mm256_broadcast_ss(sx), acc);
}

// Group g of 8 weight rows (codes q[0..8), scales ab as in Tile8) times activation rows m0 ..
// m0 + R - 1, added to acc: the arithmetic of every lane-layout product, whether the group comes
// from a tile (tile_rows) or straight from the file (direct_rows). Per row, the same float steps
// in the same order in both builds.
template <int QT, int R>
static inline __attribute__((always_inline)) void lane_group(const __m256i* q, const float* ab, int64_t g, const QX& qx,
                                                             int64_t m0, __m256i ones, __m256* acc) {
    const int64_t K = qx.K, G = K / 32;
    const float* dx = qx.d + m0 * G + g;               // row r's activation scale: dx[r * G]
#ifdef LOCALRUN_VNNI
    (void)ones;
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const uint8_t* x = (const uint8_t*)(qx.qs + (m0 + r) * K) + 32 * g;
        const __m256 d = _mm256_broadcast_ss(dx + r * G);
        if constexpr (HALVES<QT>) {
            const float* sh = qx.sxh + (m0 + r) * 2 * G + 2 * g;
            lane_scaled(acc[r], steps_sum<QT, (R > 1)>(q, x, 0, 4), ab, d);
            lane_scaled(acc[r], steps_sum<QT, (R > 1)>(q, x, 4, 8), ab + 8, d);
            lane_offset(acc[r], ab + 16, sh);
            lane_offset(acc[r], ab + 24, sh + 1);
        } else {
            lane_scaled(acc[r], steps_sum<QT, (R > 1)>(q, x, 0, 8), ab, d);
            lane_offset(acc[r], ab + 16, qx.sxg + (m0 + r) * G + g);
        }
    }
#else
    const uint8_t* xr[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) xr[r] = (const uint8_t*)(qx.qs + (m0 + r) * K) + 32 * g;
    __m256i s[R];
    if constexpr (HALVES<QT>) {
        steps_sum_rows<QT, R>(q, xr, 0, 4, ones, s);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) lane_scaled(acc[r], s[r], ab, _mm256_broadcast_ss(dx + r * G));
        steps_sum_rows<QT, R>(q, xr, 4, 8, ones, s);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float* sh = qx.sxh + (m0 + r) * 2 * G + 2 * g;
            lane_scaled(acc[r], s[r], ab + 8, _mm256_broadcast_ss(dx + r * G));
            lane_offset(acc[r], ab + 16, sh);
            lane_offset(acc[r], ab + 24, sh + 1);
        }
    } else {
        steps_sum_rows<QT, R>(q, xr, 0, 8, ones, s);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            lane_scaled(acc[r], s[r], ab, _mm256_broadcast_ss(dx + r * G));
            lane_offset(acc[r], ab + 16, qx.sxg + (m0 + r) * G + g);
        }
    }
#endif
}

// acc[r]'s 8 lanes into y[m0 + r, n0 .. n0 + rows)
template <int R>
static inline void store_lanes(const __m256* acc, int64_t m0, float* y, int64_t ldy, int64_t n0, int rows) {
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        float* out = y + (m0 + r) * ldy + n0;
        if (rows == 8) { _mm256_storeu_ps(out, acc[r]); continue; }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, acc[r]);
        for (int i = 0; i < rows; i++) out[i] = lanes[i];
    }
}

// y[m0 + r, n0 + i] for r < R, i < rows, from the tile of rows n0 ..
// tq, tab: the tile's q and ab (Tile8), passed as plain pointers: the tile is thread_local, and
// GCC (-fPIC, general-dynamic TLS) otherwise re-derived its address with a __tls_get_addr call
// (and a vzeroupper, the accumulators spilled around it) in every group of this loop.
template <int QT, int R>
static void tile_rows(const __m256i* tq, const float* tab, const QX& qx, int64_t m0, float* y, int64_t ldy, int64_t n0,
                      int rows) {
    const int64_t G = qx.K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) lane_group<QT, R>(tq + 8 * g, tab + 32 * g, g, qx, m0, ones, acc);
    store_lanes<R>(acc, m0, y, ldy, n0, rows);
}

template <int QT> constexpr bool ROW_READ = QT == Q4_K || QT == Q5_K || QT == Q6_K;
template <int QT> constexpr int SB_BYTES = QT == Q4_K ? 144 : QT == Q5_K ? 176 : 210;

// The same products for a call of few activation rows (R <= DIRECT_MAX_ROWS: one pass over the
// tile would be all its use): each group (K-quants: super-block) of the 8
// weight rows decoded and used at once, while it is in registers and L1, instead of decoding all
// of K into the tile first. Decoding (8 streams of loads) and the dot products then overlap:
// Q4_1 at 1 and 4 rows, one thread, 30 layers' weights, 2.2-2.6 -> 1.8 and 0.9-1.0 -> 0.5 ns per
// block and row on Zen 4 (2026-12-03). Same instructions per lane as tile_rows: the same bits.
constexpr int DIRECT_MAX_ROWS = LANES_TILE;

#ifdef LOCALRUN_VNNI
// ---- One activation row times the K-quants, each weight row read straight through ----
//
// The lane layout's integer sums are exact, so they need not come from transposed codes: for
// one activation row (a chat's decode step), each of the 8 weight rows' 64 codes of a 32-byte
// chunk are decoded in one 512-bit register as the row layout does (for_each_pair) and multiplied
// against the activation's 64 bytes by one vpdpbusd; the 8 registers of partial sums are then
// added across and transposed (sums8_by_lane) into lane i = row i, and lane_group's float steps
// follow, in its order: the same bits as the lane kernels' for that row (tile_rows, direct_rows
// of more rows, the AVX2 build), with no 8 x 8 word transpositions, no tile of codes stored and
// loaded again, and one 512-bit vpdpbusd for 64 products where the lanes take two 256-bit ones
// and their broadcasts; Q4_K/Q5_K take two chunks (64 bytes) of a row per load, against the
// activation's groups rearranged to match once per super-block. The tile is read in address
// order first (touch_lines) and the next tile is prefetched into L2, not L1 (T1): with the lanes'
// T0, the 37 KB tiles of a K = 5632 Q6_K weight and their successors overran the 32 KB L1 (2
// threads: 17-18 against 26-29 GB/s). A 1.1B llama of Q4_K_M blocks (TinyLlama's shape), one row,
// every layer's weights of a kind in turn, one process alternating the lane kernel and this one
// (2026-12-05, Zen 4): 2 threads, large weights 0.71-0.85 of the time (30-34 GB/s: the host's
// streaming rate), the small k/v ones ~0.9; 1 thread 0.59-0.83; its decode step 33.8 -> 23.5 ms.

// p[i] (weight row i) holds 4 int32 partial sums in each of its four 128-bit lanes; returns r0
// (lane k of rows 0..3: row i's sum over p[i]'s 128-bit lane k in 32-bit lane 4k + i) and r1
// (rows 4..7), by exact integer additions.
static inline void sums4_by_lane(const __m512i* p, __m512i& r0, __m512i& r1) {
    __m512i q[4];
    for (int k = 0; k < 4; k++)     // per 128-bit lane: [row 2k: parts 0 + 2, row 2k + 1: 0 + 2, row 2k: 1 + 3, row 2k + 1: 1 + 3]
        q[k] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * k], p[2 * k + 1]), _mm512_unpackhi_epi32(p[2 * k], p[2 * k + 1]));
    r0 = _mm512_add_epi32(_mm512_unpacklo_epi64(q[0], q[1]), _mm512_unpackhi_epi64(q[0], q[1]));
    r1 = _mm512_add_epi32(_mm512_unpacklo_epi64(q[2], q[3]), _mm512_unpackhi_epi64(q[2], q[3]));
}

// Lanes 0-7 of p[i] are group A's partial sums of weight row i, lanes 8-15 group B's: the
// groups' sums as [A: rows 0..7 | B: rows 0..7].
static inline __m512i sums8_by_lane(const __m512i* p) {
    __m512i r0, r1;
    sums4_by_lane(p, r0, r1);
    const __m512i lo = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), r1);   // 128-bit lanes 0, 2
    const __m512i hi = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2), r1);  // 1, 3
    return _mm512_add_epi32(lo, hi);
}


// Q4_K / Q5_K: the exact integer sums of super-block u, chunks c and c + 1 (c even), of 8 weight
// rows rp with the activation's bytes xu (the super-block's 256): lo = [group 2c | group 2c + 2]
// and hi = [2c + 1 | 2c + 3], rows 0..7 in each half. Each row's 64 bytes of codes (two chunks)
// in one load, against the activation's groups rearranged to match (xlo, xhi).
template <int QT>
static inline __attribute__((always_inline)) void k4_sums(const uint8_t* const* rp, int64_t u, int c, __m512i xlo,
                                                          __m512i xhi, __m512i& lo, __m512i& hi) {
    constexpr int bytes = SB_BYTES<QT>, qs_at = QT == Q4_K ? 16 : 48;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i plo[8], phi[8];
    for (int i = 0; i < 8; i++) {
        const uint8_t* blk = rp[i] + u * bytes;
        const __m512i v = _mm512_loadu_si512((const void*)(blk + qs_at + 32 * c));
        __m512i l = _mm512_and_si512(v, low4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if constexpr (QT == Q5_K) {       // bit j of qh byte l: the fifth bit of value l of group j
            const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
            const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1), one = _mm512_set1_epi8(1);
            const __m512i slo = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 2)), 1);
            const __m512i shi = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c + 1)), _mm256_set1_epi16((short)(2 * c + 3)), 1);
            l = _mm512_or_si512(l, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh2, slo), one), 4));
            h = _mm512_or_si512(h, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh2, shi), one), 4));
        }
        plo[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xlo);
        phi[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), h, xhi);
    }
    lo = sums8_by_lane(plo);
    hi = sums8_by_lane(phi);
}

// Q6_K: the exact integer sums of super-block u, groups 4h .. 4h + 3, of 8 weight rows:
// s[k] = [group 4h + k: half 0 rows 0..7 | half 1 rows 0..7]. xa: the activation's groups
// 4h | 4h + 1, xb: 4h + 2 | 4h + 3.
static inline __attribute__((always_inline)) void q6k_sums(const uint8_t* const* rp, int64_t u, int h, __m512i xa,
                                                           __m512i xb, __m512i* s) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);     // qh bits 0-1 | 2-3 -> 4-5
    const __m512i down = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);   // bits 4-5 | 6-7 -> 4-5
    __m512i pa[8], pb[8];                         // groups 4h + k, k < 4: low bits k % 2 ? ql1 : ql0, nibble k / 2
    for (int i = 0; i < 8; i++) {
        const uint8_t* blk = rp[i] + u * 210;
        const __m512i ql = _mm512_loadu_si512((const void*)(blk + 64 * h));    // ql0 | ql1
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h)));
        // (low bits & 0x0F) | high bits: vpternlog 0xEC is (a & c) | b
        const __m512i ca = _mm512_ternarylogic_epi32(ql, _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30), low4, 0xEC);
        const __m512i cb = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30),
                                                     low4, 0xEC);
        pa[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ca, xa);
        pb[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cb, xb);
    }
    for (int k2 = 0; k2 < 2; k2++) {
        __m512i r0, r1;                    // 128-bit lane k of p: half k % 2 of group 4h + 2 k2 + k / 2
        sums4_by_lane(k2 ? pb : pa, r0, r1);
        s[2 * k2] = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), r1);
        s[2 * k2 + 1] = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), r1);
    }
}

template <int QT>
static void direct_row_read(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows, const QX& qx, float* y,
                            int64_t ldy, int64_t next_rows) {
    const int64_t G = qx.K / 32, units = G / 8;
    const uint8_t* rp[8];
    for (int i = 0; i < 8; i++) rp[i] = w + (n0 + std::min(i, rows - 1)) * row_bytes;
    const uint8_t* x = (const uint8_t*)qx.qs;
    const NextTile next(w, row_bytes, n0, next_rows, units);
    touch_lines(w + n0 * row_bytes, rows * row_bytes);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        next.prefetch<_MM_HINT_T1>(u);
        alignas(32) float ab[32 * 8];
        const uint8_t* xu = x + 256 * u;
        if constexpr (QT == Q6_K) {
            scales8_q6k(rp, u, ab);
            for (int h = 0; h < 2; h++) {
                __m512i s[4];
                q6k_sums(rp, u, h, _mm512_loadu_si512((const void*)(xu + 128 * h)),
                         _mm512_loadu_si512((const void*)(xu + 128 * h + 64)), s);
                for (int k = 0; k < 4; k++) {
                    const int j = 4 * h + k, g = 8 * (int)u + j;
                    const __m256 d = _mm256_broadcast_ss(qx.d + g);
                    const float* sh = qx.sxh + 2 * g;
                    lane_scaled(acc, _mm512_castsi512_si256(s[k]), ab + 32 * j, d);
                    lane_scaled(acc, _mm512_extracti64x4_epi64(s[k], 1), ab + 32 * j + 8, d);
                    lane_offset(acc, ab + 32 * j + 16, sh);
                    lane_offset(acc, ab + 32 * j + 24, sh + 1);
                }
            }
        } else {
            scales8_k4(rp, u, SB_BYTES<QT>, ab);
            for (int c = 0; c < 4; c += 2) {          // chunks c, c + 1: groups 2c, 2c + 2 (low nibbles), 2c + 1, 2c + 3 (high)
                const __m512i x0 = _mm512_loadu_si512((const void*)(xu + 64 * c));        // groups 2c | 2c + 1
                const __m512i x1 = _mm512_loadu_si512((const void*)(xu + 64 * c + 64));   // groups 2c + 2 | 2c + 3
                __m512i tlo, thi;                     // [2c | 2c + 2], [2c + 1 | 2c + 3]
                k4_sums<QT>(rp, u, c, _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 2, 3, 2)), tlo, thi);
                for (int e = 0; e < 4; e++) {
                    const int j = 2 * c + e, g = 8 * (int)u + j;
                    const __m512i t = e % 2 ? thi : tlo;
                    lane_scaled(acc, e < 2 ? _mm512_castsi512_si256(t) : _mm512_extracti64x4_epi64(t, 1), ab + 32 * j,
                                _mm256_broadcast_ss(qx.d + g));
                    lane_offset(acc, ab + 32 * j + 16, qx.sxg + g);
                }
            }
        }
    }
    store_lanes<1>(&acc, 0, y, ldy, n0, rows);
}

// ---- A few activation rows (2 .. ROW_READ_ROWS) times the K-quants, each weight row read once ----
//
// direct_row_read for R activation rows: each weight row's codes are decoded once and multiplied
// against every row's bytes (R vpdpbusd), each activation row's partial sums reduced on their own
// (a pair of weight rows at a time as they come), the float steps per row in lane_group's order:
// the same bits as the lane kernels' (tile_rows) and one row's. Calls of 2-4 rows (a few
// sequences decoding together, a speculative verify step) built 8-row tiles before (an 8 x 8 word
// transposition of every chunk, the tile stored and loaded again). Every matmul of the 1.1B
// Q4_K_M file in turn, one process alternating tiles and this (2 Zen 4 threads, 2026-12-05): 2 rows
// 0.684 of the time (1 thread 0.649), 3 rows 0.77-0.79, 4 rows 0.90 (1 thread 0.90), 5 rows 1.107
// (its 40 registers of partial sums spill), so 5 rows and more build tiles.
constexpr int ROW_READ_ROWS = 4;

// q[0..3] (pairs of weight rows 2k, 2k + 1, each pair's partial sums added as sums4_by_lane's
// first step) -> [group A: rows 0..7 | group B: rows 0..7], as sums8_by_lane
static inline __attribute__((always_inline)) __m512i pairs8_by_lane(const __m512i* q) {
    const __m512i r0 = _mm512_add_epi32(_mm512_unpacklo_epi64(q[0], q[1]), _mm512_unpackhi_epi64(q[0], q[1]));
    const __m512i r1 = _mm512_add_epi32(_mm512_unpacklo_epi64(q[2], q[3]), _mm512_unpackhi_epi64(q[2], q[3]));
    const __m512i lo = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), r1);
    const __m512i hi = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2), r1);
    return _mm512_add_epi32(lo, hi);
}
static inline __attribute__((always_inline)) __m512i pair_sums(__m512i a, __m512i b) {
    return _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
}

// k4_sums for R activation rows: lo[r], hi[r] as k4_sums' lo and hi for row r (xlo[r], xhi[r]).
template <int QT, int R>
static inline __attribute__((always_inline)) void k4_sums_rows(const uint8_t* const* rp, int64_t u, int c,
                                                               const __m512i* xlo, const __m512i* xhi, __m512i* lo, __m512i* hi) {
    constexpr int bytes = SB_BYTES<QT>, qs_at = QT == Q4_K ? 16 : 48;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512i qlo[R][4], qhi[R][4];
    for (int k = 0; k < 4; k++) {
        __m512i pl[R][2], ph[R][2];
        for (int e = 0; e < 2; e++) {
            const uint8_t* blk = rp[2 * k + e] + u * bytes;
            const __m512i v = _mm512_loadu_si512((const void*)(blk + qs_at + 32 * c));
            __m512i l = _mm512_and_si512(v, low4), h = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if constexpr (QT == Q5_K) {       // as k4_sums
                const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
                const __m512i qh2 = _mm512_inserti64x4(_mm512_castsi256_si512(qh), qh, 1), one = _mm512_set1_epi8(1);
                const __m512i slo = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c)), _mm256_set1_epi16((short)(2 * c + 2)), 1);
                const __m512i shi = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * c + 1)), _mm256_set1_epi16((short)(2 * c + 3)), 1);
                l = _mm512_or_si512(l, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh2, slo), one), 4));
                h = _mm512_or_si512(h, _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh2, shi), one), 4));
            }
            for (int r = 0; r < R; r++) {
                pl[r][e] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), l, xlo[r]);
                ph[r][e] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), h, xhi[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            qlo[r][k] = pair_sums(pl[r][0], pl[r][1]);
            qhi[r][k] = pair_sums(ph[r][0], ph[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        lo[r] = pairs8_by_lane(qlo[r]);
        hi[r] = pairs8_by_lane(qhi[r]);
    }
}

// q6k_sums for R activation rows: s[r][k] as q6k_sums' s[k] for row r (xa[r], xb[r]).
template <int R>
static inline __attribute__((always_inline)) void q6k_sums_rows(const uint8_t* const* rp, int64_t u, int h, const __m512i* xa,
                                                                const __m512i* xb, __m512i (*s)[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    __m512i qa[R][4], qb[R][4];
    for (int k = 0; k < 4; k++) {
        __m512i pa[R][2], pb[R][2];
        for (int e = 0; e < 2; e++) {
            const uint8_t* blk = rp[2 * k + e] + u * 210;
            const __m512i ql = _mm512_loadu_si512((const void*)(blk + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h)));
            const __m512i ca = _mm512_ternarylogic_epi32(ql, _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30), low4, 0xEC);
            const __m512i cb = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30),
                                                         low4, 0xEC);
            for (int r = 0; r < R; r++) {
                pa[r][e] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ca, xa[r]);
                pb[r][e] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cb, xb[r]);
            }
        }
        for (int r = 0; r < R; r++) {
            qa[r][k] = pair_sums(pa[r][0], pa[r][1]);
            qb[r][k] = pair_sums(pb[r][0], pb[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        for (int k2 = 0; k2 < 2; k2++) {          // as q6k_sums after sums4_by_lane
            const __m512i* q = k2 ? qb[r] : qa[r];
            const __m512i r0 = _mm512_add_epi32(_mm512_unpacklo_epi64(q[0], q[1]), _mm512_unpackhi_epi64(q[0], q[1]));
            const __m512i r1 = _mm512_add_epi32(_mm512_unpacklo_epi64(q[2], q[3]), _mm512_unpackhi_epi64(q[2], q[3]));
            s[r][2 * k2] = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), r1);
            s[r][2 * k2 + 1] = _mm512_permutex2var_epi64(r0, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), r1);
        }
    }
}

template <int QT, int R>
static void direct_rows_read(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows, const QX& qx, float* y,
                             int64_t ldy, int64_t next_rows) {
    const int64_t G = qx.K / 32, units = G / 8;
    const uint8_t* rp[8];
    for (int i = 0; i < 8; i++) rp[i] = w + (n0 + std::min(i, rows - 1)) * row_bytes;
    const NextTile next(w, row_bytes, n0, next_rows, units);
    touch_lines(w + n0 * row_bytes, rows * row_bytes);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        next.prefetch<_MM_HINT_T1>(u);
        alignas(32) float ab[32 * 8];
        const uint8_t* xu[R];
        for (int r = 0; r < R; r++) xu[r] = (const uint8_t*)(qx.qs + r * qx.K) + 256 * u;
        if constexpr (QT == Q6_K) {
            scales8_q6k(rp, u, ab);
            for (int h = 0; h < 2; h++) {
                __m512i xa[R], xb[R], s[R][4];
                for (int r = 0; r < R; r++) {
                    xa[r] = _mm512_loadu_si512((const void*)(xu[r] + 128 * h));
                    xb[r] = _mm512_loadu_si512((const void*)(xu[r] + 128 * h + 64));
                }
                q6k_sums_rows<R>(rp, u, h, xa, xb, s);
                for (int r = 0; r < R; r++)
                    for (int k = 0; k < 4; k++) {
                        const int j = 4 * h + k, g = 8 * (int)u + j;
                        const __m256 d = _mm256_broadcast_ss(qx.d + r * G + g);
                        const float* sh = qx.sxh + r * 2 * G + 2 * g;
                        lane_scaled(acc[r], _mm512_castsi512_si256(s[r][k]), ab + 32 * j, d);
                        lane_scaled(acc[r], _mm512_extracti64x4_epi64(s[r][k], 1), ab + 32 * j + 8, d);
                        lane_offset(acc[r], ab + 32 * j + 16, sh);
                        lane_offset(acc[r], ab + 32 * j + 24, sh + 1);
                    }
            }
        } else {
            scales8_k4(rp, u, SB_BYTES<QT>, ab);
            for (int c = 0; c < 4; c += 2) {
                __m512i xlo[R], xhi[R], tlo[R], thi[R];
                for (int r = 0; r < R; r++) {
                    const __m512i x0 = _mm512_loadu_si512((const void*)(xu[r] + 64 * c));
                    const __m512i x1 = _mm512_loadu_si512((const void*)(xu[r] + 64 * c + 64));
                    xlo[r] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(1, 0, 1, 0));
                    xhi[r] = _mm512_shuffle_i64x2(x0, x1, _MM_SHUFFLE(3, 2, 3, 2));
                }
                k4_sums_rows<QT, R>(rp, u, c, xlo, xhi, tlo, thi);
                for (int r = 0; r < R; r++)
                    for (int e = 0; e < 4; e++) {
                        const int j = 2 * c + e, g = 8 * (int)u + j;
                        const __m512i t = e % 2 ? thi[r] : tlo[r];
                        lane_scaled(acc[r], e < 2 ? _mm512_castsi512_si256(t) : _mm512_extracti64x4_epi64(t, 1), ab + 32 * j,
                                    _mm256_broadcast_ss(qx.d + r * G + g));
                        lane_offset(acc[r], ab + 32 * j + 16, qx.sxg + r * G + g);
                    }
            }
        }
    }
    store_lanes<R>(acc, 0, y, ldy, n0, rows);
}

#else
// ---- AVX2: one activation row times the K-quants, each weight row read straight through ----
//
// As the AVX-512 build's direct_row_read, on 256-bit registers: each weight row's 32 bytes of
// codes hold two groups (Q4_K/Q5_K: a chunk's low and high nibbles; Q6_K: one 32-byte run of low
// bits, nibbles of groups k and k + 2 of a half), decoded as for_each_group does and multiplied
// by the activation's two groups (maddubs, then madd into 8 int32 partial sums: exact, STEPS
// bounds the int16 pair sums); the 8 rows' registers are added across and transposed into lane
// i = row i (a pair of rows at a time as they come, then sums8_halves), and lane_group's float
// steps follow in group order, so a row's result is the lane kernels' bits (tile_rows,
// direct_rows of more rows, the AVX-512 build). No 8 x 8 word transpositions of the codes, no
// tile stored and loaded again, and one load of an activation group for the 8 rows where the
// lanes broadcast its 4 bytes for every step. One process alternating the lane kernel and this
// one (Zen 4 forced to AVX2, 2026-12-05), every matmul of a 1.1B Q4_K_M file at one row:
// 0.85-0.87 of the time on 2 threads.

// Rows 2k and 2k + 1's partial sums (8 int32 each, 4 per 128-bit half) added pairwise: per half
// [row 2k, row 2k + 1, row 2k, row 2k + 1], parts 0 + 2 and 1 + 3.
static inline __attribute__((always_inline)) __m256i sums2(__m256i a, __m256i b) {
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
// q[k] = sums2 of rows 2k, 2k + 1: each 128-bit half's sums by row, lo = [half 0 of rows 0..3 |
// half 0 of rows 4..7] and hi the same of half 1 (exact integer additions).
static inline __attribute__((always_inline)) void sums8_halves(const __m256i* q, __m256i& lo, __m256i& hi) {
    const __m256i r0 = _mm256_add_epi32(_mm256_unpacklo_epi64(q[0], q[1]), _mm256_unpackhi_epi64(q[0], q[1]));   // rows 0..3
    const __m256i r1 = _mm256_add_epi32(_mm256_unpacklo_epi64(q[2], q[3]), _mm256_unpackhi_epi64(q[2], q[3]));   // rows 4..7
    lo = _mm256_permute2x128_si256(r0, r1, 0x20);
    hi = _mm256_permute2x128_si256(r0, r1, 0x31);
}

// The exact integer sums of two groups (A, B) of super-block u of 8 weight rows against the
// activation's groups xa, xb: run r of the row's codes (Q4_K/Q5_K: chunk r, A its low nibbles,
// B its high; Q6_K: half r / 2, low bits ql[r % 2], A group 4h + r % 2, B group 4h + r % 2 + 2).
// Q4_K/Q5_K: sa, sb[0] the groups' sums by row; Q6_K: sa[0..1], sb[0..1] each group's halves.
template <int QT>
static inline __attribute__((always_inline)) void run_sums(const uint8_t* const* rp, int64_t u, int r, __m256i xa,
                                                           __m256i xb, __m256i* sa, __m256i* sb) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i qa[4], qb[4];
    for (int k = 0; k < 4; k++) {
        __m256i pa[2], pb[2];
        for (int e = 0; e < 2; e++) {
            const uint8_t* blk = rp[2 * k + e] + u * SB_BYTES<QT>;
            __m256i ca, cb;
            if constexpr (QT == Q6_K) {
                const int h = r / 2, k2 = r % 2;
                const __m256i ql = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32 * k2));
                const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
                const __m256i m30 = _mm256_set1_epi8(0x30);      // qh bits 2k of group k, moved to bits 4-5
                const __m256i ha = k2 == 0 ? _mm256_slli_epi16(qh, 4) : _mm256_slli_epi16(qh, 2);
                const __m256i hb = k2 == 0 ? qh : _mm256_srli_epi16(qh, 2);
                ca = _mm256_or_si256(_mm256_and_si256(ql, low4), _mm256_and_si256(ha, m30));
                cb = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), low4), _mm256_and_si256(hb, m30));
            } else {
                constexpr int qs_at = QT == Q4_K ? 16 : 48;
                const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + qs_at + 32 * r));
                ca = _mm256_and_si256(v, low4);
                cb = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                if constexpr (QT == Q5_K) {      // bit j of qh byte l: the fifth bit of value l of group j (2r, 2r + 1)
                    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16)), one = _mm256_set1_epi8(1);
                    ca = _mm256_or_si256(ca, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), one), 4));
                    cb = _mm256_or_si256(cb, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * r + 1), one), 4));
                }
            }
#ifdef LOCALRUN_AVXVNNI
            pa[e] = dpbusd_avx(_mm256_setzero_si256(), ca, xa);
            pb[e] = dpbusd_avx(_mm256_setzero_si256(), cb, xb);
#else
            pa[e] = _mm256_madd_epi16(_mm256_maddubs_epi16(ca, xa), ones);
            pb[e] = _mm256_madd_epi16(_mm256_maddubs_epi16(cb, xb), ones);
#endif
        }
        qa[k] = sums2(pa[0], pa[1]);
        qb[k] = sums2(pb[0], pb[1]);
    }
    sums8_halves(qa, sa[0], sa[1]);
    sums8_halves(qb, sb[0], sb[1]);
    if constexpr (QT != Q6_K) {
        sa[0] = _mm256_add_epi32(sa[0], sa[1]);
        sb[0] = _mm256_add_epi32(sb[0], sb[1]);
    }
}

template <int QT>
static void direct_row_read(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows, const QX& qx, float* y,
                            int64_t ldy, int64_t next_rows) {
    const int64_t G = qx.K / 32, units = G / 8;
    const uint8_t* rp[8];
    for (int i = 0; i < 8; i++) rp[i] = w + (n0 + std::min(i, rows - 1)) * row_bytes;
    const uint8_t* x = (const uint8_t*)qx.qs;
    const NextTile next(w, row_bytes, n0, next_rows, units);
    touch_lines(w + n0 * row_bytes, rows * row_bytes);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        next.prefetch<_MM_HINT_T1>(u);
        alignas(32) float ab[32 * 8];
        const uint8_t* xu = x + 256 * u;
        auto xg = [&](int j) { return _mm256_loadu_si256((const __m256i*)(xu + 32 * j)); };
        if constexpr (QT == Q6_K) {
            scales8_q6k(rp, u, ab);
            for (int h = 0; h < 2; h++) {
                __m256i s[4][2];                       // groups 4h + k, halves 0 and 1, rows 0..7
                run_sums<QT>(rp, u, 2 * h, xg(4 * h), xg(4 * h + 2), s[0], s[2]);
                run_sums<QT>(rp, u, 2 * h + 1, xg(4 * h + 1), xg(4 * h + 3), s[1], s[3]);
                for (int k = 0; k < 4; k++) {
                    const int j = 4 * h + k, g = 8 * (int)u + j;
                    const __m256 d = _mm256_broadcast_ss(qx.d + g);
                    const float* sh = qx.sxh + 2 * g;
                    lane_scaled(acc, s[k][0], ab + 32 * j, d);
                    lane_scaled(acc, s[k][1], ab + 32 * j + 8, d);
                    lane_offset(acc, ab + 32 * j + 16, sh);
                    lane_offset(acc, ab + 32 * j + 24, sh + 1);
                }
            }
        } else {
            scales8_k4(rp, u, SB_BYTES<QT>, ab);
            for (int c = 0; c < 4; c++) {              // chunk c: groups 2c (low nibbles), 2c + 1 (high)
                __m256i s[2][2];
                run_sums<QT>(rp, u, c, xg(2 * c), xg(2 * c + 1), s[0], s[1]);
                for (int e = 0; e < 2; e++) {
                    const int j = 2 * c + e, g = 8 * (int)u + j;
                    lane_scaled(acc, s[e][0], ab + 32 * j, _mm256_broadcast_ss(qx.d + g));
                    lane_offset(acc, ab + 32 * j + 16, qx.sxg + g);
                }
            }
        }
    }
    store_lanes<1>(&acc, 0, y, ldy, n0, rows);
}
#endif

template <int QT, int R>
static void direct_rows(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows, const QX& qx, float* y, int64_t ldy,
                        int64_t next_rows) {
    if constexpr (R == 1 && ROW_READ<QT>) {
        direct_row_read<QT>(w, row_bytes, n0, rows, qx, y, ldy, next_rows);
        return;
    }
#ifdef LOCALRUN_VNNI
    if constexpr (R > 1 && R <= ROW_READ_ROWS && ROW_READ<QT>) {
        direct_rows_read<QT, R>(w, row_bytes, n0, rows, qx, y, ldy, next_rows);
        return;
    }
#endif
    const int64_t G = qx.K / 32;
    const __m256i ones = _mm256_set1_epi16(1);
    const uint8_t* rp[8];
    for (int i = 0; i < 8; i++) rp[i] = w + (n0 + std::min(i, rows - 1)) * row_bytes;
    __m256 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    constexpr int UG = UNIT_GROUPS<QT>;
    const int64_t units = G / UG;
    const NextTile next(w, row_bytes, n0, next_rows, units);
    touch_lines(w + n0 * row_bytes, rows * row_bytes);
    for (int64_t u = 0; u < units; u++) {
        next.prefetch(u);
        alignas(32) __m256i q[8 * UG];
        alignas(32) float ab[32 * UG];
        decode_unit<QT>(rp, u, q, ab);
        for (int j = 0; j < UG; j++) lane_group<QT, R>(q + 8 * j, ab + 32 * j, UG * u + j, qx, 0, ones, acc);
    }
    store_lanes<R>(acc, 0, y, ldy, n0, rows);
}

#ifdef LOCALRUN_VNNI
// AVX-512: 16 lanes per 512-bit register, weight rows n0 .. n0 + 7 in the low half (a) and
// n0 + 8 .. n0 + 15 in the high half (b). Every lane runs lane_group's instructions in its order
// (the same integer sums, the same float products and FMAs), so the same bits; the activation's
// broadcasts, its scales and the int32 -> float work serve 16 weight rows instead of 8 (a third
// of the instructions of a many-row call).

// steps j0 .. j1 - 1 for B activation rows at once (x[i]: row i's group), the step outside and
// the rows inside: B independent int32 chains in flight instead of one row's two, which kept
// the 512-bit pipes waiting on vpdpbusd's latency (16 rows of Q4_1 groups, in L1, one thread,
// Zen 4: 4.25 -> 3.12 ns per row and group with B = 4; B = 2: 3.49, B = 8: 3.27, registers
// run out). Integer sums are exact in any order: the same bits as steps_sum's.
template <int B>
static inline __attribute__((always_inline)) void steps_sum16_rows(const __m512i* q, const uint8_t* const* x, int j0,
                                                                   int j1, __m512i* s) {
    if constexpr (B == 1) {        // one row: two chains (even and odd steps), joined at the end
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int j = j0; j < j1; j += 2) {
            even = dpbusd_b16(even, q[j], x[0] + 4 * j);
            odd = dpbusd_b16(odd, q[j + 1], x[0] + 4 * j + 4);
        }
        s[0] = _mm512_add_epi32(even, odd);
        return;
    }
#pragma GCC unroll 8
    for (int j = j0; j < j1; j++) {
#pragma GCC unroll 8
        for (int i = 0; i < B; i++) {
            s[i] = dpbusd_b16(j == j0 ? _mm512_setzero_si512() : s[i], q[j], x[i] + 4 * j);
        }
    }
}

// Rows r0 .. r0 + B - 1 of lane_group16 (below)
template <int QT, int B>
static inline __attribute__((always_inline)) void lane_rows16(const __m512i* q, const __m512& a0, const __m512& b0,
                                                              const float* ea, const float* eb, int64_t g, const QX& qx,
                                                              int64_t m0, int r0, __m512* acc) {
    const int64_t K = qx.K, G = K / 32;
    const uint8_t* x[B];
#pragma GCC unroll 8
    for (int i = 0; i < B; i++) x[i] = (const uint8_t*)(qx.qs + (m0 + r0 + i) * K) + 32 * g;
    __m512i s[B];
    if constexpr (HALVES<QT>) {
        steps_sum16_rows<B>(q, x, 0, 4, s);
#pragma GCC unroll 8
        for (int i = 0; i < B; i++) {
            const __m512 d = _mm512_set1_ps(qx.d[(m0 + r0 + i) * G + g]);
            acc[r0 + i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(a0, d), acc[r0 + i]);
        }
        steps_sum16_rows<B>(q, x, 4, 8, s);
        const __m512 a1 = join(_mm256_loadu_ps(ea + 8), _mm256_loadu_ps(eb + 8));
        const __m512 b1 = join(_mm256_loadu_ps(ea + 24), _mm256_loadu_ps(eb + 24));
#pragma GCC unroll 8
        for (int i = 0; i < B; i++) {
            const int r = r0 + i;
            const __m512 d = _mm512_set1_ps(qx.d[(m0 + r) * G + g]);
            const float* sh = qx.sxh + (m0 + r) * 2 * G + 2 * g;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(a1, d), acc[r]);
            acc[r] = _mm512_fmadd_ps(b0, _mm512_set1_ps(sh[0]), acc[r]);
            acc[r] = _mm512_fmadd_ps(b1, _mm512_set1_ps(sh[1]), acc[r]);
        }
    } else {
        steps_sum16_rows<B>(q, x, 0, 8, s);
#pragma GCC unroll 8
        for (int i = 0; i < B; i++) {
            const int r = r0 + i;
            const __m512 d = _mm512_set1_ps(qx.d[(m0 + r) * G + g]);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(a0, d), acc[r]);
            acc[r] = _mm512_fmadd_ps(b0, _mm512_set1_ps(qx.sxg[(m0 + r) * G + g]), acc[r]);
        }
    }
}

// Rows R0 .. R - 1 of lane_group16 in blocks of 3 to 5 (fewer only when R is) for the 9-16 rows
// of direct_rows16; one at a time for tile_rows16's passes of up to 8 (calls of more than 16
// rows), where blocks of 4 measured 1-2% slower. One thread, a 16384-row Q4_1 weight of K = 576
// (L3), best of 5 alternated processes, ms per call (Zen 4, 2026-12-04): 9 rows 0.645 against
// 0.687 one row at a time (blocks of 3: 0.697), 13 rows 0.883 against 0.917, 16 rows 1.059
// against 1.089.
template <int QT, int R, int R0>
static inline __attribute__((always_inline)) void lane_blocks16(const __m512i* q, const __m512& a0, const __m512& b0,
                                                                const float* ea, const float* eb, int64_t g,
                                                                const QX& qx, int64_t m0, __m512* acc) {
    constexpr int rem = R - R0;
    if constexpr (rem > 0) {
        constexpr int B = R <= LANES_TILE ? 1 : rem <= 5 ? rem : (rem % 4 == 0 ? 4 : rem % 4 == 1 ? 5 : 3);
        lane_rows16<QT, B>(q, a0, b0, ea, eb, g, qx, m0, R0, acc);
        lane_blocks16<QT, R, R0 + B>(q, a0, b0, ea, eb, g, qx, m0, acc);
    }
}

// Group g of weight rows n0 .. n0 + 7 (codes aq[0..8), scales aab as in Tile8) and n0 + 8 .. n0 + 15
// (bq, bab) times activation rows m0 .. m0 + R - 1, added to acc's 16 lanes, a few rows at a time
// (lane_blocks16). Per row, lane_group's float steps in its order.
template <int QT, int R>
static inline __attribute__((always_inline)) void lane_group16(const __m256i* aq, const float* ea, const __m256i* bq,
                                                               const float* eb, int64_t g, const QX& qx, int64_t m0,
                                                               __m512* acc) {
    __m512i q[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) q[j] = join(_mm256_load_si256(aq + j), _mm256_load_si256(bq + j));
    const __m512 a0 = join(_mm256_loadu_ps(ea), _mm256_loadu_ps(eb)), b0 = join(_mm256_loadu_ps(ea + 16), _mm256_loadu_ps(eb + 16));
    lane_blocks16<QT, R, 0>(q, a0, b0, ea, eb, g, qx, m0, acc);
}

// acc[r]'s 16 lanes into y[m0 + r, n0 .. n0 + 8 + rows_b)
template <int R>
static inline void store_lanes16(const __m512* acc, int64_t m0, float* y, int64_t ldy, int64_t n0, int rows_b) {
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) {
        float* out = y + (m0 + r) * ldy + n0;
        _mm256_storeu_ps(out, _mm512_castps512_ps256(acc[r]));
        const __m256 hi = _mm512_extractf32x8_ps(acc[r], 1);
        if (rows_b == 8) { _mm256_storeu_ps(out + 8, hi); continue; }
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, hi);
        for (int i = 0; i < rows_b; i++) out[8 + i] = lanes[i];
    }
}

// tile_rows for two tiles at once (prompts: calls of more than 16 rows)
template <int QT, int R>
static void tile_rows16(const __m256i* aq, const float* aab, const __m256i* bq, const float* bab, const QX& qx,
                        int64_t m0, float* y, int64_t ldy, int64_t n0, int rows_b) {
    const int64_t G = qx.K / 32;
    __m512 acc[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; g++) lane_group16<QT, R>(aq + 8 * g, aab + 32 * g, bq + 8 * g, bab + 32 * g, g, qx, m0, acc);
    store_lanes16<R>(acc, m0, y, ldy, n0, rows_b);
}

// direct_rows for 16 weight rows (n0 .. n0 + 7, and n0 + 8 .. n0 + 7 + rows_b) and R of 9 .. 16
// activation rows (16-sequence decode steps): each unit of both halves decoded and used at once,
// 16 lanes per register. Same lanes, same instructions: the same bits.
constexpr int DIRECT16_MAX_ROWS = 2 * LANES_TILE;

template <int QT, int R>
static void direct_rows16(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows_b, const QX& qx, float* y,
                          int64_t ldy, int64_t next_rows) {
    const int64_t G = qx.K / 32;
    const uint8_t *ra[8], *rb[8];
    for (int i = 0; i < 8; i++) {
        ra[i] = w + (n0 + i) * row_bytes;
        rb[i] = w + (n0 + 8 + std::min(i, rows_b - 1)) * row_bytes;
    }
    __m512 acc[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    constexpr int UG = UNIT_GROUPS<QT>;
    const int64_t units = G / UG;
    const NextTile next(w, row_bytes, n0 + 8, next_rows, units);     // rows n0 + 16 on
    touch_lines(w + n0 * row_bytes, (8 + rows_b) * row_bytes);
    for (int64_t u = 0; u < units; u++) {
        next.prefetch(u);
        alignas(32) __m256i qa[8 * UG], qb[8 * UG];
        alignas(32) float aba[32 * UG], abb[32 * UG];
        decode_unit<QT>(ra, u, qa, aba);
        decode_unit<QT>(rb, u, qb, abb);
        for (int j = 0; j < UG; j++)
            lane_group16<QT, R>(qa + 8 * j, aba + 32 * j, qb + 8 * j, abb + 32 * j, UG * u + j, qx, 0, acc);
    }
    store_lanes16<R>(acc, 0, y, ldy, n0, rows_b);
}

template <int QT, int R = DIRECT16_MAX_ROWS>
static void direct_rows16_of(int r, const uint8_t* w, int64_t row_bytes, int64_t n0, int rows_b, const QX& qx,
                             float* y, int64_t ldy, int64_t next_rows) {
    if constexpr (R > LANES_TILE) {
        if (r == R) direct_rows16<QT, R>(w, row_bytes, n0, rows_b, qx, y, ldy, next_rows);
        else direct_rows16_of<QT, R - 1>(r, w, row_bytes, n0, rows_b, qx, y, ldy, next_rows);
    }
}

template <int QT, int R = LANES_TILE - 1>
static void tile_rows16_of(int r, const __m256i* aq, const float* aab, const __m256i* bq, const float* bab,
                           const QX& qx, int64_t m0, float* y, int64_t ldy, int64_t n0, int rows_b) {
    if constexpr (R >= 1) {
        if (r == R) tile_rows16<QT, R>(aq, aab, bq, bab, qx, m0, y, ldy, n0, rows_b);
        else tile_rows16_of<QT, R - 1>(r, aq, aab, bq, bab, qx, m0, y, ldy, n0, rows_b);
    }
}
#endif

// tile_rows for r < R activation rows, R a compile-time constant
template <int QT, int R = LANES_TILE - 1>
static void tile_rows_of(int r, const __m256i* tq, const float* tab, const QX& qx, int64_t m0, float* y, int64_t ldy,
                         int64_t n0, int rows) {
    if constexpr (R >= 1) {
        if (r == R) tile_rows<QT, R>(tq, tab, qx, m0, y, ldy, n0, rows);
        else tile_rows_of<QT, R - 1>(r, tq, tab, qx, m0, y, ldy, n0, rows);
    }
}

template <int QT, int R = DIRECT_MAX_ROWS>
static void direct_rows_of(int r, const uint8_t* w, int64_t row_bytes, int64_t n0, int rows, const QX& qx, float* y,
                           int64_t ldy, int64_t next_rows) {
    if constexpr (R >= 1) {
        if (r == R) direct_rows<QT, R>(w, row_bytes, n0, rows, qx, y, ldy, next_rows);
        else direct_rows_of<QT, R - 1>(r, w, row_bytes, n0, rows, qx, y, ldy, next_rows);
    }
}

#ifdef LOCALRUN_VNNI
// direct_row_read of Q6_K for 16 weight rows, n0 .. n0 + 7 and n0 + 8 .. n0 + 7 + rows_b: each 8
// rows' integer sums as there, then the float steps of both on 16 lanes ([rows n0.. | rows
// n0 + 8..], 512-bit): half the instructions, and one dependent chain of multiply-adds for 16
// rows instead of 8. Every lane takes lane_scaled's and lane_offset's steps in their order: the
// same bits. One thread, one process alternating the two (Zen 4, 2026-12-05): Q6_K 1024 x 2048
// 0.95 of the time, 2048 x 5632 0.94 (2 threads 0.97, 0.94); Q4_K, whose float steps are fewer,
// came out 1.00-1.02, so it keeps 8 rows.
static void q6k_row_read16(const uint8_t* w, int64_t row_bytes, int64_t n0, int rows_b, const QX& qx, float* y,
                           int64_t ldy, int64_t next_rows) {
    const int64_t G = qx.K / 32, units = G / 8;
    const uint8_t *ra[8], *rb[8];
    for (int i = 0; i < 8; i++) {
        ra[i] = w + (n0 + i) * row_bytes;
        rb[i] = w + (n0 + 8 + std::min(i, rows_b - 1)) * row_bytes;
    }
    const uint8_t* x = (const uint8_t*)qx.qs;
    const NextTile next(w, row_bytes, n0 + 8, next_rows, units);     // rows n0 + 16 on
    touch_lines(w + n0 * row_bytes, (8 + rows_b) * row_bytes);
    constexpr int lo2 = _MM_SHUFFLE(1, 0, 1, 0), hi2 = _MM_SHUFFLE(3, 2, 3, 2);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; u++) {
        next.prefetch<_MM_HINT_T1>(u);
        alignas(64) float ab[64 * 8];                 // group j: a of halves 0, 1 at 64j, 64j + 16, b at 64j + 32, 64j + 48
        scales8_q6k(ra, u, ab, 64);
        scales8_q6k(rb, u, ab + 8, 64);
        const uint8_t* xu = x + 256 * u;
        for (int h = 0; h < 2; h++) {
            const __m512i xa = _mm512_loadu_si512((const void*)(xu + 128 * h)), xb = _mm512_loadu_si512((const void*)(xu + 128 * h + 64));
            __m512i sa[4], sb[4];                     // [half 0 | half 1] of rows a, of rows b
            q6k_sums(ra, u, h, xa, xb, sa);
            q6k_sums(rb, u, h, xa, xb, sb);
            for (int k = 0; k < 4; k++) {
                const int j = 4 * h + k, g = 8 * (int)u + j;
                const __m512 d = _mm512_set1_ps(qx.d[g]);
                const float* sh = qx.sxh + 2 * g;
                const float* o = ab + 64 * j;
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_i64x2(sa[k], sb[k], lo2)), _mm512_mul_ps(_mm512_load_ps(o), d), acc);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_shuffle_i64x2(sa[k], sb[k], hi2)), _mm512_mul_ps(_mm512_load_ps(o + 16), d), acc);
                acc = _mm512_fmadd_ps(_mm512_load_ps(o + 32), _mm512_set1_ps(sh[0]), acc);
                acc = _mm512_fmadd_ps(_mm512_load_ps(o + 48), _mm512_set1_ps(sh[1]), acc);
            }
        }
    }
    store_lanes16<1>(&acc, 0, y, ldy, n0, rows_b);
}
#endif

// Rows n0 .. n1 - 1 of a weight of n_end rows. Each tile asks for the next one's rows ahead of
// use, past n1 too, up to n_end: a call's rows come to a thread in chunks (ops.cpp's RowShares),
// mostly one after another, and the first tile of each chunk waited for memory. SmolLM2's 30
// layers of matmuls, weights from memory, one process alternating (Zen 4, 2 threads,
// 2026-12-06): 16 rows 0.977-0.981 of the time, one row 0.983-0.989. Prefetches change no value.
template <int QT>
static void lanes_all(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n_end, const QX& qx,
                      int64_t M, float* y, int64_t ldy) {
    if (M <= DIRECT_MAX_ROWS) {
        int64_t nt = n0;
#ifdef LOCALRUN_VNNI
        if (M == 1 && QT == Q6_K)      // 16 rows at a time (q6k_row_read16), the last 8 or fewer below
            for (; nt + 8 < n1; nt += 16)
                q6k_row_read16(w, row_bytes, nt, (int)std::min<int64_t>(8, n1 - nt - 8), qx, y, ldy,
                                      std::min<int64_t>(16, std::max<int64_t>(0, n_end - nt - 16)));
#endif
        for (; nt < n1; nt += 8) {
            const int rows = (int)std::min<int64_t>(8, n1 - nt);
            const int64_t next_rows = std::min<int64_t>(8, std::max<int64_t>(0, n_end - nt - 8));
            direct_rows_of<QT>((int)M, w, row_bytes, nt, rows, qx, y, ldy, next_rows);
        }
        return;
    }
    thread_local Tile8 tile;
    int64_t nt = n0;
#ifdef LOCALRUN_VNNI
    // AVX-512: the K-quants' calls of 9 or more rows build tiles (below) rather than decoding
    // each super-block of 16 rows and using it at once (direct_rows16), which ran slower and
    // erratically at 13-16 rows (cause not traced; the 32-value types' direct paths are the
    // faster ones): one thread, a 2048 x 2048 Q4_K weight, us per row at 2 .. 16 rows, direct
    // 95 64 57 51 49 45 44 46 39 39 38 41 64 54 61, tiles 91 67 56 51 46 44 42 43 40 38 37 36 35
    // 35 34; Q6_K 6-16 rows 5-15% faster (2026-12-05, Zen 4). That weight sat in L3; with a
    // model's weights streaming from memory (six 5632 x 2048 weights in turn, one process
    // alternating the two), 5-8 rows take the direct path (direct_rows, 8 weight rows at a time)
    // in 0.75-0.86 of the tiles' time on one thread and 0.85-0.92 on two (Q4_K; Q5_K 0.85-0.88,
    // Q6_K 0.87-0.94 on two), while from 9 rows on the tiles stay ahead (Q6_K 1.02-1.24, Q5_K
    // 0.98-1.19, Q4_K 0.92-1.09). One row reads the rows straight through (direct_row_read, in
    // both builds), and so do 2-4 rows (direct_rows_read, AVX-512). On AVX2 the two measured the
    // same.
    if (M <= DIRECT16_MAX_ROWS && UNIT_GROUPS<QT> != 8) {   // 16 weight rows decoded and used at once (direct_rows16)
        for (; nt + 8 < n1; nt += 16) {
            const int rows_b = (int)std::min<int64_t>(8, n1 - nt - 8);
            direct_rows16_of<QT>((int)M, w, row_bytes, nt, rows_b, qx, y, ldy,
                                 std::min<int64_t>(16, std::max<int64_t>(0, n_end - nt - 16)));
        }
    } else {                             // two tiles at a time, 16 lanes per register (tile_rows16)
        thread_local Tile8 second;
        for (; nt + 8 < n1; nt += 16) {
            const int rows_b = (int)std::min<int64_t>(8, n1 - nt - 8);
            build_tile<QT>(w, row_bytes, nt, 8, qx.K, tile, rows_b);
            build_tile<QT>(w, row_bytes, nt + 8, rows_b, qx.K, second, std::min<int64_t>(8, std::max<int64_t>(0, n_end - nt - 16)));
            const __m256i *aq = tile.q.data(), *bq = second.q.data();
            const float *aab = tile.ab.data(), *bab = second.ab.data();
            int64_t m = 0;
            for (; m + LANES_TILE <= M; m += LANES_TILE) tile_rows16<QT, LANES_TILE>(aq, aab, bq, bab, qx, m, y, ldy, nt, rows_b);
            if (m < M) tile_rows16_of<QT>((int)(M - m), aq, aab, bq, bab, qx, m, y, ldy, nt, rows_b);
        }
    }
#endif
    for (; nt < n1; nt += 8) {
        const int rows = (int)std::min<int64_t>(8, n1 - nt);
        build_tile<QT>(w, row_bytes, nt, rows, qx.K, tile, std::min<int64_t>(8, std::max<int64_t>(0, n_end - nt - 8)));
        const __m256i* tq = tile.q.data();
        const float* tab = tile.ab.data();
        int64_t m = 0;
        for (; m + LANES_TILE <= M; m += LANES_TILE) tile_rows<QT, LANES_TILE>(tq, tab, qx, m, y, ldy, nt, rows);
        if (m < M) tile_rows_of<QT>((int)(M - m), tq, tab, qx, m, y, ldy, nt, rows);
    }
}

// Float32 activations (prompt rows): each group dequantized in registers, times x in float32.
// No activation rounding, so the result differs from a float32 GEMM on the dequantized
// weights by summation order only. Every row runs the same instructions whatever the tile.
template <int QT, int R>
static void rows_tile_f32(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x, int64_t K,
                          int64_t m0, float* y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        __m256 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
        for_each_group<QT>(w + n * row_bytes, K, [&](int64_t g, __m256i q, __m256 a, __m256 b) {
            const __m256 a_lo = _mm256_permutevar8x32_ps(a, _mm256_set1_epi32(0)), a_hi = _mm256_permutevar8x32_ps(a, _mm256_set1_epi32(4));
            const __m256 b_lo = _mm256_permutevar8x32_ps(b, _mm256_set1_epi32(0)), b_hi = _mm256_permutevar8x32_ps(b, _mm256_set1_epi32(4));
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int i = 0; i < 4; i++) {
                const __m256i q32 = QT == Q8_0 ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
                const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32), i < 2 ? a_lo : a_hi, i < 2 ? b_lo : b_hi);
                for (int r = 0; r < R; r++)
                    acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + (m0 + r) * K + 32 * g + 8 * i), acc[r]);
            }
        });
        for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = hsum(acc[r]);
    }
}

#ifdef LOCALRUN_VNNI
// AVX-512: each half of a group (16 values) widened into one 512-bit register, so a row pays
// two FMAs per group instead of four, and a group is decoded once per 8 rows instead of 4
// (about 2.5x faster at 16 rows: prompt chunks beside decodes). Same order for every row.
template <int QT, int R>
static void rows_tile_f32_512(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x, int64_t K,
                              int64_t m0, float* y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++) {
        __m512 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for_each_group<QT>(w + n * row_bytes, K, [&](int64_t g, __m256i q, __m256 a, __m256 b) {
            const __m512 a_lo = _mm512_set1_ps(_mm256_cvtss_f32(a)), b_lo = _mm512_set1_ps(_mm256_cvtss_f32(b));
            const __m512 a_hi = _mm512_set1_ps(_mm_cvtss_f32(_mm256_extractf128_ps(a, 1)));
            const __m512 b_hi = _mm512_set1_ps(_mm_cvtss_f32(_mm256_extractf128_ps(b, 1)));
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            const __m512i q_lo = QT == Q8_0 ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
            const __m512i q_hi = QT == Q8_0 ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
            const __m512 w_lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_lo), a_lo, b_lo);
            const __m512 w_hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q_hi), a_hi, b_hi);
            for (int r = 0; r < R; r++) {
                const float* xr = x + (m0 + r) * K + 32 * g;
                acc[r] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xr), acc[r]);
                acc[r] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xr + 16), acc[r]);
            }
        });
        for (int r = 0; r < R; r++) y[(m0 + r) * ldy + n] = _mm512_reduce_add_ps(acc[r]);
    }
}
#endif

// One weight row's K values as float32 (the values dequantize() returns).
template <int QT>
static inline void dequantize_row(const uint8_t* row, int64_t K, float* o) {
    for_each_group<QT>(row, K, [&](int64_t g, __m256i q, __m256 av, __m256 bv) {
        __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; i++) {
            __m256i q32 = QT == Q8_0 ? _mm256_cvtepi8_epi32(parts[i]) : _mm256_cvtepu8_epi32(parts[i]);
            const __m256i lane = _mm256_set1_epi32(i < 2 ? 0 : 4);     // the half's value, in every lane
            _mm256_storeu_ps(o + 32 * g + 8 * i, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q32), _mm256_permutevar8x32_ps(av, lane),
                                                                 _mm256_permutevar8x32_ps(bv, lane)));
        }
    });
}

#ifndef LOCALRUN_VNNI
// AVX2, float32 activations: WROWS weight rows dequantized into a float32 tile once (from the
// file's blocks, the values dequantize() gives), then a register-blocked product of R activation
// rows by the tile's rows: R x WROWS accumulators, each eighth of K loaded once per row and
// weight row. Decoding a group once per tile of 4 activation rows (rows_tile_f32) bounded that
// path at ~5 multiply-adds a cycle; this runs near the FMA rate (SmolLM2's layer, one thread:
// 1.96 -> 1.09 ns per block and row at 16 rows, 2.89 -> 2.03 at 5). Each (row, weight row) sum
// runs over K in the same order as rows_tile_f32's, with the same products, so the two give the
// same bits (checked) and a call picks by its size: below F32_TILES_MIN_ROWS rows the tile's
// round trip through memory costs as much or more than decoding in registers (5.8 against 6.7
// at one row, even at four).
constexpr int F32_WROWS = 3;
constexpr int64_t F32_TILES_MIN_ROWS = 5;

template <int R>
static inline void tile_f32(const float* wt, int64_t K, int nw, const float* x, int64_t m0, float* y, int64_t ldy,
                            int64_t n) {
    __m256 acc[R][F32_WROWS];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < F32_WROWS; j++) acc[r][j] = _mm256_setzero_ps();
    const float* xr = x + m0 * K;
    for (int64_t k = 0; k < K; k += 8) {
        __m256 wv[F32_WROWS];
        for (int j = 0; j < F32_WROWS; j++) wv[j] = _mm256_loadu_ps(wt + j * K + k);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(xr + r * K + k);
            for (int j = 0; j < F32_WROWS; j++) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nw; j++) y[(m0 + r) * ldy + n + j] = hsum(acc[r][j]);
}

template <int QT>
static void tiles_all_f32(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x, int64_t K,
                          int64_t M, float* y, int64_t ldy) {
    thread_local std::vector<float> tile_buf;
    tile_buf.resize(F32_WROWS * K);
    float* const wt = tile_buf.data();                 // a plain pointer in the loops (see tile_rows)
    for (int64_t n = n0; n < n1; n += F32_WROWS) {
        const int nw = (int)std::min<int64_t>(F32_WROWS, n1 - n);
        for (int j = 0; j < F32_WROWS; j++) dequantize_row<QT>(w + (n + std::min(j, nw - 1)) * row_bytes, K, wt + j * K);
        int64_t m = 0;
        for (; m + 4 <= M; m += 4) tile_f32<4>(wt, K, nw, x, m, y, ldy, n);
        switch (M - m) {
            case 3: tile_f32<3>(wt, K, nw, x, m, y, ldy, n); break;
            case 2: tile_f32<2>(wt, K, nw, x, m, y, ldy, n); break;
            case 1: tile_f32<1>(wt, K, nw, x, m, y, ldy, n); break;
            default: break;
        }
    }
}
#endif

template <int QT>
static void rows_all_f32(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x, int64_t K,
                         int64_t M, float* y, int64_t ldy) {
#ifndef LOCALRUN_VNNI
    if (M >= F32_TILES_MIN_ROWS) { tiles_all_f32<QT>(w, row_bytes, n0, n1, x, K, M, y, ldy); return; }
#endif
    constexpr int64_t NCHUNK = 16;
    for (int64_t nc = n0; nc < n1; nc += NCHUNK) {
        const int64_t ne = nc + NCHUNK < n1 ? nc + NCHUNK : n1;
        int64_t m = 0;
#ifdef LOCALRUN_VNNI
        for (; m + 8 <= M; m += 8) rows_tile_f32_512<QT, 8>(w, row_bytes, nc, ne, x, K, m, y, ldy);
        switch (M - m) {
            case 7: rows_tile_f32_512<QT, 7>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 6: rows_tile_f32_512<QT, 6>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 5: rows_tile_f32_512<QT, 5>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 4: rows_tile_f32_512<QT, 4>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 3: rows_tile_f32_512<QT, 3>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 2: rows_tile_f32_512<QT, 2>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 1: rows_tile_f32_512<QT, 1>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            default: break;
        }
#else
        switch (M) {                  // fewer than F32_TILES_MIN_ROWS rows (tiles_all_f32 takes the rest)
            case 4: rows_tile_f32<QT, 4>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 3: rows_tile_f32<QT, 3>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 2: rows_tile_f32<QT, 2>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            case 1: rows_tile_f32<QT, 1>(w, row_bytes, nc, ne, x, K, m, y, ldy); break;
            default: break;
        }
#endif
    }
}

bool matmul_rows_f32(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x, int64_t K,
                     int64_t M, float* y, int64_t ldy) {
    switch (qtype) {
        case Q4_0: rows_all_f32<Q4_0>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q4_1: rows_all_f32<Q4_1>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q5_0: rows_all_f32<Q5_0>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q5_1: rows_all_f32<Q5_1>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q8_0: rows_all_f32<Q8_0>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q4_K: rows_all_f32<Q4_K>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q5_K: rows_all_f32<Q5_K>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        case Q6_K: rows_all_f32<Q6_K>(w, row_bytes, n0, n1, x, K, M, y, ldy); return true;
        default: return false;
    }
}

// The entry points the dispatcher calls (ops.cpp).
bool matmul_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n_end, const QX& qx,
                 int64_t M, float* y, int64_t ldy, bool lanes) {
    if (lanes) {
        switch (qtype) {
            case Q4_0: lanes_all<Q4_0>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
            case Q4_1: lanes_all<Q4_1>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
            case Q5_0: lanes_all<Q5_0>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
            case Q5_1: lanes_all<Q5_1>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
            case Q4_K: lanes_all<Q4_K>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
            case Q5_K: lanes_all<Q5_K>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
            case Q6_K: lanes_all<Q6_K>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
#if defined(LOCALRUN_VNNI) || defined(LOCALRUN_AVXVNNI)
            case Q8_0: lanes_all<Q8_0>(w, row_bytes, n0, n1, n_end, qx, M, y, ldy); return true;
#endif
            default: break;   // AVX2: Q8_0 keeps the row layout (group8_q8; measured on Zen 3, its
                              // lanes were no faster: the head is bound by its reading)
        }
    }
    switch (qtype) {
        case Q4_0: rows_all<Q4_0>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q4_1: rows_all<Q4_1>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q5_0: rows_all<Q5_0>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q5_1: rows_all<Q5_1>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q8_0: rows_all<Q8_0>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q4_K: rows_all<Q4_K>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q5_K: rows_all<Q5_K>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        case Q6_K: rows_all<Q6_K>(w, row_bytes, n0, n1, qx, M, y, ldy); return true;
        default: return false;
    }
}

// Quantize rows [m0, m1) of x (M, K) to the activation format: round half to even, as the reference.

// What a group's code sums a0 (values 0..15) and a1 (16..31) and scale give the kernels, stored
// for group b of row m: s, d, the row layout's dxv/sxv lanes and the lane layout's sxh/sxg.
static inline void store_group(int64_t m, int64_t b, int64_t K, float scale, int32_t a0, int32_t a1, float* d,
                               int32_t* s, float* dxv, float* sxv, float* sxh, float* sxg) {
    const int64_t G = K / 32;
    d[m * G + b] = scale;
    s[m * (K / 16) + 2 * b] = a0; s[m * (K / 16) + 2 * b + 1] = a1;
    const float s0 = scale * (float)a0 * 0.25f, s1 = scale * (float)a1 * 0.25f;
    _mm256_storeu_ps(dxv + (m * G + b) * LANES, _mm256_set1_ps(scale));
    _mm256_storeu_ps(sxv + (m * G + b) * LANES, _mm256_setr_ps(s0, s0, s0, s0, s1, s1, s1, s1));
    if (sxh) {                                   // the lane layout's sums
        sxh[m * (K / 16) + 2 * b] = scale * (float)a0;
        sxh[m * (K / 16) + 2 * b + 1] = scale * (float)a1;
        sxg[m * G + b] = scale * (float)(a0 + a1);
    }
}

#ifdef LOCALRUN_VNNI
// AVX-512: a group's 32 values in two registers, its maximum and code sums reduced in registers
// and its codes narrowed by one move each; the same scale, codes and sums as the 256-bit loop
// below (the maximum and the integer sums are exact in any order, the products the same). The
// activations of a 16-row decode step's matmuls (16 x 576 or 16 x 1536 values, 121 calls)
// took ~0.3 ms of SmolLM2's ~20 ms step with the 256-bit loop: engine steps 0.984x the time
// (one process alternating the two step by step, Zen 4, 2 threads, 2026-12-06).
void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, int8_t* qs, float* d, int32_t* s,
                   float* dxv, float* sxv, float* sxh, float* sxg) {
    constexpr int nearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t b = 0; b < K / 32; b++) {
            const float* xb = x + m * K + 32 * b;
            const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
            const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            const float inv = a > 0.f ? 127.f / a : 0.f;
            const __m512i q0 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)), nearest);
            const __m512i q1 = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)), nearest);
            _mm_storeu_si128((__m128i*)(qs + m * K + 32 * b), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i*)(qs + m * K + 32 * b + 16), _mm512_cvtsepi32_epi8(q1));
            store_group(m, b, K, a / 127.f, _mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1), d, s, dxv, sxv,
                        sxh, sxg);
        }
    }
}
#else
void quantize_rows(const float* x, int64_t K, int64_t m0, int64_t m1, int8_t* qs, float* d, int32_t* s,
                   float* dxv, float* sxv, float* sxh, float* sxg) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t b = 0; b < K / 32; b++) {
            const float* xb = x + m * K + 32 * b;
            __m256 v[4], amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_mask, v[i]));
            }
            __m128 mx = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            mx = _mm_max_ps(mx, _mm_movehl_ps(mx, mx));
            mx = _mm_max_ss(mx, _mm_movehdup_ps(mx));
            const float a = _mm_cvtss_f32(mx);
            const float inv = a > 0.f ? 127.f / a : 0.f;
            __m256i q[4];
            for (int i = 0; i < 4; i++)
                q[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(inv)),
                                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            // the sums of values 0..15 and 16..31: s01's and s23's 128-bit halves added, then within
            // (integer sums: exact in any order), in registers: 16-row decode steps' matmuls 0.98x
            // the time of summing through memory (Zen 4 forced to AVX2, 2026-12-06)
            const __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]);
            const __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(s01), _mm256_extracti128_si256(s01, 1));
            const __m128i hi = _mm_add_epi32(_mm256_castsi256_si128(s23), _mm256_extracti128_si256(s23, 1));
            const __m128i h = _mm_hadd_epi32(lo, hi);          // lo01 lo23 hi01 hi23
            const __m128i t = _mm_hadd_epi32(h, h);            // a0 a1 a0 a1
            store_group(m, b, K, a / 127.f, _mm_cvtsi128_si32(t), _mm_extract_epi32(t, 1), d, s, dxv, sxv, sxh, sxg);
            // pack int32 -> int8 in order
            __m256i p01 = _mm256_packs_epi32(q[0], q[1]), p23 = _mm256_packs_epi32(q[2], q[3]);
            __m256i p = _mm256_packs_epi16(p01, p23);
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i*)(qs + m * K + 32 * b), p);
        }
    }
}
#endif

// Dequantize weight rows [n0, n1) to float32 out (row stride K).
bool dequantize_rows(int qtype, const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, float* out) {
    auto run = [&](auto qt) {
        constexpr int QT = decltype(qt)::value;
        for (int64_t n = n0; n < n1; n++) dequantize_row<QT>(w + n * row_bytes, K, out + n * K);
    };
    switch (qtype) {
        case Q4_0: run(std::integral_constant<int, Q4_0>{}); return true;
        case Q4_1: run(std::integral_constant<int, Q4_1>{}); return true;
        case Q5_0: run(std::integral_constant<int, Q5_0>{}); return true;
        case Q5_1: run(std::integral_constant<int, Q5_1>{}); return true;
        case Q8_0: run(std::integral_constant<int, Q8_0>{}); return true;
        case Q4_K: run(std::integral_constant<int, Q4_K>{}); return true;
        case Q5_K: run(std::integral_constant<int, Q5_K>{}); return true;
        case Q6_K: run(std::integral_constant<int, Q6_K>{}); return true;
        default: return false;
    }
}

}}  // namespace localrun::ISA_NS
