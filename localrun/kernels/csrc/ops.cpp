// localrun's compiled ops, registered with torch.library (namespace `localrun`):
//   qmatmul(x, weights, qtypes) -> y      x (M, K) float32; weights: GGUF rows (N_i, row bytes) uint8,
//                                         used in place; y (M, sum N_i) float32 = x @ [W_0; W_1; ...].T
//   dequantize(w, qtype, k) -> (N, K) float32
//   qmatmul_f32(x, weights, qtypes) -> y  the same product with x in float32 (no 8-bit rounding):
//                                         the prompt rows' path below the GEMM's threshold
//   isa() -> str                          the instruction set the kernels dispatch to
// The instruction set is chosen once from the CPU's features, or forced with LOCALRUN_ISA=
// avx512|avxvnni|avx2|ref. Work is split over weight rows with at::parallel_for (torch's thread pool).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>
#include "ref.h"

namespace localrun {
// Each instruction set's build of qmatmul_simd.h (qmatmul_<isa>.cpp), in its own namespace
#define LOCALRUN_SIMD_DECLS                                                                                              \
    bool matmul_rows(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, const QX&, int64_t, float*, int64_t, bool); \
    bool matmul_rows_f32(int, const uint8_t*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t); \
    void quantize_rows(const float*, int64_t, int64_t, int64_t, int8_t*, float*, int32_t*, float*, float*, float*, float*); \
    bool dequantize_rows(int, const uint8_t*, int64_t, int64_t, int64_t, int64_t, float*);
namespace avx2 { LOCALRUN_SIMD_DECLS }
namespace avxvnni { LOCALRUN_SIMD_DECLS }
namespace avxvnni_evex { LOCALRUN_SIMD_DECLS }
namespace avx512 { LOCALRUN_SIMD_DECLS }

namespace {

enum class Isa { Ref, Avx2, AvxVnni, Avx512 };

// One instruction set's kernels (nullptr: the scalar reference, ref.h)
struct Simd {
    decltype(&avx2::matmul_rows) matmul_rows;
    decltype(&avx2::matmul_rows_f32) matmul_rows_f32;
    decltype(&avx2::quantize_rows) quantize_rows;
    decltype(&avx2::dequantize_rows) dequantize_rows;
};
#define LOCALRUN_SIMD(ns) Simd{&ns::matmul_rows, &ns::matmul_rows_f32, &ns::quantize_rows, &ns::dequantize_rows}

struct Chosen {
    Isa isa;
    const Simd* simd;
};

// AVX-512 (F/BW/VL/DQ + VNNI) where the CPU has it, else AVX-VNNI (the AVX2 kernels with
// vpdpbusd: Intel client cores from Alder Lake on), else AVX2, else the scalar reference.
// LOCALRUN_ISA=avxvnni on a CPU without AVX-VNNI but with AVX-512 VNNI runs the same kernels
// through vpdpbusd's EVEX form (qmatmul_avxvnni_evex.cpp), so an AVX-512 host tests that path.
Chosen detect_isa() {
    static const Simd avx2_k = LOCALRUN_SIMD(avx2), avxvnni_k = LOCALRUN_SIMD(avxvnni),
                      avxvnni_evex_k = LOCALRUN_SIMD(avxvnni_evex), avx512_k = LOCALRUN_SIMD(avx512);
    const char* forced = std::getenv("LOCALRUN_ISA");
    __builtin_cpu_init();
    const bool has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    const bool has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                            __builtin_cpu_supports("avx512vnni");
    const bool has_avxvnni = has_avx2 && __builtin_cpu_supports("avxvnni");
    const Chosen avx512{Isa::Avx512, &avx512_k}, avx2{Isa::Avx2, &avx2_k}, ref{Isa::Ref, nullptr};
    const Chosen avxvnni{Isa::AvxVnni, has_avxvnni ? &avxvnni_k : &avxvnni_evex_k};
    if (forced && *forced) {
        std::string f(forced);
        if (f == "ref") return ref;
        if (f == "avx2") { TORCH_CHECK(has_avx2, "LOCALRUN_ISA=avx2 but this CPU lacks AVX2/FMA/F16C"); return avx2; }
        if (f == "avxvnni") {
            TORCH_CHECK(has_avxvnni || has_avx512, "LOCALRUN_ISA=avxvnni but this CPU lacks AVX-VNNI (and AVX-512 VNNI)");
            return avxvnni;
        }
        if (f == "avx512") { TORCH_CHECK(has_avx512, "LOCALRUN_ISA=avx512 but this CPU lacks AVX-512 VNNI"); return avx512; }
        TORCH_CHECK(false, "LOCALRUN_ISA must be avx512, avxvnni, avx2 or ref, got ", f);
    }
    return has_avx512 ? avx512 : has_avxvnni ? avxvnni : has_avx2 ? avx2 : ref;
}

const Chosen& chosen() {
    static const Chosen c = detect_isa();
    return c;
}
Isa isa() { return chosen().isa; }
const Simd* simd() { return chosen().simd; }

std::string isa_name() {
    switch (isa()) {
        case Isa::Avx512: return "avx512";
        case Isa::AvxVnni: return "avxvnni";
        case Isa::Avx2: return "avx2";
        default: return "ref";
    }
}

// A weight's type with this bit set asks for the lane layout of the integer kernel (eight
// weight rows side by side, qmatmul_simd.h; AVX2's maddubs or AVX-512 VNNI's vpdpbusd, the same
// bits). A call's rows get the same bits whatever their number in either layout; the layouts
// differ from each other by summation order, so an engine uses one (localrun/model/gguf_weight.py).
constexpr int64_t LANES = 1 << 8;

int64_t row_bytes_of(int qtype, int64_t K) {
    int values, bytes;
    block_shape(qtype, values, bytes);
    TORCH_CHECK(values > 0, "localrun::qmatmul: GGML type ", qtype, " has no kernel");
    TORCH_CHECK(K % values == 0, "localrun::qmatmul: K=", K, " is not a multiple of the type's block of ", values);
    return K / values * bytes;
}

// From this many rows a call's activations are quantized by all threads (rows split among
// them), however short: a 16-row decode step's 120 matmuls quantized 16 x 576 or 16 x 1536
// values on the calling thread while the others waited. SmolLM2's 30 layers of matmuls, one
// process alternating the two ways call by call (Zen 4, 2 threads): 16 rows 0.89-0.96x the
// time, 32 rows 0.88x, 8 rows 0.99x, 2 and 4 rows 1.00-1.01x (2026-12-04).
constexpr int64_t QUANTIZE_SPLIT_ROWS = 8;

void quantize(const float* x, int64_t M, int64_t K, int8_t* qs, float* d, int32_t* s, float* dxv, float* sxv,
              float* sxh, float* sxg) {
    auto body = [&](int64_t m0, int64_t m1) {
        if (const Simd* k = simd()) {
            k->quantize_rows(x, K, m0, m1, qs, d, s, dxv, sxv, sxh, sxg);
        } else {
            for (int64_t m = m0; m < m1; m++)
                quantize_row_ref(x + m * K, K, qs + m * K, d + m * (K / 32), s + m * (K / 16));
        }
    };
    if (M < QUANTIZE_SPLIT_ROWS && M * K < 65536) body(0, M); else at::parallel_for(0, M, 1, body);
}

// rows n0 .. n1 - 1 of a weight of n_end rows (the kernels' prefetches may reach past n1)
void matmul_range(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t n_end, const QX& qx,
                  int64_t M, float* y, int64_t ldy, bool lanes) {
    if (const Simd* k = simd()) {
        k->matmul_rows(qtype, w, row_bytes, n0, n1, n_end, qx, M, y, ldy, lanes);
        return;
    }
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) y[m * ldy + n] = dot_row_ref(qtype, w + n * row_bytes, qx, m);
}

void matmul_range_f32(int qtype, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const float* x, int64_t K,
                      int64_t M, float* y, int64_t ldy) {
    if (const Simd* k = simd()) {
        k->matmul_rows_f32(qtype, w, row_bytes, n0, n1, x, K, M, y, ldy);
        return;
    }
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; n++) {
        dequantize_row_ref(qtype, w + n * row_bytes, K, row.data());
        for (int64_t m = 0; m < M; m++) {
            double sum = 0.0;
            for (int64_t k = 0; k < K; k++) sum += (double)row[k] * x[m * K + k];
            y[m * ldy + n] = (float)sum;
        }
    }
}

