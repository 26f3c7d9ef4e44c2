// Batched paged attention for decode and verify rows, in one call per layer, over a float32,
// float16, bfloat16, int8 or fp8 KV pool (the queries, new keys and values and the output are float32):
//   paged_attention(q, k, v, k_pool, v_pool, slots, block_tables, row_seq, row_len, block_size, window=0,
//                   k_scale=None, v_scale=None) -> out
//   q (T, H, hd); k, v (T, n_kv, hd): the rows' new keys and values, written first into the pools
//   (num_blocks * block_size, n_kv, hd) at `slots` (T,), rounded to the pool's type as torch's
//   .to() rounds (to nearest, ties to even). A quantized pool (int8, or fp8 bytes) comes with its
//   scales (paged_kv.py's layouts) and its rows are quantized as paged_kv.py's stores do it (an
//   int8 K block is requantized whole with its new rows, the rows of one sequence being consecutive).
//   Row t then attends, as one query, over
//   the first row_len[t] positions of sequence row_seq[t], whose position p lives in slot
//   block_tables[row_seq[t], p / block_size] * block_size + p % block_size. window > 0 (a
//   sliding-window layer): only the last `window` of those positions, p >= row_len[t] - window;
//   the block table's entries before them are never read. Grouped-query: head h
//   reads KV head h / (H / n_kv). Scale 1/sqrt(hd), softmax in float32 with the maximum removed.
// A float16 pool is read in place, each row widened (exactly) as it is multiplied; a bfloat16 or
// quantized pool is read a block at a time, its rows widened to float32 into an L1 scratch once
// (code x scale for a quantized one). Either way each key and value row is read once for the
// query heads that share its KV head, on exactly the values the pool's store would read; the
// AVX2 and AVX-512 builds multiply-add with FMA. A row over CHUNK positions is
// split into chunks over the threads and merged in chunk order.
// No gather, no Python loop over sequences; every row is computed on its own, so a verify row
// equals the decode step it stands for, bit for bit. The reference is torch's SDPA over the
// gathered keys (localrun/model/llama.py, Attention._attend).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>
#include <immintrin.h>
#include "fp8.h"
#include "vec8.h"

namespace localrun {
namespace {

// The row kernel is written once with GCC vector types (csrc/vec8.h) and compiled three times:
// for AVX-512 (more registers), AVX2 + FMA (target attributes) and the baseline (SSE2);
// paged_attention picks one at run time (LOCALRUN_ISA=avx2|ref forces a narrower one). Every
// row runs the same instructions in the same order whatever else is in the call.
struct Pool {
    const void* data;          // (slots, n_kv, hd) values: float, half, bfloat16, int8 or fp8 bytes per Fmt
    const float* scale;        // quantized pools: per-token (slots, n_kv, hd / group) or per-block (blocks, n_kv, hd)
    int64_t group;             // values per per-token scale
};

struct RowArgs {
    const float* q;            // (heads, hd): the query heads of this row that share KV head g
    Pool k, v;
    void (*widen_f16)(float*, const uint16_t*, int64_t, int64_t, int64_t);   // float16 rows -> float32 (per ISA)
    // rows of int8 codes x their scales -> float32 rows (widen_i8_scaled_*: one call per block)
    void (*widen_i8_scaled)(float*, const int8_t*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
    void (*widen_fp8)(float*, const uint8_t*, int64_t);    // n float8 e4m3fn codes -> float32
    const int64_t* table;      // this sequence's block table
    int64_t block_size, n_kv, g, hd, first, L, heads;
    int64_t per_kv;            // 0: the heads of KV head g; else every head of the row (g = 0), head h
                               // reading KV head h / per_kv
    float scale;
    float* scores;             // scratch: heads * (L - first + 8) scores, heads * hd sums, block_size * hd rows
                               // (block_size * n_kv * hd in per_kv mode), heads * hd scaled queries
    float* out;                // (heads, hd)
    float* ml;                 // nullptr, or (heads, 2): each head's score maximum and sum of e^(s - max)
};

// Pool formats. rows(): where the rows off..off+n-1 of block b (KV head g) are as float32, and
// their stride: the pool itself for float32, else `buf` (n * hd floats) after widening them.
struct F32 {
    using E = float;
    static constexpr bool SCALED = false;
    ALWAYS_INLINE static const float* rows(const RowArgs& a, const Pool& pool, int64_t b, int64_t off, int64_t n,
                                           float* buf, int64_t& stride) {
        stride = a.n_kv * a.hd;   // every KV head's rows side by side: per_kv mode reads them at head offsets
        return static_cast<const float*>(pool.data) + ((a.table[b] * a.block_size + off) * a.n_kv + a.g) * a.hd;
    }
};

template <typename Widen>
struct Half16 {                    // float16 or bfloat16 values, stored as 16-bit words
    using E = uint16_t;
    static constexpr bool SCALED = false;
    ALWAYS_INLINE static const float* rows(const RowArgs& a, const Pool& pool, int64_t b, int64_t off, int64_t n,
                                           float* buf, int64_t& stride) {
        // per_kv mode: the rows of every KV head, one contiguous stretch of the block, widened
        // in one pass (rows n_kv * hd wide); else KV head g's hd values of each row
        const int64_t hd = a.hd, src_stride = a.n_kv * hd, width = a.per_kv ? src_stride : hd;
        const uint16_t* src = static_cast<const uint16_t*>(pool.data) + ((a.table[b] * a.block_size + off) * a.n_kv + a.g) * hd;
        Widen::rows(a, buf, src, n, src_stride, width);
        stride = width;
        return buf;
    }
};

// rows(a, dst, src, n, src_stride, hd): n rows of hd values (src rows src_stride apart) widened
// to float32 into dst (rows hd apart), one call per block
struct WidenF16 {     // through the kernel's ISA's converter (vcvtph2ps where F16C exists)
    ALWAYS_INLINE static void rows(const RowArgs& a, float* dst, const uint16_t* src, int64_t n, int64_t src_stride,
                                   int64_t hd) {
        a.widen_f16(dst, src, n, src_stride, hd);
    }
};
struct WidenBF16 {    // exact: the 16 bits are the float's upper half
    ALWAYS_INLINE static void rows(const RowArgs&, float* dst, const uint16_t* src, int64_t n, int64_t src_stride,
                                   int64_t hd) {
        for (int64_t r = 0; r < n; r++, src += src_stride, dst += hd) {
            int64_t i = 0;
            for (; i + 8 <= hd; i += 8) store8(dst + i, bf16x8(src + i));
            for (; i < hd; i++) dst[i] = static_cast<float>(c10::BFloat16(src[i], c10::BFloat16::from_bits()));
        }
    }
};

// float16 -> float32, exact either way: F16C's vcvtph2ps, or half8's bit arithmetic without it;
// n rows of hd values, src rows src_stride apart, dst rows hd apart.
__attribute__((target("avx,f16c"))) void widen_f16_f16c(float* dst, const uint16_t* src, int64_t n, int64_t src_stride,
                                                       int64_t hd) {
    for (int64_t r = 0; r < n; r++, src += src_stride, dst += hd) {
        int64_t i = 0;
        for (; i + 8 <= hd; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
        for (; i < hd; i++) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
    }
}
// rows of x (`row` values each, x_stride apart) into the pool at slots
template <typename E>
void write_rows(E* pool, const float* x, int64_t x_stride, const int64_t* slots, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < row; i++) pool[slots[t] * row + i] = static_cast<E>(x[t * x_stride + i]);
}

// float32 rows of x (`row` values each, x_stride apart) into a float16 pool at slots, rounded to
// nearest, ties to even, as torch's .to() and c10::Half round: F16C's vcvtps2ph, 8 at a time (the
// scalar conversion of a 16-row SmolLM2 step's new keys and values took ~16 us a layer, ~0.5 ms a
// step, Zen 4), or c10::Half without it.
__attribute__((target("avx,f16c"))) void narrow_f16_f16c(uint16_t* pool, const float* x, int64_t x_stride,
                                                        const int64_t* slots, int64_t T, int64_t row) {
    for (int64_t t = 0; t < T; t++) {
        uint16_t* dst = pool + slots[t] * row;
        const float* src = x + t * x_stride;
        int64_t i = 0;
        for (; i + 8 <= row; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < row; i++) dst[i] = c10::Half(src[i]).x;
    }
}
void narrow_f16_base(uint16_t* pool, const float* x, int64_t x_stride, const int64_t* slots, int64_t T, int64_t row) {
    write_rows(reinterpret_cast<at::Half*>(pool), x, x_stride, slots, T, row);
}
// The same for a bfloat16 pool, as c10::BFloat16 rounds: the float's bits + 0x7fff + (bit 16), the
// top half kept; a NaN becomes 0x7fc0. AVX2 integer arithmetic, 8 at a time.
__attribute__((target("avx2"))) void narrow_bf16_avx2(uint16_t* pool, const float* x, int64_t x_stride,
                                                     const int64_t* slots, int64_t T, int64_t row) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), qnan = _mm256_set1_epi32(0x7fc0);
    for (int64_t t = 0; t < T; t++) {
        uint16_t* dst = pool + slots[t] * row;
        const float* src = x + t * x_stride;
        int64_t i = 0;
        for (; i + 8 <= row; i += 8) {
            const __m256 f = _mm256_loadu_ps(src + i);
            const __m256i b = _mm256_castps_si256(f);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, bias)), 16);
            r = _mm256_blendv_epi8(r, qnan, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);   // r0..r7 in the low half
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_castsi256_si128(packed));
        }
        for (; i < row; i++) dst[i] = c10::BFloat16(src[i]).x;
    }
}
void narrow_bf16_base(uint16_t* pool, const float* x, int64_t x_stride, const int64_t* slots, int64_t T, int64_t row) {
    write_rows(reinterpret_cast<at::BFloat16*>(pool), x, x_stride, slots, T, row);
}
void widen_f16_bits(float* dst, const uint16_t* src, int64_t n, int64_t src_stride, int64_t hd) {
    for (int64_t r = 0; r < n; r++, src += src_stride, dst += hd) {
        int64_t i = 0;
        for (; i + 8 <= hd; i += 8) store8(dst + i, half8(src + i));
        for (; i < hd; i++) dst[i] = static_cast<float>(c10::Half(src[i], c10::Half::from_bits()));
    }
}

using F16 = Half16<WidenF16>;
using BF16 = Half16<WidenBF16>;

// Quantized pools (localrun/engine/paged_kv.py): value = code * scale, one float32 product, as
// the store's read computes it. Code::rows(a, dst, src, sc, n, src_stride, hd, group, sc_stride):
// n rows of hd codes (src rows src_stride apart) into dst (rows hd apart), row r's value i
// times sc[r * sc_stride + i / group]. int8 widens and scales a block in one call and one pass
// (the kernel ISA's widen_i8_scaled); fp8 widens each row exactly, then scales it in place.
struct Int8Code {
    using E = int8_t;
    ALWAYS_INLINE static void rows(const RowArgs& a, float* dst, const int8_t* src, const float* sc, int64_t n,
                                   int64_t src_stride, int64_t hd, int64_t group, int64_t sc_stride) {
        a.widen_i8_scaled(dst, src, sc, n, src_stride, hd, group, sc_stride);
    }
};
struct Fp8Code {                   // float8 e4m3fn bytes
    using E = uint8_t;
    ALWAYS_INLINE static void rows(const RowArgs& a, float* dst, const uint8_t* src, const float* sc, int64_t n,
                                   int64_t src_stride, int64_t hd, int64_t group, int64_t sc_stride) {
        for (int64_t r = 0; r < n; r++, src += src_stride, dst += hd, sc += sc_stride) {
            a.widen_fp8(dst, src, hd);
            if (group % 8 == 0) {
                for (int64_t gi = 0; gi < hd / group; gi++) {
                    const v8 s8 = splat8(sc[gi]);
                    for (int64_t i = gi * group; i < (gi + 1) * group; i += 8) store8(dst + i, load8(dst + i) * s8);
                }
            } else {
                for (int64_t i = 0; i < hd; i++) dst[i] *= sc[i / group];
            }
        }
    }
};

