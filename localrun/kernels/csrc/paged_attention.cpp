// Batched paged attention for decode and verify rows, float32 KV, in one call per layer:
//   paged_attention(q, k, v, k_pool, v_pool, slots, block_tables, row_seq, row_len, block_size, window=0) -> out
//   q (T, H, hd); k, v (T, n_kv, hd): the rows' new keys and values, written first into the pools
//   (num_blocks * block_size, n_kv, hd) at `slots` (T,). Row t then attends, as one query, over
//   the first row_len[t] positions of sequence row_seq[t], whose position p lives in slot
//   block_tables[row_seq[t], p / block_size] * block_size + p % block_size. window > 0 (a
//   sliding-window layer): only the last `window` of those positions, p >= row_len[t] - window;
//   the block table's entries before them are never read. Grouped-query: head h
//   reads KV head h / (H / n_kv). Scale 1/sqrt(hd), softmax in float32 with the maximum removed.
// No gather, no Python loop over sequences; every row is computed on its own, so a verify row
// equals the decode step it stands for, bit for bit. The reference is torch's SDPA over the
// gathered keys (localrun/model/llama.py, Attention._attend).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

namespace localrun {
namespace {

// sum of a[i] * b[i] in 8 fixed lanes (vectorizable without reordering), then a fixed tree
inline float dot8(const float* a, const float* b, int64_t n) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i < n; i++, j++) acc[j] += a[i] * b[i];
    return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

at::Tensor paged_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slots_in, const at::Tensor& tables_in,
                           const at::Tensor& row_seq_in, const at::Tensor& row_len_in, int64_t block_size, int64_t window) {
    const at::Tensor q = q_in.contiguous(), k = k_in.contiguous(), v = v_in.contiguous();
    const at::Tensor slots = slots_in.contiguous(), tables = tables_in.contiguous();
    const at::Tensor row_seq = row_seq_in.contiguous(), row_len = row_len_in.contiguous();
    TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "localrun::paged_attention: q (T,H,hd), k and v (T,n_kv,hd)");
    for (const at::Tensor* t : {&q, &k, &v, static_cast<const at::Tensor*>(&k_pool), static_cast<const at::Tensor*>(&v_pool)})
        TORCH_CHECK(t->scalar_type() == at::kFloat, "localrun::paged_attention: float32 tensors only");
    TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.sizes() == v_pool.sizes() && k_pool.dim() == 3,
                "localrun::paged_attention: pools must be contiguous (slots, n_kv, hd)");
    for (const at::Tensor* t : {&slots, &tables, &row_seq, &row_len})
        TORCH_CHECK(t->scalar_type() == at::kLong, "localrun::paged_attention: index tensors must be int64");
    const int64_t T = q.size(0), H = q.size(1), hd = q.size(2), n_kv = k.size(1);
    TORCH_CHECK(k.size(0) == T && k.size(2) == hd && H % n_kv == 0 && k_pool.size(1) == n_kv && k_pool.size(2) == hd,
                "localrun::paged_attention: shapes disagree");
    TORCH_CHECK(window >= 0, "localrun::paged_attention: window must be >= 0");
    TORCH_CHECK(slots.numel() == T && row_seq.numel() == T && row_len.numel() == T && tables.dim() == 2,
                "localrun::paged_attention: one slot, sequence and length per row");
    const int64_t num_slots = k_pool.size(0), max_blocks = tables.size(1), row_bytes = n_kv * hd;
    const int64_t *sp = slots.data_ptr<int64_t>(), *tp = tables.data_ptr<int64_t>();
    const int64_t *seqp = row_seq.data_ptr<int64_t>(), *lenp = row_len.data_ptr<int64_t>();
    float *kp = k_pool.data_ptr<float>(), *vp = v_pool.data_ptr<float>();
    for (int64_t t = 0; t < T; t++) {                      // writes first: later rows read earlier ones
        TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "localrun::paged_attention: slot out of range");
        TORCH_CHECK(seqp[t] >= 0 && seqp[t] < tables.size(0) && lenp[t] >= 1 && lenp[t] <= max_blocks * block_size,
                    "localrun::paged_attention: row ", t, " reaches past its block table");
        std::memcpy(kp + sp[t] * row_bytes, k.data_ptr<float>() + t * row_bytes, row_bytes * sizeof(float));
        std::memcpy(vp + sp[t] * row_bytes, v.data_ptr<float>() + t * row_bytes, row_bytes * sizeof(float));
    }
    at::Tensor out = at::empty({T, H, hd}, q.options());
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float scale = 1.0f / std::sqrt((float)hd);
    const int64_t group = H / n_kv;
    at::parallel_for(0, T * H, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> scores;
        for (int64_t i = i0; i < i1; i++) {
            const int64_t t = i / H, h = i % H, g = h / group, L = lenp[t];
            const int64_t first = window > 0 && L > window ? L - window : 0;   // first position attended
            const int64_t* table = tp + seqp[t] * max_blocks;
            const float* qh = qp + (t * H + h) * hd;
            scores.resize(L);
            float mx = -INFINITY;
            for (int64_t p = first; p < L; p++) {
                const int64_t slot = table[p / block_size] * block_size + p % block_size;
                TORCH_CHECK(slot >= 0 && slot < num_slots, "localrun::paged_attention: block table entry out of range");
                const float* kh = kp + (slot * n_kv + g) * hd;
                scores[p] = dot8(qh, kh, hd) * scale;
                mx = std::max(mx, scores[p]);
            }
            float sum = 0.f;
            for (int64_t p = first; p < L; p++) { scores[p] = std::exp(scores[p] - mx); sum += scores[p]; }
            float* oh = op + (t * H + h) * hd;
            for (int64_t d = 0; d < hd; d++) oh[d] = 0.f;
            for (int64_t p = first; p < L; p++) {
                const int64_t slot = table[p / block_size] * block_size + p % block_size;
                const float* vh = vp + (slot * n_kv + g) * hd;
                const float w = scores[p] / sum;
                for (int64_t d = 0; d < hd; d++) oh[d] += w * vh[d];
            }
        }
    });
    return out;
}

}  // namespace
}  // namespace localrun

TORCH_LIBRARY_FRAGMENT(localrun, m) {
    m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, "
          "Tensor block_tables, Tensor row_seq, Tensor row_len, int block_size, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("paged_attention", &localrun::paged_attention);
}
