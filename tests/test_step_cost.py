"""The engine's step-cost model (localrun/engine/step_cost.py) against a known cost law: what it
learns from steps shaped like real ones, its prior before any, and the case that motivated it."""
from __future__ import annotations

import random

import pytest

from localrun.engine.step_cost import MixedStepCost, attended_keys


def law(d: int, p: int, a: int) -> float:
    """Seconds, about SmolLM2's on 2 Zen 3 cores: decode rows at 4 ms each over 10 ms; a
    prompt-carrying step 3 ms more, 5 ms a prompt token and 3 us a key its tokens attend."""
    decode = 0.010 + 0.004 * d if d else 0.0
    return decode + (0.003 + 0.005 * p + 3e-6 * a if p else 0.0)


def test_attended_keys_counts_each_tokens_keys():
    assert attended_keys(0, 3) == 1 + 2 + 3
    assert attended_keys(10, 2) == 11 + 12


def test_it_learns_the_law_from_steps_and_predicts_new_shapes():
    model = MixedStepCost(lambda n: law(n, 0, 0), lambda n: 0.5 * law(0, n, attended_keys(32, n)))   # a prior off by 2x
    rng = random.Random(0)
    for _ in range(40):
        d, p, start = rng.choice([0, 1, 4, 8]), rng.choice([0, 16, 64, 512]), rng.choice([0, 300, 1500])
        a = attended_keys(start, p)
        model.observe(d, p, a, law(d, p, a) * rng.uniform(0.98, 1.02))     # 2% noise
    for d, p, start in [(8, 16, 1500), (2, 100, 700), (0, 256, 0), (8, 0, 0), (3, 32, 3000)]:
        a = attended_keys(start, p)
        assert model.cost(d, p, a) == pytest.approx(law(d, p, a), rel=0.06), (d, p, start)


def test_before_any_prompt_step_it_prices_prompt_tokens_from_one_scratch_forward():
    measured = []
    model = MixedStepCost(lambda n: 0.01 * n, lambda n: measured.append(n) or 0.002 * n)
    assert model.cost(4, 0, 0) == pytest.approx(0.04)
    assert model.cost(4, 100, 5050) == pytest.approx(0.04 + 0.2)       # 2 ms a token, nothing else yet
    assert measured == [64]
    for _ in range(30):                                                 # steps that cost less
        model.observe(0, 100, 5050, 0.1)
    assert min(model.coefficients()) >= 0 and model.cost(0, 100, 5050) == pytest.approx(0.1, rel=0.05)


def test_a_chunk_beside_decodes_costs_its_prompt_tokens_not_a_decode_rows_price():
    """The case the token-count model got wrong: 8 decodes and 16 prompt tokens over 1500 cached
    ones, priced after it saw decode steps and prompt steps of other shapes, against what 24
    decode rows cost."""
    model = MixedStepCost(lambda n: law(n, 0, 0), lambda n: law(0, n, attended_keys(32, n)))
    for d in (1, 8, 24):
        model.observe(d, 0, 0, law(d, 0, 0))
    for p, start in ((512, 0), (512, 512), (64, 1024), (128, 200)):
        model.observe(0, p, attended_keys(start, p), law(0, p, attended_keys(start, p)))
    a = attended_keys(1500, 16)
    assert model.cost(8, 16, a) == pytest.approx(law(8, 16, a), rel=0.1)
    assert model.cost(8, 16, a) > 1.5 * model.cost(24, 0, 0)


def test_the_bound_plans_with_the_largest_overrun_the_model_leaves():
    """bound() = cost() times the largest actual / cost() of the recent steps that carried
    decodes and prompt tokens, priced by the model as it is now, plus its distance from their
    median; PRIOR_OVERRUN before MIN_OVERRUNS of them. Steps that follow the law leave no
    overrun once learned; steps with +-10% noise leave about 1.2 (1.1 and 0.1 beyond the median),
    so that a step of that noise lands within the target; a slow step leaves the window after
    OVERRUN_WINDOW more."""
    from localrun.engine import step_cost
    model = MixedStepCost(lambda n: law(n, 0, 0), lambda n: 0.5 * law(0, n, attended_keys(32, n)))  # prior off 2x
    a = attended_keys(1000, 40)
    assert model.bound(8, 40, a) == pytest.approx(step_cost.PRIOR_OVERRUN * model.cost(8, 40, a))
    assert model.bound(8, 0, 0) == model.cost(8, 0, 0) and model.bound(0, 40, a) == model.cost(0, 40, a)
    for d in (1, 4, 8):
        model.observe(d, 0, 0, law(d, 0, 0))
    rng = random.Random(1)
    shapes = [(rng.choice([2, 4, 8]), rng.choice([16, 40, 100]), rng.choice([0, 500, 1500])) for _ in range(40)]
    for i, (d, p, start) in enumerate(shapes[:step_cost.MIN_OVERRUNS - 1]):
        model.observe(d, p, attended_keys(start, p), law(d, p, attended_keys(start, p)))
        assert model.overrun_factor() == step_cost.PRIOR_OVERRUN
    for d, p, start in shapes:
        model.observe(d, p, attended_keys(start, p), law(d, p, attended_keys(start, p)))
    assert 0.97 < model.overrun_factor() < 1.1         # the ridge prior leaves a few percent
    for i, (d, p, start) in enumerate(shapes):
        model.observe(d, p, attended_keys(start, p), law(d, p, attended_keys(start, p)) * (1.1 if i % 2 else 0.9))
    assert 1.15 < model.overrun_factor() < 1.3
    assert model.bound(8, 40, a) == pytest.approx(model.overrun_factor() * model.cost(8, 40, a))
    assert all(seconds <= model.overrun_factor() * model.cost(d, p, a) for d, p, a, seconds in model.mixed)
    model.observe(8, 40, a, 3 * law(8, 40, a))                  # one slow step
    assert model.overrun_factor() > 2
    for d, p, start in shapes[:step_cost.OVERRUN_WINDOW]:
        model.observe(d, p, attended_keys(start, p), law(d, p, attended_keys(start, p)))
    assert model.overrun_factor() < 1.3


def test_after_warm_up_a_larger_row_count_is_extrapolated_not_timed():
    """Decodes plus short prompt chunks (paged rows) can outnumber max_num_seqs: past the warm-up,
    D(d) continues the line through the two largest counts known instead of running a scratch
    forward while requests are being served."""
    timed = []
    model = MixedStepCost(lambda n: timed.append(n) or 0.010 + 0.004 * n, lambda n: 0.002 * n)
    model.warm_up(16)
    assert timed == [1, 2, 4, 8, 16]
    assert model.cost(22, 0, 0) == pytest.approx(0.010 + 0.004 * 22)
    assert model.cost(12, 0, 0) == pytest.approx(0.010 + 0.004 * 12)     # interpolated
    assert timed == [1, 2, 4, 8, 16]


def test_the_bound_adds_the_median_time_between_steps():
    model = MixedStepCost(lambda n: law(n, 0, 0), lambda n: law(0, n, attended_keys(32, n)))
    a = attended_keys(100, 20)
    plain = model.bound(4, 20, a)
    for seconds in (0.003, 0.004, 0.5, 0.002, 0.004):        # one outlier: the median ignores it
        model.observe_between(seconds)
    assert model.between_s() == pytest.approx(0.004)
    assert model.bound(4, 20, a) == pytest.approx(plain + 0.004)
    assert model.bound(4, 0, 0) == pytest.approx(model.cost(4, 0, 0) + 0.004)