template <typename Code>
struct TokenScaled {               // one scale per `group` values of a token's head (group: 32, or hd)
    using E = typename Code::E;
    static constexpr bool SCALED = true;
    // the scales of block b's first `rows` positions, every KV head: one contiguous stretch
    static const float* scale_span(const RowArgs& a, const Pool& pool, int64_t b, int64_t rows, int64_t& n) {
        const int64_t per_token = a.n_kv * (a.hd / pool.group);
        n = rows * per_token;
        return pool.scale + a.table[b] * a.block_size * per_token;
    }
    ALWAYS_INLINE static const float* rows(const RowArgs& a, const Pool& pool, int64_t b, int64_t off, int64_t n,
                                           float* buf, int64_t& stride) {
        // per_kv mode: every KV head's values of a row at once, their scales side by side too
        const int64_t hd = a.hd, groups = hd / pool.group, width = a.per_kv ? a.n_kv * hd : hd;
        const int64_t at = (a.table[b] * a.block_size + off) * a.n_kv + a.g;       // the first row's token and head
        Code::rows(a, buf, static_cast<const E*>(pool.data) + at * hd, pool.scale + at * groups, n,
                   a.n_kv * hd, width, pool.group, a.n_kv * groups);
        stride = width;
        return buf;
    }
};

struct ChannelScaledInt8 {         // int8 with one scale per block per channel: scale (blocks, n_kv, hd)
    using E = int8_t;
    static constexpr bool SCALED = true;
    static const float* scale_span(const RowArgs& a, const Pool& pool, int64_t b, int64_t, int64_t& n) {
        n = a.n_kv * a.hd;
        return pool.scale + a.table[b] * a.n_kv * a.hd;
    }
    ALWAYS_INLINE static const float* rows(const RowArgs& a, const Pool& pool, int64_t b, int64_t off, int64_t n,
                                           float* buf, int64_t& stride) {
        const int64_t hd = a.hd, width = a.per_kv ? a.n_kv * hd : hd;       // per_kv: every KV head at once
        const float* sc = pool.scale + (a.table[b] * a.n_kv + a.g) * hd;     // the block's, every row
        a.widen_i8_scaled(buf, static_cast<const int8_t*>(pool.data) + ((a.table[b] * a.block_size + off) * a.n_kv + a.g) * hd,
                          sc, n, a.n_kv * hd, width, 1, 0);
        stride = width;
        return buf;
    }
};

// float8 e4m3fn codes -> float32, exact (int8 codes: widen_i8_scaled below). e4m3fn: sign, 4
// exponent bits (bias 7), 3 mantissa bits; a normal code's bits move into a float's place with
// the exponent rebiased (+120), a subnormal one (exponent 0) is mantissa x 2^-9, 0x7f/0xff are
// NaN (never written: the stores scale values to at most 448).
float fp8_value(uint8_t c) { return static_cast<float>(c10::Float8_e4m3fn(c, c10::Float8_e4m3fn::from_bits())); }

__attribute__((target("avx2,fma,f16c"))) void widen_fp8_avx2(float* dst, const uint8_t* src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, fp8x8(src + i));
    for (; i < n; i++) dst[i] = fp8_value(src[i]);
}

// n rows of hd int8 codes (src rows src_stride apart) times their scales into dst (rows hd
// apart): row r's value i is code x sc[r * sc_stride + i / group], one float32 product (the
// stores' read). group 1 with sc_stride 0: one scale per channel for the whole block (int8 K);
// group 32 or hd: one per group of a token's values (int8 V).
__attribute__((target("avx2,fma"))) void widen_i8_scaled_avx2(float* dst, const int8_t* src, const float* sc, int64_t n,
                                                             int64_t src_stride, int64_t hd, int64_t group, int64_t sc_stride) {
    for (int64_t r = 0; r < n; r++, src += src_stride, dst += hd, sc += sc_stride) {
        int64_t i = 0;
        if (group == 1) {
            for (; i + 8 <= hd; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)))), _mm256_loadu_ps(sc + i)));
        } else if (group % 8 == 0) {
            for (; i + 8 <= hd; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                    _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i)))), _mm256_set1_ps(sc[i / group])));
        }
        for (; i < hd; i++) dst[i] = static_cast<float>(src[i]) * sc[i / group];
    }
}
void widen_i8_scaled_base(float* dst, const int8_t* src, const float* sc, int64_t n, int64_t src_stride, int64_t hd,
                          int64_t group, int64_t sc_stride) {
    for (int64_t r = 0; r < n; r++, src += src_stride, dst += hd, sc += sc_stride)
        for (int64_t i = 0; i < hd; i++) dst[i] = static_cast<float>(src[i]) * sc[i / group];
}
void widen_fp8_base(float* dst, const uint8_t* src, int64_t n) {
    static const std::array<float, 256> table = [] {
        std::array<float, 256> t{};
        for (int i = 0; i < 256; i++) t[i] = fp8_value(static_cast<uint8_t>(i));
        return t;
    }();
    for (int64_t i = 0; i < n; i++) dst[i] = table[src[i]];
}

// The query heads of one row that share KV head g, over positions first..L-1: each key and
// value row is read from memory once for all of them (grouped-query attention), and stays in
// L1 while each head uses it. Every head's arithmetic is the same, in the same order, as it
// would be alone. HD: the head size at compile time (a multiple of 8), 0 for any multiple of
// 8 at run time.
// Ask for a block's rows of KV head g (keys or values) ahead of their use: the blocks of a
// sequence lie anywhere in the pool, so the hardware prefetcher cannot follow. LOCALITY 3: into
// L1, for the block used next; 1: into L2 only. During the keys' pass, the keys KEYS_AHEAD blocks on
// and this block's values go to L2, so the values' pass finds them there: asked into L1 from
// memory, the requests of a 16-row decode step waited in the prefetch loops themselves, and
// the step's attention took 1.4-1.7x as long (docs/measurements.md).
// part of parts: the block's rows part * rows / parts .. (part + 1) * rows / parts - 1, so that the
// requests for one block are spread over the work on the current one (key_pieces, value passes):
// a whole block's requests at once (192 lines of keys and values in a 16-row decode's whole-row
// tasks) filled the core's miss buffers, and the loads of the work in between waited behind them.
template <typename Fmt, int LOCALITY = 3>
ALWAYS_INLINE void prefetch_block(const RowArgs& a, const Pool& pool, int64_t b, int64_t hd, int64_t part = 0,
                                  int64_t parts = 1) {
    if (b * a.block_size >= a.L) return;
    const int64_t rows = std::min(a.block_size, a.L - b * a.block_size), row_bytes = a.n_kv * hd * sizeof(typename Fmt::E);
    const int64_t bytes = a.per_kv ? row_bytes : hd * sizeof(typename Fmt::E);     // read of each position
    const int64_t r0 = part * rows / parts, r1 = (part + 1) * rows / parts;
    const char* row = static_cast<const char*>(pool.data) + ((a.table[b] * a.block_size + r0) * a.n_kv + a.g) * hd * sizeof(typename Fmt::E);
    for (int64_t r = r0; r < r1; r++, row += row_bytes)
        for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, LOCALITY);
    if constexpr (Fmt::SCALED) {       // a quantized pool's scales, with the first part's rows
        if (part == 0) {
            int64_t n;
            const char* sc = reinterpret_cast<const char*>(Fmt::scale_span(a, pool, b, rows, n));
            for (int64_t c = 0; c < n * (int64_t)sizeof(float); c += 64) __builtin_prefetch(sc + c, 0, LOCALITY);
            __builtin_prefetch(sc + n * sizeof(float) - 1, 0, LOCALITY);     // the last line, where sc is not aligned
        }
    }
}
// Blocks ahead. One: 0.95-0.99 of two's time on Zen 4 (16-row SmolLM2-shaped steps over 256-1024
// positions, AVX-512 and forced AVX2, one process alternating; farther was slower: 3 blocks 1.03,
// 4 1.08, 6 1.18), the first blocks of a row coming from its predecessor (prefetch_row_start).
constexpr int64_t KEYS_AHEAD = 1;
template <typename KF, typename VF>
ALWAYS_INLINE void prefetch_keys_pass(const RowArgs& a, int64_t b, int64_t hd, int64_t part, int64_t parts) {
    prefetch_block<KF, 1>(a, a.k, b + KEYS_AHEAD, hd, part, parts);
    prefetch_block<VF, 1>(a, a.v, b, hd, part, parts);
}
// The keys of block b for one head group, PIECE positions at a time (f(j, n): the n keys from the
// call's j-th), each piece after its share of the block's prefetches (part++ of parts). The score
// loops take keys 8 at a time, each key's sum on its own, so pieces of 8 give the same bits as one
// call. One thread, 16 SmolLM2 rows over 286 positions, 30 layers' pools (memory), us per row and
// layer: the whole block's prefetches before the first head group 37-40, one head group's share
// before each 31-34, a piece's share before each 28-31.
constexpr int64_t PIECE = 8;
template <typename KF, typename VF, typename F>
ALWAYS_INLINE void key_pieces(const RowArgs& a, int64_t b, int64_t hd, int64_t n, int64_t& part, int64_t parts, F&& f) {
    for (int64_t j = 0; j < a.block_size; j += PIECE) {
        prefetch_keys_pass<KF, VF>(a, b, hd, part++, parts);
        if (j < n) f(j, std::min(PIECE, n - j));
    }
}

// In the vector kernel a float16 pool is read in place, each row widened as it is multiplied
// (vcvtph2ps from memory); the other formats give float32 rows: the pool's own (float32), or
// rows widened into the scratch a block at a time (bfloat16, int8, fp8).
template <typename Fmt>
struct Src {
    ALWAYS_INLINE static const float* rows(const RowArgs& a, const Pool& pool, int64_t b, int64_t off, int64_t n,
                                           float* buf, int64_t& stride) {
        return Fmt::rows(a, pool, b, off, n, buf, stride);
    }
};
template <>
struct Src<F16> {
    ALWAYS_INLINE static const uint16_t* rows(const RowArgs& a, const Pool& pool, int64_t b, int64_t off, int64_t,
                                              float*, int64_t& stride) {
        stride = a.n_kv * a.hd;
        return static_cast<const uint16_t*>(pool.data) + ((a.table[b] * a.block_size + off) * a.n_kv + a.g) * a.hd;
    }
};

// Two builds of the inner loops below, with one order of operations per head:
//   *_base: GCC vector types (the baseline build), a product then a sum, float16 widened by bit
//     arithmetic (half8);
//   *_fast: the same loops in AVX2 + FMA + F16C intrinsics (the AVX2 and AVX-512 entry points),
//     products fused into their sums, float16 widened by vcvtph2ps straight from the pool.
// The fast ones are real calls, one per block and group of heads: GCC will not inline a function
// with a target attribute into the ISA-neutral templates that call it.
ALWAYS_INLINE v8 get8_base(const float* p) { return load8(p); }
ALWAYS_INLINE v8 get8_base(const uint16_t* p) { return half8(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 get8_fast(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"))) inline __m256 get8_fast(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// How the fast loops read 8 values at p, channel ch of its row: as stored (float32, or float16
// widened by vcvtph2ps), or, for int8 pools read in place, the 8 codes widened and multiplied by
// their scales as they are used (K: the block's per-channel scales; V: the token's per-group
// scales, next() moving to the next token): exactly the float32 product widen_i8_scaled_avx2
// writes into the scratch, so the bits are the scratch path's, without the store and the reload
// (a shared cached prefix, read from cache by every row of a step, was widened 16 times a step:
// 16-row decode steps took 1.2-1.5x float16's).
__attribute__((target("avx2,fma,f16c"))) inline __m256 get8_i8(const int8_t* p, __m256 s) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))), s);
}
struct AsStored {
    template <typename R>
    __attribute__((target("avx2,fma,f16c"))) __m256 operator()(const R* p, int64_t, int64_t = 0) const { return get8_fast(p); }
    void next() {}
};
struct KeysI8 {                    // ks: the block's hd scales, one per channel, every key alike
    const float* ks;
    __attribute__((target("avx2,fma,f16c"))) __m256 operator()(const int8_t* p, int64_t ch, int64_t = 0) const {
        return get8_i8(p, _mm256_loadu_ps(ks + ch));
    }
    void next() {}
};
struct ValuesI8 {                  // vs: the token's scales, one per `group` values (a multiple of 8)
    const float* vs;
    int64_t vs_stride;             // the next token's scales
    int64_t gi[4];                 // the scale of the 4 chunks of 8 read from channel ch0 on
    ValuesI8(const float* vs_, int64_t vs_stride_, int64_t ch0, int64_t group) : vs(vs_), vs_stride(vs_stride_) {
        for (int c = 0; c < 4; c++) gi[c] = (ch0 + 8 * c) / group;
    }
    __attribute__((target("avx2,fma,f16c"))) __m256 operator()(const int8_t* p, int64_t ch) const {
        return get8_i8(p, _mm256_broadcast_ss(vs + gi[ch / 8]));
    }
    void next() { vs += vs_stride; }
};

