// Attention of a step's prompt rows in bfloat16 with float32 sums (AVX-512 BF16's vdpbf16ps):
//   attention_bf16(q, k, v, offset, scale, window=0) -> (out, lse)
//     q (T, Hq, D) float32; k, v (Hkv, L, D) float32; query i sees keys 0 .. offset + i
//     (offset < 0: every key), and with window > 0 only the last `window` of those (a sliding-
//     window layer: keys offset + i - window + 1 .. offset + i); out (T, Hq, D) float32 and lse (T, Hq) float32, the natural
//     log-sum-exp of each row's scaled scores, as torch's flash attention returns them (so the
//     caller merges partial attentions the same way). Query head h reads KV head h / (Hq / Hkv).
//   has_attention_bf16() -> bool   whether this CPU has AVX-512 BF16 (and LOCALRUN_ISA allows it)
//   attention_f32(...), has_attention_f32(): the same in float32 with FMA, nothing rounded (AVX2
//     hosts; the second half of this file)
//   attention_paged_bf16 / _f32(q, k_pool, v_pool, blocks, block_size, key0, L, offset, scale,
//     window=0, lead=0, k_scale=None, v_scale=None): the same over keys read where they lie in
//     the engine's pool (float32, float16, bfloat16, or int8 / float8 codes with their scales;
//     key j at position key0 + j of `blocks`), no gathered copy
//   attention_shared_bf16 / _f32, attention_shared_paged_bf16 / _f32: several sequences' rows
//     over one shared prefix (packed once) and their own keys (cascade attention; Segment below)
//
// Why: a prompt chunk over a cached prefix is two matrix products per head (Q.K^T and P.V) at
// the float32 GEMM's ceiling (~130 GFLOP/s on 2 Zen 4 cores, torch's flash attention the same),
// and vdpbf16ps multiplies twice the pairs per instruction. What it costs: queries, keys, values
// and the softmax weights are rounded to bfloat16 (8 significant bits) before they multiply;
// every sum, the scores, the softmax and the output stay float32. llama.cpp's CPU attention
// rounds queries and weights to float16 (11 bits) the same way. The engine uses it only with
// prompt_math "int8" (llama.cpp's arithmetic); "float32" keeps torch's exact path.
//
// Layout: each KV head's keys are packed as bfloat16 pairs (dims 2p, 2p+1) for 16 keys per
// vector, its values as pairs of keys (2t, 2t+1) for 16 dims per vector, once per call. A task
// is one KV head and a few query positions (all its grouped query heads: ROWS rows in all); it
// walks the keys in blocks of KEYS with an online softmax (base 2: scores are scaled by
// log2(e) / sqrt(D) once, out of the bfloat16 rounding).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>
#include "fp8.h"

namespace localrun {
namespace {

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

constexpr int64_t ROWS = 24;    // query rows (positions x grouped heads) a task aims at
constexpr int64_t KEYS = 64;    // keys per block of the online softmax (4 vectors of 16)

bool bf16_allowed() {
    static const bool allowed = [] {
        const char* env = std::getenv("LOCALRUN_ISA");
        const std::string forced = env ? env : "";
        __builtin_cpu_init();
        return (forced.empty() || forced == "avx512") && __builtin_cpu_supports("avx512f") &&
               __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
               __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bf16");
    }();
    return allowed;
}

// 16 float32 -> 16 bfloat16 pairs' halves: round to nearest even (as vcvtne2ps2bf16)
BF16_TARGET inline __m512i pairs_of(__m512 lo16, __m512 hi16) {
    return (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16);   // elements 0-15 from lo16, 16-31 from hi16
}

// 2^x for x <= 0 (-inf -> 0): 2^n * p(f), n = round(x), |f| <= 1/2, p the degree-6 Taylor
// polynomial of e^(f ln 2) (relative error under 2e-7, below the bfloat16 rounding that follows)
BF16_TARGET inline __m512 exp2_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-160.f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.6931471805599453f));
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// 16 x 16 transposition of 32-bit words: out[c] word j = r[j] word c
BF16_TARGET inline void transpose16(const __m512i* r, __m512i* out) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {       // u[4i + c], 128-bit lane l: words c + 4l of r[4i .. 4i + 3]
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        out[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        out[c + 8] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        out[c + 4] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        out[c + 12] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}

// Where key j (0 .. L - 1) of KV head g is: a float32 tensor (Hkv, L, D) read with its strides, or
// the engine's paged pool itself (slots, Hkv, D) of float32, float16, bfloat16, int8 or float8
// codes, key j at position key0 + j of `blocks` (block_size positions a block): the prompt rows
// attend over their cached prefix where it lies, with no gathered copy. Codes come with their
// float32 scales in paged_kv.py's layouts, and a value is code x scale, one float32 product, as
// the stores' read (and kernels.gather_kv) computes it: the same values as the gathered keys.
struct Source {
    const uint8_t* data;
    int kind;                  // 0 float32, 1 float16, 2 bfloat16, 3 int8 codes, 4 float8 e4m3fn codes
    int64_t esize, L;
    int64_t hs, rs;            // a tensor: elements between heads and between keys
    const int64_t* blocks;     // a pool: its blocks (nullptr: a tensor)
    int64_t bs, key0, n_kv, D;
    const float* scale = nullptr;   // codes: group 1, one scale per block and channel (blocks, Hkv, D)
    int64_t group = 0;              // (int8 K); else one per `group` values of a token's head (slots, Hkv, D / group)
    // out[i]: key j0 + i's row of KV head g where that key exists (0 <= j < L), else nullptr, and
    // sc[i] (codes) its scales, indexed by channel (group 1) or by channel / group; one division
    // for the n keys, not one each
    void rows(int64_t g, int64_t j0, int n, const uint8_t** out, const float** sc = nullptr) const {
        const int64_t lo = std::max<int64_t>(j0, 0), hi = std::min(j0 + n, L);
        for (int i = 0; i < n; i++) out[i] = nullptr;
        if (sc != nullptr)
            for (int i = 0; i < n; i++) sc[i] = nullptr;
        if (lo >= hi) return;
        if (blocks == nullptr) {
            for (int64_t j = lo; j < hi; j++) out[j - j0] = data + (g * hs + j * rs) * esize;
            return;
        }
        int64_t b = (key0 + lo) / bs, o = (key0 + lo) % bs;
        for (int64_t j = lo; j < hi; j++) {
            const int64_t slot = blocks[b] * bs + o;
            out[j - j0] = data + (slot * n_kv + g) * D * esize;
            if (scale != nullptr && sc != nullptr)
                sc[j - j0] = group == 1 ? scale + (blocks[b] * n_kv + g) * D : scale + (slot * n_kv + g) * (D / group);
            if (++o == bs) {
                o = 0;
                b++;
            }
        }
    }
};

// 16 values of a row from dim d as float32: 16-bit values widened exactly, codes times their
// scales (sc: the row's, Source::rows; fp8 widened by fp8.h)
BF16_TARGET inline __m512 load16(const Source& src, const uint8_t* row, const float* sc, int64_t d) {
    if (src.kind == 0) return _mm512_loadu_ps((const float*)row + d);
    if (src.kind >= 3) {
        const __m512 s = src.group == 1 ? _mm512_loadu_ps(sc + d) : _mm512_set1_ps(sc[d / src.group]);
        const __m512 c = src.kind == 3 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + d))))
                                       : fp8x16(row + d);
        return _mm512_mul_ps(c, s);
    }
    const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)row + d));
    if (src.kind == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Keys of KV head g -> [n16 / 16][D / 2][16] pairs; values -> [n16 / 2][D / 16][16] pairs, packed
// key lead + j holding key j. The packed keys before `lead` and past lead + L are zero (their
// scores are masked), and so are their values (their weights are zero).
BF16_TARGET void pack_block(const Source& k, const Source& v, int64_t g, int64_t D, int64_t key0, int64_t lead,
                            uint32_t* kp, uint32_t* vp) {
    const int64_t P = D / 2, C = D / 16;
    const uint8_t *krows[16], *vrows[16];
    const float *ksc[16], *vsc[16];
    k.rows(g, key0 - lead, 16, krows, ksc);
    v.rows(g, key0 - lead, 16, vrows, vsc);
    uint32_t* kb = kp + key0 / 16 * P * 16;
    for (int64_t d = 0; d < D; d += 32) {               // pairs d / 2 .. d / 2 + 15 of the 16 keys
        __m512i r[16], out[16];
        for (int64_t j = 0; j < 16; j++)
            r[j] = krows[j] ? pairs_of(load16(k, krows[j], ksc[j], d), load16(k, krows[j], ksc[j], d + 16))
                             : _mm512_setzero_si512();
        transpose16(r, out);
        for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512((__m512i*)(kb + (d / 2 + p) * 16), out[p]);
    }
    for (int64_t t = 0; t < 8; t++) {                   // key pairs (key0 + 2t, key0 + 2t + 1)
        uint32_t* vb = vp + (key0 / 2 + t) * C * 16;
        const uint8_t *ra = vrows[2 * t], *rb = vrows[2 * t + 1];
        const float *sa = vsc[2 * t], *sb = vsc[2 * t + 1];
        for (int64_t c = 0; c < C; c++) {
            const __m512 va = ra ? load16(v, ra, sa, c * 16) : _mm512_setzero_ps();
            const __m512 vb16 = rb ? load16(v, rb, sb, c * 16) : _mm512_setzero_ps();
            // element 2i = value of key a at dim i, element 2i + 1 = key b's: interleave the halves
            const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(va));
            const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(vb16));
            _mm512_storeu_si512((__m512i*)(vb + c * 16), _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
    }
}

// Scores of 4 query rows over NV x 16 keys: s[i][key] = (q_i . k_key) * sc
template <int NV>
BF16_TARGET inline void scores4(const uint32_t* q, int64_t P, const uint32_t* kp, float* s, float sc) {
    __m512 acc[4][NV];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) acc[i][c] = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        __m512bh kv[NV];
        for (int c = 0; c < NV; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kp + (c * P + p) * 16);
        for (int i = 0; i < 4; i++) {
            const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)q[i * P + p]);
            for (int c = 0; c < NV; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], qb, kv[c]);
        }
    }
    const __m512 scale = _mm512_set1_ps(sc);
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(s + i * KEYS + c * 16, _mm512_mul_ps(acc[i][c], scale));
}

