"""A fault while sampling one request ends that request alone (issue 21).

A batch of 8 runs with one sequence whose sampler raises (at its first token, or part-way
through its decode). The other 7 must produce exactly what they produce in a run without the
faulty one, the faulty one must finish with finish_reason "error" and a message, and every
KV block must come back."""
from __future__ import annotations

import random

import pytest

import localrun.engine.model_runner as model_runner
from localrun.api import LLM
from localrun.engine.llm_engine import LLMEngine
from localrun.sampling import SamplingParams

EOS = 2
FAULTY_SEED = 666


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


PROMPTS = [ids(n, seed) for seed, n in enumerate((3, 9, 17, 5, 26, 12, 7, 14))]
# greedy and seeded sampling both: each sequence draws from its own generator
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True, seed=i, temperature=0 if i % 2 else 0.9,
                         top_k=0, top_p=1.0, min_p=0.0) for i in range(8)]


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return LLM(tiny_gguf("F32"), dtype="float32", n_threads=1).model


def run(model, requests: dict[str, tuple[list[int], SamplingParams]]):
    """Every StepOutput per request, and the engine afterwards."""
    engine = LLMEngine(model, tokenizer_eog_ids=(EOS,), num_blocks=96, block_size=4, max_num_seqs=8)
    outputs = {rid: [] for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.seq.request_id].append(out)
    return outputs, engine


def tokens(outs) -> list[int]:
    return [o.token_id for o in outs if o.token_id is not None]


@pytest.mark.parametrize("fail_after", [0, 4], ids=["at-first-token", "mid-decode"])
def test_a_sampling_fault_ends_only_its_own_request(model, monkeypatch, fail_after):
    faulty = 3
    requests = {f"r{i}": (PROMPTS[i], PARAMS[i]) for i in range(8)}
    reference, _ = run(model, {rid: r for rid, r in requests.items() if rid != f"r{faulty}"})

    real_sample = model_runner.sample

    def sample(logits, params, generator, recent=()):
        if params.seed == FAULTY_SEED and len(recent) >= len(PROMPTS[faulty]) + fail_after:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, params, generator, recent)

    monkeypatch.setattr(model_runner, "sample", sample)
    requests[f"r{faulty}"] = (PROMPTS[faulty], SamplingParams(max_tokens=12, ignore_eos=True, seed=FAULTY_SEED))
    outputs, engine = run(model, requests)

    for rid, outs in reference.items():
        assert tokens(outputs[rid]) == tokens(outs), rid
        assert len(tokens(outs)) == 12 and outputs[rid][-1].finished and outputs[rid][-1].error is None
    bad = outputs[f"r{faulty}"]
    assert len(tokens(bad)) == fail_after
    assert bad[-1].finished and bad[-1].seq.finish_reason == "error"
    assert "RuntimeError: probability tensor" in bad[-1].error
    assert sum(o.finished for o in bad) == 1
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_unfinished() and engine.runner.generators == {}


def test_python_api_raises_when_its_request_fails(tiny_gguf, monkeypatch):
    """LLM.generate does not return truncated text as 'length' when sampling its request
    failed: it raises, naming the failure, and the engine's blocks are free afterwards."""
    from localrun.api import LLM
    from localrun.engine import model_runner
    llm = LLM(tiny_gguf("F32"), n_threads=1)
    real = model_runner.sample

    def failing(logits, params, generator, history):
        if len(history) > 6:
            raise ValueError("injected")
        return real(logits, params, generator, history)

    monkeypatch.setattr(model_runner, "sample", failing)
    # a plain greedy row takes the argmax without `sample` (ModelRunner.sample): send this one
    # through the sampler chain, where the fault is injected
    monkeypatch.setattr(model_runner, "plain_greedy", lambda params: False)
    with pytest.raises(RuntimeError, match="generation failed: ValueError: injected"):
        llm.generate([5, 6, 7, 8], max_tokens=8, temperature=0, ignore_eos=True)
    monkeypatch.undo()                  # the real sample and plain_greedy
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert len(llm.generate([5, 6, 7, 8], max_tokens=8, temperature=0, ignore_eos=True).token_ids) == 8