// Scores of G query heads that share a KV head (qs: their scaled queries, hd apart) against n
// keys (rows `stride` apart): sc[h][j] = q_h . k_j, mx[h] their running maximum. Each key row is
// read once for the G heads (grouped-query attention), 4 keys x G heads of sums at a time; every
// head's sums are the same operations in the same order whatever G is, so a head's bits are its own.
template <int G, int HD, typename R>
ALWAYS_INLINE void scores_base(const float* qs, const R* k, int64_t stride, int64_t hd_rt, int64_t n,
                               float* const* sc, float* mx) {
    const int64_t hd = HD ? HD : hd_rt, nv = hd / 8;
    int64_t j0 = 0;
    for (; j0 + 8 <= n; j0 += 8, k += 8 * stride) {            // 8 keys: 8 sums per head, one tree
        v8 s[G][8];
        for (int half = 0; half < 2; half++) {
            const R* kk = k + half * 4 * stride;
            v8 acc[G][4];
            for (int j = 0; j < 4; j++) {
                const v8 kv = get8_base(kk + j * stride);
                for (int h = 0; h < G; h++) acc[h][j] = load8(qs + h * hd) * kv;
            }
            for (int64_t i = 1; i < nv; i++)
                for (int j = 0; j < 4; j++) {
                    const v8 kv = get8_base(kk + j * stride + 8 * i);
                    for (int h = 0; h < G; h++) acc[h][j] += load8(qs + h * hd + 8 * i) * kv;
                }
            for (int h = 0; h < G; h++)
                for (int j = 0; j < 4; j++) s[h][half * 4 + j] = acc[h][j];
        }
        for (int h = 0; h < G; h++) {
            const v8 t = transpose_sum8(s[h]);
            store8(sc[h] + j0, t);
            mx[h] = std::max(mx[h], max8(t));
        }
    }
    for (; j0 < n; j0++, k += stride)                          // the block's last keys, one at a time
        for (int h = 0; h < G; h++) {
            const float* qh = qs + h * hd;
            v8 s0 = splat8(0.f), s1 = splat8(0.f);
            int64_t i = 0;
            for (; i + 2 <= nv; i += 2) {
                s0 += load8(qh + 8 * i) * get8_base(k + 8 * i);
                s1 += load8(qh + 8 * i + 8) * get8_base(k + 8 * i + 8);
            }
            if (i < nv) s0 += load8(qh + 8 * i) * get8_base(k + 8 * i);
            const float t = hsum8(s0 + s1);
            sc[h][j0] = t;
            mx[h] = std::max(mx[h], t);
        }
}

template <int G, int HD, typename R, typename Read = AsStored>
__attribute__((target("avx2,fma,f16c"), noinline)) void scores_fast(const float* qs, const R* k, int64_t stride,
                                                                    int64_t hd_rt, int64_t n, float* const* sc, float* mx,
                                                                    Read read = {}) {
    const int64_t hd = HD ? HD : hd_rt, nv = hd / 8;
    int64_t j0 = 0;
    for (; j0 + 8 <= n; j0 += 8, k += 8 * stride) {
        v8 s[G][8];
        for (int half = 0; half < 2; half++) {
            const R* kk = k + half * 4 * stride;
            __m256 acc[G][4];
            for (int j = 0; j < 4; j++) {
                const __m256 kv = read(kk + j * stride, 0, j0 + half * 4 + j);
                for (int h = 0; h < G; h++) acc[h][j] = _mm256_mul_ps(_mm256_loadu_ps(qs + h * hd), kv);
            }
            for (int64_t i = 1; i < nv; i++)
                for (int j = 0; j < 4; j++) {
                    const __m256 kv = read(kk + j * stride + 8 * i, 8 * i, j0 + half * 4 + j);
                    for (int h = 0; h < G; h++) acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + h * hd + 8 * i), kv, acc[h][j]);
                }
            for (int h = 0; h < G; h++)
                for (int j = 0; j < 4; j++) s[h][half * 4 + j] = (v8)acc[h][j];
        }
        for (int h = 0; h < G; h++) {
            const v8 t = transpose_sum8(s[h]);
            store8(sc[h] + j0, t);
            mx[h] = std::max(mx[h], max8(t));
        }
    }
    for (; j0 < n; j0++, k += stride)
        for (int h = 0; h < G; h++) {
            const float* qh = qs + h * hd;
            __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
            int64_t i = 0;
            for (; i + 2 <= nv; i += 2) {
                s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), read(k + 8 * i, 8 * i, j0), s0);
                s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i + 8), read(k + 8 * i + 8, 8 * i + 8, j0), s1);
            }
            if (i < nv) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * i), read(k + 8 * i, 8 * i, j0), s0);
            const float t = hsum8((v8)_mm256_add_ps(s0, s1));
            sc[h][j0] = t;
            mx[h] = std::max(mx[h], t);
        }
}

// acc[h] (C chunks of 8 of head h's running sums) += sum_j w[h][j] v_j over n value rows
// (`stride` apart, each at the same C chunks): each row read once for the G heads.
template <int G, int C, typename R>
ALWAYS_INLINE void values_base(const float* const* w, const R* v, int64_t stride, int64_t n, float* const* acc) {
    v8 sum[G][C];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) sum[h][c] = load8(acc[h] + 8 * c);
    for (int64_t j = 0; j < n; j++, v += stride) {
        v8 wj[G];
        for (int h = 0; h < G; h++) wj[h] = splat8(w[h][j]);
        for (int c = 0; c < C; c++) {
            const v8 x = get8_base(v + 8 * c);
            for (int h = 0; h < G; h++) sum[h][c] += wj[h] * x;
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) store8(acc[h] + 8 * c, sum[h][c]);
}

template <int G, int C, typename R, typename Read = AsStored>
__attribute__((target("avx2,fma,f16c"), noinline)) void values_fast(const float* const* w, const R* v, int64_t stride,
                                                                    int64_t n, float* const* acc, Read read = {}) {
    // Return before the sums are loaded when there is no row: without this, GCC 12 at -O3 (its
    // loop peeling) kept sum[][] in memory and stored all 12 sums on every value row, 12 stores
    // for 12 FMAs, which bounded the loop (a 16-row decode step's attention, in L2, 1.37x).
    if (n <= 0) return;
    __m256 sum[G][C];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) sum[h][c] = _mm256_loadu_ps(acc[h] + 8 * c);
    for (int64_t j = 0; j < n; j++, v += stride, read.next()) {
        __m256 wj[G];
        for (int h = 0; h < G; h++) wj[h] = _mm256_broadcast_ss(w[h] + j);
        for (int c = 0; c < C; c++) {
            const __m256 x = read(v + 8 * c, 8 * c);
            for (int h = 0; h < G; h++) sum[h][c] = _mm256_fmadd_ps(wj[h], x, sum[h][c]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) _mm256_storeu_ps(acc[h] + 8 * c, sum[h][c]);
}

// The AVX-512 build's loops for pools read as stored (float32, float16) or widened into the
// scratch: 16 values a step in 32 registers, where the 8-wide loops above spill the queries
// and issue twice the instructions (a 16-row decode step of SmolLM2 spent most of its attention
// time there). Same structure, wider steps: a row's bits are the same in any call on an AVX-512
// host (they differ from the AVX2 build's, as any other summation order would). They are not
// the 8-wide loops templated on a width: a template cannot carry the target attribute (the
// 8-wide code must stay free of AVX-512 encodings for AVX2 hosts), and the keys' blocking
// differs (8 keys x 3 heads of sums fit 32 registers, 4 keys x 3 heads fit 16).
#define WIDE_TARGET __attribute__((target("avx512f,avx512vl,avx2,fma,f16c")))
WIDE_TARGET inline __m512 get16(const float* p) { return _mm512_loadu_ps(p); }
WIDE_TARGET inline __m512 get16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
WIDE_TARGET inline __m256 fold16(__m512 x) {       // lanes i + lanes 8 + i
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}
// The scores' maximum of 8 lanes in vector registers (max8 extracted them one by one), and the
// softmax's exponentials 16 at a time (attend_row): the same bits, a 16-row SmolLM2 call over 30
// layers' pools 341 against 364 us per layer (one thread, best of 4 alternated processes; every
// round faster, medians 348 against 428; Zen 4, 2026-12-04). A shorter reduction of the 8 keys'
// 16-lane sums (24 instructions for fold16 + transpose_sum8's 37) took another 2-5% off, but it
// changes the scores' bits, and with them SmolLM2's greedy continuations: speculative.py's copy
// tasks accepted 0.71-0.75 of the drafts instead of 0.85-0.87, ngram_speedup 2.0-2.1 against
// 2.4-2.6 (alternated runs), so it waits.
WIDE_TARGET inline float max8_wide(__m256 v) {      // exact, as max8
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}
// The readers of the wide loops, as AsStored, KeysI8 and ValuesI8 for the 8-wide ones (16 codes
// times their scales: the same float32 products, so an int8 pool read in place gives the bits
// of the float32 pool of its values here too).
struct AsStored16 {
    template <typename R>
    WIDE_TARGET __m512 operator()(const R* p, int64_t, int64_t = 0) const { return get16(p); }
    void next() {}
};
// float8 e4m3fn codes are read in place by the wide loops only (in AVX2's 16 registers a 16-row
// step over 256 positions took 1.3x the scratch path's time with the first decoder, and the same
// time with fp8.h's): 16 codes widened exactly (fp8x16) times their token's scale, the scratch
// path's float32 products.
// fp8 keys: key j's scales at ks + j * ks_stride, one per `group` values (a multiple of 16);
// gi[ch / 16]: channel ch's (no division per load)
struct KeysFp8x16 {
    const float* ks;
    int64_t ks_stride;
    int64_t gi[16];                // head sizes up to 256
    KeysFp8x16(const float* ks_, int64_t ks_stride_, int64_t hd, int64_t group) : ks(ks_), ks_stride(ks_stride_) {
        for (int64_t c = 0; c < hd / 16; c++) gi[c] = 16 * c / group;
    }
    WIDE_TARGET __m512 operator()(const uint8_t* p, int64_t ch, int64_t j) const {
        return _mm512_mul_ps(fp8x16(p), _mm512_set1_ps(ks[j * ks_stride + gi[ch / 16]]));
    }
    void next() {}
};
WIDE_TARGET inline __m512 get16_i8(const int8_t* p, __m512 s) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), s);
}
struct KeysI8x16 {
    const float* ks;
    WIDE_TARGET __m512 operator()(const int8_t* p, int64_t ch, int64_t = 0) const { return get16_i8(p, _mm512_loadu_ps(ks + ch)); }
    void next() {}
};
struct ValuesI8x16 {               // the token's scales, one per `group` values (a multiple of 16)
    const float* vs;
    int64_t vs_stride;
    int64_t gi[4];                 // the scale of the 4 chunks of 16 read from channel ch0 on
    ValuesI8x16(const float* vs_, int64_t vs_stride_, int64_t ch0, int64_t group) : vs(vs_), vs_stride(vs_stride_) {
        for (int c = 0; c < 4; c++) gi[c] = (ch0 + 16 * c) / group;
    }
    WIDE_TARGET __m512 operator()(const int8_t* p, int64_t ch) const { return get16_i8(p, _mm512_set1_ps(vs[gi[ch / 16]])); }
    WIDE_TARGET __m512 operator()(const uint8_t* p, int64_t ch) const {        // fp8 V (the same scales' layout)
        return _mm512_mul_ps(fp8x16(p), _mm512_set1_ps(vs[gi[ch / 16]]));
    }
    void next() { vs += vs_stride; }
};

