// Fused small ops of a transformer block, float32, rows split over torch's threads:
//   rms_norm(x, w, eps)                 x (T, D) -> x / sqrt(mean(x^2) + eps) * w
//   add_rms_norm(x, r, w, eps) -> (h, n) h = x + r, n = rms_norm(h, w, eps)   (residual + next norm)
//   silu_mul(gu) -> (T, F)              gu (T, 2F) = [gate | up] -> silu(gate) * up
//   gelu_mul(gu) -> (T, F)              the same with gelu_tanh(gate) (gemma's GeGLU)
// Each replaces 3-6 torch ops (and their allocations) per call; the plain torch expressions
// in localrun/model/llama.py are the reference the tests compare with.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
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

inline void norm_row(const float* h, const float* w, int64_t D, double eps, float* out) {
    double sum = 0.0;
    for (int64_t i = 0; i < D; i++) sum += (double)h[i] * h[i];
    const float scale = (float)(1.0 / std::sqrt(sum / (double)D + eps));
    for (int64_t i = 0; i < D; i++) out[i] = h[i] * scale * w[i];
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w, double eps) {
    const at::Tensor x = x_in.contiguous();
    check_rows(x, "rms_norm");
    const int64_t T = x.size(0), D = x.size(1);
    TORCH_CHECK(w.numel() == D && w.scalar_type() == at::kFloat && w.is_contiguous(), "localrun::rms_norm: w must be (D,) float32");
    at::Tensor out = at::empty_like(x);
    const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) norm_row(xp + t * D, wp, D, eps, op + t * D);
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
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            for (int64_t i = 0; i < D; i++) hp[t * D + i] = xp[t * D + i] + rp[t * D + i];
            norm_row(hp + t * D, wp, D, eps, op + t * D);
        }
    });
    return {h, out};
}

// silu(g) * u = g / (1 + e^-g) * u over one row, 8 at a time with the vector exp (vec8.h),
// compiled for AVX2 and for the baseline.
ALWAYS_INLINE void silu_mul_row_any(const float* g, const float* u, int64_t F, float* out) {
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) {
        const v8 gv = load8(g + i);
        store8(out + i, gv / (splat8(1.f) + exp8(-gv)) * load8(u + i));
    }
    for (; i < F; i++) {
        float gt[8] = {-g[i]}, e[8];
        store8(e, exp8(load8(gt)));
        out[i] = g[i] / (1.f + e[0]) * u[i];
    }
}
__attribute__((target("avx2,fma"))) void silu_mul_row_avx2(const float* g, const float* u, int64_t F, float* out) {
    silu_mul_row_any(g, u, F, out);
}
void silu_mul_row_base(const float* g, const float* u, int64_t F, float* out) { silu_mul_row_any(g, u, F, out); }

// gelu_tanh(g) * u = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u, tanh(z) = 1 - 2 / (e^2z + 1)
ALWAYS_INLINE void gelu_mul_row_any(const float* g, const float* u, int64_t F, float* out) {
    const auto one = [](v8 gv) {
        const v8 z = splat8(0.7978845608028654f) * (gv + splat8(0.044715f) * gv * gv * gv);
        const v8 t = splat8(1.f) - splat8(2.f) / (exp8(splat8(2.f) * z) + splat8(1.f));
        return splat8(0.5f) * gv * (splat8(1.f) + t);
    };
    int64_t i = 0;
    for (; i + 8 <= F; i += 8) store8(out + i, one(load8(g + i)) * load8(u + i));
    for (; i < F; i++) {
        float gt[8] = {g[i]}, r[8];
        store8(r, one(load8(gt)));
        out[i] = r[0] * u[i];
    }
}
__attribute__((target("avx2,fma"))) void gelu_mul_row_avx2(const float* g, const float* u, int64_t F, float* out) {
    gelu_mul_row_any(g, u, F, out);
}
void gelu_mul_row_base(const float* g, const float* u, int64_t F, float* out) { gelu_mul_row_any(g, u, F, out); }

bool use_avx2_rows() {
    static const bool avx2 = [] {
        const char* env = std::getenv("LOCALRUN_ISA");
        __builtin_cpu_init();
        return !(env && std::string(env) == "ref") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }();
    return avx2;
}

at::Tensor gelu_mul(const at::Tensor& gu_in) {
    const at::Tensor gu = gu_in.contiguous();
    check_rows(gu, "gelu_mul");
    const int64_t T = gu.size(0), F = gu.size(1) / 2;
    TORCH_CHECK(gu.size(1) == 2 * F, "localrun::gelu_mul: the width must be even");
    at::Tensor out = at::empty({T, F}, gu.options());
    const float* gp = gu.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const bool avx2 = use_avx2_rows();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float *g = gp + t * 2 * F, *u = g + F;
            if (avx2) gelu_mul_row_avx2(g, u, F, op + t * F); else gelu_mul_row_base(g, u, F, op + t * F);
        }
    });
    return out;
}

at::Tensor silu_mul(const at::Tensor& gu_in) {
    const at::Tensor gu = gu_in.contiguous();
    check_rows(gu, "silu_mul");
    const int64_t T = gu.size(0), F = gu.size(1) / 2;
    TORCH_CHECK(gu.size(1) == 2 * F, "localrun::silu_mul: the width must be even");
    at::Tensor out = at::empty({T, F}, gu.options());
    const float* gp = gu.data_ptr<float>();
    float* op = out.data_ptr<float>();
    static const bool avx2 = [] {
        const char* env = std::getenv("LOCALRUN_ISA");
        __builtin_cpu_init();
        return !(env && std::string(env) == "ref") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }();
    at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; t++) {
            const float *g = gp + t * 2 * F, *u = g + F;
            if (avx2) silu_mul_row_avx2(g, u, F, op + t * F); else silu_mul_row_base(g, u, F, op + t * F);
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
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("rms_norm", &localrun::rms_norm);
    m.impl("add_rms_norm", &localrun::add_rms_norm);
    m.impl("silu_mul", &localrun::silu_mul);
    m.impl("gelu_mul", &localrun::gelu_mul);
}