// o[i][64 dims from d0] += sum over the block's key pairs of w[i][t] . v[t] for 4 rows
BF16_TARGET inline void values4(const uint32_t* w, const uint32_t* vp, int64_t pairs, int64_t C, int64_t c0,
                                float* o, int64_t D) {
    __m512 acc[4][4];
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) acc[i][c] = _mm512_loadu_ps(o + i * D + (c0 + c) * 16);
    for (int64_t t = 0; t < pairs; t++) {
        __m512bh vv[4];
        for (int c = 0; c < 4; c++) vv[c] = (__m512bh)_mm512_loadu_si512(vp + (t * C + c0 + c) * 16);
        for (int i = 0; i < 4; i++) {
            const __m512bh wb = (__m512bh)_mm512_set1_epi32((int)w[i * (KEYS / 2) + t]);
            for (int c = 0; c < 4; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], wb, vv[c]);
        }
    }
    for (int i = 0; i < 4; i++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + i * D + (c0 + c) * 16, acc[i][c]);
}

// The n chunks of positions in the order 0, n - 1, 1, n - 2, ...: at::parallel_for gives each
// thread a contiguous run of tasks, and under a causal mask a chunk's cost grows with its
// position, so in plain order the last thread got the most work (3/4 of it with 2 threads).
inline int64_t zigzag(int64_t j, int64_t n) { return j % 2 == 0 ? j / 2 : n - 1 - j / 2; }

// The checks both kernels make, in one sentence each (head sizes a multiple of `step`)
void check_args(const char* name, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t step,
                int64_t offset, int64_t window, int64_t lead) {
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), name, ": q (T, Hq, D), k and v (Hkv, L, D)");
    TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
                name, ": float32 tensors");
    TORCH_CHECK(k.size(2) == q.size(2) && q.size(2) % step == 0 && q.size(2) <= 256, name, ": head size a multiple of ",
                step, ", at most 256");
    TORCH_CHECK(k.size(0) > 0 && q.size(1) % k.size(0) == 0 && k.size(1) > 0, name,
                ": query heads a multiple of KV heads, keys > 0");
    TORCH_CHECK(window == 0 || (window > 0 && offset >= 0), name, ": a window needs a causal offset");
    TORCH_CHECK(lead >= 0 && lead < KEYS, name, ": a lead of 0 to ", KEYS - 1, " keys");
}

// The key grid. A call's keys are numbered as the positions they hold, up to a multiple of KEYS:
// key j of k is grid key lead + j (lead = the first key's position mod KEYS), and every row walks
// the grid's blocks of KEYS keys from the block of its first visible key on, with one online
// softmax step per block. A row's sums then run over the same blocks in the same order whatever
// the call: the chunk it came in, the keys the caller trimmed before its window, the other rows
// of its task, or a shared prefix read once for several sequences (attention_shared_*): its bits
// depend on its query, its keys and its mask alone (keys a block holds past a row's mask weigh
// exactly 0, and adding 0 changes no sum).
//
// A segment: consecutive query rows over their own keys, after S keys shared with the other
// segments of the call (S a multiple of KEYS; grid keys 0 .. S - 1) when there are such.
template <typename Keys>
struct Segment {
    int64_t row0, rows;         // rows row0 .. row0 + rows - 1 of q and out
    int64_t keys;               // grid keys: S + lead + its own keys
    int64_t offset, window;     // row i sees grid keys .. offset + i (offset < 0: all), the last `window` of them
    int64_t first;              // the first grid key that exists (lead when S = 0)
    Keys own;                   // its keys from grid key S on
};

