"""The sampler's filters against hand-computed distributions."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from localrun.errors import UserError
from localrun.sampling import (SamplerState, SamplingParams, apply_repeat_penalty, filter_logits, make_generator,
                               plain_greedy, sample)

# probabilities 0.5, 0.25, 0.125, 0.0625, 0.0625
LOGITS = torch.tensor([math.log(p) for p in (0.5, 0.25, 0.125, 0.0625, 0.0625)])


def kept(logits):
    return torch.isfinite(logits).nonzero().flatten().tolist()


def test_top_k_keeps_k_largest():
    assert kept(filter_logits(LOGITS, SamplingParams(top_k=2, top_p=1, min_p=0))) == [0, 1]


def test_top_p_keeps_smallest_set_reaching_p():
    # cumulative 0.5, 0.75, 0.875: p=0.7 needs the first two, p=0.8 the first three
    assert kept(filter_logits(LOGITS, SamplingParams(top_k=0, top_p=0.7, min_p=0))) == [0, 1]
    assert kept(filter_logits(LOGITS, SamplingParams(top_k=0, top_p=0.8, min_p=0))) == [0, 1, 2]
    assert kept(filter_logits(LOGITS, SamplingParams(top_k=0, top_p=0.1, min_p=0))) == [0]


def test_min_p_is_relative_to_the_top_token():
    # min_p=0.3: keep p >= 0.15 -> 0.5, 0.25
    assert kept(filter_logits(LOGITS, SamplingParams(top_k=0, top_p=1, min_p=0.3))) == [0, 1]


def test_repeat_penalty_follows_llama_cpp_rule():
    logits = torch.tensor([2.0, -2.0, 1.0])
    out = apply_repeat_penalty(logits, [0, 1, 1], 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0]


def test_greedy_ignores_seed_and_temperature_zero_is_argmax():
    assert sample(LOGITS, SamplingParams(temperature=0), make_generator(1)) == 0


def test_sampling_frequencies_match_distribution():
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    g = make_generator(0)
    counts = torch.bincount(torch.tensor([sample(LOGITS, p, g) for _ in range(4000)]), minlength=5)
    freq = counts.float() / 4000
    assert torch.allclose(freq, LOGITS.softmax(-1), atol=0.03), freq


def test_temperature_sharpens():
    g = make_generator(0)
    cold = SamplingParams(temperature=0.25, top_k=0, top_p=1.0, min_p=0.0)
    n0 = sum(sample(LOGITS, cold, g) == 0 for _ in range(1000))
    # p0 at T=0.25: 0.5^4 / sum(p^4) = 0.0625 / (0.0625+0.0039+0.00024+2*1.5e-5) ~ 0.937
    assert 900 <= n0 <= 970


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=1.5), dict(min_p=-0.1),
                                 dict(max_tokens=-3), dict(repeat_penalty=0)])
def test_bad_parameters_are_user_errors(bad):
    with pytest.raises(UserError):
        SamplingParams(**bad)


def test_argmax_is_torchs_first_maximum_and_first_nan():
    """sampling.argmax (numpy's on the CPU) picks what torch's argmax picks: the first of tied
    maxima, the first NaN if any, on strided views too."""
    from localrun.sampling import argmax
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        x = torch.randint(-3, 4, (97,), generator=g).float()          # many ties
        assert argmax(x) == int(x.argmax())
        assert argmax(x[1::3]) == int(x[1::3].argmax())
        x[torch.randint(0, 97, (2,), generator=g)] = float("nan")
        assert argmax(x) == int(x.argmax())


def test_candidate_probs_are_the_full_width_chain():
    """The sampler computes top-k, top-p, min-p and the temperature over top-k's candidates
    only. Its distribution, put back over the vocabulary, is the full-width reference's:
    softmax(filter_logits(logits) / temperature), with ties at the k-th value, masked tokens
    and fewer finite logits than k among the cases."""
    from localrun.sampling import candidate_probs, probabilities
    g = torch.Generator().manual_seed(5)
    for case in range(300):
        logits = torch.randn(500, generator=g) * 3
        if case % 3 == 0:
            logits = torch.round(logits)                                # many ties
        if case % 5 == 0:
            logits[torch.rand(500, generator=g) < (0.99 if case % 2 else 0.5)] = float("-inf")
        p = SamplingParams(temperature=float(torch.rand(1, generator=g)) * 1.5 + 0.05,
                           top_k=int(torch.randint(0, 80, (1,), generator=g)),
                           top_p=[1.0, 0.95, 0.5, 0.1][case % 4], min_p=[0.0, 0.05, 0.3][case % 3])
        reference = (filter_logits(logits, p) / p.temperature).softmax(-1)
        ids, probs = candidate_probs(logits, p)
        full = torch.zeros(500).index_copy_(0, ids, probs)
        if case % 3 == 0 and p.top_p < 1.0:
            # a top-p boundary inside a group of tied logits may keep another member of the
            # group (either sort may order ties): the same probabilities, not the same ids
            assert torch.allclose(full.sort().values, reference.sort().values, atol=1e-6), case
        else:
            assert torch.allclose(full, reference, atol=1e-6), case
        assert torch.equal(probabilities(logits, p), full)


def test_sampling_frequencies_match_the_filtered_distribution():
    """Draws follow the filtered distribution: top-k 3 of a 9-token vocabulary, at T=0.7."""
    logits = torch.tensor([2.0, 1.5, 0.2, 1.0, -1.0, 0.5, -3.0, 0.0, 1.2])
    p = SamplingParams(temperature=0.7, top_k=3, top_p=1.0, min_p=0.0)
    g = make_generator(1)
    counts = torch.bincount(torch.tensor([sample(logits, p, g) for _ in range(6000)]), minlength=9)
    expected = torch.zeros(9)
    expected[[0, 1, 8]] = (torch.tensor([2.0, 1.5, 1.2]) / 0.7).softmax(-1)
    assert torch.allclose(counts.float() / 6000, expected, atol=0.025), counts


class _BanFirst:
    """A grammar matcher's stand-in (grammar.Matcher's interface): bans token 0 (the logits'
    argmax below), its masks always ready."""
    def advance(self, token_ids):
        pass

    def ready(self):
        return True

    def allowed(self):
        return torch.tensor([False, True, True, True])

    def mask(self, logits):
        return logits.masked_fill(~self.allowed(), float("-inf"))


@given(st.data())
@settings(max_examples=200, deadline=None)
def test_plain_greedy_params_sample_the_argmax_and_the_others_go_through_the_chain(data):
    """ModelRunner.sample takes the argmax of rows whose params are `plain_greedy`, skipping the
    chain: that must be what `sample` gives for them. Every field that changes a greedy token
    (logit bias, min_tokens' ban, the penalties, a grammar; logprobs only records) is drawn, and
    the logits are made so that each one, when on, changes the token (token 0 leads, token 1 is
    close behind and in the recent tokens)."""
    eog = 0
    p = SamplingParams(
        temperature=0.0, max_tokens=8,
        logit_bias=data.draw(st.sampled_from([(), ((0, -5.0),)])),
        min_tokens=data.draw(st.sampled_from([0, 2])),
        repeat_penalty=data.draw(st.sampled_from([1.0, 1.5])),
        repeat_last_n=data.draw(st.sampled_from([0, 64])),
        presence_penalty=data.draw(st.sampled_from([0.0, 1.0])),
        frequency_penalty=data.draw(st.sampled_from([0.0, 1.0])),
        logprobs=data.draw(st.sampled_from([None, 2])))
    matcher = _BanFirst() if data.draw(st.booleans()) else None
    object.__setattr__(p, "state", SamplerState(num_prompt_tokens=2, matcher=matcher, banned_early=(eog,)))
    logits = torch.tensor([3.0, 2.9, 1.0, -1.0])
    recent = [0, 2, 0]                       # the prompt's 2 tokens, then token 0 once in the output
    token = sample(logits, p, make_generator(0), recent)
    if plain_greedy(p):
        assert token == 0
    changes = bool(p.logit_bias or p.min_tokens or matcher or p.frequency_penalty or p.presence_penalty
                   or (p.repeat_penalty != 1.0 and p.repeat_last_n))
    if changes:
        assert not plain_greedy(p)
        assert token != 0
    assert plain_greedy(p) == (not changes and p.logprobs is None)