// scores_fast's job (hd a multiple of 16): 8 keys x G heads of 16-lane sums, each folded to 8
// lanes and the 8 keys' sums transposed into one vector.
template <int G, int HD, typename R, typename Read = AsStored16>
WIDE_TARGET __attribute__((noinline)) void scores_wide(const float* qs, const R* k, int64_t stride, int64_t hd_rt,
                                                      int64_t n, float* const* sc, float* mx, Read read = {}) {
    const int64_t hd = HD ? HD : hd_rt, nc = hd / 16;
    int64_t j0 = 0;
    for (; j0 + 8 <= n; j0 += 8, k += 8 * stride) {
        __m512 acc[G][8];
        for (int j = 0; j < 8; j++) {
            const __m512 kv = read(k + j * stride, 0, j0 + j);
            for (int h = 0; h < G; h++) acc[h][j] = _mm512_mul_ps(_mm512_loadu_ps(qs + h * hd), kv);
        }
        for (int64_t c = 1; c < nc; c++)
            for (int j = 0; j < 8; j++) {
                const __m512 kv = read(k + j * stride + 16 * c, 16 * c, j0 + j);
                for (int h = 0; h < G; h++) acc[h][j] = _mm512_fmadd_ps(_mm512_loadu_ps(qs + h * hd + 16 * c), kv, acc[h][j]);
            }
        for (int h = 0; h < G; h++) {
            v8 s8[8];
            for (int j = 0; j < 8; j++) s8[j] = (v8)fold16(acc[h][j]);
            const v8 t = transpose_sum8(s8);
            store8(sc[h] + j0, t);
            mx[h] = std::max(mx[h], max8_wide((__m256)t));
        }
    }
    for (; j0 < n; j0++, k += stride)                          // the block's last keys, one at a time
        for (int h = 0; h < G; h++) {
            const float* qh = qs + h * hd;
            __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(qh), read(k, 0, j0));
            for (int64_t c = 1; c < nc; c++) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(qh + 16 * c), read(k + 16 * c, 16 * c, j0), s0);
            const float t = hsum8((v8)fold16(s0));
            sc[h][j0] = t;
            mx[h] = std::max(mx[h], t);
        }
}

// values_fast's job, C chunks of 16 values.
template <int G, int C, typename R, typename Read = AsStored16>
WIDE_TARGET __attribute__((noinline)) void values_wide(const float* const* w, const R* v, int64_t stride, int64_t n,
                                                      float* const* acc, Read read = {}) {
    if (n <= 0) return;            // as in values_fast: the sums stay in registers
    __m512 sum[G][C];
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) sum[h][c] = _mm512_loadu_ps(acc[h] + 16 * c);
    for (int64_t j = 0; j < n; j++, v += stride, read.next()) {
        __m512 wj[G];
        for (int h = 0; h < G; h++) wj[h] = _mm512_set1_ps(w[h][j]);
        for (int c = 0; c < C; c++) {
            const __m512 x = read(v + 16 * c, 16 * c);
            for (int h = 0; h < G; h++) sum[h][c] = _mm512_fmadd_ps(wj[h], x, sum[h][c]);
        }
    }
    for (int h = 0; h < G; h++)
        for (int c = 0; c < C; c++) _mm512_storeu_ps(acc[h] + 16 * c, sum[h][c]);
}

// Whether the vector kernel reads this pool's keys and values in place (int8 in the AVX2 and
// AVX-512 builds, its V groups a multiple of 8 values) rather than through the scratch.
template <typename KF, typename VF, bool FAST>
constexpr bool INT8_IN_PLACE = FAST && std::is_same_v<KF, ChannelScaledInt8> && std::is_same_v<VF, TokenScaled<Int8Code>>;
// fp8 too in the wide loops (K and V per-token scales, their groups a multiple of 16 values): a
// 16-row decode step over 256 positions in 30 layers' pools took 2x int8's time through the
// scratch (widened, then scaled in a second pass).
template <typename KF, typename VF, bool FAST>
constexpr bool FP8_IN_PLACE = FAST && std::is_same_v<KF, TokenScaled<Fp8Code>> && std::is_same_v<VF, TokenScaled<Fp8Code>>;
template <typename KF, typename VF, bool FAST>
constexpr bool CODES_IN_PLACE = INT8_IN_PLACE<KF, VF, FAST> || FP8_IN_PLACE<KF, VF, FAST>;

template <int G, int HD, bool FAST, bool WIDE, typename R>
ALWAYS_INLINE void scores_block(const float* qs, const R* k, int64_t stride, int64_t hd, int64_t n, float* const* sc,
                                float* mx) {
    if constexpr (WIDE) { if (hd % 16 == 0) { scores_wide<G, HD>(qs, k, stride, hd, n, sc, mx); return; } }   // = `wide`
    if constexpr (FAST) scores_fast<G, HD>(qs, k, stride, hd, n, sc, mx);
    else scores_base<G, HD>(qs, k, stride, hd, n, sc, mx);
}
template <int G, int C, bool FAST, typename R>
ALWAYS_INLINE void values_block(const float* const* w, const R* v, int64_t stride, int64_t n, float* const* acc) {
    if constexpr (FAST) values_fast<G, C>(w, v, stride, n, acc);
    else values_base<G, C>(w, v, stride, n, acc);
}

// f(g, h0, heads) for the query heads of a row in groups of up to 3 that share KV head g:
// heads h0..h0+G-1, G given as std::integral_constant<int, G> (the inner loops' register count).
template <typename F>
ALWAYS_INLINE void head_groups(int64_t groups, int64_t per, F&& f) {
    for (int64_t g = 0; g < groups; g++)
        for (int64_t h0 = g * per; h0 < (g + 1) * per; h0 += 3) {
            const int64_t left = (g + 1) * per - h0;
            if (left >= 3) f(g, h0, std::integral_constant<int, 3>{});
            else if (left == 2) f(g, h0, std::integral_constant<int, 2>{});
            else f(g, h0, std::integral_constant<int, 1>{});
        }
}

// The values' pass over one head group's hd sums, W values a chunk (8, or 16 in the wide
// loops): f(C, c, acc) for 4 chunks from chunk c at a time, then one, acc pointing at chunk c
// of each head's sums (C a std::integral_constant: the loops' register count).
template <int G, int W, typename F>
ALWAYS_INLINE void value_chunks(int64_t hd, float* acc_all, int64_t h0, F&& f) {
    float* acc[G];
    for (int64_t c = 0, nc = hd / W; c < nc;) {
        for (int h = 0; h < G; h++) acc[h] = acc_all + (h0 + h) * hd + W * c;
        if (c + 4 <= nc) { f(std::integral_constant<int, 4>{}, c, acc); c += 4; }
        else { f(std::integral_constant<int, 1>{}, c, acc); c += 1; }
    }
}