template <typename Keys>
struct Call {
    const float* q; float* out; float* lse;
    int64_t Hq, Hkv, G, D;
    float sc;                               // scale * log2(e)
    int64_t S;                              // shared grid keys, a multiple of KEYS (0: none)
    Keys shared;
    std::vector<Segment<Keys>> segs;
};

// Every task of a call on the threads: task(s, g, i0, i1) for segment s, KV head g and its rows
// i0 .. i1 - 1, ROWS rows a task (positions x the G query heads of a KV head), chunks in zigzag order
template <typename Keys, typename F>
void for_each_task(const Call<Keys>& a, F&& task) {
    const int64_t positions = std::max<int64_t>(1, ROWS / a.G);
    std::vector<std::array<int64_t, 3>> chunks;             // (segment, i0, i1)
    for (int64_t s = 0; s < (int64_t)a.segs.size(); s++)
        for (int64_t i0 = 0; i0 < a.segs[s].rows; i0 += positions)
            chunks.push_back({s, i0, std::min(a.segs[s].rows, i0 + positions)});
    const int64_t n = chunks.size();
    at::parallel_for(0, a.Hkv * n, 1, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const auto& c = chunks[zigzag(t / a.Hkv, n)];
            task(c[0], t % a.Hkv, c[1], c[2]);
        }
    });
}

// A task's R rows (row row0 + i0 + r / G, query head g * G + r % G): out = o / l, lse = ln(2^m l)
void finish_rows(float* out, float* lse, const float* o, const float* m, const float* l, int64_t R, int64_t G,
                 int64_t i0, int64_t g, int64_t Hq, int64_t D) {
    for (int64_t r = 0; r < R; r++) {
        const int64_t i = i0 + r / G, h = g * G + r % G;
        const float inv = 1.f / l[r];
        float* dst = out + (i * Hq + h) * D;
        for (int64_t d = 0; d < D; d++) dst[d] = o[r * D + d] * inv;
        lse[i * Hq + h] = (m[r] + std::log2(l[r])) * 0.6931471805599453f;
    }
}

// The first and last grid key each of a task's rows sees (padding rows repeat the last real row)
template <typename Keys>
void row_spans(const Segment<Keys>& seg, int64_t i0, int64_t R, int64_t RP, int64_t G, int64_t* first, int64_t* last) {
    for (int64_t r = 0; r < RP; r++) {
        const int64_t i = i0 + std::min(r, R - 1) / G;
        last[r] = seg.offset < 0 ? seg.keys - 1 : std::min(seg.keys - 1, seg.offset + i);
        first[r] = std::max(seg.first, seg.window > 0 ? seg.offset + i - seg.window + 1 : 0);
    }
}

// A float32 tensor (Hkv, L, D) as a Source, read with its strides where each row's D values are
// contiguous (the engine's gathered keys are a transposed (L, Hkv, D) tensor: no copy), and the
// tensor it reads (a contiguous copy otherwise), which must outlive the call
struct Held {
    Source src;
    at::Tensor keep;
};

Held tensor_source(const at::Tensor& x) {
    const at::Tensor c = x.stride(2) == 1 ? x : x.contiguous();
    return {{static_cast<const uint8_t*>(c.data_ptr()), 0, 4, c.size(1), c.stride(0), c.stride(1), nullptr, 0, 0, 0,
             c.size(2)}, c};
}

// The pool's keys key0 .. key0 + L - 1 of `blocks` (checked by check_pools and check_blocks);
// codes with their scales (an int8 K pool's per block and channel, the others' per token)
Source pool_source(const at::Tensor& pool, const c10::optional<at::Tensor>& scale, const at::Tensor& blocks,
                   int64_t block_size, int64_t key0, int64_t L) {
    const auto t = pool.scalar_type();
    const int kind = t == at::kFloat ? 0 : t == at::kHalf ? 1 : t == at::kBFloat16 ? 2 : t == at::kChar ? 3 : 4;
    Source src{static_cast<const uint8_t*>(pool.data_ptr()), kind, (int64_t)pool.element_size(), L, 0, 0,
               blocks.data_ptr<int64_t>(), block_size, key0, pool.size(1), pool.size(2)};
    if (kind >= 3) {
        src.scale = scale->data_ptr<float>();
        src.group = scale->size(0) == pool.size(0) ? pool.size(2) / scale->size(2) : 1;
    }
    return src;
}

// The checks of the ops that read a pool: q (T, Hq, D) float32, the pools (slots, Hkv, D), each
// run of keys (key0 .. key0 + L - 1 of its blocks) inside its blocks and the blocks in the pools;
// int8 or float8 (uint8) codes with float32 scales as paged_kv.py lays them out: an int8 K pool's
// one per block and channel (slots / block_size, Hkv, D), the others' one per group of a token's
// values (slots, Hkv, D / group), the groups a multiple of 16 values
void check_pools(const char* name, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, int64_t step,
                 const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale, int64_t block_size) {
    const auto t = k_pool.scalar_type();
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, name, ": q (T, Hq, D) float32");
    TORCH_CHECK(k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes() && v_pool.scalar_type() == t &&
                (t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kChar || t == at::kByte) &&
                k_pool.is_contiguous() && v_pool.is_contiguous(), name,
                ": contiguous pools (slots, Hkv, D) of float32, float16, bfloat16, int8 or float8 (uint8) codes");
    TORCH_CHECK(k_pool.size(2) == q.size(2) && q.size(2) % step == 0 && q.size(2) <= 256, name,
                ": head size a multiple of ", step, ", at most 256");
    TORCH_CHECK(k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0, name, ": query heads a multiple of KV heads");
    const bool codes = t == at::kChar || t == at::kByte;
    TORCH_CHECK(codes == (k_scale.has_value() && v_scale.has_value()), name,
                ": int8 and float8 pools come with their K and V scales, the others with none");
    if (!codes) return;
    const int64_t slots = k_pool.size(0), Hkv = k_pool.size(1), D = k_pool.size(2);
    for (const at::Tensor* s : {&*k_scale, &*v_scale})
        TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->dim() == 3 && s->size(1) == Hkv,
                    name, ": contiguous float32 scales (rows, Hkv, channels)");
    const auto per_token = [&](const at::Tensor& s) {
        return s.size(0) == slots && s.size(2) >= 1 && D % s.size(2) == 0 && (D / s.size(2)) % 16 == 0;
    };
    if (t == at::kChar) {
        TORCH_CHECK(block_size > 0 && slots % block_size == 0 && k_scale->size(0) == slots / block_size &&
                    k_scale->size(2) == D, name, ": int8 K scales per block and channel (slots / block_size, Hkv, D)");
    } else {
        TORCH_CHECK(per_token(*k_scale), name, ": float8 K scales per group of 16n values of a token (slots, Hkv, D / group)");
    }
    TORCH_CHECK(per_token(*v_scale), name, ": V scales per group of 16n values of a token (slots, Hkv, D / group)");
}

