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
    ("stop", ("",)), ("stop", "abc"), ("min_tokens", -1), ("min_tokens", 300), ("min_tokens", 2.0),
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


# --- logit_bias: OpenAI's field, token ids in the vocabulary and values in [-100, 100] ---------
@pytest.mark.parametrize("bias", [{-1: 1}, {5: 101}, {5: math.nan}, {"5": 1}, {True: 1}, {i: 1 for i in range(1025)}],
                         ids=["negative id", "value 101", "NaN", "string key", "bool key", "1025 tokens"])
def test_bad_logit_bias_is_refused_by_name(bias):
    with pytest.raises(InvalidSamplingParam, match="^logit_bias"):
        SamplingParams(logit_bias=bias)


def test_logit_bias_shifts_the_distribution_before_the_filters():
    params = SamplingParams(temperature=0, logit_bias={4: 100, 0: -100})
    assert params.logit_bias == ((0, -100.0), (4, 100.0))
    assert sample(LOGITS, params, make_generator(0)) == 4
    probs = probabilities(LOGITS, SamplingParams(temperature=1, top_k=0, top_p=1, min_p=0, logit_bias={0: -100}))
    assert float(probs[0]) < 1e-40 and abs(float(probs[1:].sum()) - 1) < 1e-6
    # the others keep their ratios: 0.25 : 0.125 : 0.0625 : 0.0625
    assert torch.allclose(probs[1:], torch.tensor([0.5, 0.25, 0.125, 0.125]), atol=1e-6)


def test_logit_bias_in_the_python_api(llm):
    forced = llm.generate("hello", max_tokens=5, temperature=0, ignore_eos=True, logit_bias={7: 100})
    assert forced.token_ids == [7] * 5
    with pytest.raises(ValueError, match="^logit_bias names token id 99999, outside the vocabulary"):
        llm.generate("hello", max_tokens=2, logit_bias={99999: 1})
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_min_tokens_bans_the_end_of_generation_until_that_many(llm):
    """min_tokens (vLLM's, llama-cpp-python's): with the end-of-generation token forced by a
    +100 bias, a request ends at once; with min_tokens=n it generates exactly n tokens first,
    none of them an EOG, then ends on the EOG ("stop"). With ignore_eos too, the first n are
    still no EOG (no hidden end-of-turn tokens in a fixed-length benchmark reply), and an EOG
    after them does not end it."""
    eog = sorted(llm.tokenizer.eog_ids)
    forced = {eog[0]: 100.0}
    assert llm.generate("hello", max_tokens=8, temperature=0, logit_bias=forced).token_ids == []
    for n in (1, 3, 8):
        out = llm.generate("hello", max_tokens=8, min_tokens=n, temperature=0, logit_bias=forced)
        assert len(out.token_ids) == n and not set(out.token_ids) & set(eog), out.token_ids
        assert out.finish_reason == ("length" if n == 8 else "stop")
    sampled = llm.generate("hello", max_tokens=6, min_tokens=6, temperature=1.0, seed=3, logit_bias=forced)
    assert len(sampled.token_ids) == 6 and not set(sampled.token_ids) & set(eog)
    ignoring = llm.generate("hello", max_tokens=5, min_tokens=3, temperature=0, logit_bias=forced, ignore_eos=True)
    assert ignoring.token_ids[3:] == [eog[0]] * 2 and not set(ignoring.token_ids[:3]) & set(eog)
    assert llm.engine.block_manager.num_used_blocks == 0 and not llm.engine.has_unfinished()


def test_min_tokens_holds_through_speculative_verification(tiny_gguf):
    """Prompt lookup drafts the prompt's repeats, EOG-free; verification samples each kept row
    under the ban of its own position, so the output is the plain engine's, draft or not."""
    prompt = "hello world " * 12
    plain = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    eog = sorted(plain.tokenizer.eog_ids)
    options = dict(max_tokens=12, min_tokens=9, temperature=0, logit_bias={eog[0]: 10.0})
    spec = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, speculative="ngram", speculative_adaptive=False)
    expected = plain.generate(prompt, **options)
    unbanned = plain.generate(prompt, **{**options, "min_tokens": 0})
    assert len(unbanned.token_ids) < 9        # the bias makes the EOG win early: the ban matters
    assert len(expected.token_ids) >= 9 and not set(expected.token_ids[:9]) & set(eog)
    got = spec.generate(prompt, **options)
    assert got.token_ids == expected.token_ids
    assert spec.engine.stats()["spec_draft_tokens"] > 0


def test_min_tokens_in_the_sampler_counts_output_tokens_only():
    from localrun.sampling import SamplerState
    logits = torch.tensor([0.0, 5.0, 1.0])     # token 1, the EOG here, is the argmax
    params = SamplingParams(temperature=0, min_tokens=2, max_tokens=4)
    params = SamplingParams(**{**params.__dict__, "state": SamplerState(3, banned_early=(1,))})
    prompt = [7, 7, 7]
    assert sample(logits, params, make_generator(0), prompt) == 2             # 0 generated
    assert sample(logits, params, make_generator(0), prompt + [2]) == 2       # 1 generated
    assert sample(logits, params, make_generator(0), prompt + [2, 2]) == 1    # 2: the ban is over
    assert float(probabilities(logits, params, prompt)[1]) == 0.0
