"""Speculative decoding on the tiny synthetic model: prompt lookup against its plain-loop
reference, the rejection rule against the target distribution (chi-square), greedy output
against plain decoding through the same engine, the sampled distribution of speculative
against plain decoding, KV block accounting after rollbacks, and the adaptive controller's
switches against hand-computed costs."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localrun.api import LLM
from localrun.engine.draft_model import check_vocab_compatible, self_draft
from localrun.engine.llm_engine import LLMEngine
from localrun.engine.spec_control import AdaptiveController, StepCostModel, expected_tokens
from localrun.engine.speculative import NgramProposer, SpeculativeConfig, verify_draft
from localrun.errors import UserError
from localrun.sampling import SamplingParams

EOS = 2


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return LLM(tiny_gguf("F32"), dtype="float32", n_threads=1).model


@pytest.fixture(scope="module")
def other_model(tiny_gguf):
    """A different random model with the same vocabulary: a draft that is mostly wrong."""
    return LLM(tiny_gguf("F32", n_layers=1, seed=5), dtype="float32", n_threads=1).model


def chi_square_p(a: Counter, b: Counter | dict, *, expected: bool = False, min_count: float = 5.0) -> float:
    """p-value that sample a and sample b (or, with expected=True, probabilities b) come from one
    distribution. Categories with small counts are pooled into one."""
    n_a = sum(a.values())
    if expected:
        cats = sorted(b, key=lambda c: -b[c])
        exp = {c: b[c] * n_a for c in cats}
        big = [c for c in cats if exp[c] >= min_count]
        observed = [a[c] for c in big] + [n_a - sum(a[c] for c in big)]
        wanted = [exp[c] for c in big] + [n_a - sum(exp[c] for c in big)]
        if wanted[-1] < 1e-9:
            observed, wanted = observed[:-1], wanted[:-1]
        stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
        df = len(wanted) - 1
    else:
        n_b = sum(b.values())
        total = a + Counter(b)
        big = [c for c in total if total[c] * min(n_a, n_b) / (n_a + n_b) >= min_count]
        rows = [(a[c], b.get(c, 0)) for c in big]
        rest = (n_a - sum(r[0] for r in rows), n_b - sum(r[1] for r in rows))
        if sum(rest):
            rows.append(rest)
        stat = 0.0
        for x, y in rows:
            for observed, n in ((x, n_a), (y, n_b)):
                e = (x + y) * n / (n_a + n_b)
                stat += (observed - e) ** 2 / e
        df = len(rows) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# --- prompt lookup ------------------------------------------------------------------------------
def reference_ngram_propose(token_ids: list[int], k: int, ngram_min: int, ngram_max: int,
                            policy: str) -> list[int]:
    """NgramProposer.propose in plain Python loops: the reference."""
    L = len(token_ids)
    sizes = [ngram_min] if policy == "recent" else range(ngram_max, ngram_min - 1, -1)
    for n in sizes:
        if n > L - 1:
            continue
        suffix = token_ids[L - n:]
        for i in range(L - n - 1, -1, -1):
            if token_ids[i:i + n] == suffix:
                return token_ids[i + n:i + n + k]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=60), st.integers(1, 3), st.integers(0, 3),
       st.integers(1, 6), st.sampled_from(["longest", "recent"]))
def test_ngram_proposer_matches_plain_loops(tokens, ngram_min, extra, k, policy):
    proposer = NgramProposer(ngram_min, ngram_min + extra, policy)
    assert proposer.propose(tokens, k) == reference_ngram_propose(tokens, k, ngram_min, ngram_min + extra, policy)


def test_ngram_proposer_by_hand():
    tokens = [7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    assert NgramProposer(1, 3, "longest").propose(tokens, 3) == [4, 5, 1]     # "1 2" last seen before 4
    assert NgramProposer(1, 3, "recent").propose(tokens + [4], 2) == [5, 1]    # "4" seen at index 7
    assert NgramProposer(2, 3, "longest").propose([1, 2, 3], 2) == []           # no earlier match


# --- the rejection rule -------------------------------------------------------------------------
PLAIN_T1 = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_rule_samples_the_target_distribution(point_mass):
    """Whatever the draft proposes, the first kept token is distributed as the target's p."""
    g = torch.Generator().manual_seed(0)
    target_logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.3, 1.0, 0.0, 0.2]])
    p = target_logits[0].softmax(-1)
    q = torch.tensor([0.05, 0.1, 0.6, 0.05, 0.2])            # a draft that disagrees with p
    counts, draft_counts = Counter(), Counter()
    for _ in range(4000):
        if point_mass:
            draft, probs = [2], None                          # prompt lookup always guesses token 2
        else:
            draft = [int(torch.multinomial(q, 1, generator=g))]
            probs = q[None]
        kept = verify_draft(target_logits, draft, probs, PLAIN_T1, g, [])
        counts[kept[0]] += 1
        draft_counts[draft[0]] += 1
    expected = {i: float(p[i]) for i in range(5)}
    assert chi_square_p(counts, expected, expected=True) > 1e-3
    if not point_mass:   # the test has power: the draft's own samples fail it
        assert chi_square_p(draft_counts, expected, expected=True) < 1e-9