// The query heads of one row over positions first..L-1, in groups of up to 3 heads that share a
// KV head (per_kv mode: every KV head of the row in turn), so each key and value row is read once
// per group, and the sums of 3 heads x 4 chunks stay in AVX2's 16 registers. HD: the head size
// at compile time (a multiple of 8), 0 for any multiple of 8 at run time.
template <int HD, typename KF, typename VF, bool FAST, bool WIDE>
ALWAYS_INLINE void attend_row(const RowArgs& a) {
    const int64_t hd = HD ? HD : a.hd, nv = hd / 8, n = a.L - a.first, ls = n + 8;
    float* acc_all = a.scores + a.heads * ls;                     // (heads, hd) running sums of e * v
    float* buf = acc_all + a.heads * hd;                          // (block_size, hd or n_kv * hd) widened rows
    float* qs = buf + a.block_size * (a.per_kv ? a.n_kv * hd : hd);    // (heads, hd) queries x scale
    const int64_t groups = a.per_kv ? a.heads / a.per_kv : 1, per = a.per_kv ? a.per_kv : a.heads;
    const int64_t head_calls = groups * ((per + 2) / 3);          // head groups a block is worked in (head_groups)
    const int64_t key_parts = head_calls * ((a.block_size + PIECE - 1) / PIECE);   // key_pieces' calls a block
    float mx[64];
    for (int64_t hh = 0; hh < a.heads; hh++) {
        mx[hh] = -INFINITY;
        for (int64_t i = 0; i < nv; i++) store8(qs + hh * hd + 8 * i, load8(a.q + hh * hd + 8 * i) * splat8(a.scale));
    }
    // int8 in place: V's scale groups a multiple of 8 values (paged_kv: 32, or hd)
    // (the wide loops read 16 values at a time: groups of 16; else the scratch, the same bits)
    const bool wide = WIDE && hd % 16 == 0;
    const int64_t step = wide ? 16 : 8;
    const bool in_place = (INT8_IN_PLACE<KF, VF, FAST> && a.v.group % step == 0) ||
                          (FP8_IN_PLACE<KF, VF, FAST> && wide && a.v.group % 16 == 0 && a.k.group % 16 == 0);
    // scores[hh][p - first] = q_hh . k_p * scale, block by block through the table
    for (int64_t b = a.first / a.block_size, i = 0; i < KEYS_AHEAD; i++) prefetch_block<KF>(a, a.k, b + i, hd);
    for (int64_t p = a.first; p < a.L;) {
        const int64_t b = p / a.block_size, end = std::min(a.L, (b + 1) * a.block_size);
        if constexpr (CODES_IN_PLACE<KF, VF, FAST>) {
            if (in_place) {
                using Code = typename KF::E;                                         // int8_t, or fp8's uint8_t
                const int64_t tok = (a.table[b] * a.block_size + p % a.block_size) * a.n_kv + a.g;   // first row's token, head
                const Code* kc = static_cast<const Code*>(a.k.data) + tok * hd;
                int64_t part = 0;
                head_groups(groups, per, [&](int64_t g, int64_t h0, auto heads) {
                    constexpr int G = decltype(heads)::value;
                    const int64_t at = a.per_kv ? g * hd : 0, stride = a.n_kv * hd;
                    key_pieces<KF, VF>(a, b, hd, end - p, part, key_parts, [&](int64_t j, int64_t n) {
                        float* sc[G];
                        for (int h = 0; h < G; h++) sc[h] = a.scores + (h0 + h) * ls + (p + j - a.first);
                        const Code* k = kc + at + j * stride;
                        if constexpr (INT8_IN_PLACE<KF, VF, FAST>) {
                            const float* ks = a.k.scale + (a.table[b] * a.n_kv + a.g) * hd + at;   // the block's, every row
                            if constexpr (WIDE) {
                                if (wide) {
                                    scores_wide<G, HD>(qs + h0 * hd, k, stride, hd, n, sc, mx + h0, KeysI8x16{ks});
                                    return;
                                }
                            }
                            scores_fast<G, HD>(qs + h0 * hd, k, stride, hd, n, sc, mx + h0, KeysI8{ks});
                        } else if constexpr (WIDE) {   // fp8 (wide only): each key's scales, n_kv * groups floats apart
                            const int64_t groups_k = hd / a.k.group;
                            const float* ks = a.k.scale + (tok + j * a.n_kv) * groups_k + (a.per_kv ? g * groups_k : 0);
                            scores_wide<G, HD>(qs + h0 * hd, k, stride, hd, n, sc, mx + h0,
                                               KeysFp8x16(ks, a.n_kv * groups_k, hd, a.k.group));
                        }
                    });
                });
                p = end;
                continue;
            }
        }
        int64_t stride;
        const auto* kb = Src<KF>::rows(a, a.k, b, p % a.block_size, end - p, buf, stride);
        int64_t part = 0;
        head_groups(groups, per, [&](int64_t g, int64_t h0, auto heads) {
            constexpr int G = decltype(heads)::value;
            key_pieces<KF, VF>(a, b, hd, end - p, part, key_parts, [&](int64_t j, int64_t n) {
                float* sc[G];
                for (int h = 0; h < G; h++) sc[h] = a.scores + (h0 + h) * ls + (p + j - a.first);
                scores_block<G, HD, FAST, WIDE>(qs + h0 * hd, kb + (a.per_kv ? g * hd : 0) + j * stride, stride, hd, n, sc,
                                                mx + h0);
            });
        });
        p = end;
    }
    // e^(s - max) per head, summed in 8 lanes
    float inv[64];
    for (int64_t hh = 0; hh < a.heads; hh++) {
        float* sc_h = a.scores + hh * ls;
        v8 vsum = splat8(0.f);
        int64_t j = 0;
        if constexpr (WIDE) {      // 16 at a time: exp8's bits lane for lane, summed in exp8's order
            for (; j + 16 <= n; j += 16) {
                v16 x; std::memcpy(&x, sc_h + j, sizeof x);
                const v16 e = expv<v16, v16i>(x - mx[hh]);
                std::memcpy(sc_h + j, &e, sizeof e);
                vsum += __builtin_shufflevector(e, e, 0, 1, 2, 3, 4, 5, 6, 7);
                vsum += __builtin_shufflevector(e, e, 8, 9, 10, 11, 12, 13, 14, 15);
            }
        }
        for (; j + 8 <= n; j += 8) {
            const v8 e = exp8(load8(sc_h + j) - splat8(mx[hh]));
            store8(sc_h + j, e);
            vsum += e;
        }
        if (j < n) {
            float tail[8];
            for (int k = 0; k < 8; k++) tail[k] = j + k < n ? sc_h[j + k] - mx[hh] : -INFINITY;
            v8 e = exp8(load8(tail));
            for (int k = 0; k < 8; k++) if (j + k >= n) e[k] = 0.f;
            for (int k = 0; j + k < n; k++) sc_h[j + k] = e[k];
            vsum += e;
        }
        const float sum = hsum8(vsum);
        inv[hh] = 1.0f / sum;
        if (a.ml) { a.ml[2 * hh] = mx[hh]; a.ml[2 * hh + 1] = sum; }
        for (int64_t i = 0; i < hd; i++) acc_all[hh * hd + i] = 0.f;
    }
    // out_hh = sum_p e_p v_p / sum: each value row read once per group of heads, 4 chunks of 8 at a time
    for (int64_t p = a.first; p < a.L;) {
        const int64_t b = p / a.block_size, end = std::min(a.L, (b + 1) * a.block_size);
        if constexpr (CODES_IN_PLACE<KF, VF, FAST>) {
            if (in_place) {
                using Code = typename VF::E;
                const int64_t tok = (a.table[b] * a.block_size + p % a.block_size) * a.n_kv + a.g;   // first row's token, head
                const int64_t groups_per_head = hd / a.v.group;
                const Code* vc = static_cast<const Code*>(a.v.data) + tok * hd;
                const float* vs = a.v.scale + tok * groups_per_head;
                int64_t part = 0;
                head_groups(groups, per, [&](int64_t g, int64_t h0, auto heads) {
                    constexpr int G = decltype(heads)::value;
                    prefetch_block<VF>(a, a.v, b + 1, hd, part++, head_calls);
                    const float* w[G];
                    for (int h = 0; h < G; h++) w[h] = a.scores + (h0 + h) * ls + (p - a.first);
                    const Code* v = vc + (a.per_kv ? g * hd : 0);
                    const float* s = vs + (a.per_kv ? g * groups_per_head : 0);
                    const int64_t stride = a.n_kv * hd, s_stride = a.n_kv * groups_per_head;
                    if constexpr (WIDE) {
                        if (wide) {
                            value_chunks<G, 16>(hd, acc_all, h0, [&](auto C, int64_t c, float* const* acc) {
                                values_wide<G, decltype(C)::value>(w, v + 16 * c, stride, end - p, acc, ValuesI8x16(s, s_stride, 16 * c, a.v.group));
                            });
                            return;
                        }
                    }
                    if constexpr (INT8_IN_PLACE<KF, VF, FAST>)      // fp8 is read in place by the wide loops only
                        value_chunks<G, 8>(hd, acc_all, h0, [&](auto C, int64_t c, float* const* acc) {
                            values_fast<G, decltype(C)::value>(w, v + 8 * c, stride, end - p, acc, ValuesI8(s, s_stride, 8 * c, a.v.group));
                        });
                });
                p = end;
                continue;
            }
        }
        int64_t stride;
        const auto* vb = Src<VF>::rows(a, a.v, b, p % a.block_size, end - p, buf, stride);
        int64_t part = 0;
        head_groups(groups, per, [&](int64_t g, int64_t h0, auto heads) {
            constexpr int G = decltype(heads)::value;
            prefetch_block<VF>(a, a.v, b + 1, hd, part++, head_calls);
            const float* w[G];
            for (int h = 0; h < G; h++) w[h] = a.scores + (h0 + h) * ls + (p - a.first);
            const auto* v = vb + (a.per_kv ? g * hd : 0);
            if constexpr (WIDE) {
                if (wide) {
                    value_chunks<G, 16>(hd, acc_all, h0, [&](auto C, int64_t c, float* const* acc) {
                        values_wide<G, decltype(C)::value>(w, v + 16 * c, stride, end - p, acc);
                    });
                    return;
                }
            }
            value_chunks<G, 8>(hd, acc_all, h0, [&](auto C, int64_t c, float* const* acc) {
                values_block<G, decltype(C)::value, FAST>(w, v + 8 * c, stride, end - p, acc);
            });
        });
        p = end;
    }
    for (int64_t hh = 0; hh < a.heads; hh++)
        for (int64_t i = 0; i < nv; i++) store8(a.out + hh * hd + 8 * i, load8(acc_all + hh * hd + 8 * i) * splat8(inv[hh]));
}

// Head sizes the vector kernel does not take (not a multiple of 8, or over 256), or more than
// 64 heads per KV head: plain loops, one head at a time, one widened row at a time.
template <typename KF, typename VF>
inline void attend_scalar(const RowArgs& a) {
    const int64_t n = a.L - a.first;
    float* buf = a.scores + a.heads * (n + 8);                    // one widened row
    int64_t stride;
    for (int64_t hh = 0; hh < a.heads; hh++) {
        const float* q = a.q + hh * a.hd;
        float* out = a.out + hh * a.hd;
        float mx = -INFINITY;
        for (int64_t p = a.first; p < a.L; p++) {
            const float* k = KF::rows(a, a.k, p / a.block_size, p % a.block_size, 1, buf, stride);
            float s = 0.f;
            for (int64_t d = 0; d < a.hd; d++) s += q[d] * a.scale * k[d];
            a.scores[p - a.first] = s;
            mx = std::max(mx, s);
        }
        float sum = 0.f;
        for (int64_t j = 0; j < n; j++) { a.scores[j] = std::exp(a.scores[j] - mx); sum += a.scores[j]; }
        for (int64_t d = 0; d < a.hd; d++) out[d] = 0.f;
        for (int64_t p = a.first; p < a.L; p++) {
            const float* v = VF::rows(a, a.v, p / a.block_size, p % a.block_size, 1, buf, stride);
            for (int64_t d = 0; d < a.hd; d++) out[d] += a.scores[p - a.first] * v[d];
        }
        for (int64_t d = 0; d < a.hd; d++) out[d] /= sum;
        if (a.ml) { a.ml[2 * hh] = mx; a.ml[2 * hh + 1] = sum; }
    }
}

// Whether the vector kernel (attend_row) takes this head size and number of heads; the plain
// loops (attend_scalar) read one KV head per task only, so the whole-row tasks need this too.
inline bool vector_kernel_takes(int64_t hd, int64_t heads) { return hd % 8 == 0 && hd <= 256 && heads <= 64; }

template <typename KF, typename VF, bool FAST, bool WIDE>
ALWAYS_INLINE void attend_fmt(const RowArgs& a) {
    if (!vector_kernel_takes(a.hd, a.heads)) { attend_scalar<KF, VF>(a); return; }
    switch (a.hd) {
        case 64: attend_row<64, KF, VF, FAST, WIDE>(a); return;
        case 128: attend_row<128, KF, VF, FAST, WIDE>(a); return;
        case 256: attend_row<256, KF, VF, FAST, WIDE>(a); return;
        default: attend_row<0, KF, VF, FAST, WIDE>(a); return;
    }
}

// int8: K scaled per block per channel, V per token; fp8: both per token (paged_kv.py)
enum class PoolType { F32, F16, BF16, INT8, FP8 };

template <bool FAST, bool WIDE = false>
ALWAYS_INLINE void attend_any(const RowArgs& a, PoolType type) {
    switch (type) {
        case PoolType::F32: attend_fmt<F32, F32, FAST, WIDE>(a); return;
        case PoolType::F16: attend_fmt<F16, F16, FAST, WIDE>(a); return;
        case PoolType::BF16: attend_fmt<BF16, BF16, FAST, WIDE>(a); return;
        case PoolType::INT8: attend_fmt<ChannelScaledInt8, TokenScaled<Int8Code>, FAST, WIDE>(a); return;
        case PoolType::FP8: attend_fmt<TokenScaled<Fp8Code>, TokenScaled<Fp8Code>, FAST, WIDE>(a); return;
    }
}

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl"))) void attend_avx512(const RowArgs& a, PoolType t) {
    attend_any<true, true>(a, t);
}
__attribute__((target("avx2,fma,f16c"))) void attend_avx2(const RowArgs& a, PoolType t) { attend_any<true>(a, t); }
void attend_base(const RowArgs& a, PoolType t) { attend_any<false>(a, t); }

// Quantized rows, written as paged_kv.py's stores write them (the reference; a test compares the
// pools' bytes): a value over its scale, rounded to nearest even and clamped (int8) or cast (fp8).
constexpr float MIN_SCALE = 1e-12f;     // paged_kv.MIN_SCALE: an all-zero vector still gets a scale

// To nearest, ties to even, as torch.round (|x| < 2^22: the codes' range and far beyond), then
// clamped as the stores clamp.
ALWAYS_INLINE int8_t int8_code(float x) {
    const float r = (x + 0x1.8p23f) - 0x1.8p23f;
    return static_cast<int8_t>(static_cast<int>(std::min(std::max(r, -127.f), 127.f)));
}

// One int8 K block's columns c0..c0+w-1 requantized: `window` (bs, CH) gets its earlier tokens
// (rows before off, code x scale), the n new rows x (stride `row`), zeros after; then each
// column's scale and codes. Compiled for AVX2 and the baseline (loops the compiler vectorizes;
// every operation is exact or correctly rounded, so both give the same bits).
__attribute__((target_clones("avx2", "default")))
void requantize_columns(int8_t* blk, float* sc, const float* x, float* window, int64_t off, int64_t n, int64_t bs,
                        int64_t row, int64_t w, int64_t CH) {
    for (int64_t r = 0; r < bs; r++) {
        float* wr = window + r * CH;
        if (r < off) for (int64_t c = 0; c < w; c++) wr[c] = static_cast<float>(blk[r * row + c]) * sc[c];
        else if (r < off + n) for (int64_t c = 0; c < w; c++) wr[c] = x[(r - off) * row + c];
        else for (int64_t c = 0; c < w; c++) wr[c] = 0.f;
    }
    float amax[64];
    for (int64_t c = 0; c < w; c++) amax[c] = 0.f;
    for (int64_t r = 0; r < bs; r++)
        for (int64_t c = 0; c < w; c++) amax[c] = std::max(amax[c], std::fabs(window[r * CH + c]));
    for (int64_t c = 0; c < w; c++) sc[c] = std::max(amax[c] / 127.f, MIN_SCALE);
    for (int64_t r = 0; r < bs; r++)
        for (int64_t c = 0; c < w; c++) blk[r * row + c] = int8_code(window[r * CH + c] / sc[c]);
}