// The quantized activations of one call, in a buffer that each calling thread keeps and reuses
// (it only grows): five tensors a call cost more than quantizing one decode row. The threads of
// the call read it; nothing keeps it past the call.
struct ActivationBuffers {
    std::vector<float> storage;
    int8_t* qs; float* d; int32_t* s; float* dxv; float* sxv; float* sxh; float* sxg;
};

// lane_sums: also room for the lane layout's sums (sxh, sxg), else they are null and not computed
ActivationBuffers& activation_buffers(int64_t M, int64_t K, bool lane_sums) {
    thread_local ActivationBuffers buf;
    const int64_t qs_floats = (M * K + 3) / 4, d = M * (K / 32), s = M * (K / 16), v = M * (K / 32) * 8;
    const int64_t h = lane_sums ? M * (K / 16) : 0, g = h / 2;
    buf.storage.resize(std::max<size_t>(buf.storage.size(), qs_floats + d + s + 2 * v + h + g));
    float* p = buf.storage.data();
    buf.sxh = h ? p : nullptr; buf.sxg = h ? p + h : nullptr; p += h + g;
    buf.dxv = p; buf.sxv = p + v; buf.d = p + 2 * v;
    buf.s = reinterpret_cast<int32_t*>(p + 2 * v + d);
    buf.qs = reinterpret_cast<int8_t*>(p + 2 * v + d + s);
    return buf;
}

