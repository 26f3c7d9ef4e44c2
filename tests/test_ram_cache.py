"""The host-RAM tier of the prefix cache on the tiny synthetic model: blocks the pool evicts come
back from RAM with the same greedy output as computing them; the size bound holds; a block is
only used for the token ids it holds; it is off by default where the KV is in host memory."""
from __future__ import annotations

import random

import pytest
import torch

from localrun.api import LLM
from localrun.engine.llm_engine import LLMEngine
from localrun.engine.ram_cache import HostKVCache, default_ram_bytes
from localrun.errors import UserError
from localrun.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BS = 16


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


A, B, C = (random_ids(200, seed) for seed in (1, 2, 3))


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return LLM(tiny_gguf("F32"), dtype="float32", n_threads=1).model


def engine(model, ram_cache_bytes: int) -> LLMEngine:
    """A 20-block pool: one 200-token prompt (13 blocks with its output) at a time."""
    return LLMEngine(model, num_blocks=20, block_size=BS, max_model_len=256, ram_cache_bytes=ram_cache_bytes)


def run(eng: LLMEngine, request_id: str, prompt: list[int]):
    seq = eng.add_request(request_id, prompt, GREEDY)
    while eng.has_unfinished():
        eng.step()
    return seq.generated_token_ids, seq.timings()


def test_evicted_blocks_come_back_from_ram(model):
    plain = engine(model, 0)
    first, _ = run(plain, "a", A)
    eng = engine(model, 64 << 20)
    assert run(eng, "a", A)[0] == first
    run(eng, "b", B)
    run(eng, "c", C)
    hashes = eng.block_manager._block_hashes(_seq(A), 12)
    in_pool = sum(h in eng.block_manager.cached_block_ids for h in hashes)
    assert in_pool < 12 and all(h in eng.ram_cache.blocks for h in hashes)   # evicted, kept in RAM
    again, t = run(eng, "a2", A)
    assert again == first
    assert t["cached_tokens_ram"] == (12 - in_pool) * BS
    assert t["cached_tokens"] == 192                                     # the prompt's 12 full blocks
    assert eng.stats()["ram_cache_hit_tokens"] == t["cached_tokens_ram"]
    # without the tier the same sequence of requests recomputes A
    run(plain, "b", B)
    run(plain, "c", C)
    again_plain, t_plain = run(plain, "a2", A)
    assert again_plain == first and t_plain["cached_tokens_ram"] == 0
    assert t_plain["cached_tokens"] < t["cached_tokens"]


def _seq(prompt):
    from localrun.engine.sequence import Sequence
    return Sequence("probe", prompt, GREEDY)


def test_size_bound_holds(model):
    eng = engine(model, 0)
    block_bytes = HostKVCache(eng.kv_cache, 1).block_bytes
    eng = engine(model, 5 * block_bytes)
    for i, prompt in enumerate((A, B, C)):
        run(eng, str(i), prompt)
    ram = eng.ram_cache
    assert ram.num_blocks == 5 and ram.num_bytes == 5 * block_bytes <= ram.max_bytes
    assert ram.stats.num_stored_blocks == ram.stats.num_evicted_blocks + 5
    assert sum(t.numel() * t.element_size() for _, ts in ram.blocks.values() for t in ts.values()) == ram.num_bytes


def test_a_block_is_used_only_for_its_token_ids(model):
    eng = engine(model, 64 << 20)
    run(eng, "a", A)
    ram = eng.ram_cache
    block_hash, (token_ids, _) = next(iter(ram.blocks.items()))
    free_block = eng.block_manager.free_block_ids[0]
    assert not ram.load(block_hash, tuple(t + 1 for t in token_ids), free_block)
    assert ram.load(block_hash, token_ids, free_block)


def test_default_is_off_where_the_kv_is_in_host_memory(model, tiny_gguf):
    assert default_ram_bytes([torch.device("cpu")] * 2) == 0
    assert 0 < default_ram_bytes([torch.device("cpu"), torch.device("cuda", 0)]) <= 4 << 30
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    assert llm.engine.ram_cache is None and llm.engine.stats()["ram_cache_enabled"] == 0
    with pytest.raises(UserError, match="not a size"):
        LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, cache_ram="lots")
    with pytest.raises(UserError, match="non-negative"):
        LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, cache_ram=-1)
