// One transformer block for decode and verify rows, in one call (no Python between its ops):
//   decode_block(x, attn_norm, ffn_norm, eps, wqkv, qkv_types, wo, wo_types, w13, w13_types,
//                w2, w2_types, freqs, k_pool, v_pool, slots, block_tables, row_seq, row_len,
//                block_size, window, n_head, n_kv, neox, qkv_bias?, q_norm?, k_norm?,
//                post_attn_norm?, post_ffw_norm?, q_scale, gelu, k_scale?, v_scale?) -> x + attention + feed-forward
// for every block shape localrun/model/llama.py builds: optional Q/K/V biases (qwen2), per-head
// Q/K norms (qwen3, gemma3), post-norms and GELU-tanh (gemma3), a query scale (q_scale > 0,
// folded into q), a sliding window, every KV pool paged_attention reads (k_scale and v_scale for
// an int8 or fp8 one). It calls the same ops, in the same order, as the Python path
// (Block.forward with the fused kernels and paged rows), RoPE included (localrun::rope), so a
// row's result is the same bits through either path: a decode row does not
// change with whether its step also carries prompt rows (which take the Python path).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <tuple>
#include <vector>

namespace localrun {
namespace {

at::Tensor qmatmul(const at::Tensor& x, at::TensorList w, at::IntArrayRef types) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::qmatmul", "")
        .typed<at::Tensor(const at::Tensor&, at::TensorList, at::IntArrayRef)>();
    return op.call(x, w, types);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::rms_norm", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    return op.call(x, w, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::add_rms_norm", "")
        .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
    return op.call(x, r, w, eps);
}

at::Tensor silu_mul(const at::Tensor& gu) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::silu_mul", "")
        .typed<at::Tensor(const at::Tensor&)>();
    return op.call(gu);
}

at::Tensor gelu_mul(const at::Tensor& gu) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::gelu_mul", "")
        .typed<at::Tensor(const at::Tensor&)>();
    return op.call(gu);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool,
                           at::Tensor& v_pool, const at::Tensor& slots, const at::Tensor& tables,
                           const at::Tensor& row_seq, const at::Tensor& row_len, int64_t block_size, int64_t window,
                           const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::paged_attention", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                          const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                          const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>();
    return op.call(q, k, v, k_pool, v_pool, slots, tables, row_seq, row_len, block_size, window, k_scale, v_scale);
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& freqs, bool neox) {
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("localrun::rope", "")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, bool)>();
    return op.call(x, freqs, neox);
}

// t.narrow(1, first, count) of a (T, heads, hd) tensor as one as_strided view: narrow goes through
// the dispatcher three times (narrow, slice, as_strided), ~2 us a layer of a one-row step's ~12 us
// of fixed cost (SmolLM2, 2026-12-06)
at::Tensor heads(const at::Tensor& t, int64_t first, int64_t count) {
    return t.as_strided({t.size(0), count, t.size(2)}, {t.stride(0), t.stride(1), t.stride(2)},
                        t.storage_offset() + first * t.stride(1));
}