void check_blocks(const char* name, const at::Tensor& pool, const at::Tensor& blocks, int64_t block_size, int64_t key0,
                  int64_t L) {
    TORCH_CHECK(blocks.dim() == 1 && blocks.scalar_type() == at::kLong && blocks.is_contiguous() && block_size > 0 &&
                key0 >= 0 && L > 0 && key0 + L <= blocks.size(0) * block_size, name,
                ": keys key0 .. key0 + L - 1 (L > 0) within the int64 blocks");
    const int64_t* b = blocks.data_ptr<int64_t>();
    for (int64_t i = key0 / block_size; i < (key0 + L + block_size - 1) / block_size; i++)
        TORCH_CHECK(b[i] >= 0 && (b[i] + 1) * block_size <= pool.size(0), name, ": block ", b[i], " is not in the pool");
}

// One KV head's keys and values in bfloat16 pairs (pack_block's layout), n16 packed keys a head
struct PackedBF16 {
    const uint32_t* kp; const uint32_t* vp;
    int64_t n16;
};

struct PackBF16 {
    at::Tensor kp, vp;
    PackedBF16 keys;
};

// Keys and values of every KV head packed, key j at packed key lead + j
PackBF16 pack_bf16(const Source& k, const Source& v, int64_t Hkv, int64_t D, int64_t lead) {
    const int64_t n16 = (lead + k.L + 15) / 16 * 16, B = n16 / 16;
    PackBF16 p{at::empty({Hkv, n16 * D / 2}, at::kInt), at::empty({Hkv, n16 * D / 2}, at::kInt), {}};
    auto* kpp = reinterpret_cast<uint32_t*>(p.kp.data_ptr<int32_t>());
    auto* vpp = reinterpret_cast<uint32_t*>(p.vp.data_ptr<int32_t>());
    // 16 keys at a time, every KV head in turn: a pool block's positions are then read front to
    // back (head by head in the outer loop, each block was visited once a head, a third of its lines
    // each time). 4 rows over 2004 keys in 30 layers' pools (memory), one call 0.84-0.87 of the time
    // (Zen 4, 2 threads, 2026-12-05).
    at::parallel_for(0, B, 4, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; b++)
            for (int64_t g = 0; g < Hkv; g++)
                pack_block(k, v, g, D, b * 16, lead, kpp + g * n16 * D / 2, vpp + g * n16 * D / 2);
    });
    p.keys = {kpp, vpp, n16};
    return p;
}

// One task: segment s, KV head g, its rows i0 .. i1 - 1 (rows r = (i - i0) * G + j for query head g * G + j)
BF16_TARGET void attend_task(const Call<PackedBF16>& a, int64_t s, int64_t g, int64_t i0, int64_t i1) {
    const Segment<PackedBF16>& seg = a.segs[s];
    const int64_t D = a.D, P = D / 2, C = D / 16, G = a.G;
    const int64_t R = (i1 - i0) * G, R4 = (R + 3) / 4 * 4;
    std::vector<uint32_t> qb(R4 * P, 0);
    std::vector<float> o(R4 * D, 0.f), s4(4 * KEYS);
    std::vector<uint32_t> w(R4 * (KEYS / 2));
    std::vector<float> m(R4, -std::numeric_limits<float>::infinity()), l(R4, 0.f), alpha(R4);
    std::vector<int64_t> first(R4), last(R4);               // the first and last grid key each row sees
    row_spans(seg, i0, R, R4, G, first.data(), last.data());
    for (int64_t r = 0; r < R; r++) {
        const float* src = a.q + ((seg.row0 + i0 + r / G) * a.Hq + g * G + r % G) * D;
        for (int64_t d = 0; d < D; d += 32)
            _mm512_storeu_si512((__m512i*)(qb.data() + r * P + d / 2),
                                pairs_of(_mm512_loadu_ps(src + d), _mm512_loadu_ps(src + d + 16)));
    }
    const int64_t end = last[R4 - 1] + 1;                   // grid keys any row of the task sees: from begin on
    const int64_t begin = first[0] / KEYS * KEYS;           // (rows by position: the first row's first key is the least)
    for (int64_t k0 = begin; k0 < end; k0 += KEYS) {
        const int64_t nv = std::min<int64_t>(4, (end - k0 + 15) / 16), nk = nv * 16;
        const PackedBF16& run = k0 < a.S ? a.shared : seg.own;   // a block is all shared or all own
        const int64_t key = k0 < a.S ? k0 : k0 - a.S;            // its first packed key
        const uint32_t* kblock = run.kp + g * run.n16 * P + key / 16 * P * 16;
        const uint32_t* vblock = run.vp + g * run.n16 * P + key / 2 * C * 16;
        for (int64_t r = 0; r < R4; r += 4) {
            switch (nv) {
                case 4: scores4<4>(qb.data() + r * P, P, kblock, s4.data(), a.sc); break;
                case 3: scores4<3>(qb.data() + r * P, P, kblock, s4.data(), a.sc); break;
                case 2: scores4<2>(qb.data() + r * P, P, kblock, s4.data(), a.sc); break;
                default: scores4<1>(qb.data() + r * P, P, kblock, s4.data(), a.sc); break;
            }
            for (int64_t i = 0; i < 4; i++) {               // online softmax of the block, row r + i
                float* si = s4.data() + i * KEYS;
                const int64_t seen = std::min(nk, last[r + i] - k0 + 1);   // keys k0 .. k0 + seen - 1
                for (int64_t k = std::max<int64_t>(seen, 0); k < nk; k++) si[k] = -std::numeric_limits<float>::infinity();
                for (int64_t k = 0; k < std::min(nk, first[r + i] - k0); k++) si[k] = -std::numeric_limits<float>::infinity();
                __m512 mx = _mm512_loadu_ps(si);
                for (int64_t c = 1; c < nv; c++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(si + c * 16));
                const float m_new = std::max(m[r + i], _mm512_reduce_max_ps(mx));
                uint32_t* wi = w.data() + (r + i) * (KEYS / 2);
                if (m_new == -std::numeric_limits<float>::infinity()) {   // nothing seen yet
                    std::memset(wi, 0, KEYS / 2 * sizeof(uint32_t));
                    alpha[r + i] = 1.f;
                    continue;
                }
                const __m512 mv = _mm512_set1_ps(m_new);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t c = 0; c < nv; c += 2) {
                    const __m512 p0 = exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(si + c * 16), mv));
                    const __m512 p1 = c + 1 < nv ? exp2_neg(_mm512_sub_ps(_mm512_loadu_ps(si + c * 16 + 16), mv))
                                                 : _mm512_setzero_ps();
                    sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                    _mm512_storeu_si512((__m512i*)(wi + c * 8), pairs_of(p0, p1));
                }
                alpha[r + i] = std::exp2(m[r + i] - m_new);
                l[r + i] = l[r + i] * alpha[r + i] + _mm512_reduce_add_ps(sum);
                m[r + i] = m_new;
            }
            for (int64_t i = 0; i < 4; i++) {               // rescale the rows' sums to the new maxima
                if (alpha[r + i] == 1.f) continue;
                const __m512 al = _mm512_set1_ps(alpha[r + i]);
                float* oi = o.data() + (r + i) * D;
                for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(oi + d, _mm512_mul_ps(_mm512_loadu_ps(oi + d), al));
            }
            for (int64_t c0 = 0; c0 < C; c0 += 4)           // D is a multiple of 64
                values4(w.data() + r * (KEYS / 2), vblock, nk / 2, C, c0, o.data() + r * D, D);
        }
    }
    finish_rows(a.out, a.lse, o.data(), m.data(), l.data(), R, G, seg.row0 + i0, g, a.Hq, D);
}