// A call's N weight rows, shared out among the threads in chunks. Each thread starts on a
// contiguous share of its own and takes its chunks front to back (one stream for the hardware
// prefetcher and the kernels' next-tile requests); a thread done with its share takes chunks
// from the back of another's. A static split left a thread waiting for the other in every call
// (a slower vCPU, a Q6_K part beside Q4_K ones): the one-row calls of a decode step of the 1.1B
// Q4_K_M file (benchmarks/synthetic_model.py) kept their two threads busy 96.3% of the call's time.
// Every matmul of that file in layer order, one process alternating the two ways (Zen 4, 2
// threads, 2026-12-05), median of the passes' ratios: one row 0.978-0.985 of the time, 64 rows
// 0.977; with a busy process on one of the two cores (a desktop's other work) one row 0.87. Each
// row is computed on its own, so the split does not change a bit. One word per share: its next
// row (low 32 bits) and its end.
class RowShares {
public:
    RowShares(int64_t N, int64_t threads, int64_t chunk) : shares_(threads), chunk_(chunk) {
        const int64_t per = ((N + threads - 1) / threads + 15) / 16 * 16;     // whole 16-row tiles
        for (int64_t t = 0; t < threads; t++) {
            const int64_t lo = std::min(N, t * per), hi = t + 1 == threads ? N : std::min(N, (t + 1) * per);
            shares_[t].store((uint64_t)hi << 32 | (uint64_t)lo);
        }
    }
    template <class F>
    void run(int64_t t, F&& f) {      // thread t: its own share, then the others' backs
        int64_t b, e;
        while (take(t, true, b, e)) f(b, e);
        for (int64_t k = 1; k < (int64_t)shares_.size(); k++) {
            const int64_t o = (t + k) % (int64_t)shares_.size();
            while (take(o, false, b, e)) f(b, e);
        }
    }

private:
    bool take(int64_t t, bool front, int64_t& b, int64_t& e) {
        uint64_t cur = shares_[t].load();
        for (;;) {
            const int64_t lo = (int64_t)(cur & 0xffffffffu), hi = (int64_t)(cur >> 32);
            if (lo >= hi) return false;
            // the owner takes half of what is left (at least a chunk): few breaks in its stream
            const int64_t size = front ? std::max(chunk_, (hi - lo) / 2 / 16 * 16) : chunk_;
            b = front ? lo : std::max(lo, hi - size);
            e = front ? std::min(hi, lo + size) : hi;
            const uint64_t next = front ? (uint64_t)hi << 32 | (uint64_t)e : (uint64_t)b << 32 | (uint64_t)lo;
            if (shares_[t].compare_exchange_weak(cur, next)) return true;
        }
    }
    std::vector<std::atomic<uint64_t>> shares_;
    int64_t chunk_;
};

