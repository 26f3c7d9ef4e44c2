"""A block's decode step in one compiled call (localrun::decode_block, csrc/decode_block.cpp).

When every row of a forward is a decode or verify row read through the paged KV pool, a
llama-shaped block (no biases, head norms or post-norms; SwiGLU) runs its ~25 ops in C++
instead of Python: about 30 such calls per token otherwise cost more time in the interpreter
than in the kernels for a small model. The op calls the same kernels in the same order as
Block.forward's fused path, so the rows come out the same bits either way; Block.forward is
the reference (tests/test_kernels.py checks the two against each other).
"""
from __future__ import annotations

import torch

from localrun import kernels
from localrun.model.gguf_weight import GGUFWeight


class FusedDecode:
    def __init__(self, block):
        a, f = block.attention, block.feed_forward
        self.block = block
        self.args = (block.attention_norm.weight, block.ffn_norm.weight, block.ffn_norm.eps,
                     a.wqkv.parts, a.wqkv.qtypes, a.wo.parts, a.wo.qtypes,
                     f.w13.parts, f.w13.qtypes, f.w2.parts, f.w2.qtypes)
        self.layer, self.n_head, self.n_kv, self.neox = a.layer, a.n_head, a.n_head_kv, a.neox
        self.window = a.window or 0

    @staticmethod
    def build(block) -> "FusedDecode | None":
        """The fused call for a block it can run, else None (the Python path runs)."""
        a, f = block.attention, block.feed_forward
        plain = (a.bias is None and a.q_norm is None and a.scale is None and block.post_attention_norm is None
                 and block.post_ffw_norm is None and f.fused and block.attention_norm.eps == block.ffn_norm.eps)
        weights = all(isinstance(w, GGUFWeight) for w in (a.wqkv, a.wo, f.w13, f.w2))
        return FusedDecode(block) if plain and weights and block.fused and kernels.available() else None

    def applies(self, x: torch.Tensor, segments, decode_rows: int, paged) -> bool:
        return (paged is not None and not segments and x.dtype == torch.float32 and x.dim() == 2
                and decode_rows == x.shape[0] == paged.num_rows)

    def __call__(self, x: torch.Tensor, freqs: torch.Tensor, paged) -> torch.Tensor:
        k_pool, v_pool = paged.pools(self.layer)
        return torch.ops.localrun.decode_block(x, *self.args, freqs, k_pool, v_pool, paged.slots, paged.block_tables,
                                               paged.row_seq, paged.row_len, paged.block_size, self.window,
                                               self.n_head, self.n_kv, self.neox)