// The call's output and log-sum-exp, every segment's rows attended (the other arguments of Call
// set by the caller)
template <typename Keys, typename Task>
std::tuple<at::Tensor, at::Tensor> run_call(Call<Keys>& a, const at::Tensor& q, int64_t Hkv, double scale, Task&& task) {
    const at::Tensor qc = q.contiguous();
    at::Tensor out = at::empty(q.sizes(), q.options()), lse = at::empty({q.size(0), q.size(1)}, q.options());
    a.q = qc.data_ptr<float>();
    a.out = out.data_ptr<float>();
    a.lse = lse.data_ptr<float>();
    a.Hq = q.size(1);
    a.Hkv = Hkv;
    a.G = a.Hq / Hkv;
    a.D = q.size(2);
    a.sc = static_cast<float>(scale * 1.4426950408889634);
    for_each_task(a, [&](int64_t s, int64_t g, int64_t i0, int64_t i1) { task(a, s, g, i0, i1); });
    return {out, lse};
}

// One segment over keys k, v: key j is grid key lead + j
template <typename Keys>
Segment<Keys> alone(int64_t T, int64_t L, int64_t offset, int64_t window, int64_t lead, Keys own) {
    return {0, T, lead + L, offset < 0 ? -1 : lead + offset, window, lead, own};
}

// Segments after a shared prefix of S grid keys: segment s's rows[s] rows, then its own keys
// (k_own[s], v_own[s]: grid keys S ..), row i of them seeing every key up to its own L - rows + i
template <typename Keys, typename Pack>
std::vector<Segment<Keys>> after_shared(const char* name, int64_t T, int64_t S, const std::vector<Source>& k_own,
                                        const std::vector<Source>& v_own, at::IntArrayRef rows, Pack&& pack) {
    TORCH_CHECK(S > 0 && S % KEYS == 0, name, ": a shared prefix of a multiple of ", KEYS, " keys");
    TORCH_CHECK(k_own.size() == rows.size() && v_own.size() == rows.size() && !rows.empty(), name,
                ": the keys, the values and a row count of each segment");
    std::vector<Segment<Keys>> segs;
    int64_t row0 = 0;
    for (size_t s = 0; s < rows.size(); s++) {
        const int64_t L = k_own[s].L, t = rows[s];
        TORCH_CHECK(t > 0 && t <= L, name, ": each segment's rows at most its own keys");
        segs.push_back({row0, t, S + L, S + L - t, 0, 0, pack(k_own[s], v_own[s])});
        row0 += t;
    }
    TORCH_CHECK(row0 == T, name, ": the segments' rows are q's rows");
    return segs;
}

// One kernel's attention over its sources: one segment (the one-call ops), or segments after a
// shared prefix (cascade). K: the kernel (BF16 below, F32 further down).
template <typename K>
std::tuple<at::Tensor, at::Tensor> attend_alone(const at::Tensor& q, const Source& k, const Source& v, int64_t Hkv,
                                                int64_t offset, double scale, int64_t window, int64_t lead) {
    const typename K::Pack p = K::pack(k, v, Hkv, q.size(2), lead);
    Call<typename K::Keys> call{};
    call.segs.push_back(alone(q.size(0), k.L, offset, window, lead, p.keys));
    return run_call(call, q, Hkv, scale, K::task);
}

template <typename K>
at::Tensor attend_shared(const char* name, const at::Tensor& q, const Source& k_pre, const Source& v_pre,
                         const std::vector<Source>& k_own, const std::vector<Source>& v_own, at::IntArrayRef rows,
                         int64_t Hkv, double scale) {
    std::vector<typename K::Pack> packs;
    packs.reserve(rows.size() + 1);
    packs.push_back(K::pack(k_pre, v_pre, Hkv, q.size(2), 0));
    Call<typename K::Keys> call{};
    call.S = k_pre.L;
    call.shared = packs[0].keys;
    call.segs = after_shared<typename K::Keys>(name, q.size(0), k_pre.L, k_own, v_own, rows,
                                               [&](const Source& k, const Source& v) {
        packs.push_back(K::pack(k, v, Hkv, q.size(2), 0));
        return packs.back().keys;
    });
    return std::get<0>(run_call(call, q, Hkv, scale, K::task));
}

// The ops, for either kernel: over float32 tensors (the keys gathered: quantized pools, or a
// model's own cache), or over the engine's pool where it holds float32, float16 or bfloat16
template <typename K>
std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             int64_t offset, double scale, int64_t window, int64_t lead) {
    const std::string name = std::string("localrun::attention_") + K::NAME;
    TORCH_CHECK(K::allowed(), name, K::REFUSAL);
    check_args(name.c_str(), q, k, v, K::STEP, offset, window, lead);
    const Held hk = tensor_source(k), hv = tensor_source(v);
    return attend_alone<K>(q, hk.src, hv.src, k.size(0), offset, scale, window, lead);
}