def test_greedy_rule_keeps_plain_choices():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0)
    g = torch.Generator()
    assert verify_draft(logits, [1, 0], None, greedy, g, []) == [1, 0, 2]      # all accepted + bonus
    assert verify_draft(logits, [1, 2], None, greedy, g, []) == [1, 0]         # corrected at the 2nd
    assert verify_draft(logits, [2, 0], None, greedy, g, []) == [1]


# --- the engine ---------------------------------------------------------------------------------
def random_ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


LOOP = random_ids(7, 11)
PROMPTS = [random_ids(5, 1), LOOP * 4, random_ids(30, 2), random_ids(3, 3) + LOOP * 2,
           random_ids(17, 4), LOOP * 6 + random_ids(2, 5), random_ids(9, 6) * 3, random_ids(1, 7)]


def audit(engine):
    """Block accounting: every block's ref count is the number of block tables holding it, the
    free lists hold exactly the unreferenced blocks, and no running sequence holds a block past
    its last token (which a missed rollback of rejected drafts would leave)."""
    bm = engine.block_manager
    holders = Counter(b for seq in engine.scheduler.running for b in seq.block_table)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id]
    unreferenced = {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert set(bm.free_block_ids) | set(bm.evictable_block_ids) == unreferenced
    assert not set(bm.free_block_ids) & set(bm.evictable_block_ids)
    for block_hash, block_id in bm.cached_block_ids.items():
        assert bm.blocks[block_id].block_hash == block_hash
    for seq in engine.scheduler.running:
        assert len(seq.block_table) <= bm.num_blocks_needed(seq.num_tokens)
        assert seq.num_computed_tokens < seq.num_tokens


def run(model, prompts, params, *, speculative=None, draft_model=None, steps_audited=True, **options):
    engine = LLMEngine(model, tokenizer_eog_ids=(EOS,), **{"num_blocks": 64, "block_size": 4, **options},
                       speculative=speculative, draft_model=draft_model)
    seqs = [engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
            for i, p in enumerate(prompts)]
    streamed = {seq.request_id: [] for seq in seqs}
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_id is not None:
                streamed[out.seq.request_id].append(out.token_id)
        if steps_audited:
            audit(engine)
    assert [streamed[s.request_id] for s in seqs] == [s.generated_token_ids for s in seqs]  # every token, in order
    assert engine.block_manager.num_used_blocks == 0    # nothing leaked
    return seqs, engine


FIXED = dict(adaptive=False, num_speculative_tokens=4)
GREEDY = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, repeat_penalty=r)
          for n, r in zip((20, 24, 13, 24, 7, 24, 24, 18), (1.0, 1.0, 1.3, 1.0, 1.0, 1.1, 1.0, 1.0))]


