"""OpenAI's sampling fields in the engine and the Python API (issue 19), on a tiny synthetic model:
presence/frequency penalties against hand-computed values and a greedy loop over `LLM.logits`,
logprobs against `LLM.logits` (values, ranks, sums), n > 1 (one prefill, seeds per choice)."""
from __future__ import annotations

import math

import pytest
import torch

from localrun.api import LLM, MAX_N
from localrun.errors import UserError
from localrun.sampling import SamplerState, SamplingParams, apply_openai_penalties, make_generator, sample

PROMPT = "the quick brown fox jumps over the lazy dog and the fox"


@pytest.fixture(scope="module")
def llm(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=512), dtype="float32", n_threads=1, n_parallel=4)


# --- penalties ---------------------------------------------------------------------------------
def test_openai_penalties_hand_computed():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    # output so far: token 2 twice, token 0 once; c = [1, 0, 2, 0]
    out = apply_openai_penalties(logits, [2, 2, 0], presence=0.5, frequency=0.25)
    assert out.tolist() == [1.0 - 0.25 - 0.5, 2.0, 3.0 - 2 * 0.25 - 0.5, 0.5]
    # negative values encourage repetition: same formula
    assert apply_openai_penalties(logits, [3], presence=-1.0, frequency=-0.5).tolist() == [1.0, 2.0, 3.0, 2.0]


def test_penalties_count_the_output_only_not_the_prompt():
    logits = torch.tensor([0.0, 1.0, 0.9])
    # the prompt is [1, 1, 1]: not counted, so token 1 (1.0) still beats token 2 (0.9)
    params = SamplingParams(temperature=0, frequency_penalty=0.2, state=SamplerState(num_prompt_tokens=3))
    assert sample(logits, params, make_generator(0), [1, 1, 1]) == 1
    # one 1 in the output: 1.0 - 0.2 = 0.8 < 0.9
    assert sample(logits, params, make_generator(0), [1, 1, 1, 1]) == 2


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_greedy_with_a_penalty_follows_a_hand_loop_over_llm_logits(llm, field):
    """The engine's greedy choice at every step equals argmax(logits - penalty(output so far)),
    with the logits from LLM.logits (the reference path)."""
    value = 1.5
    prompt = llm.tokenize(PROMPT)
    result = llm.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True, **{field: value})
    ids, expected = list(prompt), []
    for _ in range(12):
        logits = llm.logits(ids)[-1]
        counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=logits.shape[0]).float() \
            if expected else torch.zeros_like(logits)
        penalty = counts * value if field == "frequency_penalty" else (counts > 0).float() * value
        expected.append(int((logits - penalty).argmax()))
        ids.append(expected[-1])
    assert result.token_ids == expected
    plain = llm.generate(prompt, max_tokens=12, temperature=0, ignore_eos=True)
    assert plain.token_ids != expected       # the penalty changed something: the test can fail


# --- logprobs ----------------------------------------------------------------------------------
def test_logprobs_match_llm_logits_in_value_rank_and_sum(llm):
    prompt = llm.tokenize(PROMPT)
    k = 20
    result = llm.generate(prompt, max_tokens=6, temperature=0, ignore_eos=True, logprobs=k)
    assert len(result.logprobs) == len(result.token_ids) == 6
    ids = list(prompt)
    for token_id, record in zip(result.token_ids, result.logprobs):
        reference = torch.log_softmax(llm.logits(ids)[-1].double(), -1)
        assert record.token_id == token_id
        assert record.logprob == pytest.approx(float(reference[token_id]), abs=2e-3)
        # ranks: the top k in descending order, the same tokens as the reference's top k
        values = [v for _, v in record.top]
        assert values == sorted(values, reverse=True) and len(record.top) == k
        assert record.top[0][0] == token_id == int(reference.argmax())        # greedy draws the top token
        ref_top = torch.topk(reference, k + 1)
        ref_ids = ref_top.indices.tolist()
        margin = float(ref_top.values[k - 1] - ref_top.values[k])
        if margin > 1e-3:           # no near-tie at the cut: the same set
            assert {i for i, _ in record.top} == set(ref_ids[:k])
        for i, v in record.top:
            assert v == pytest.approx(float(reference[i]), abs=2e-3)
        # sums: the top k's mass equals the reference's, and never exceeds 1
        mass = sum(math.exp(v) for _, v in record.top)
        assert mass <= 1 + 1e-5
        assert mass == pytest.approx(float(reference[ref_ids[:k]].exp().sum()), abs=2e-3)
        ids.append(token_id)


def test_logprobs_are_taken_before_temperature_and_after_penalties(llm):
    prompt = llm.tokenize(PROMPT)
    # the prompt's full blocks into the prefix cache first, so that both calls below compute the
    # same logits the same way (a prompt computed in one chunk and one computed after its cached
    # blocks differ by summation order, ~2e-5 here on an AVX-512 host)
    llm.generate(prompt, max_tokens=1, temperature=0)
    hot = llm.generate(prompt, max_tokens=1, temperature=1.7, top_k=1, seed=1, logprobs=3)
    cold = llm.generate(prompt, max_tokens=1, temperature=0, logprobs=3)
    assert hot.token_ids == cold.token_ids                 # top_k=1: the same token
    assert hot.logprobs[0].logprob == cold.logprobs[0].logprob      # temperature: no effect, bit for bit
    assert hot.logprobs[0].top == cold.logprobs[0].top
    # logit_bias (before logprobs) moves them: +5 on the runner-up
    runner_up = cold.logprobs[0].top[1][0]
    biased = llm.generate(prompt, max_tokens=1, temperature=0, logprobs=3, logit_bias={runner_up: 5.0})
    assert dict(biased.logprobs[0].top)[runner_up] > dict(cold.logprobs[0].top)[runner_up]


def test_logprobs_bounds():
    with pytest.raises(UserError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(UserError, match="presence_penalty"):
        SamplingParams(presence_penalty=2.5)


# --- n > 1 ------------------------------------------------------------------------------------
def test_n_choices_share_one_prefill(llm):
    """n=3: the first choice computes the prompt; the other two wait for its blocks and hit the
    prefix cache, recomputing only the prompt's last partial block (< block_size tokens)."""
    prompt = llm.tokenize(PROMPT * 4)
    num_prompt = len(prompt)
    engine = llm.engine
    llm.reset()
    before = engine.stats()["num_prefill_tokens"]
    results = llm.generate(prompt, n=3, max_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    counted = engine.stats()["num_prefill_tokens"] - before
    block_size = engine.block_manager.block_size
    tail = num_prompt - (num_prompt - 1) // block_size * block_size      # the last partial block, >= 1 token
    assert num_prompt > 3 * block_size
    assert [r.timings["cached_tokens"] for r in results] == [0, num_prompt - tail, num_prompt - tail]
    assert counted == num_prompt + 2 * tail           # one prefill; not 3 * num_prompt
    assert counted < 1.5 * num_prompt


def test_n_choices_are_reproducible_by_seed(llm):
    prompt = llm.tokenize(PROMPT)
    choices = llm.generate(prompt, n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    singles = [llm.generate(prompt, max_tokens=8, temperature=1.0, seed=5 + i, ignore_eos=True) for i in range(3)]
    assert [c.token_ids for c in choices] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in choices}) > 1          # different seeds, different choices
    again = llm.generate(prompt, n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    assert [c.token_ids for c in again] == [c.token_ids for c in choices]


def test_n_bound(llm):
    with pytest.raises(UserError, match="n must be"):
        llm.generate("x", n=MAX_N + 1)
    with pytest.raises(UserError, match="n must be"):
        llm.generate("x", n=0)
