// Fused small ops of a transformer block, float32, rows split over torch's threads:
//   rms_norm(x, w, eps)                 x (T, D) -> x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, r, w, eps) -> (h, n) h = x + r, n = rms_norm(h, w, eps)   (residual + next norm)
//   silu_mul(gu) -> (T, F)              gu (T, 2F) = [gate | up] -> silu(gate) * up
//   gelu_mul(gu) -> (T, F)              the same with gelu_tanh(gate) (gemma's GeGLU)
//   rope(x, freqs, neox) -> (T, H, hd)  x rotated by freqs (T, hd/2) complex: llama.py's apply_rope
// Each replaces 3-6 torch ops (and their allocations) per call; the plain torch expressions
// in localrun/model/llama.py are the reference the tests compare with.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <string>
#include <tuple>
#include "vec8.h"

namespace localrun {
namespace {

void check_rows(const at::Tensor& x, const char* name) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "localrun::", name, ": expects a contiguous (T, D) float32 tensor");
}

// N rows (D values each, rows D apart) normalized: each row's sum of squares in double, in index
// order (the products are exact), then x * scale * w. The N rows' sums are N independent chains
// of additions, so one row no longer waits on its own additions' latency (one row alone: ~1 us
// for D = 576); every row's bits are those of the row alone.
template <int N>
ALWAYS_INLINE void norm_rows_n(const float* h, const float* w, int64_t D, double eps, float* out) {
    double sum[N] = {};
    for (int64_t i = 0; i < D; i++)
        for (int r = 0; r < N; r++) sum[r] += (double)h[r * D + i] * h[r * D + i];
    for (int r = 0; r < N; r++) {
        const float scale = (float)(1.0 / std::sqrt(sum[r] / (double)D + eps));
        for (int64_t i = 0; i < D; i++) out[r * D + i] = h[r * D + i] * scale * w[i];
    }
}
constexpr int64_t NORM_ROWS = 8;     // rows a group (and the threads' grain)
inline void norm_rows(const float* h, const float* w, int64_t n, int64_t D, double eps, float* out) {
    switch (n) {
        case 1: norm_rows_n<1>(h, w, D, eps, out); return;
        case 2: norm_rows_n<2>(h, w, D, eps, out); return;
        case 3: norm_rows_n<3>(h, w, D, eps, out); return;
        case 4: norm_rows_n<4>(h, w, D, eps, out); return;
        case 5: norm_rows_n<5>(h, w, D, eps, out); return;
        case 6: norm_rows_n<6>(h, w, D, eps, out); return;
        case 7: norm_rows_n<7>(h, w, D, eps, out); return;
        default: norm_rows_n<8>(h, w, D, eps, out); return;
    }
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
    const at::Tensor x = x_in.contiguous();
    check_rows(x, "rms_norm");
    const int64_t T = x.size(0), D = x.size(1);
    TORCH_CHECK(w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "localrun::rms_norm: w must be (D,) float32");
    at::Tensor out = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, NORM_ROWS, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t += NORM_ROWS)
            norm_rows(xp + t * D, wp, std::min(NORM_ROWS, t1 - t), D, eps, op + t * D);
    });
    return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& r_in, const at::Tensor& w, double eps) {
    const at::Tensor x = x_in.contiguous(), r = r_in.contiguous();
    check_rows(x, "add_rms_norm");
    check_rows(r, "add_rms_norm");
    TORCH_CHECK(x.sizes() == r.sizes(), "localrun::add_rms_norm: x and r differ in shape");
    const int64_t T = x.size(0), D = x.size(1);
    TORCH_CHECK(w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "localrun::add_rms_norm: w must be (D,) float32");
    at::Tensor h = at::empty_like(x), out = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *rp = r.data_ptr<float>(), *wp = w.data_ptr<float>();
    float *hp = h.data_ptr<float>(), *op = out.data_ptr<float>();
    at::parallel_for(0, T, NORM_ROWS, [&](int64_t t0, int64_t t1) {
        for (int64_t i = t0 * D; i < t1 * D; i++) hp[i] = xp[i] + rp[i];
        for (int64_t t = t0; t < t1; t += NORM_ROWS)
            norm_rows(hp + t * D, wp, std::min(NORM_ROWS, t1 - t), D, eps, op + t * D);
    });
    return {h, out};
}