@pytest.mark.parametrize("mode", ["ngram", "self", "other"])
def test_greedy_output_equals_plain_decoding(model, other_model, mode):
    plain, _ = run(model, PROMPTS, GREEDY)
    config = SpeculativeConfig("ngram" if mode == "ngram" else "draft", **FIXED)
    draft = {"ngram": None, "self": self_draft(model, 1), "other": other_model}[mode]
    spec, engine = run(model, PROMPTS, GREEDY, speculative=config, draft_model=draft)
    assert [s.generated_token_ids for s in spec] == [s.generated_token_ids for s in plain]
    assert [s.finish_reason for s in spec] == [s.finish_reason for s in plain]
    stats = engine.stats()
    drafted, accepted = stats["spec_draft_tokens"], stats["spec_accepted_tokens"]
    assert drafted == sum(s.num_draft_tokens for s in spec) and accepted == sum(s.num_accepted_tokens for s in spec)
    assert 0 < accepted < drafted                       # some drafts right, some wrong
    assert stats["num_steps"] < engine.scheduler.stats.num_generated_tokens    # fewer steps than tokens
    t = spec[1].timings()
    assert t["draft_tokens"] == spec[1].num_draft_tokens and t["acceptance_rate"] == pytest.approx(
        t["accepted_tokens"] / t["draft_tokens"])


def test_speculative_and_plain_requests_share_a_batch_under_preemption(model):
    """Mixed requests, a pool small enough to preempt, chunked prefill, a tight token budget."""
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, speculative=i % 2 == 0)
              for i in range(len(PROMPTS))]
    greedy = {"output_reserve_tokens": 0, "watermark": 0.0}    # admitted greedily, so that the pool preempts
    plain, _ = run(model, PROMPTS, params, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=96,
                   **greedy)
    spec, engine = run(model, PROMPTS, params, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=8, max_model_len=96,
                       speculative=SpeculativeConfig("ngram", **FIXED), **greedy)
    assert [s.generated_token_ids for s in spec] == [s.generated_token_ids for s in plain]
    assert all(s.num_draft_tokens == 0 for s in spec[1::2])
    assert sum(s.num_draft_tokens for s in spec[0::2]) > 0
    assert engine.stats()["num_preemptions"] > 0


def test_stop_inside_accepted_drafts(model):
    """max_tokens and EOS cut a verify step's tokens where plain decoding would stop."""
    plain, _ = run(model, [LOOP * 4], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    out = plain[0].generated_token_ids
    stop_token = out[9]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 2, 3, 5, 9)]
    spec, _ = run(model, [LOOP * 4] * 5, params, speculative=SpeculativeConfig("ngram", **FIXED))
    assert [s.generated_token_ids for s in spec] == [out[:n] for n in (1, 2, 3, 5, 9)]
    engine = LLMEngine(model, tokenizer_eog_ids=(stop_token,), num_blocks=64, block_size=4,
                       speculative=SpeculativeConfig("ngram", **FIXED))
    seq = engine.add_request("a", LOOP * 4, SamplingParams(max_tokens=40, temperature=0))
    while engine.has_unfinished():
        engine.step()
    first = out.index(stop_token)
    assert seq.generated_token_ids == out[:first + 1] and seq.finish_reason == "stop"
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("mode", ["ngram", "other"])
def test_sampled_distribution_equals_plain_sampling(model, other_model, mode):
    """Temperature 1: the 2nd and 3rd tokens (the first ones a verify step produces) have the
    same distribution with and without speculation (two-sample chi-square). For prompt lookup
    the prompt holds most of the vocabulary once, so most first tokens have a match."""
    prompt = random.Random(3).sample(range(3, 320), 200) if mode == "ngram" else LOOP * 3
    n = 800
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=i,
                             ignore_eos=True) for i in range(n)]
    config = SpeculativeConfig("ngram" if mode == "ngram" else "draft", ngram_min=1, **FIXED)
    draft = other_model if mode == "other" else None
    samples = {}
    for name, spec in (("plain", None), ("spec", config)):
        seqs, engine = run(model, [prompt] * n, params, speculative=spec, draft_model=draft if spec else None,
                           steps_audited=False, num_blocks=1024, max_num_seqs=128, max_num_batched_tokens=4096)
        samples[name] = [tuple(s.generated_token_ids) for s in seqs]
        if spec:
            stats = engine.stats()
            assert stats["spec_draft_tokens"] > n // 3 and 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
    for position in (1, 2):
        a = Counter(t[position] for t in samples["spec"])
        b = Counter(t[position] for t in samples["plain"])
        assert chi_square_p(a, b) > 1e-3, position