// The low byte of each of 8 int32 lanes, packed into the low 8 bytes (a truncating narrowing)
__attribute__((target("avx2"))) ALWAYS_INLINE __m128i low_bytes8(__m256i v) {
    const __m256i low = _mm256_shuffle_epi8(v, _mm256_setr_epi8(
        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
}

// int8_code of 8 floats: the same float steps (the rounding constant added and taken off, the
// clamp with std::max / std::min's NaN rule: a NaN passes through), then the truncating
// conversion and its low byte, as static_cast<int> and static_cast<int8_t> (a NaN: 0x80000000 ->
// 0), packed into the low 8 bytes
__attribute__((target("avx2"))) ALWAYS_INLINE __m128i int8_codes8(__m256 x) {
    const __m256 magic = _mm256_set1_ps(0x1.8p23f);
    const __m256 r = _mm256_sub_ps(_mm256_add_ps(x, magic), magic);
    const __m256 c = _mm256_min_ps(_mm256_set1_ps(127.f), _mm256_max_ps(_mm256_set1_ps(-127.f), r));
    return low_bytes8(_mm256_cvttps_epi32(c));
}

// requantize_columns with AVX2, 8 channels at a time, the same bytes and scales: the maximum
// over the block's earlier tokens (code x scale) and the new rows, the scale over 127 (max with
// std::max's order, so a NaN is passed over as there), each row's value over it, int8_code.
// Where 8 channels' scales come out bit for bit as they were, their earlier codes are left in
// place: code x scale / scale rounds back to the code exactly (the two roundings move it by
// under 2^-16). A code of -128 (not one the stores write) makes the maximum 128 x scale, so its
// scale grows and it is requantized (clamped to -127) as the store does.
// A decode step writes one row per block; requantizing the block whole took ~17 us of a 16-row
// SmolLM2 step's paged_attention (~45 us with the V rows) a layer (Zen 4, 2026-12-06).
__attribute__((target("avx2"))) void requantize_columns_avx2(int8_t* blk, float* sc, const float* x, float* window,
                                                            int64_t off, int64_t n, int64_t bs, int64_t row, int64_t w,
                                                            int64_t CH) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    int64_t c = 0;
    for (; c + 8 <= w; c += 8) {
        const __m256 s = _mm256_loadu_ps(sc + c);
        __m256 amax = _mm256_setzero_ps();
        for (int64_t r = 0; r < off; r++) {
            const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + r * row + c));
            const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
            amax = _mm256_max_ps(_mm256_and_ps(v, abs_mask), amax);    // std::max(amax, |v|)
        }
        for (int64_t r = 0; r < n; r++)
            amax = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + r * row + c), abs_mask), amax);
        const __m256 s2 = _mm256_max_ps(_mm256_set1_ps(MIN_SCALE), _mm256_div_ps(amax, _mm256_set1_ps(127.f)));
        _mm256_storeu_ps(sc + c, s2);
        if (_mm256_movemask_ps(_mm256_cmp_ps(s2, s, _CMP_EQ_OQ)) != 0xff)
            for (int64_t r = 0; r < off; r++) {
                int8_t* dst = blk + r * row + c;
                const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(dst));
                const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), s);
                _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), int8_codes8(_mm256_div_ps(v, s2)));
            }
        for (int64_t r = 0; r < n; r++)
            _mm_storel_epi64(reinterpret_cast<__m128i*>(blk + (off + r) * row + c),
                             int8_codes8(_mm256_div_ps(_mm256_loadu_ps(x + r * row + c), s2)));
        for (int64_t r = off + n; r < bs; r++) std::memset(blk + r * row + c, 0, 8);     // int8_code(0 / s2)
    }
    if (c < w)          // the last channels (fewer than 8) as requantize_columns does them
        requantize_columns(blk + c, sc + c, x + c, window, off, n, bs, row, w - c, CH);
}

// The largest |value| of a token's group (a multiple of 8 values), a NaN passed over as
// std::max passes it in write_token_scaled.
__attribute__((target("avx2"))) float group_amax_avx2(const float* src, int64_t group) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int64_t j = 0; j < group; j += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + j), abs_mask), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// c10::Float8_e4m3fn's rounding of 8 floats (fp8e4m3fn_from_fp32_value) in AVX2 integer steps,
// the 8 codes packed into the low 8 bytes: |x| from 480 up saturates to 0x7e (a NaN: 0x7f); under
// 2^-6 (fp8's subnormals) the float sum with 2^14 rounds the mantissa; else the exponent is
// rebiased with the rounding bias (0x7ffff, plus the mantissa's odd bit: to nearest even) and a
// carry into 0x7f saturates to 0x7e; then the sign. A write's values are at most 448 times their
// scale, so the saturation (which older torch versions did otherwise) is never reached from here.
// A 16-row SmolLM2 step's fp8 writes one value at a time through c10 took ~25 us a layer (Zen 4).
__attribute__((target("avx2"))) ALWAYS_INLINE __m128i fp8_codes8(__m256 x) {
    const __m256i bits = _mm256_castps_si256(x), sign = _mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN));
    const __m256i a = _mm256_xor_si256(bits, sign);                           // |x|'s bits, under 2^31
    const __m256i denorm = _mm256_set1_epi32(141 << 23);
    const __m256i small = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(denorm))), denorm);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(1));
    __m256i normal = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(a, _mm256_set1_epi32((int)(((uint32_t)(7 - 127) << 23) + 0x7FFFF))), odd), 20);
    normal = _mm256_and_si256(normal, _mm256_set1_epi32(0xff));
    normal = _mm256_add_epi32(normal, _mm256_cmpeq_epi32(normal, _mm256_set1_epi32(0x7f)));    // 0x7f -> 0x7e
    const __m256i big = _mm256_sub_epi32(_mm256_set1_epi32(0x7e),
                                         _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));    // NaN: 0x7f
    __m256i r = _mm256_blendv_epi8(normal, small, _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), a));
    r = _mm256_blendv_epi8(r, big, _mm256_cmpgt_epi32(a, _mm256_set1_epi32((1087 << 20) - 1)));
    return low_bytes8(_mm256_or_si256(r, _mm256_srli_epi32(sign, 24)));
}

// One token's group of int8 or fp8 values (a multiple of 8) as write_token_scaled quantizes it:
// the maximum |value|, the scale over 127 or 448, each value over it, int8_code or c10's rounding.
template <bool FP8>
__attribute__((target("avx2"))) void quantize_group_avx2(void* dst, float* scale, const float* src, int64_t group) {
    const float s = std::max(group_amax_avx2(src, group) / (FP8 ? 448.f : 127.f), MIN_SCALE);
    *scale = s;
    for (int64_t j = 0; j < group; j += 8) {
        const __m256 v = _mm256_div_ps(_mm256_loadu_ps(src + j), _mm256_set1_ps(s));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(dst) + j), FP8 ? fp8_codes8(v) : int8_codes8(v));
    }
}

using RowKernel = void (*)(const RowArgs&, PoolType);
struct Kernels {
    RowKernel attend;
    void (*widen_f16)(float*, const uint16_t*, int64_t, int64_t, int64_t);
    void (*narrow_f16)(uint16_t*, const float*, int64_t, const int64_t*, int64_t, int64_t);
    void (*narrow_bf16)(uint16_t*, const float*, int64_t, const int64_t*, int64_t, int64_t);
    void (*widen_fp8)(float*, const uint8_t*, int64_t);
    void (*widen_i8_scaled)(float*, const int8_t*, const float*, int64_t, int64_t, int64_t, int64_t, int64_t);
    // the int8 stores' writes (below): an int8 K block's channels requantized; a token's group of int8 V
    void (*requantize)(int8_t*, float*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
    void (*quantize_group_int8)(void*, float*, const float*, int64_t);        // nullptr: the scalar loop
    void (*quantize_group_fp8)(void*, float*, const float*, int64_t);         // nullptr: the scalar loop
};

// AVX-512 only adds registers here (32 instead of 16); LOCALRUN_ISA=avx2|avxvnni|ref forces a
// narrower kernel (avxvnni: the AVX2 one, as on the CPUs it stands for).
const Kernels& kernels() {
    static const Kernels chosen = [] {
        const char* env = std::getenv("LOCALRUN_ISA");
        const std::string forced = env ? env : "";
        __builtin_cpu_init();
        const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
        if (forced == "ref" || !avx2)
            return Kernels{&attend_base, &widen_f16_bits, &narrow_f16_base, &narrow_bf16_base, &widen_fp8_base,
                           &widen_i8_scaled_base, &requantize_columns, nullptr, nullptr};
        // every AVX2 CPU has F16C
        return Kernels{avx512 && (forced.empty() || forced == "avx512") ? &attend_avx512 : &attend_avx2, &widen_f16_f16c,
                       &narrow_f16_f16c, &narrow_bf16_avx2, &widen_fp8_avx2, &widen_i8_scaled_avx2,
                       &requantize_columns_avx2, &quantize_group_avx2<false>, &quantize_group_avx2<true>};
    }();
    return chosen;
}

// Below this much work (query heads x positions x head size) a call runs on the calling thread:
// waking the others and splitting heads costs more (Zen 3, 2 threads: one SmolLM2 decode row
// over 160 positions takes 35 us alone and 40 us split; at 300 positions the two are even).
constexpr int64_t SERIAL_WORK = 1 << 17;

constexpr int64_t CHUNK = 512;   // positions per task of one long row (a multiple of every block size we use)

// The first blocks of a task's keys, asked into L2 when the task before it on the same thread
// starts: a row's own prefetches run ahead of its keys' pass only, so each task began by waiting
// for its first blocks from memory. bytes: a position's read (every KV head's values in a
// whole-row task, else KV head g's), elem: the pool's element size. The scales of a quantized
// pool are left to the row's own prefetches. 30 SmolLM2-shaped layers' float16 pools, one process
// alternating (Zen 4, 2 threads; with KEYS_AHEAD 1 against 2 before): 16 rows x 256 positions 0.92-0.93
// of the time, 32 x 256 0.92, 16 x 1024 0.94, 4 x 256 0.96, TinyLlama's and gemma-3's heads 0.97;
// forced AVX2 0.93. The same bits (prefetches change no value).
constexpr int64_t NEXT_TASK_BLOCKS = 2;
inline void prefetch_row_start(const char* pool, int64_t elem, const int64_t* table, int64_t first, int64_t end,
                               int64_t block_size, int64_t n_kv, int64_t hd, int64_t g, bool whole) {
    const int64_t bytes = (whole ? n_kv * hd : hd) * elem, row_bytes = n_kv * hd * elem;
    for (int64_t b = first / block_size, i = 0; i < NEXT_TASK_BLOCKS && b * block_size < end; b++, i++) {
        const int64_t p0 = std::max(first, b * block_size), p1 = std::min(end, (b + 1) * block_size);
        const char* row = pool + (table[b] * block_size + p0 % block_size) * row_bytes + (whole ? 0 : g * hd * elem);
        for (int64_t p = p0; p < p1; p++, row += row_bytes)
            for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(row + c, 0, 1);
    }
}

// Values a thread's share of a quantized store's write takes at least (at::parallel_for's grain):
// a decode step's few rows are written on the calling thread, ~1-2 us, less than waking another.
constexpr int64_t WRITE_GRAIN = 4096;

// One scale per `group` values of a token's head (TokenScaledStore): int8 or fp8 codes.
template <bool FP8>
void write_token_scaled(void* data, float* scale, int64_t group, const float* x, const int64_t* slots, int64_t T,
                        int64_t n_kv, int64_t hd) {
    const float qmax = FP8 ? 448.f : 127.f;      // float8_e4m3fn's largest finite value, or int8's
    const int64_t groups = n_kv * hd / group;     // scales per token
    const auto vector = group % 8 ? nullptr : FP8 ? kernels().quantize_group_fp8 : kernels().quantize_group_int8;
    at::parallel_for(0, T * groups, WRITE_GRAIN / group, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t t = i / groups, gi = i % groups, at_ = slots[t] * groups + gi;
            const float* src = x + t * groups * group + gi * group;
            if (vector) {
                vector(static_cast<uint8_t*>(data) + at_ * group, scale + at_, src, group);
                continue;
            }
            float amax = 0.f;
            for (int64_t j = 0; j < group; j++) amax = std::max(amax, std::fabs(src[j]));
            const float s = std::max(amax / qmax, MIN_SCALE);
            scale[at_] = s;
            if (FP8) {
                uint8_t* dst = static_cast<uint8_t*>(data) + at_ * group;
                for (int64_t j = 0; j < group; j++) dst[j] = c10::Float8_e4m3fn(src[j] / s).x;
            } else {
                int8_t* dst = static_cast<int8_t*>(data) + at_ * group;
                for (int64_t j = 0; j < group; j++) dst[j] = int8_code(src[j] / s);
            }
        }
    });
}