template <typename K>
std::tuple<at::Tensor, at::Tensor> attention_paged(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                                   const at::Tensor& blocks, int64_t block_size, int64_t key0, int64_t L,
                                                   int64_t offset, double scale, int64_t window, int64_t lead,
                                                   const c10::optional<at::Tensor>& k_scale,
                                                   const c10::optional<at::Tensor>& v_scale) {
    const std::string name = std::string("localrun::attention_paged_") + K::NAME;
    TORCH_CHECK(K::allowed(), name, K::REFUSAL);
    check_pools(name.c_str(), q, k_pool, v_pool, K::STEP, k_scale, v_scale, block_size);
    check_blocks(name.c_str(), k_pool, blocks, block_size, key0, L);
    TORCH_CHECK(window == 0 || (window > 0 && offset >= 0), name, ": a window needs a causal offset");
    TORCH_CHECK(lead >= 0 && lead < KEYS, name, ": a lead of 0 to ", KEYS - 1, " keys");
    return attend_alone<K>(q, pool_source(k_pool, k_scale, blocks, block_size, key0, L),
                           pool_source(v_pool, v_scale, blocks, block_size, key0, L), k_pool.size(1), offset, scale,
                           window, lead);
}

template <typename K>
at::Tensor attention_shared(const at::Tensor& q, const at::Tensor& k_pre, const at::Tensor& v_pre, at::TensorList k_own,
                            at::TensorList v_own, at::IntArrayRef rows, double scale) {
    const std::string name = std::string("localrun::attention_shared_") + K::NAME;
    TORCH_CHECK(K::allowed(), name, K::REFUSAL);
    check_args(name.c_str(), q, k_pre, v_pre, K::STEP, -1, 0, 0);
    TORCH_CHECK(k_own.size() == v_own.size(), name, ": the keys, the values and a row count of each segment");
    const Held pre_k = tensor_source(k_pre), pre_v = tensor_source(v_pre);
    std::vector<Held> held;
    std::vector<Source> ks, vs;
    for (size_t s = 0; s < k_own.size(); s++) {
        check_args(name.c_str(), q, k_own[s], v_own[s], K::STEP, 0, 0, 0);
        TORCH_CHECK(k_own[s].size(0) == k_pre.size(0), name, ": each segment's KV heads the prefix's");
        held.push_back(tensor_source(k_own[s]));
        ks.push_back(held.back().src);
        held.push_back(tensor_source(v_own[s]));
        vs.push_back(held.back().src);
    }
    return attend_shared<K>(name.c_str(), q, pre_k.src, pre_v.src, ks, vs, rows, k_pre.size(0), scale);
}

template <typename K>
at::Tensor attention_shared_paged(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& blocks_pre, int64_t S, at::TensorList blocks_own,
                                  at::IntArrayRef own_keys, at::IntArrayRef rows, int64_t block_size, double scale,
                                  const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale) {
    const std::string name = std::string("localrun::attention_shared_paged_") + K::NAME;
    TORCH_CHECK(K::allowed(), name, K::REFUSAL);
    check_pools(name.c_str(), q, k_pool, v_pool, K::STEP, k_scale, v_scale, block_size);
    check_blocks(name.c_str(), k_pool, blocks_pre, block_size, 0, S);
    TORCH_CHECK(blocks_own.size() == own_keys.size(), name, ": the blocks and the number of own keys of each segment");
    std::vector<Source> ks, vs;
    for (size_t s = 0; s < blocks_own.size(); s++) {
        check_blocks(name.c_str(), k_pool, blocks_own[s], block_size, 0, own_keys[s]);
        ks.push_back(pool_source(k_pool, k_scale, blocks_own[s], block_size, 0, own_keys[s]));
        vs.push_back(pool_source(v_pool, v_scale, blocks_own[s], block_size, 0, own_keys[s]));
    }
    return attend_shared<K>(name.c_str(), q, pool_source(k_pool, k_scale, blocks_pre, block_size, 0, S),
                            pool_source(v_pool, v_scale, blocks_pre, block_size, 0, S), ks, vs, rows, k_pool.size(1), scale);
}

struct BF16 {
    using Keys = PackedBF16;
    using Pack = PackBF16;
    static constexpr const char* NAME = "bf16";
    static constexpr const char* REFUSAL = ": this CPU has no AVX-512 BF16 (or LOCALRUN_ISA forbids it)";
    static constexpr int64_t STEP = 64;
    static bool allowed() { return bf16_allowed(); }
    static Pack pack(const Source& k, const Source& v, int64_t Hkv, int64_t D, int64_t lead) {
        return pack_bf16(k, v, Hkv, D, lead);
    }
    static void task(const Call<Keys>& a, int64_t s, int64_t g, int64_t i0, int64_t i1) { attend_task(a, s, g, i0, i1); }
};

// ---- The same attention in float32 with FMA (AVX2 hosts; AVX-512 ones without BF16) ----
//
// No rounding of the inputs: the products and sums are float32 throughout, as torch's flash
// attention computes them (up to summation order and the exp polynomial's 2e-7). Why a kernel,
// then: on 2 Zen 3 cores torch's flash attention ran gemma-3's prompt at ~54 GFLOP/s (18% of a
// 512-token prefill) where two FMA pipes give ~190. Keys are packed per call as 8 keys per
// vector for each dim (KeysF32 below); values are read as stored (a row of D per key). A task is
// the same as above: one KV head, the grouped query heads of a few positions, on the same key grid.

#define F32_TARGET __attribute__((target("avx2,fma,f16c")))
constexpr int64_t RG = 6;      // query rows per register tile: 12 accumulators of 16 (2 x 8 lanes each)

bool f32_allowed() {
    static const bool allowed = [] {
        const char* env = std::getenv("LOCALRUN_ISA");
        const std::string forced = env ? env : "";
        __builtin_cpu_init();
        return (forced.empty() || forced == "avx512" || forced == "avxvnni" || forced == "avx2") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }();
    return allowed;
}

// 2^x for x <= 0 (-inf -> 0): 2^n * p(f) as exp2_neg above; n <= -127 gives exactly 0 (the
// weight of a key 127 binary orders below the row's largest: negligible before it vanishes)
F32_TARGET inline __m256 exp2_neg8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-127.f));
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.6931471805599453f));
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

F32_TARGET inline float reduce_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return std::max(_mm_cvtss_f32(m), _mm_cvtss_f32(_mm_shuffle_ps(m, m, 1)));
}

F32_TARGET inline float reduce_add8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(a) + _mm_cvtss_f32(_mm_shuffle_ps(a, a, 1));
}

// Scores of RG query rows (q, stride D) over 16 keys (kb: [2][D][8]), times sc, into s[i][0 .. 16)
F32_TARGET inline void scores4_f32(const float* q, int64_t D, const float* kb, float* s, float sc) {
    __m256 acc[RG][2];
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < 2; c++) acc[i][c] = _mm256_setzero_ps();
    const float* k1 = kb + D * 8;