# --- adaptive control ---------------------------------------------------------------------------
def linear_cost(fixed: float, per_token: float):
    return StepCostModel(lambda t: fixed + per_token * t)


def test_rowwise_verify_attends_each_row_exactly_as_a_decode_segment(model):
    """A verify entry's rowwise segment (one cache write and read, k+1 attention calls) gives
    bit for bit the rows of k+1 one-token segments, each a decode step's attention."""
    from localrun.engine.draft_model import DraftKVCache, layer_devices
    from localrun.model.llama import Segment
    c = model.config
    ids = torch.tensor(random.Random(3).choices(range(3, c.n_vocab), k=45))
    pos = torch.arange(45)
    caches = [DraftKVCache(c.n_layers, c.n_head_kv, c.head_dim, model.dtype, capacity=64,
                           devices=layer_devices(model)) for _ in range(2)]
    for cache in caches:
        model(ids[:40], pos[:40], [Segment(0, 40, 0, cache)], pos[:1])
    rows = torch.arange(5)
    rowwise = model(ids[40:], pos[40:], [Segment(0, 5, 40, caches[0], rowwise=True)], rows)
    decodes = model(ids[40:], pos[40:], [Segment(j, 1, 40 + j, caches[1]) for j in range(5)], rows)
    assert torch.equal(rowwise, decodes)


def test_expected_tokens():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 4) == 1.0 and expected_tokens(1.0, 4) == 5.0


def test_controller_speculates_when_it_pays_and_stops_when_not():
    cheap = AdaptiveController(4, linear_cost(1.0, 0.01))    # memory-bound: 5 rows cost 1.04x one
    assert cheap.plan(["a"], [10], num_decodes=1, base_tokens=1) == [4]
    # a plain step costs 1.2, each extra row 0.2: at the prior acceptance 0.5, k=2 is best
    # (E = 1.75 tokens for 1.4/1.2 of the cost: speedup 1.31 against 1.29 for k=1, 1.25 for k=3)
    c = AdaptiveController(4, linear_cost(1.0, 0.2))
    assert c.plan(["a"], [10], num_decodes=1, base_tokens=1) == [2]
    for _ in range(6):                                       # every draft rejected
        c.observe_acceptance("a", 4, 0)
    # acceptance ~0.09: no k pays (k=1: 1.09 tokens for 1.17x the cost)
    assert c._speedup_alone(c.requests["a"].acceptance, 1) < 1
    assert c.plan(["a"], [10], num_decodes=1, base_tokens=1) == [0]
    assert c.requests["a"].off_steps == 8 and c.stats()["spec_request_cooldowns"] == 1
    plans = [c.plan(["a"], [10], num_decodes=1, base_tokens=1)[0] for _ in range(8)]
    assert plans == [0] * 8 and c.requests["a"].off_steps == 0
    assert c.plan(["a"], [10], num_decodes=1, base_tokens=1) == [2]     # retried after the cool-down
    # one rejection of 4 drafts, with the prior: acceptance (0.9*0.5 + 0)/(0.9*1 + 1) = 0.237;
    # k=1 gives 1.237 tokens for 1.4/1.2 of the cost (1.06), k=2 1.293 for 1.6/1.2 (0.97)
    c.observe_acceptance("a", 4, 0)
    assert c.requests["a"].acceptance == pytest.approx(0.45 / 1.9)
    assert c.plan(["a"], [10], num_decodes=1, base_tokens=1) == [1]
    assert cheap.plan(["b"], [2], num_decodes=1, base_tokens=1) == [2]   # capped by max_tokens/context