// The gated activations with the vector exp (vec8.h), for any width of vector V (int32 VI):
//   silu(g) = g / (1 + e^-g)
//   gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), tanh(z) = 1 - 2 / (e^2z + 1)
// Each lane's steps are the same at any width, so 16 lanes give 8 lanes' bits.
struct Silu {
    template <typename V, typename VI>
    static ALWAYS_INLINE V apply(V g) { return g / (1.f + expv<V, VI>(-g)); }
};
struct GeluTanh {
    template <typename V, typename VI>
    static ALWAYS_INLINE V apply(V g) {
        const V z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        const V t = 1.f - 2.f / (expv<V, VI>(2.f * z) + 1.f);
        return 0.5f * g * (1.f + t);
    }
};

// act(g) * u over n values: W at a time (16 in the AVX-512 build), then 8, then the tail
// through the same 8-lane code, one lane used
template <class Act, int W>
ALWAYS_INLINE void act_mul_span(const float* g, const float* u, int64_t n, float* out) {
    int64_t i = 0;
    if constexpr (W == 16) {
        for (; i + 16 <= n; i += 16) {
            v16 x, y;
            std::memcpy(&x, g + i, sizeof x);
            std::memcpy(&y, u + i, sizeof y);
            const v16 r = Act::template apply<v16, v16i>(x) * y;
            std::memcpy(out + i, &r, sizeof r);
        }
    }
    for (; i + 8 <= n; i += 8) store8(out + i, Act::template apply<v8, v8i>(load8(g + i)) * load8(u + i));
    for (; i < n; i++) {
        float gt[8] = {g[i]}, r[8];
        store8(r, Act::template apply<v8, v8i>(load8(gt)));
        out[i] = r[0] * u[i];
    }
}

// Each span function compiled for AVX-512, AVX2 + FMA and the baseline; LOCALRUN_ISA=avx2 or ref
// forces a narrower one.
template <class Act>
__attribute__((target("avx512f,avx2,fma"))) void act_mul_span_avx512(const float* g, const float* u, int64_t n, float* out) {
    act_mul_span<Act, 16>(g, u, n, out);
}
template <class Act>
__attribute__((target("avx2,fma"))) void act_mul_span_avx2(const float* g, const float* u, int64_t n, float* out) {
    act_mul_span<Act, 8>(g, u, n, out);
}
template <class Act>
void act_mul_span_base(const float* g, const float* u, int64_t n, float* out) { act_mul_span<Act, 8>(g, u, n, out); }

enum class Isa { Base, Avx2, Avx512 };
Isa isa() {
    static const Isa chosen = [] {
        const char* env = std::getenv("LOCALRUN_ISA");
        const std::string forced = env ? env : "";
        __builtin_cpu_init();
        const bool avx2 = forced != "ref" && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        if (avx2 && (forced.empty() || forced == "avx512") && __builtin_cpu_supports("avx512f")) return Isa::Avx512;
        return avx2 ? Isa::Avx2 : Isa::Base;
    }();
    return chosen;
}

