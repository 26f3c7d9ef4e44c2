"""localrun::decode_block (localrun/model/fused_block.py) against Block.forward's Python path:
the same rows, the same bits, for decode rows of several sequences read through shuffled
block tables, on quantized weights (the only weights it runs on), for every family's block
shape (qwen2's biases, qwen3's head norms, gemma3's post-norms, GELU and sliding window), over
float32 and float16 KV pools; and the Transformer's one call for all blocks' fused steps (a
decode step's path, localrun::decode_layers) and its loop over them against both."""
from __future__ import annotations

import random

import pytest
import torch

from localrun import kernels
from localrun.api import LLM
from localrun.model.llama import PagedRows
from synthetic_gguf import write_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="localrun's kernels did not compile here")


def decode_logits(model, tokens, lengths, pools, block_size, tables):
    rows = len(lengths)
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(lengths)])
    pools = [(k.clone(), v.clone()) for k, v in pools]
    paged = PagedRows(num_rows=rows, slots=slots, block_tables=tables, row_seq=torch.arange(rows),
                      row_len=torch.tensor(lengths), block_size=block_size, pools=lambda layer: pools[layer])
    logits = model(torch.tensor(tokens), torch.tensor(lengths) - 1, [], decode_rows=rows, paged=paged)
    return logits, pools


@pytest.mark.parametrize("architecture, tensor_type", [("llama", "Q4_0"), ("llama", "Q8_0"), ("llama", "Q4_K"),
                                                       ("qwen2", "Q8_0"), ("qwen3", "Q4_0"), ("gemma3", "Q8_0")])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_fused_decode_block_equals_python_block(tmp_path, architecture, tensor_type, pool_dtype):
    path = write_tiny_model(tmp_path / f"{architecture}.gguf", architecture=architecture, tensor_type=tensor_type)
    model = LLM(path, dtype="float32", quantized=True, n_threads=1).model
    assert all(b.fused_decode is not None for b in model.layers)
    c, bs, num_blocks = model.config, 4, 16
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(num_blocks * bs, c.n_head_kv, c.head_dim, generator=g).to(pool_dtype),
              torch.randn(num_blocks * bs, c.n_head_kv, c.head_dim, generator=g).to(pool_dtype)) for _ in range(c.n_layers)]
    tables = torch.tensor([random.Random(s).sample(range(num_blocks), 5) for s in range(3)])
    tokens, lengths = [5, 17, 3], [1, 9, 20]
    assert model.steps() is not None and model.fused_stack is not None   # a decode step: one call for all blocks
    stacked, stacked_pools = decode_logits(model, tokens, lengths, pools, bs, tables)
    model.fused_stack = None                      # the blocks' fused steps in one loop
    looped, looped_pools = decode_logits(model, tokens, lengths, pools, bs, tables)
    model.fused_steps = None                      # each block's forward, its fused branch
    fused, fused_pools = decode_logits(model, tokens, lengths, pools, bs, tables)
    for b in model.layers:
        b.fused_decode = None
    try:
        python, python_pools = decode_logits(model, tokens, lengths, pools, bs, tables)
    finally:
        del model
    assert torch.equal(stacked, python) and torch.equal(looped, python) and torch.equal(fused, python)
    for got in (stacked_pools, looped_pools, fused_pools):
        assert all(torch.equal(a, b) for (k1, v1), (k2, v2) in zip(got, python_pools) for a, b in ((k1, k2), (v1, v2)))