def test_a_new_request_drafts_where_a_verify_step_is_costly():
    """A verify step of 5 rows costs 2.9x a plain one (a 2-core CPU, measured): at the neutral
    prior (acceptance 0.5, E <= 1.94 tokens) nothing would ever draft, so no evidence could
    show that a copying request accepts 90% of its drafts. A new request probes with one
    draft, and its evidence keeps it drafting (k growing with its acceptance) or stops it."""
    cost = StepCostModel(lambda t: 1.0 + 0.475 * (t - 1))       # cost(5) / cost(1) = 2.9
    c = AdaptiveController(4, cost)
    # both probe with one draft: 2 x 2 tokens for cost(4) = 2.425 beats 2 for cost(2) = 1.475
    assert c.plan(["copy", "story"], [10, 10], num_decodes=2, base_tokens=2) == [1, 1]
    for _ in range(3):
        c.observe_acceptance("copy", 1, 1)                       # the draft accepted
        c.observe_acceptance("story", 1, 0)                      # rejected
    # copy: (0.3645 + 2.71) / (0.729 + 2.71) = 0.894; k=3 gives 3.408 tokens for 2.425x the
    # cost (1.405), against 1.284 for k=1, 1.381 for k=2 and 1.396 for k=4
    assert c.requests["copy"].acceptance == pytest.approx(3.0745 / 3.439, abs=1e-3)
    assert c.plan(["copy"], [10], num_decodes=1, base_tokens=1) == [3]
    # story: 0.3645 / 3.439 = 0.106; k=1 gives 1.106 tokens for 1.475x the cost: off
    assert c.plan(["story"], [10], num_decodes=1, base_tokens=1) == [0]
    assert c.requests["story"].off_steps == 8
    for _ in range(4):
        c.observe_acceptance("copy", 4, 4)
    assert c.plan(["copy"], [10], num_decodes=1, base_tokens=1) == [4]


def test_controller_turns_off_for_a_busy_batch_and_back_on():
    # compute-bound beyond 32 tokens: each extra token costs as much as a real one there
    model = StepCostModel(lambda t: 1.0 + 0.01 * t if t <= 32 else 1.32 + 0.1 * (t - 32))
    c = AdaptiveController(4, model)
    ids = [f"r{i}" for i in range(30)]
    for r in ids:
        c.observe_acceptance(r, 4, 2)                      # acceptance ~0.5
    assert c.plan(ids, [10] * 30, num_decodes=30, base_tokens=30) == [0] * 30
    assert c.stats()["spec_steps_off_busy"] == 1 and c.stats()["spec_enabled"] == 0
    assert all(k > 0 for k in c.plan(ids[:4], [10] * 4, num_decodes=4, base_tokens=4))
    assert c.stats()["spec_enabled"] == 1


def test_cost_model_measures_unseen_sizes_and_learns():
    measured = []
    model = StepCostModel(lambda t: measured.append(t) or 0.1 * t)
    assert model.cost(1) == pytest.approx(0.1) and model.cost(5) == pytest.approx(0.5)
    assert model.cost(3) == pytest.approx(0.3) and measured == [1, 5]    # interpolated, not measured
    for _ in range(9):
        model.observe(5, 1.0)
    # real steps of 5 tokens take twice the scratch forward: the scratch size 1 counts at that
    # level too (0.2), and size 3 lies between
    assert model.cost(5) == 1.0 and model.cost(1) == pytest.approx(0.2) and model.cost(3) == pytest.approx(0.6)
    assert measured == [1, 5]