#pragma GCC unroll 2
    for (int64_t d = 0; d < D; d++) {
        const __m256 ka = _mm256_loadu_ps(kb + d * 8), kc = _mm256_loadu_ps(k1 + d * 8);
        for (int i = 0; i < RG; i++) {
            const __m256 qb = _mm256_broadcast_ss(q + i * D + d);
            acc[i][0] = _mm256_fmadd_ps(qb, ka, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(qb, kc, acc[i][1]);
        }
    }
    const __m256 scale = _mm256_set1_ps(sc);
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < 2; c++) _mm256_storeu_ps(s + i * KEYS + c * 8, _mm256_mul_ps(acc[i][c], scale));
}

// o[i][16 dims from d0] += sum over keys t < n of w[i][t] v[t] for RG rows (v: rows vr floats apart)
F32_TARGET inline void values4_f32(const float* w, const float* v, int64_t n, int64_t vr, int64_t D, int64_t d0, float* o) {
    __m256 acc[RG][2];
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < 2; c++) acc[i][c] = _mm256_loadu_ps(o + i * D + d0 + 8 * c);
    for (int64_t t = 0; t < n; t++) {
        const __m256 v0 = _mm256_loadu_ps(v + t * vr + d0), v1 = _mm256_loadu_ps(v + t * vr + d0 + 8);
        for (int i = 0; i < RG; i++) {
            const __m256 wb = _mm256_broadcast_ss(w + i * KEYS + t);
            acc[i][0] = _mm256_fmadd_ps(wb, v0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(wb, v1, acc[i][1]);
        }
    }
    for (int i = 0; i < RG; i++)
        for (int c = 0; c < 2; c++) _mm256_storeu_ps(o + i * D + d0 + 8 * c, acc[i][c]);
}

// One KV head's keys packed 8 keys a vector for each dim ([n16 / 8][D][8], packed key lead + j
// holding key j, zeros around them) and its values as stored (L rows of D)
struct KeysF32 {
    const float* kp; const float* v;
    int64_t n16, L, lead;
    int64_t vh, vr;                              // the floats between heads and between rows of v
};

struct PackF32 {
    at::Tensor kp, v;
    KeysF32 keys;
};

// 8 values of a row from dim d as float32, as load16
F32_TARGET inline __m256 load8(const Source& src, const uint8_t* row, const float* sc, int64_t d) {
    if (src.kind == 0) return _mm256_loadu_ps((const float*)row + d);
    if (src.kind >= 3) {
        const __m256 s = src.group == 1 ? _mm256_loadu_ps(sc + d) : _mm256_set1_ps(sc[d / src.group]);
        const __m256 c = src.kind == 3 ? _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + d))))
                                       : fp8x8(row + d);
        return _mm256_mul_ps(c, s);
    }
    const __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)row + d));
    if (src.kind == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 x 8 transposition of floats: out[c] lane j = r[j] lane c
F32_TARGET inline void transpose8_ps(const __m256* r, __m256* out) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {       // u[4i + c], 128-bit half h: lanes c + 4h of r[4i .. 4i + 3]
        u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
        u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
        u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
        u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        out[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        out[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

// Keys key0 .. key0 + 7 of KV head g (zeros outside 0 .. L - 1) transposed: dst[d][8]
F32_TARGET void pack_keys8(const Source& k, int64_t g, int64_t D, int64_t key0, float* dst) {
    const uint8_t* rows[8];
    const float* sc[8];
    k.rows(g, key0, 8, rows, sc);
    __m256 r[8], out[8];
    for (int64_t d = 0; d < D; d += 8) {                // D is a multiple of 16
        for (int j = 0; j < 8; j++) r[j] = rows[j] ? load8(k, rows[j], sc[j], d) : _mm256_setzero_ps();
        transpose8_ps(r, out);
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(dst + (d + c) * 8, out[c]);
    }
}

// Values j0 .. j0 + 15 (those that exist) of KV head g as float32 rows of D, from a pool or a
// 16-bit source
F32_TARGET void widen_rows(const Source& v, int64_t g, int64_t j0, int64_t D, float* dst) {
    const uint8_t* rows[16];
    const float* sc[16];
    v.rows(g, j0, 16, rows, sc);
    for (int64_t j = j0; j < std::min(j0 + 16, v.L); j++)
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(dst + j * D + d, load8(v, rows[j - j0], sc[j - j0], d));
}

// Keys packed for every head (key j at packed key lead + j); values read where they are (a
// float32 tensor) or widened into float32 rows (a pool)
PackF32 pack_f32(const Source& k, const Source& v, int64_t Hkv, int64_t D, int64_t lead) {
    const int64_t n16 = (lead + k.L + 15) / 16 * 16, B = n16 / 8;
    PackF32 p{at::empty({Hkv, n16 * D}, at::kFloat), at::Tensor(), {}};
    float* kpp = p.kp.data_ptr<float>();
    at::parallel_for(0, B, 8, [&](int64_t b0, int64_t b1) {   // every head's 8 keys in turn (pack_bf16)
        for (int64_t b = b0; b < b1; b++)
            for (int64_t g = 0; g < Hkv; g++)               // 8 keys of one head, transposed
                pack_keys8(k, g, D, b * 8 - lead, kpp + (g * B + b) * D * 8);
    });
    if (v.blocks == nullptr && v.kind == 0) {
        p.keys = {kpp, reinterpret_cast<const float*>(v.data), n16, k.L, lead, v.hs, v.rs};
        return p;
    }
    p.v = at::empty({Hkv, v.L, D}, at::kFloat);
    float* vd = p.v.data_ptr<float>();
    const int64_t V16 = (v.L + 15) / 16;
    at::parallel_for(0, V16, 4, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; b++)
            for (int64_t g = 0; g < Hkv; g++) widen_rows(v, g, b * 16, D, vd + g * v.L * D);
    });
    p.keys = {kpp, vd, n16, k.L, lead, v.L * D, D};
    return p;
}

F32_TARGET void attend_task_f32(const Call<KeysF32>& a, int64_t s, int64_t g, int64_t i0, int64_t i1) {
    const Segment<KeysF32>& seg = a.segs[s];
    const int64_t D = a.D, G = a.G;
    const int64_t R = (i1 - i0) * G, RP = (R + RG - 1) / RG * RG;
    std::vector<float> qr(RP * D, 0.f), o(RP * D, 0.f), sc(RP * KEYS), w(RP * KEYS);
    std::vector<float> m(RP, -std::numeric_limits<float>::infinity()), l(RP, 0.f);
    std::vector<int64_t> first(RP), last(RP);
    row_spans(seg, i0, R, RP, G, first.data(), last.data());
    for (int64_t r = 0; r < R; r++)
        std::memcpy(qr.data() + r * D, a.q + ((seg.row0 + i0 + r / G) * a.Hq + g * G + r % G) * D, D * sizeof(float));
    const int64_t end = last[RP - 1] + 1, begin = first[0] / KEYS * KEYS;
    for (int64_t k0 = begin; k0 < end; k0 += KEYS) {
        const int64_t nv = std::min<int64_t>(KEYS / 8, (end - k0 + 7) / 8), nk = nv * 8;
        const KeysF32& run = k0 < a.S ? a.shared : seg.own;      // a block is all shared or all own
        const int64_t key = k0 < a.S ? k0 : k0 - a.S;            // its first packed key
        const float* kp = run.kp + (g * run.n16 + key) * D;
        // the block's stored keys: j0 .. j0 + nk - 1 of the run, those before 0 or from L on weigh 0
        const int64_t j0 = key - run.lead, lo = std::max<int64_t>(0, -j0), hi = std::min(nk, run.L - j0);
        const float* vlo = run.v + g * run.vh + (j0 + lo) * run.vr;  // key j0 + lo's value
        // Each pass over the block's keys (16 at a time) or values (16 dims at a time) serves every
        // row of the task before it moves on, so those stay in L1 across the row groups: a group of
        // 4 rows alone read each value line once per 8 FMAs, as fast as L2 delivers it.
        for (int64_t c = 0; c < nv; c += 2)                 // keys packed to a multiple of 16
            for (int64_t r = 0; r < RP; r += RG)
                scores4_f32(qr.data() + r * D, D, kp + c * D * 8, sc.data() + r * KEYS + c * 8, a.sc);
        for (int64_t r = 0; r < RP; r++) {                  // online softmax of the block, row r
            float* sr = sc.data() + r * KEYS;
            const int64_t seen = std::min(nk, last[r] - k0 + 1);
            for (int64_t k = std::max<int64_t>(seen, 0); k < nk; k++) sr[k] = -std::numeric_limits<float>::infinity();
            for (int64_t k = 0; k < std::min(nk, first[r] - k0); k++) sr[k] = -std::numeric_limits<float>::infinity();
            __m256 mx = _mm256_loadu_ps(sr);
            for (int64_t c = 1; c < nv; c++) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sr + c * 8));
            const float m_new = std::max(m[r], reduce_max8(mx));
            float* wr = w.data() + r * KEYS;
            if (m_new == -std::numeric_limits<float>::infinity()) {   // nothing seen yet
                std::memset(wr, 0, KEYS * sizeof(float));
                continue;
            }
            const __m256 mv = _mm256_set1_ps(m_new);
            __m256 sum = _mm256_setzero_ps();
            for (int64_t c = 0; c < nv; c++) {
                const __m256 p = exp2_neg8(_mm256_sub_ps(_mm256_loadu_ps(sr + c * 8), mv));
                sum = _mm256_add_ps(sum, p);
                _mm256_storeu_ps(wr + c * 8, p);
            }
            const float alpha = std::exp2(m[r] - m_new);
            l[r] = l[r] * alpha + reduce_add8(sum);
            m[r] = m_new;
            if (alpha != 1.f) {                             // rescale the row's sums to the new maximum
                const __m256 al = _mm256_set1_ps(alpha);
                float* orow = o.data() + r * D;
                for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(orow + d, _mm256_mul_ps(_mm256_loadu_ps(orow + d), al));
            }
        }
        if (hi > lo)                                        // the keys outside weigh 0: skipping them adds nothing
            for (int64_t d0 = 0; d0 < D; d0 += 16)          // D is a multiple of 16
                for (int64_t r = 0; r < RP; r += RG)
                    values4_f32(w.data() + r * KEYS + lo, vlo, hi - lo, run.vr, D, d0, o.data() + r * D);
    }
    finish_rows(a.out, a.lse, o.data(), m.data(), l.data(), R, G, seg.row0 + i0, g, a.Hq, D);
}

