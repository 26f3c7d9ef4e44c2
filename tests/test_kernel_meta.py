"""The decode step's ops can be traced by torch.compile (localrun/kernels/meta.py): every op a
decode forward calls, fused block or Python block, passes torch.library.opcheck (its schema
says what it writes, and its fake gives the real op's shapes and dtypes), and the forward
compiled as one graph computes the same bits and writes the same KV pool as the forward itself."""
from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from localrun import kernels
from localrun.api import LLM
from localrun.kernels import meta
from localrun.model.llama import PagedRows
from synthetic_gguf import write_tiny_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="localrun's kernels did not compile here")


@pytest.fixture(autouse=True)
def traceable():
    meta.register()                                   # as a tracer's caller does (not at start-up)

TOKENS, LENGTHS, BLOCK, BLOCKS = [5, 17, 3], [1, 9, 20], 4, 16


def decode_inputs(model):
    """Three decode rows over shuffled blocks of a float16 pool: (tokens, positions, paged, pools)."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    pools = [(torch.randn(BLOCKS * BLOCK, c.n_head_kv, c.head_dim, generator=g).half(),
              torch.randn(BLOCKS * BLOCK, c.n_head_kv, c.head_dim, generator=g).half()) for _ in range(c.n_layers)]
    tables = torch.tensor([random.Random(s).sample(range(BLOCKS), 5) for s in range(len(LENGTHS))])
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK]) * BLOCK + (n - 1) % BLOCK for i, n in enumerate(LENGTHS)])
    paged = PagedRows(num_rows=len(LENGTHS), slots=slots, block_tables=tables, row_seq=torch.arange(len(LENGTHS)),
                      row_len=torch.tensor(LENGTHS), block_size=BLOCK, pools=lambda layer: pools[layer])
    return torch.tensor(TOKENS), torch.tensor(LENGTHS) - 1, paged, pools


class LocalrunCalls(TorchDispatchMode):
    """The first call of each localrun op, with its arguments."""
    def __init__(self):
        super().__init__()
        self.calls = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "localrun":
            self.calls.setdefault(func.name(), (func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("architecture, tensor_type", [("llama", "Q4_0"), ("gemma3", "Q8_0")])
@pytest.mark.parametrize("fused", [True, False])
def test_every_op_of_a_decode_step_has_its_real_shapes_when_traced(tmp_path, architecture, tensor_type, fused):
    path = write_tiny_model(tmp_path / f"{architecture}.gguf", architecture=architecture, tensor_type=tensor_type)
    model = LLM(path, dtype="float32", quantized=True, n_threads=1).model
    model.steps()
    model.fused_stack = None      # the one call for all blocks (decode_layers) is eager only: tracing takes the loop
    if not fused:
        model.fused_steps = None
        for block in model.layers:
            block.fused_decode = None
    tokens, positions, paged, _ = decode_inputs(model)
    with LocalrunCalls() as seen:
        model(tokens, positions, [], decode_rows=len(TOKENS), paged=paged)
    expected = {"localrun::decode_block"} if fused else {"localrun::paged_attention", "localrun::rope"}
    assert expected | {"localrun::qmatmul", "localrun::rms_norm"} <= set(seen.calls)
    for name, (op, args, kwargs) in seen.calls.items():
        result = torch.library.opcheck(op, args, kwargs, test_utils=("test_schema", "test_faketensor"))
        assert set(result.values()) == {"SUCCESS"}, (name, result)


def test_the_decode_forward_compiles_to_one_graph_with_the_same_bits(tmp_path):
    path = write_tiny_model(tmp_path / "llama.gguf", architecture="llama", tensor_type="Q4_0")
    model = LLM(path, dtype="float32", quantized=True, n_threads=1).model
    tokens, positions, paged, pools = decode_inputs(model)
    before = [(k.clone(), v.clone()) for k, v in pools]
    eager = model(tokens, positions, [], decode_rows=len(TOKENS), paged=paged)
    written = [(k.clone(), v.clone()) for k, v in pools]
    for (k, v), (k0, v0) in zip(pools, before):                      # the same pool contents again
        k.copy_(k0)
        v.copy_(v0)
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True, dynamic=True)
    try:
        assert torch.equal(compiled(tokens, positions, [], decode_rows=len(TOKENS), paged=paged), eager)
    finally:
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for (k, v), (kw, vw) in zip(pools, written) for a, b in ((k, kw), (v, vw)))


def test_registering_skips_ops_a_library_lacks_and_ops_done_already(monkeypatch):
    """An older build loaded through LOCALRUN_KERNEL_LIBRARY (benchmarks/kernel_ab.py) may lack an
    op; the kernels must still load."""
    monkeypatch.setitem(meta.FAKES, "no_such_op", lambda x: x)
    meta.register()                                   # neither the missing op nor the second time raises
    assert not hasattr(torch.ops.localrun, "no_such_op")