def test_a_scratch_forward_slower_than_real_steps_does_not_stop_drafting():
    """The scratch forward runs outside the engine's fused paths: here at twice the level of
    real steps, with the same growth per row (5 rows: 1.6x one). Taken at face value beside real
    one-row steps it prices k=4 at 3.2x a plain step, which no acceptance below 1 repays, and the
    controller would never draft 4 and never see a real 5-row step. Scaled to the real steps, a
    copying request drafts 4."""
    measured = []
    cost = StepCostModel(lambda t: measured.append(t) or 2.0 * (1.0 + 0.15 * (t - 1)))
    for _ in range(5):
        cost.observe(1, 1.0)                                  # real plain steps
    assert cost.cost(5) == pytest.approx(1.6)
    c = AdaptiveController(4, cost)
    for _ in range(4):
        c.observe_acceptance("copy", 4, 4)                    # acceptance ~0.93
    assert c.plan(["copy"], [10], num_decodes=1, base_tokens=1) == [4]
    assert sorted(measured) == [1, 5]                         # size 1 once in scratch, for the scale
    for _ in range(9):
        cost.observe(5, 2.5)                                  # real verify steps say more
    assert cost.cost(5) == 2.5 and cost.cost(3) == pytest.approx(1.75)


def test_adaptive_engine_keeps_output_and_reports(model):
    plain, _ = run(model, PROMPTS, GREEDY)
    spec, engine = run(model, PROMPTS, GREEDY, speculative=SpeculativeConfig("ngram"))
    assert [s.generated_token_ids for s in spec] == [s.generated_token_ids for s in plain]
    stats = engine.stats()
    assert stats["spec_steps_planned"] > 0 and "spec_verify_cost_ratio" in stats


# --- errors ---------------------------------------------------------------------------------------
def test_user_errors(tiny_gguf, model):
    with pytest.raises(UserError, match="same vocabulary"):
        check_vocab_compatible([b"a", b"b"], [b"a", b"c"], "d.gguf")
    with pytest.raises(UserError, match="same vocabulary"):
        LLM(tiny_gguf("F32"), n_threads=1, speculative=str(tiny_gguf("F32", n_layers=1, n_vocab=330)))
    with pytest.raises(UserError, match="self:N"):
        LLM(tiny_gguf("F32"), n_threads=1, speculative="self:two")
    with pytest.raises(UserError, match="between 1 and 1 layers"):
        self_draft(model, 2)
    with pytest.raises(UserError):
        SpeculativeConfig("ngram", num_speculative_tokens=0)
    with pytest.raises(UserError):
        LLMEngine(model, speculative=SpeculativeConfig("draft"))


def test_api_and_cli(tiny_gguf):
    from typer.testing import CliRunner

    from localrun.cli.main import app
    llm = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, speculative="ngram", speculative_adaptive=False)
    plain = LLM(tiny_gguf("F32"), dtype="float32", n_threads=1)
    prompt = "the fox and the dog and the fox and the dog and the"
    r = llm.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True)
    assert r.token_ids == plain.generate(prompt, max_tokens=16, temperature=0, ignore_eos=True).token_ids
    assert r.timings["draft_tokens"] > 0 and "spec_draft_tokens" in llm.engine.stats()
    result = CliRunner().invoke(app, ["generate", str(tiny_gguf("F32")), "-p", "x", "--spec", "lookup"])
    assert result.exit_code != 0 and "ngram" in str(result.exception or result.output)


def test_the_cli_builds_the_engine_while_loading(tiny_gguf):
    """The engine (and the speculator's cost measurements, ~3 s for SmolLM2 here) is built
    with the model, not inside the first request, whose TTFT would otherwise include it."""
    from localrun.cli.options import engine_config, load_llm
    llm = load_llm(str(tiny_gguf("F32")), engine_config(ctx=256, threads=1, spec="ngram"))
    assert llm._engine is not None and llm._engine.speculator is not None
