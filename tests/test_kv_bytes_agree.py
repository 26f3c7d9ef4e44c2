"""One KV spec (layerplan.kv_cache.ENGINE_KV): the pool the engine allocates, the plan that places
it (layerplan's placement, sized for localrun) and the KV line of layerplan's ledger agree with it,
byte for byte, for every KV type and for head sizes with and without 32-value scale groups."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import layerplan
from layerplan.kv_cache import ENGINE_KV, ENGINE_KV_TYPES, LLAMA_CPP, LOCALRUN, engine_kv
from layerplan.ledger import engine_ledger
from layerplan.probe import probe_host
from localrun.engine import paged_kv
from localrun.engine.paged_kv import PagedKVCache

KV_TYPES = [t for t in ENGINE_KV_TYPES if t != "fp8" or paged_kv.fp8_dtype() is not None]
HEAD_DIMS = [64, 128, 256, 80, 40]       # 80 and 40: no 32-value scale groups, one scale per head


def pool_bytes(cache: PagedKVCache) -> int:
    return sum(t.numel() * t.element_size() for k, v in cache.layers for store in (k, v) for t in store.tensors())


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (40, 16), (64, 8), (80, 16)])
def test_the_pool_allocates_what_the_spec_says(kv_type, head_dim, block_size):
    n_layers, n_kv, num_blocks = 3, 2, 6
    cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size, n_layers=n_layers, n_head_kv=n_kv,
                         head_dim=head_dim, kv_type=kv_type, compute_dtype=torch.float32)
    tokens = num_blocks * block_size
    spec = engine_kv(kv_type).bytes_per_token(n_kv, head_dim, head_dim, block_size)
    assert pool_bytes(cache) == n_layers * tokens * spec


def test_the_quantized_layouts_by_hand():
    """Per value at head size 64 and blocks of 16: int8 K 1 + 4/16 (a scale per block per channel),
    V 1 + 4/32 (a scale per 32 values of a token's head): 1.1875 on average, not q8_0's 1.0625;
    fp8 K and V 1 + 4/32 = 1.125, not vLLM's 1."""
    per_value = {name: ENGINE_KV[name].bytes_per_token(1, 64, 64) / 128 for name in ENGINE_KV}
    assert per_value == {"f32": 4, "bf16": 2, "f16": 2, "int8": 1.1875, "fp8": 1.125}
    assert layerplan.kv_type("q8_0").bytes_for(32) == 34        # llama.cpp's own, for --emit llama-server


def profile_with_heads(head_dim: int, n_kv_head: int = 2, n_layers: int = 3):
    """A small dense model's profile whose layers have `n_kv_head` KV heads of `head_dim`."""
    base = layerplan.profile_builtin("llama2-7b:q4_0")
    layers = tuple(dataclasses.replace(layer, n_kv_head=n_kv_head, head_dim_k=head_dim, head_dim_v=head_dim)
                   for layer in base.layers[:n_layers])
    return dataclasses.replace(base, n_layers=n_layers, layers=layers)


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_the_plan_places_the_pool_the_engine_allocates(kv_type, head_dim):
    """The KV bytes a plan for localrun puts on a device (what decides whether a placement fits, and
    the KV budget the engine is given) are the bytes the pool takes for the plan's tokens."""
    n_ctx, n_parallel, block_size = 256, 2, 16
    profile = profile_with_heads(head_dim)
    plan = layerplan.plan(profile, layerplan.Machine(gpus=(), host=probe_host()), n_ctx=n_ctx, n_parallel=n_parallel,
                          kv_type=kv_type, n_gpu_layers=0, with_sweep=False, runtime=LOCALRUN)
    cache = PagedKVCache(num_blocks=n_ctx * n_parallel // block_size, block_size=block_size, n_layers=profile.n_layers,
                         n_head_kv=2, head_dim=head_dim, kv_type=kv_type, compute_dtype=torch.float32)
    assert plan.placement.host.kv_bytes == pool_bytes(cache)
    assert plan.kv_bytes_per_token * n_ctx * n_parallel == pool_bytes(cache)
    (ledger_kv,) = [i.n_bytes for i in engine_ledger(plan).items if i.what.startswith("KV pool")]
    assert ledger_kv == pool_bytes(cache)


def test_a_plan_for_llama_cpp_keeps_its_block_sizes():
    """The same q8_0 plan for llama.cpp (--emit llama-server) sizes 34 bytes per 32 values."""
    profile = profile_with_heads(64)
    machine = layerplan.Machine(gpus=(), host=probe_host())
    ours, theirs = (layerplan.plan(profile, machine, n_ctx=256, kv_type="q8_0", n_gpu_layers=0, with_sweep=False,
                                   runtime=runtime) for runtime in (LOCALRUN, LLAMA_CPP))
    values = 256 * profile.n_layers * 2 * 2 * 64
    assert (ours.settings.kv.name, ours.placement.host.kv_bytes) == ("int8", values * 1.1875)
    assert (theirs.settings.kv.name, theirs.placement.host.kv_bytes) == ("q8_0", values * 34 / 32)
    assert "-ctk q8_0" in layerplan.llama_server_command(ours)    # a command for llama.cpp says its name


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_the_engine_sizes_its_pool_as_its_plan(tiny_gguf, kv_type):
    """LLM's plan (localrun.placement.plan_device_map) and its engine's pool: the same bytes per token."""
    from localrun.api import LLM
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, n_ctx=64, n_parallel=1, kv_type=kv_type)
    plan = layerplan.plan(llm.file.profile, layerplan.Machine(gpus=(), host=probe_host()), n_ctx=64,
                          kv_type=llm.kv_type, n_gpu_layers=0, with_sweep=False, runtime=LOCALRUN)
    engine = llm.engine
    assert engine.kv_type == kv_type
    assert engine.bytes_per_token == plan.kv_bytes_per_token
    assert engine.kv_cache.num_bytes == engine.num_blocks * engine.block_manager.block_size * plan.kv_bytes_per_token