at::Tensor decode_block(const at::Tensor& x, const at::Tensor& attn_norm, const at::Tensor& ffn_norm, double eps,
                        at::TensorList wqkv, at::IntArrayRef qkv_types, at::TensorList wo, at::IntArrayRef wo_types,
                        at::TensorList w13, at::IntArrayRef w13_types, at::TensorList w2, at::IntArrayRef w2_types,
                        const at::Tensor& freqs, at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
                        const at::Tensor& tables, const at::Tensor& row_seq, const at::Tensor& row_len,
                        int64_t block_size, int64_t window, int64_t n_head, int64_t n_kv, bool neox,
                        const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& q_norm,
                        const std::optional<at::Tensor>& k_norm, const std::optional<at::Tensor>& post_attn_norm,
                        const std::optional<at::Tensor>& post_ffw_norm, double q_scale, bool gelu,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "localrun::decode_block: x must be (T, D) float32");
    TORCH_CHECK(freqs.is_complex() && freqs.dim() == 2 && freqs.size(0) == x.size(0),
                "localrun::decode_block: freqs must be (T, hd/2) complex");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "localrun::decode_block: Q and K norms come together");
    const int64_t T = x.size(0), hd = 2 * freqs.size(1);
    at::Tensor qkv = qmatmul(rms_norm(x, attn_norm, eps), wqkv, qkv_types);
    TORCH_CHECK(qkv.size(1) == (n_head + 2 * n_kv) * hd, "localrun::decode_block: q/k/v widths disagree with the heads");
    if (qkv_bias) qkv = qkv + *qkv_bias;
    const at::Tensor qkv_heads = qkv.view({T, n_head + 2 * n_kv, hd});
    at::Tensor qk;
    if (q_norm) {
        const at::Tensor q = rms_norm(heads(qkv_heads, 0, n_head).reshape({-1, hd}), *q_norm, eps).view({T, n_head, hd});
        const at::Tensor k = rms_norm(heads(qkv_heads, n_head, n_kv).reshape({-1, hd}), *k_norm, eps).view({T, n_kv, hd});
        qk = apply_rope(at::cat({q, k}, 1), freqs, neox);
    } else {
        qk = apply_rope(heads(qkv_heads, 0, n_head + n_kv), freqs, neox);
    }
    at::Tensor q = heads(qk, 0, n_head);
    if (q_scale > 0) q = q * q_scale;
    at::Tensor attn = paged_attention(q, heads(qk, n_head, n_kv), heads(qkv_heads, n_head + n_kv, n_kv),
                                      k_pool, v_pool, slots, tables, row_seq, row_len, block_size, window, k_scale, v_scale);
    attn = qmatmul(attn.reshape({T, n_head * hd}), wo, wo_types);
    if (post_attn_norm) attn = rms_norm(attn, *post_attn_norm, eps);
    auto [h, normed] = add_rms_norm(x, attn, ffn_norm, eps);
    const at::Tensor gate_up = qmatmul(normed, w13, w13_types);
    const at::Tensor act = gelu ? gelu_mul(gate_up) : silu_mul(gate_up);
    at::Tensor ffn = qmatmul(act, w2, w2_types);
    if (post_ffw_norm) ffn = rms_norm(ffn, *post_ffw_norm, eps);
    return h.add_(ffn);        // h: add_rms_norm's own new tensor
}

}  // namespace

// Every block's own arguments of decode_block, bound once (localrun/model/fused_block.py's
// FusedStack), so that a decode step makes one call for all of its blocks (decode_layers): a
// call from Python spent ~8 us converting decode_block's 33 arguments, ~0.25 ms of SmolLM2's
// ~6 ms one-sequence step over its 30 blocks.
struct DecodeLayers : torch::CustomClassHolder {
    struct Layer {
        at::Tensor attn_norm, ffn_norm;
        double eps, q_scale;
        std::vector<at::Tensor> wqkv, wo, w13, w2;
        std::vector<int64_t> qkv_types, wo_types, w13_types, w2_types;
        int64_t window, n_head, n_kv, table;           // table: which of the step's RoPE tables
        bool neox, gelu;
        std::optional<at::Tensor> qkv_bias, q_norm, k_norm, post_attn_norm, post_ffw_norm;
    };
    std::vector<Layer> layers;

    void add(at::Tensor attn_norm, at::Tensor ffn_norm, double eps, std::vector<at::Tensor> wqkv,
             std::vector<int64_t> qkv_types, std::vector<at::Tensor> wo, std::vector<int64_t> wo_types,
             std::vector<at::Tensor> w13, std::vector<int64_t> w13_types, std::vector<at::Tensor> w2,
             std::vector<int64_t> w2_types, int64_t window, int64_t n_head, int64_t n_kv, bool neox,
             std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm,
             std::optional<at::Tensor> post_attn_norm, std::optional<at::Tensor> post_ffw_norm, double q_scale,
             bool gelu, int64_t table) {
        layers.push_back(Layer{std::move(attn_norm), std::move(ffn_norm), eps, q_scale, std::move(wqkv), std::move(wo),
                               std::move(w13), std::move(w2), std::move(qkv_types), std::move(wo_types),
                               std::move(w13_types), std::move(w2_types), window, n_head, n_kv, table, neox, gelu,
                               std::move(qkv_bias), std::move(q_norm), std::move(k_norm), std::move(post_attn_norm),
                               std::move(post_ffw_norm)});
    }
};

