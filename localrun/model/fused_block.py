"""A block's decode step in one compiled call (localrun::decode_block, csrc/decode_block.cpp).

When every row of a forward is a decode or verify row read through the paged KV pool, a block
on quantized weights runs its ~25-35 ops in C++ instead of Python: about 30 such calls per
token otherwise cost more time in the interpreter than in the kernels for a small model. Every
block shape of localrun/model/llama.py is covered (Q/K/V biases, Q/K head norms, post-norms,
GELU-tanh, a query scale, sliding-window layers and their own pool). The op calls the same
kernels in the same order as Block.forward's fused path, so the rows come out the same bits
either way; Block.forward is the reference (tests/test_fused_block.py checks the two).
"""
from __future__ import annotations

import torch

from localrun import kernels
from localrun.model.gguf_weight import GGUFWeight


class FusedDecode:
    def __init__(self, block):
        a, f = block.attention, block.feed_forward
        self.args = (block.attention_norm.weight, block.ffn_norm.weight, block.ffn_norm.eps,
                     a.wqkv.parts, a.wqkv.kernel_types, a.wo.parts, a.wo.kernel_types,
                     f.w13.parts, f.w13.kernel_types, f.w2.parts, f.w2.kernel_types)
        self.layer, self.n_head, self.n_kv, self.neox = a.layer, a.n_head, a.n_head_kv, a.neox
        self.window = a.window or 0
        weight = lambda norm: None if norm is None else norm.weight
        self.options = (a.bias, weight(a.q_norm), weight(a.k_norm), weight(block.post_attention_norm),
                        weight(block.post_ffw_norm), 0.0 if a.scale is None else a.scale * a.head_dim ** 0.5,
                        f.activation == "gelu_tanh")

    @staticmethod
    def build(block) -> "FusedDecode | None":
        """The fused call for a block it can run, else None (the Python path runs)."""
        a, f = block.attention, block.feed_forward
        norms = [n for n in (block.attention_norm, block.ffn_norm, a.q_norm, a.k_norm, block.post_attention_norm,
                             block.post_ffw_norm) if n is not None]
        same_eps = all(n.eps == block.ffn_norm.eps and n.fused for n in norms)
        known = f.activation in ("silu", "gelu_tanh") and f.fused
        weights = all(isinstance(w, GGUFWeight) for w in (a.wqkv, a.wo, f.w13, f.w2))
        usable = same_eps and known and weights and block.fused and (a.bias is None or a.bias.dtype == torch.float32)
        return FusedDecode(block) if usable and kernels.available() else None

    def applies(self, x: torch.Tensor, segments, decode_rows: int, paged) -> bool:
        return (paged is not None and not segments and x.dtype == torch.float32
                and x.dim() == 2 and decode_rows == x.shape[0] == paged.num_rows)

    def __call__(self, x: torch.Tensor, freqs: torch.Tensor, paged) -> torch.Tensor:
        k_pool, v_pool = paged.pools(self.layer)
        slots, tables = paged.slots, paged.block_tables
        if self.window and paged.local_slots is not None:            # the local layers' own pool
            slots, tables = paged.local_slots, paged.local_block_tables
        scales = paged.scales(self.layer) if paged.scales is not None else (None, None)
        return torch.ops.localrun.decode_block(x, *self.args, freqs, k_pool, v_pool, slots, tables,
                                               paged.row_seq, paged.row_len, paged.block_size, self.window,
                                               self.n_head, self.n_kv, self.neox, *self.options, *scales)


class FusedStack:
    """Every block's FusedDecode in one compiled call per decode step (localrun::decode_layers,
    csrc/decode_block.cpp): each block's own arguments are bound once to a DecodeLayers object,
    and a step passes only what changes (the activations, RoPE tables, pools, slots and block
    tables). The same decode_block calls in the same order as the loop over FusedDecode, so the
    same bits (tests/test_fused_block.py); it saves converting 33 arguments a block in each call
    from Python, ~0.25 ms of SmolLM2's ~6 ms one-sequence step."""

    def __init__(self, steps):
        self.layers = [step.layer for step, _ in steps]
        self.bound = torch.classes.localrun.DecodeLayers()
        for step, table in steps:
            self.bound.add(*step.args, step.window, step.n_head, step.n_kv, step.neox, *step.options, table)

    @staticmethod
    def build(steps) -> "FusedStack | None":
        """The one call for these (FusedDecode, RoPE table) steps, or None where the loaded kernels
        have no decode_layers (a library built from older sources: benchmarks/kernel_ab.py)."""
        try:
            torch.ops.localrun.decode_layers
            torch.classes.localrun.DecodeLayers
        except (AttributeError, RuntimeError):
            return None
        return FusedStack(steps)

    def __call__(self, x: torch.Tensor, freqs: torch.Tensor, paged) -> torch.Tensor:
        pools = [paged.pools(layer) for layer in self.layers]
        scales = [paged.scales(layer) for layer in self.layers] if paged.scales is not None else []
        return torch.ops.localrun.decode_layers(self.bound, x, list(freqs.unbind(0)), [k for k, _ in pools],
                                                [v for _, v in pools], paged.slots, paged.block_tables,
                                                paged.local_slots, paged.local_block_tables, paged.row_seq,
                                                paged.row_len, paged.block_size, [k for k, _ in scales],
                                                [v for _, v in scales])
