"""Sampling fields are checked at the door with OpenAI's ranges (issue 21), and the values
that used to reach the sampler and crash it (top_p 0 or 5e-324, repeat_penalty 5e-324, seeds
of 2**64 and more) are refused by name or sampled safely."""
from __future__ import annotations

import math

import pytest
import torch

from localrun.api import LLM
from localrun.errors import UserError
from localrun.sampling import InvalidSamplingParam, SamplingParams, make_generator, probabilities, sample

LOGITS = torch.tensor([math.log(p) for p in (0.5, 0.25, 0.125, 0.0625, 0.0625)])

REFUSED = [
    ("temperature", -0.1), ("temperature", 2.5), ("temperature", math.nan), ("temperature", math.inf),
    ("temperature", "hot"), ("top_p", 0), ("top_p", -1e-9), ("top_p", 1.0001), ("top_p", math.nan),
    ("min_p", -0.1), ("min_p", 1.5), ("top_k", -1), ("top_k", 2.5), ("top_k", True),
    ("repeat_penalty", 0), ("repeat_penalty", 5e-324), ("repeat_penalty", 11), ("repeat_penalty", math.inf),
    ("repeat_last_n", -1), ("max_tokens", -1), ("max_tokens", 1.5), ("seed", 1.5), ("seed", "7"),
    ("stop", ("",)), ("stop", "abc"),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v!r}" for f, v in REFUSED])
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidSamplingParam) as info:
        SamplingParams(**{field: value})
    e = info.value
    assert isinstance(e, UserError) and isinstance(e, ValueError)   # the CLI's and Python's kinds
    assert e.field == field and str(e).startswith(field) and "\n" not in str(e)


@pytest.mark.parametrize("fields", [dict(temperature=0), dict(temperature=2), dict(top_p=5e-324),
                                    dict(top_p=1), dict(min_p=0), dict(min_p=1), dict(top_k=0),
                                    dict(repeat_penalty=0.01), dict(repeat_penalty=10),
                                    dict(temperature=1e-300), dict(max_tokens=0)])
def test_edge_values_sample_a_real_token(fields):
    params = SamplingParams(**{"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, **fields})
    probs = probabilities(LOGITS, params, recent=[0, 1])
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    for seed in range(5):
        assert 0 <= sample(LOGITS, params, make_generator(seed), recent=[0, 1]) < 5


def test_tiny_top_p_and_temperature_keep_the_top_token():
    for params in (SamplingParams(top_p=5e-324, top_k=0, min_p=0, temperature=1),
                   SamplingParams(temperature=5e-324, top_k=0, top_p=1, min_p=0)):
        assert all(sample(LOGITS, params, make_generator(s)) == 0 for s in range(20))


@pytest.mark.parametrize("seed", [2**63, 2**64 - 1, 2**64, 10**30, -1, -(10**30)])
def test_any_integer_seed_maps_into_the_generator(seed):
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    draws = [sample(LOGITS, params, make_generator(seed)) for _ in range(2)]
    again = [sample(LOGITS, params, make_generator(seed % 2**64)) for _ in range(2)]
    assert draws == again


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, n_parallel=2)


@pytest.mark.parametrize("field,value", [("top_p", 0), ("repeat_penalty", 5e-324), ("temperature", 3)])
def test_the_python_api_refuses_with_one_sentence(llm, field, value):
    for call in (lambda: llm.generate("hello", **{field: value}),
                 lambda: list(llm.stream("hello", **{field: value})),
                 lambda: llm.chat([{"role": "user", "content": "hi"}], **{field: value})):
        with pytest.raises(ValueError, match=f"^{field} must be"):
            call()
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_a_huge_seed_generates_the_same_as_its_residue(llm):
    a = llm.generate("hello", max_tokens=6, temperature=1.0, seed=10**30, ignore_eos=True)
    b = llm.generate("hello", max_tokens=6, temperature=1.0, seed=10**30 % 2**64, ignore_eos=True)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 6