at::Tensor qmatmul_impl(const at::Tensor& x_in, at::TensorList weights, at::IntArrayRef qtypes, bool float_activations) {
    TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "localrun::qmatmul: x must be (M, K) float32");
    TORCH_CHECK(weights.size() == qtypes.size() && !weights.empty(), "localrun::qmatmul: one qtype per weight");
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1);
    TORCH_CHECK(K % 32 == 0, "localrun::qmatmul: K must be a multiple of 32, got ", K);
    std::vector<int64_t> starts{0};
    std::vector<int> types;                 // the GGML types, without the LANES bit
    bool lanes = false;                     // a part asks for the lane layout (AVX2 and AVX-512)
    for (size_t i = 0; i < weights.size(); i++) {
        const at::Tensor& w = weights[i];
        types.push_back((int)(qtypes[i] & ~LANES));
        lanes |= (qtypes[i] & LANES) && isa() != Isa::Ref;
        TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                    "localrun::qmatmul: weights must be contiguous (N, row bytes) uint8");
        TORCH_CHECK(w.size(1) == row_bytes_of(types[i], K), "localrun::qmatmul: weight ", i, " has ", w.size(1),
                    " bytes per row, its type needs ", row_bytes_of(types[i], K));
        starts.push_back(starts.back() + w.size(0));
    }
    const int64_t N = starts.back();
    at::Tensor y = at::empty({M, N}, x.options());
    if (M == 0) return y;
    const int64_t grain = std::max<int64_t>(16, N / (4 * at::get_num_threads()) / 16 * 16);
    float* out = y.data_ptr<float>();
    // chunks of about 64 KB of weight rows (16-row multiples), from the widest part's row size
    int64_t widest = 1;
    for (const at::Tensor& w : weights) widest = std::max<int64_t>(widest, w.size(1));
    const int64_t chunk = std::max<int64_t>(16, (65536 / widest) / 16 * 16);
    const int64_t threads = at::get_num_threads();
    auto over_rows = [&](auto&& run) {      // one pass over all weights' rows, split at part boundaries
        auto rows = [&](int64_t b, int64_t e) {
            for (size_t i = 0; i < weights.size(); i++) {
                const int64_t lo = std::max(b, starts[i]), hi = std::min(e, starts[i + 1]);
                if (lo < hi) run(i, lo - starts[i], hi - starts[i]);
            }
        };
        if (threads < 2 || N < 4 * chunk || N >= (int64_t{1} << 31)) {
            at::parallel_for(0, N, grain, rows);
            return;
        }
        RowShares shares(N, threads, chunk);
        at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
            for (int64_t t = t0; t < t1; t++) shares.run(t, rows);
        });
    };
    if (float_activations) {
        const float* xp = x.data_ptr<float>();
        over_rows([&](size_t i, int64_t n0, int64_t n1) {
            const at::Tensor& w = weights[i];
            matmul_range_f32(types[i], w.data_ptr<uint8_t>(), w.size(1), n0, n1, xp, K, M, out + starts[i], N);
        });
        return y;
    }
    ActivationBuffers& buf = activation_buffers(M, K, lanes);
    quantize(x.data_ptr<float>(), M, K, buf.qs, buf.d, buf.s, buf.dxv, buf.sxv, buf.sxh, buf.sxg);
    const QX qx{buf.qs, buf.d, buf.s, K, buf.dxv, buf.sxv, buf.sxh, buf.sxg};
    over_rows([&](size_t i, int64_t n0, int64_t n1) {   // part i's rows n0..n1, at column offset starts[i]
        const at::Tensor& w = weights[i];
        matmul_range(types[i], w.data_ptr<uint8_t>(), w.size(1), n0, n1, w.size(0), qx, M, out + starts[i], N,
                     qtypes[i] & LANES);
    });
    return y;
}

at::Tensor qmatmul(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes) {
    return qmatmul_impl(x, weights, qtypes, false);
}

at::Tensor qmatmul_f32(const at::Tensor& x, at::TensorList weights, at::IntArrayRef qtypes) {
    return qmatmul_impl(x, weights, qtypes, true);
}

at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t K) {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.is_contiguous(),
                "localrun::dequantize: w must be contiguous (N, row bytes) uint8");
    const int64_t row_bytes = row_bytes_of((int)qtype, K);
    TORCH_CHECK(w.size(1) == row_bytes, "localrun::dequantize: ", w.size(1), " bytes per row, the type needs ", row_bytes);
    const int64_t N = w.size(0);
    at::Tensor out = at::empty({N, K}, w.options().dtype(at::kFloat));
    const uint8_t* src = w.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
        if (const Simd* k = simd()) {
            k->dequantize_rows((int)qtype, src, row_bytes, K, n0, n1, dst);
        } else {
            for (int64_t n = n0; n < n1; n++) dequantize_row_ref((int)qtype, src + n * row_bytes, K, dst + n * K);
        }
    });
    return out;
}

}  // namespace
}  // namespace localrun

TORCH_LIBRARY(localrun, m) {
    m.def("qmatmul(Tensor x, Tensor[] weights, int[] qtypes) -> Tensor");
    m.def("qmatmul_f32(Tensor x, Tensor[] weights, int[] qtypes) -> Tensor");
    m.def("dequantize(Tensor w, int qtype, int k) -> Tensor");
    m.def("isa() -> str", [] { return localrun::isa_name(); });
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("qmatmul", &localrun::qmatmul);
    m.impl("qmatmul_f32", &localrun::qmatmul_f32);
    m.impl("dequantize", &localrun::dequantize);
}