// gu (T, 2F) = [gate | up] -> act(gate) * up (T, F), split over the threads by values (16
// rows of SmolLM2's 1536 took 30 us on one thread when split by rows, grain 16)
constexpr int64_t ACT_GRAIN = 4096;    // values a task at least
template <class Act>
at::Tensor act_mul(const at::Tensor& gu_in, const char* name) {
    const at::Tensor gu = gu_in.contiguous();
    check_rows(gu, name);
    const int64_t T = gu.size(0), F = gu.size(1) / 2;
    TORCH_CHECK(gu.size(1) == 2 * F, "localrun::", name, ": the width must be even");
    at::Tensor out = at::empty({T, F}, gu.options());
    if (F == 0) return out;
    const float* gp = gu.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const Isa which = isa();
    const auto span = which == Isa::Avx512 ? &act_mul_span_avx512<Act>
                      : which == Isa::Avx2 ? &act_mul_span_avx2<Act> : &act_mul_span_base<Act>;
    at::parallel_for(0, T * F, ACT_GRAIN, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1;) {         // row t's values i % F .. through the task's end
            const int64_t t = i / F, c = i % F, n = std::min(F - c, i1 - i);
            span(gp + t * 2 * F + c, gp + t * 2 * F + F + c, n, op + i);
            i += n;
        }
    });
    return out;
}

at::Tensor silu_mul(const at::Tensor& gu) { return act_mul<Silu>(gu, "silu_mul"); }
at::Tensor gelu_mul(const at::Tensor& gu) { return act_mul<GeluTanh>(gu, "gelu_mul"); }

// RoPE: each pair (a, b) of a head, (x[2i], x[2i+1]) or for neox (x[i], x[i + hd/2]), times
// freqs[t, i] = (c, d) as a complex product: (a c - b d, a d + b c), each product rounded before
// the sum (no FMA: the file is compiled with -ffp-contract=off), as torch's complex product
// computes it. x may be a view with rows and heads apart (a narrow of the fused q/k/v heads);
// its last dimension must be unit-stride or it is copied. One call instead of the six views,
// copies and products of the torch expression (llama.py's apply_rope, the reference).
at::Tensor rope(const at::Tensor& x_in, const at::Tensor& freqs_in, bool neox) {
    TORCH_CHECK(x_in.dim() == 3 && x_in.scalar_type() == at::kFloat, "localrun::rope: x must be (T, H, hd) float32");
    const at::Tensor x = x_in.stride(2) == 1 ? x_in : x_in.contiguous();
    const int64_t T = x.size(0), H = x.size(1), hd = x.size(2), half = hd / 2;
    TORCH_CHECK(hd % 2 == 0 && freqs_in.scalar_type() == at::kComplexFloat && freqs_in.dim() == 2 &&
                freqs_in.size(0) == T && freqs_in.size(1) == half, "localrun::rope: freqs must be (T, hd/2) complex64");
    const at::Tensor f = at::view_as_real(freqs_in.contiguous());            // (T, hd/2, 2)
    at::Tensor out = at::empty({T, H, hd}, x.options());
    const float *xp = x.data_ptr<float>(), *fp = f.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t st = x.stride(0), sh = x.stride(1);
    at::parallel_for(0, T * H, 64, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; i++) {
            const int64_t t = i / H, h = i % H;
            const float* src = xp + t * st + h * sh;
            const float* fr = fp + t * hd;
            float* dst = op + i * hd;
            for (int64_t j = 0; j < half; j++) {
                const float c = fr[2 * j], d = fr[2 * j + 1];
                const int64_t ia = neox ? j : 2 * j, ib = neox ? j + half : 2 * j + 1;
                const float a = src[ia], b = src[ib];
                dst[ia] = a * c - b * d;
                dst[ib] = a * d + b * c;
            }
        }
    });
    return out;
}

}  // namespace
}  // namespace localrun

TORCH_LIBRARY_FRAGMENT(localrun, m) {
    m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
    m.def("silu_mul(Tensor gu) -> Tensor");
    m.def("gelu_mul(Tensor gu) -> Tensor");
    m.def("rope(Tensor x, Tensor freqs, bool neox) -> Tensor");
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("rms_norm", &localrun::rms_norm);
    m.impl("add_rms_norm", &localrun::add_rms_norm);
    m.impl("silu_mul", &localrun::silu_mul);
    m.impl("gelu_mul", &localrun::gelu_mul);
    m.impl("rope", &localrun::rope);
}