// int8 with one scale per block per channel (ChannelScaledStore): each block a row lands in is
// requantized whole: its earlier tokens (code x scale), the sequence's new rows in it, zeros
// after; the scale is the block's largest |value| per channel over 127. Rows of one sequence are
// consecutive in a call, so the rows landing in one block are a run of rows.
void write_channel_scaled(int8_t* data, float* scale, const float* x, const int64_t* slots, const int64_t* row_seq,
                          int64_t T, int64_t n_kv, int64_t hd, int64_t bs) {
    const int64_t row = n_kv * hd;
    std::vector<std::array<int64_t, 2>> runs;          // [first row, end row) per block written
    for (int64_t t0 = 0, t1; t0 < T; t0 = t1) {
        for (t1 = t0 + 1; t1 < T && row_seq[t1] == row_seq[t0] && slots[t1] == slots[t1 - 1] + 1 &&
                          slots[t1] / bs == slots[t0] / bs; t1++) {}
        runs.push_back({t0, t1});
    }
    for (size_t a = 0; a < runs.size(); a++)
        for (size_t b = a + 1; b < runs.size(); b++)
            TORCH_CHECK(slots[runs[a][0]] / bs != slots[runs[b][0]] / bs,
                        "localrun::paged_attention: two sequences' rows write one int8 K block");
    // tasks: (run, channel chunk); a channel's scale depends on its own column only
    constexpr int64_t CH = 64;
    const int64_t chunks = (row + CH - 1) / CH;
    const auto requantize = kernels().requantize;
    at::parallel_for(0, (int64_t)runs.size() * chunks, std::max<int64_t>(1, WRITE_GRAIN / (bs * CH)), [&](int64_t i0, int64_t i1) {
        std::vector<float> window(bs * CH);
        for (int64_t i = i0; i < i1; i++) {
            const int64_t t0 = runs[i / chunks][0], n = runs[i / chunks][1] - t0;
            const int64_t c0 = i % chunks * CH, b = slots[t0] / bs;
            requantize(data + b * bs * row + c0, scale + b * row + c0, x + t0 * row + c0, window.data(),
                               slots[t0] % bs, n, bs, row, std::min(CH, row - c0), CH);
        }
    });
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slots_in, const at::Tensor& tables_in,
                           const at::Tensor& row_seq_in, const at::Tensor& row_len_in, int64_t block_size, int64_t window,
                           const std::optional<at::Tensor>& k_scale_in, const std::optional<at::Tensor>& v_scale_in) {
    TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "localrun::paged_attention: K and V pools of one type");
    const at::ScalarType pool_type = k_pool.scalar_type();
    TORCH_CHECK(pool_type == at::kFloat || pool_type == at::kHalf || pool_type == at::kBFloat16 || pool_type == at::kChar ||
                pool_type == at::kByte, "localrun::paged_attention: pools must be float32, float16, bfloat16, int8 or fp8 bytes");
    const PoolType type = pool_type == at::kFloat ? PoolType::F32 : pool_type == at::kHalf ? PoolType::F16
                        : pool_type == at::kBFloat16 ? PoolType::BF16 : pool_type == at::kChar ? PoolType::INT8 : PoolType::FP8;
    const bool quantized = type == PoolType::INT8 || type == PoolType::FP8;
    // q, and k and v for a 16-bit or float32 pool, may be views with rows apart (decode_block's
    // narrows of the fused heads): each row's heads contiguous is enough (no copy per call)
    const auto rows_of = [](const at::Tensor& x, bool strided_ok) {
        return strided_ok && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
    };
    const at::Tensor q = rows_of(q_in, true), k = rows_of(k_in, !quantized), v = rows_of(v_in, !quantized);
    const at::Tensor slots = slots_in.contiguous(), tables = tables_in.contiguous();
    const at::Tensor row_seq = row_seq_in.contiguous(), row_len = row_len_in.contiguous();
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "localrun::paged_attention: q (T,H,hd), k and v (T,n_kv,hd)");
    for (const at::Tensor* t : {&q, &k, &v})
        TORCH_CHECK(t->scalar_type() == at::kFloat, "localrun::paged_attention: q, k and v must be float32");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() && k_pool.dim() == 3,
                "localrun::paged_attention: pools must be contiguous (slots, n_kv, hd)");
    for (const at::Tensor* t : {&slots, &tables, &row_seq, &row_len})
        TORCH_CHECK(t->scalar_type() == at::kLong, "localrun::paged_attention: index tensors must be int64");
    const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), n_kv = k_pool.size(1);
    TORCH_CHECK(k.size(0) == T && k.size(1) == n_kv && k.size(2) == hd && H % n_kv == 0 && k_pool.size(2) == hd,
                "localrun::paged_attention: shapes disagree");
    TORCH_CHECK(window >= 0, "localrun::paged_attention: window must be >= 0");
    TORCH_CHECK(slots.numel() == T && row_seq.numel() == T && row_len.numel() == T && tables.dim() == 2,
                "localrun::paged_attention: one slot, sequence and length per row");
    const int64_t num_slots = k_pool.size(0), max_blocks = tables.size(1), row_bytes = n_kv * hd;
    TORCH_CHECK(quantized == (k_scale_in.has_value() && v_scale_in.has_value()),
                "localrun::paged_attention: int8 and fp8 pools take k_scale and v_scale, the others none");
    at::Tensor k_scale, v_scale;
    int64_t k_group = 0, v_group = 0;
    if (quantized) {
        k_scale = *k_scale_in, v_scale = *v_scale_in;      // written in place with the rows
        TORCH_CHECK(k_scale.is_contiguous() && v_scale.is_contiguous(), "localrun::paged_attention: scales must be contiguous");
        const auto token_group = [&](const at::Tensor& s) {      // (slots, n_kv, hd / group)
            TORCH_CHECK(s.scalar_type() == at::kFloat && s.dim() == 3 && s.size(0) == num_slots && s.size(1) == n_kv &&
                        s.size(2) >= 1 && hd % s.size(2) == 0, "localrun::paged_attention: per-token scales (slots, n_kv, hd / group)");
            return hd / s.size(2);
        };
        v_group = token_group(v_scale);
        if (type == PoolType::FP8) k_group = token_group(k_scale);
        else TORCH_CHECK(k_scale.scalar_type() == at::kFloat && k_scale.dim() == 3 && num_slots % block_size == 0 &&
                         k_scale.size(0) == num_slots / block_size && k_scale.size(1) == n_kv && k_scale.size(2) == hd,
                         "localrun::paged_attention: int8 K scales (blocks, n_kv, hd)");
    }
    if (T == 0) return at::empty({0, H, hd}, q.options());    // no rows: no tasks (a grain of 0 would divide by zero)
    const int64_t *sp = slots.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>();
    const int64_t *seqp = row_seq.data_ptr<int64_t>(), *lenp = row_len.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++) {
        TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "localrun::paged_attention: slot out of range");
        TORCH_CHECK(seqp[t] >= 0 && seqp[t] < tables.size(0) && lenp[t] >= 1 && lenp[t] <= max_blocks * block_size,
                    "localrun::paged_attention: row ", t, " reaches past its block table");
    }
    // writes first: later rows read earlier ones; 16-bit pools round as torch's .to() does
    const float *kn = k.data_ptr<float>(), *vn = v.data_ptr<float>();
    const int64_t ks = k.stride(0), vs = v.stride(0), qs = q.stride(0);     // row strides
    if (type == PoolType::INT8) {
        write_channel_scaled(k_pool.data_ptr<int8_t>(), k_scale.data_ptr<float>(), kn, sp, seqp, T, n_kv, hd, block_size);
        write_token_scaled<false>(v_pool.data_ptr(), v_scale.data_ptr<float>(), v_group, vn, sp, T, n_kv, hd);
    } else if (type == PoolType::FP8) {
        write_token_scaled<true>(k_pool.data_ptr(), k_scale.data_ptr<float>(), k_group, kn, sp, T, n_kv, hd);
        write_token_scaled<true>(v_pool.data_ptr(), v_scale.data_ptr<float>(), v_group, vn, sp, T, n_kv, hd);
    } else {
        if (type == PoolType::F32) {
            write_rows(k_pool.data_ptr<float>(), kn, ks, sp, T, row_bytes);
            write_rows(v_pool.data_ptr<float>(), vn, vs, sp, T, row_bytes);
        } else if (type == PoolType::F16) {
            const auto narrow = kernels().narrow_f16;
            narrow(reinterpret_cast<uint16_t*>(k_pool.data_ptr<at::Half>()), kn, ks, sp, T, row_bytes);
            narrow(reinterpret_cast<uint16_t*>(v_pool.data_ptr<at::Half>()), vn, vs, sp, T, row_bytes);
        } else {
            const auto narrow = kernels().narrow_bf16;
            narrow(reinterpret_cast<uint16_t*>(k_pool.data_ptr<at::BFloat16>()), kn, ks, sp, T, row_bytes);
            narrow(reinterpret_cast<uint16_t*>(v_pool.data_ptr<at::BFloat16>()), vn, vs, sp, T, row_bytes);
        }
    }
    const Pool kp{k_pool.data_ptr(), quantized ? k_scale.data_ptr<float>() : nullptr, k_group},
               vp{v_pool.data_ptr(), quantized ? v_scale.data_ptr<float>() : nullptr, v_group};
    at::Tensor out = at::empty({T, H, hd}, q.options());
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float scale = 1.0f / std::sqrt((float)hd);
    const int64_t group = H / n_kv;
    const Kernels& chosen = kernels();
    // Tasks: (row, KV head, chunk of positions, slice of its query heads). A row over more than
    // CHUNK positions is split into equal chunks of at most CHUNK (flash-decoding),
    // so that one long row keeps every thread reading different keys; the chunks' partial outputs
    // are merged in chunk order. The chunks depend on the row alone, so a row's bits do not
    // depend on what else is in the call. With enough (row, chunk) tasks for the threads, one
    // task takes every KV head of its chunk (with the vector kernel's head sizes): each block's
    // positions are then one contiguous read (codes, and scales), every KV head's values
    // side by side, where a task per KV head read a strided part of each position (the same
    // arithmetic per head either way, so the same bits). With fewer, a task takes one KV head,
    // and the heads of a KV head stay in one task unless there are still too few tasks for the
    // threads (one short decode row of a model with one or two KV heads): then they are split,
    // each slice reading the keys and values on its own.
    struct Task { int64_t t, g, first, end, part; };      // part: the row's partial slot, -1: none
    std::vector<Task> row_tasks, tasks;                     // (row, chunk) with g = 0; (row, chunk, KV head)
    std::vector<int64_t> part_row;                          // partial slot -> its row
    for (int64_t t = 0; t < T; t++) {
        const int64_t L = lenp[t], first = window > 0 && L > window ? L - window : 0;   // first position attended
        const int64_t* table = tp + seqp[t] * max_blocks;
        for (int64_t b = first / block_size; b <= (L - 1) / block_size; b++)
            TORCH_CHECK(table[b] >= 0 && (table[b] + 1) * block_size <= num_slots,
                        "localrun::paged_attention: block table entry out of range");
        // chunks of equal size (at most CHUNK), so that one row's tasks take equal time on the threads
        const int64_t chunks = (L - first + CHUNK - 1) / CHUNK, size = (L - first + chunks - 1) / chunks;
        for (int64_t c = 0; c < chunks; c++) {
            const int64_t part = chunks > 1 ? (int64_t)part_row.size() : -1;
            if (chunks > 1) part_row.push_back(t);
            row_tasks.push_back({t, 0, first + c * size, std::min(L, first + (c + 1) * size), part});
        }
    }
    int64_t work = 0;                                       // query heads x positions x head size
    for (const Task& task : row_tasks) work += H * (task.end - task.first) * hd;
    const bool serial = work < SERIAL_WORK;                 // one thread, no head slices (same bits either way)
    const int64_t threads = at::get_num_threads(), want = serial ? 1 : 2 * threads;
    // at::parallel_for hands each thread an equal run of tasks: 5 chunks of one row on 2 threads
    // took the time of 3 (a 2060-position row); a task per KV head then balances better, with
    // the same bits
    const auto imbalance = [&](int64_t n) { return (double)((n + threads - 1) / threads * threads) / (double)n; };
    const bool whole_rows = n_kv > 1 && vector_kernel_takes(hd, H) && (int64_t)row_tasks.size() >= want &&
                            (serial || imbalance((int64_t)row_tasks.size()) <= 1.1);
    if (whole_rows) tasks = row_tasks;
    else
        for (const Task& task : row_tasks)
            for (int64_t g = 0; g < n_kv; g++) tasks.push_back({task.t, g, task.first, task.end, task.part});
    const int64_t pairs = (int64_t)tasks.size();
    const int64_t slices = whole_rows ? 1 : std::min<int64_t>(group, std::max<int64_t>(1, (want + pairs - 1) / pairs));
    const int64_t per = whole_rows ? H : (group + slices - 1) / slices;
    const int64_t width = whole_rows ? n_kv * hd : hd;     // widened values per position
    std::vector<float> partial(part_row.size() * H * hd), ml(part_row.size() * H * 2);
    const char* k_bytes = static_cast<const char*>(k_pool.data_ptr());
    const int64_t k_elem = k_pool.element_size();
    at::parallel_for(0, pairs * slices, serial ? pairs * slices : 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> scratch;
        for (int64_t i = i0; i < i1; i++) {
            if (i + 1 < i1 && (i + 1) / slices != i / slices) {
                const Task& next = tasks[(i + 1) / slices];
                prefetch_row_start(k_bytes, k_elem, tp + seqp[next.t] * max_blocks, next.first, next.end, block_size, n_kv,
                                   hd, next.g, whole_rows);
            }
            const Task& task = tasks[i / slices];
            const int64_t t = task.t, g = task.g, h0 = g * group + i % slices * per;
            const int64_t heads = whole_rows ? H : std::min(per, (g + 1) * group - h0);
            if (heads <= 0) continue;
            scratch.resize(heads * (task.end - task.first + 8 + 2 * hd) + block_size * width);
            float* dst = task.part < 0 ? op + (t * H + h0) * hd : partial.data() + (task.part * H + h0) * hd;
            float* dst_ml = task.part < 0 ? nullptr : ml.data() + (task.part * H + h0) * 2;
            const RowArgs args{qp + t * qs + h0 * hd, kp, vp, chosen.widen_f16, chosen.widen_i8_scaled, chosen.widen_fp8,
                               tp + seqp[t] * max_blocks, block_size,
                               n_kv, g, hd, task.first, task.end, heads, whole_rows ? group : 0, scale, scratch.data(), dst, dst_ml};
            chosen.attend(args, type);
        }
    });
    // merge a split row's chunks, in chunk order: out = sum_c w_c o_c / sum_c w_c, w_c = l_c e^(m_c - max)
    if (part_row.empty()) return out;
    std::vector<int64_t> row_first(T, -1);
    for (int64_t s = (int64_t)part_row.size() - 1; s >= 0; s--) row_first[part_row[s]] = s;
    at::parallel_for(0, T * H, 1, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t t = i / H, h = i % H, s0 = row_first[t];
            if (s0 < 0) continue;
            int64_t s1 = s0;
            while (s1 < (int64_t)part_row.size() && part_row[s1] == t) s1++;
            float m = -INFINITY;
            for (int64_t s = s0; s < s1; s++) m = std::max(m, ml[(s * H + h) * 2]);
            float* o = op + (t * H + h) * hd;
            float total = 0.f;
            for (int64_t d = 0; d < hd; d++) o[d] = 0.f;
            for (int64_t s = s0; s < s1; s++) {
                const float w = ml[(s * H + h) * 2 + 1] * std::exp(ml[(s * H + h) * 2] - m);
                const float* oc = partial.data() + (s * H + h) * hd;
                for (int64_t d = 0; d < hd; d++) o[d] += w * oc[d];
                total += w;
            }
            for (int64_t d = 0; d < hd; d++) o[d] /= total;
        }
    });
    return out;
}

