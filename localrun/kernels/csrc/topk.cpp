// topk(x, n) -> (values, ids): the n largest of one row of logits x (V,) float32, in descending
// order, ties taken lowest index first: the candidates of the sampler (localrun/sampling.py,
// candidate_probs). One pass over the row on the calling thread, keeping the n best in a heap:
// an element is compared with the heap's worst and almost never enters, so the pass costs about
// one compare per logit, against ~2.7 ns a logit for torch.topk (49k logits: 134 us on one Zen 3
// core, several times that inside a decode step, where its threads meet the step's pool).
// A row with a NaN is handed to at::topk, whose ordering of NaNs the sampler's reference sees.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

namespace localrun {
namespace {

struct Entry {
    float value;
    int64_t id;
};

// a ranks below b: a smaller value, or the same value at a later index
inline bool worse(const Entry& a, const Entry& b) { return a.value < b.value || (a.value == b.value && a.id > b.id); }

// heap order for std::push_heap / pop_heap: the worst entry at the front
inline bool better(const Entry& a, const Entry& b) { return worse(b, a); }

// The first index from i on whose value is not <= threshold (greater, or a NaN), or V.
int64_t next_candidate_base(const float* p, int64_t i, int64_t V, float threshold) {
    for (; i < V; i++)
        if (!(p[i] <= threshold)) return i;
    return V;
}

// The same, eight compares at once (AVX); the last few one by one.
__attribute__((target("avx"))) int64_t next_candidate_avx(const float* p, int64_t i, int64_t V, float threshold) {
    const __m256 t = _mm256_set1_ps(threshold);
    for (; i + 8 <= V; i += 8) {
        const int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(p + i), t, _CMP_NLE_UQ));
        if (mask) return i + __builtin_ctz(mask);
    }
    return next_candidate_base(p, i, V, threshold);
}

std::tuple<at::Tensor, at::Tensor> topk(const at::Tensor& x_in, int64_t n) {
    TORCH_CHECK(x_in.dim() == 1 && x_in.scalar_type() == at::kFloat, "localrun::topk: x must be a (V,) float32 row");
    const at::Tensor x = x_in.contiguous();
    const int64_t V = x.size(0);
    TORCH_CHECK(n >= 1 && n <= V, "localrun::topk: n must be in 1..V");
    static const auto next_candidate = [] {     // LOCALRUN_ISA=ref forces the plain loop, as for the other kernels
        const char* env = std::getenv("LOCALRUN_ISA");
        const bool ref = env && std::string(env) == "ref";
        return !ref && __builtin_cpu_supports("avx") ? &next_candidate_avx : &next_candidate_base;
    }();
    const float* p = x.data_ptr<float>();
    std::vector<Entry> heap;
    heap.reserve(n);
    for (int64_t i = 0; i < n; i++) {
        if (std::isnan(p[i])) return at::topk(x, n);
        heap.push_back({p[i], i});
    }
    std::make_heap(heap.begin(), heap.end(), better);
    for (int64_t i = next_candidate(p, n, V, heap.front().value); i < V; i = next_candidate(p, i + 1, V, heap.front().value)) {
        if (std::isnan(p[i])) return at::topk(x, n);
        // greater than the worst kept value: it enters, at a later index than every tie kept
        std::pop_heap(heap.begin(), heap.end(), better);
        heap.back() = {p[i], i};
        std::push_heap(heap.begin(), heap.end(), better);
    }
    std::sort(heap.begin(), heap.end(), better);            // best first
    at::Tensor values = at::empty({n}, x.options());
    at::Tensor ids = at::empty({n}, x.options().dtype(at::kLong));
    float* vp = values.data_ptr<float>();
    int64_t* ip = ids.data_ptr<int64_t>();
    for (int64_t j = 0; j < n; j++) vp[j] = heap[j].value, ip[j] = heap[j].id;
    return {values, ids};
}

}  // namespace
}  // namespace localrun

TORCH_LIBRARY_FRAGMENT(localrun, m) {
    m.def("topk(Tensor x, int n) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("topk", &localrun::topk);
}