namespace {

// decode_block over every bound block in order, each with its layer's pools (and scales, for a
// quantized pool), its RoPE table freqs[table], and the local layers' slots and block tables
// where a sliding-window layer has a pool of its own: the same calls, in the same order, as
// FusedDecode's loop, so the same bits.
at::Tensor decode_layers(const c10::intrusive_ptr<DecodeLayers>& self, const at::Tensor& x, at::TensorList freqs,
                         at::TensorList k_pools, at::TensorList v_pools, const at::Tensor& slots,
                         const at::Tensor& tables, const std::optional<at::Tensor>& local_slots,
                         const std::optional<at::Tensor>& local_tables, const at::Tensor& row_seq,
                         const at::Tensor& row_len, int64_t block_size, at::TensorList k_scales,
                         at::TensorList v_scales) {
    const size_t n = self->layers.size();
    TORCH_CHECK(k_pools.size() == n && v_pools.size() == n, "localrun::decode_layers: one K and one V pool per layer");
    TORCH_CHECK(k_scales.size() == v_scales.size() && (k_scales.empty() || k_scales.size() == n),
                "localrun::decode_layers: K and V scales for every layer, or none");
    TORCH_CHECK(local_slots.has_value() == local_tables.has_value(), "localrun::decode_layers: local slots and tables come together");
    at::Tensor h = x;
    for (size_t i = 0; i < n; i++) {
        const DecodeLayers::Layer& l = self->layers[i];
        TORCH_CHECK(l.table >= 0 && l.table < (int64_t)freqs.size(), "localrun::decode_layers: no RoPE table ", l.table);
        const bool local = l.window && local_slots.has_value();
        at::Tensor k_pool = k_pools[i], v_pool = v_pools[i];
        std::optional<at::Tensor> k_scale, v_scale;
        if (!k_scales.empty()) k_scale = k_scales[i], v_scale = v_scales[i];
        h = decode_block(h, l.attn_norm, l.ffn_norm, l.eps, l.wqkv, l.qkv_types, l.wo, l.wo_types, l.w13, l.w13_types,
                         l.w2, l.w2_types, freqs[l.table], k_pool, v_pool, local ? *local_slots : slots,
                         local ? *local_tables : tables, row_seq, row_len, block_size, l.window, l.n_head, l.n_kv,
                         l.neox, l.qkv_bias, l.q_norm, l.k_norm, l.post_attn_norm, l.post_ffw_norm, l.q_scale, l.gelu,
                         k_scale, v_scale);
    }
    return h;
}

}  // namespace
}  // namespace localrun

TORCH_LIBRARY_FRAGMENT(localrun, m) {
    m.class_<localrun::DecodeLayers>("DecodeLayers")
        .def(torch::init<>())
        .def("add", &localrun::DecodeLayers::add);
    m.def("decode_layers(__torch__.torch.classes.localrun.DecodeLayers layers, Tensor x, Tensor[] freqs, "
          "Tensor(a!)[] k_pools, Tensor(b!)[] v_pools, Tensor slots, Tensor block_tables, Tensor? local_slots, "
          "Tensor? local_block_tables, Tensor row_seq, Tensor row_len, int block_size, Tensor(c!)[] k_scales, "
          "Tensor(d!)[] v_scales) -> Tensor");
    m.def("decode_block(Tensor x, Tensor attn_norm, Tensor ffn_norm, float eps, Tensor[] wqkv, int[] qkv_types, "
          "Tensor[] wo, int[] wo_types, Tensor[] w13, int[] w13_types, Tensor[] w2, int[] w2_types, Tensor freqs, "
          "Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor block_tables, Tensor row_seq, Tensor row_len, "
          "int block_size, int window, int n_head, int n_kv, bool neox, Tensor? qkv_bias, Tensor? q_norm, Tensor? k_norm, "
          "Tensor? post_attn_norm, Tensor? post_ffw_norm, float q_scale, bool gelu, Tensor(c!)? k_scale=None, "
          "Tensor(d!)? v_scale=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(localrun, CPU, m) {
    m.impl("decode_block", &localrun::decode_block);
    m.impl("decode_layers", &localrun::decode_layers);
}
