"""One source for the sizes of the engine's KV layouts (layerplan.kv_cache.engine_kv_bytes_per_value):
the pool the engine allocates and the KV line of layerplan's ledger agree with it, byte for byte,
for every KV type and for head sizes with and without 32-value scale groups."""
from __future__ import annotations

import pytest
import torch

import layerplan
from layerplan.kv_cache import ENGINE_KV_TYPES, engine_kv_bytes_per_value
from layerplan.ledger import EngineOptions, engine_kv_type, engine_ledger
from layerplan.probe import probe_host
from localrun.engine import paged_kv
from localrun.engine.paged_kv import PagedKVCache

KV_TYPES = [t for t in ENGINE_KV_TYPES if t != "fp8" or paged_kv.fp8_dtype() is not None]


def pool_bytes(cache: PagedKVCache) -> int:
    return sum(t.numel() * t.element_size() for k, v in cache.layers for store in (k, v) for t in store.tensors())


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (40, 16), (64, 8)])
def test_the_pool_allocates_what_the_formula_says(kv_type, head_dim, block_size):
    n_layers, n_kv, num_blocks = 3, 2, 6
    cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size, n_layers=n_layers, n_head_kv=n_kv,
                         head_dim=head_dim, kv_type=kv_type, compute_dtype=torch.float32)
    values = 2 * n_layers * num_blocks * block_size * n_kv * head_dim           # K and V
    assert pool_bytes(cache) == pytest.approx(values * engine_kv_bytes_per_value(kv_type, head_dim, block_size), rel=1e-12)


@pytest.mark.parametrize("plan_kv, engine_kv", [("f16", "f16"), ("f32", "f32"), ("bf16", "bf16"), ("q8_0", "int8"),
                                                ("int8", "int8"), ("fp8", "fp8"), ("q4_0", None)])
def test_plan_kv_names_map_to_the_engine(plan_kv, engine_kv):
    assert engine_kv_type(plan_kv) == engine_kv


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_the_ledger_plans_the_pool_the_engine_allocates(tiny_gguf, kv_type):
    """The ledger's KV line for n_ctx tokens equals a real pool of n_ctx tokens of the same model."""
    from localrun.api import LLM
    path = tiny_gguf("F32")
    n_ctx, block_size = 256, 16
    profile = layerplan.profile_gguf(path)
    plan = layerplan.plan(profile, layerplan.Machine(gpus=(), host=probe_host()), n_ctx=n_ctx, n_parallel=1,
                          kv_type="q8_0" if kv_type == "int8" else kv_type, n_gpu_layers=0, with_sweep=False)
    ledger = engine_ledger(plan, EngineOptions(kv_type=kv_type))
    (planned,) = [i.n_bytes for i in ledger.items if i.what.startswith("KV pool")]
    c = LLM(path, dtype="float32", n_threads=1).model.config
    cache = PagedKVCache(num_blocks=n_ctx // block_size, block_size=block_size, n_layers=c.n_layers,
                         n_head_kv=c.n_head_kv, head_dim=c.head_dim, kv_type=kv_type, compute_dtype=torch.float32)
    assert planned == pytest.approx(pool_bytes(cache), abs=c.n_layers)      # the ledger rounds per layer