struct F32 {
    using Keys = KeysF32;
    using Pack = PackF32;
    static constexpr const char* NAME = "f32";
    static constexpr const char* REFUSAL = ": this CPU has no AVX2, FMA and F16C (or LOCALRUN_ISA forbids them)";
    static constexpr int64_t STEP = 16;
    static bool allowed() { return f32_allowed(); }
    static Pack pack(const Source& k, const Source& v, int64_t Hkv, int64_t D, int64_t lead) {
        return pack_f32(k, v, Hkv, D, lead);
    }
    static void task(const Call<Keys>& a, int64_t s, int64_t g, int64_t i0, int64_t i1) { attend_task_f32(a, s, g, i0, i1); }
};

}  // namespace
}  // namespace localrun

TORCH_LIBRARY_FRAGMENT(localrun, m) {
    for (const char* kind : {"bf16", "f32"}) {
        const std::string k = kind;
        m.def(("attention_" + k + "(Tensor q, Tensor k, Tensor v, int offset, float scale, int window=0, int lead=0) -> "
               "(Tensor, Tensor)").c_str());
        m.def(("attention_paged_" + k + "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor blocks, int block_size, int key0, "
               "int L, int offset, float scale, int window=0, int lead=0, Tensor? k_scale=None, Tensor? v_scale=None) -> "
               "(Tensor, Tensor)").c_str());
        m.def(("attention_shared_" + k + "(Tensor q, Tensor k_pre, Tensor v_pre, Tensor[] k_own, Tensor[] v_own, "
               "int[] rows, float scale) -> Tensor").c_str());
        m.def(("attention_shared_paged_" + k + "(Tensor q, Tensor k_pool, Tensor v_pool, Tensor blocks_pre, int S, "
               "Tensor[] blocks_own, int[] own_keys, int[] rows, int block_size, float scale, Tensor? k_scale=None, "
               "Tensor? v_scale=None) -> Tensor").c_str());
    }
    m.def("has_attention_bf16() -> bool", [] { return localrun::bf16_allowed(); });
    m.def("has_attention_f32() -> bool", [] { return localrun::f32_allowed(); });
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    using localrun::BF16;
    using localrun::F32;
    m.impl("attention_bf16", &localrun::attention<BF16>);
    m.impl("attention_paged_bf16", &localrun::attention_paged<BF16>);
    m.impl("attention_shared_bf16", &localrun::attention_shared<BF16>);
    m.impl("attention_shared_paged_bf16", &localrun::attention_shared_paged<BF16>);
    m.impl("attention_f32", &localrun::attention<F32>);
    m.impl("attention_paged_f32", &localrun::attention_paged<F32>);
    m.impl("attention_shared_f32", &localrun::attention_shared<F32>);
    m.impl("attention_shared_paged_f32", &localrun::attention_shared_paged<F32>);
}