// The first num_tokens tokens of the blocks block_ids of a float16 or int8 pool, in order, as
// float32 (num_tokens, n_kv, hd): what paged_kv.py's stores read for a prompt chunk's attention
// over its cached prefix (float16 widened exactly; int8 as code x scale, one float32 product), in
// one pass per block instead of torch's index_select, widen (and multiply) and copy. data
// (num_blocks * block_size, n_kv, hd). int8: per_block: scale (num_blocks, n_kv, hd), one per
// block and channel (int8 K); else scale (num_blocks * block_size, n_kv, hd / group), one per
// group of a token's values (int8 V).
at::Tensor gather_kv(const at::Tensor& data, const c10::optional<at::Tensor>& scale, const at::Tensor& block_ids,
                     int64_t num_tokens, int64_t block_size, int64_t group, bool per_block) {
    const bool int8 = data.scalar_type() == at::kChar;
    TORCH_CHECK((int8 || data.scalar_type() == at::kHalf) && data.dim() == 3 && data.is_contiguous(),
                "localrun::gather_kv: data must be a contiguous (slots, n_kv, hd) float16 or int8 tensor");
    TORCH_CHECK(!int8 || (scale.has_value() && scale->scalar_type() == at::kFloat && scale->is_contiguous()),
                "localrun::gather_kv: an int8 pool needs its float32 scales");
    const int64_t n_kv = data.size(1), hd = data.size(2), row = n_kv * hd, num_blocks = data.size(0) / block_size;
    TORCH_CHECK(group >= 1 && hd % group == 0, "localrun::gather_kv: group must divide the head size");
    const at::Tensor ids = block_ids.to(at::kLong).contiguous();
    const int64_t nb = ids.numel();
    TORCH_CHECK(num_tokens >= 0 && num_tokens <= nb * block_size, "localrun::gather_kv: more tokens than blocks");
    const int64_t* idp = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < nb; i++)
        TORCH_CHECK(idp[i] >= 0 && idp[i] < num_blocks, "localrun::gather_kv: block id out of range");
    at::Tensor out = at::empty({num_tokens, n_kv, hd}, data.options().dtype(at::kFloat));
    const float* sc = int8 ? scale->data_ptr<float>() : nullptr;
    float* dst = out.data_ptr<float>();
    const Kernels& chosen = kernels();
    at::parallel_for(0, nb, 4, [&](int64_t b0, int64_t b1) {
        for (int64_t i = b0; i < b1; i++) {
            const int64_t n = std::min(block_size, num_tokens - i * block_size), blk = idp[i];
            if (n <= 0) continue;
            float* d = dst + i * block_size * row;
            if (!int8)
                chosen.widen_f16(d, static_cast<const uint16_t*>(data.data_ptr()) + blk * block_size * row, n, row, row);
            else if (per_block)  // every token of the block times the block's scale per channel
                chosen.widen_i8_scaled(d, data.data_ptr<int8_t>() + blk * block_size * row, sc + blk * row, n, row,
                                       row, 1, 0);
            else                 // each token times its own scale per group of its values
                chosen.widen_i8_scaled(d, data.data_ptr<int8_t>() + blk * block_size * row,
                                       sc + blk * block_size * (row / group), n, row, row, group, row / group);
        }
    });
    return out;
}

// Rows x (T, n_kv, hd) float32 of one sequence written at slots (T,) of a quantized pool, as
// paged_kv.py's stores write them and as paged_attention writes decode rows (the same functions):
// int8 with per_block scales (blocks, n_kv, hd): every block a row lands in requantized whole;
// int8 or fp8 bytes with per-token scales (slots, n_kv, hd / group): each group of a row's values
// over its own scale. A prompt chunk's write, in one pass instead of ~10 torch ops per store.
void write_kv(const at::Tensor& x_in, at::Tensor& data, at::Tensor& scale, const at::Tensor& slots_in,
              int64_t block_size, bool per_block, bool fp8) {
    const at::Tensor x = x_in.contiguous(), slots = slots_in.to(at::kLong).contiguous();
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3, "localrun::write_kv: x must be float32 (T, n_kv, hd)");
    TORCH_CHECK(data.is_contiguous() && data.dim() == 3 && data.size(1) == x.size(1) && data.size(2) == x.size(2) &&
                data.scalar_type() == (fp8 ? at::kByte : at::kChar),
                "localrun::write_kv: data must be a contiguous (slots, n_kv, hd) int8 (or fp8 bytes) pool");
    TORCH_CHECK(scale.is_contiguous() && scale.scalar_type() == at::kFloat && scale.dim() == 3,
                "localrun::write_kv: scale must be contiguous float32");
    const int64_t T = x.size(0), n_kv = x.size(1), hd = x.size(2), num_slots = data.size(0);
    TORCH_CHECK(slots.numel() == T && block_size >= 1 && num_slots % block_size == 0,
                "localrun::write_kv: one slot per row, whole blocks");
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < T; t++)
        TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "localrun::write_kv: slot out of range");
    const float* xp = x.data_ptr<float>();
    if (per_block) {
        TORCH_CHECK(!fp8 && scale.size(0) == num_slots / block_size && scale.size(1) == n_kv && scale.size(2) == hd,
                    "localrun::write_kv: int8 scales per block and channel (blocks, n_kv, hd)");
        const std::vector<int64_t> one_sequence(T, 0);
        write_channel_scaled(data.data_ptr<int8_t>(), scale.data_ptr<float>(), xp, sp, one_sequence.data(), T, n_kv, hd,
                             block_size);
        return;
    }
    TORCH_CHECK(scale.size(0) == num_slots && scale.size(1) == n_kv && scale.size(2) >= 1 && hd % scale.size(2) == 0,
                "localrun::write_kv: per-token scales (slots, n_kv, hd / group)");
    const int64_t group = hd / scale.size(2);
    if (fp8) write_token_scaled<true>(data.data_ptr(), scale.data_ptr<float>(), group, xp, sp, T, n_kv, hd);
    else write_token_scaled<false>(data.data_ptr(), scale.data_ptr<float>(), group, xp, sp, T, n_kv, hd);
}

}  // namespace
}  // namespace localrun

TORCH_LIBRARY_FRAGMENT(localrun, m) {
    m.def("gather_kv(Tensor data, Tensor? scale, Tensor block_ids, int num_tokens, int block_size, int group, "
          "bool per_block) -> Tensor");
    m.def("write_kv(Tensor x, Tensor(a!) data, Tensor(b!) scale, Tensor slots, int block_size, bool per_block, "
          "bool fp8) -> ()");
    m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
          "Tensor block_tables, Tensor row_seq, Tensor row_len, int block_size, int window=0, "
          "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("paged_attention", &localrun::paged_attention);
    m.impl("gather_kv", &localrun::gather_kv);
    m.impl("write_kv", &localrun::write_kv);
}
