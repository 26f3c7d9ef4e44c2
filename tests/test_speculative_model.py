"""Speculative decoding on the real SmolLM2: greedy output identical to plain decoding through
the same engine, on 8 prompts (copy-heavy ones where prompt lookup is mostly right, free text
where it and a 2-layer self-draft are mostly wrong), for prompt lookup and a draft model.

One request at a time: torch's int4 CPU kernel rounds differently from 32 rows up, so on the
quantized path a row's logits depend on how many rows share its forward (plain continuous
batching has the same effect). Batched speculation is checked token for token on the tiny
float32 model (tests/test_speculative.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from corpus import CODE, CODE_2, NUMBERS_2, PROSE  # noqa: E402

from localrun.engine.draft_model import self_draft
from localrun.engine.llm_engine import LLMEngine
from localrun.engine.speculative import SpeculativeConfig
from localrun.sampling import SamplingParams

pytestmark = pytest.mark.model

CHATS = [
    "Repeat this code exactly, but rename fibonacci to fib:\n\n" + CODE,
    "Copy the following SQL query:\n\n" + CODE_2,
    "Write a short story about a fox who learns to sail.",
    "What is the capital of France? Answer in one sentence.",
    "List five colours, one per line.",
    "Summarize this paragraph in one sentence:\n\n" + PROSE[:200],
    "Repeat the table:\n\n" + NUMBERS_2[:120],
    "Explain why the sky is blue to a child.",
]


@pytest.fixture(scope="module")
def llm():
    from localrun import LLM
    return LLM(None, n_ctx=1024)


def generate(llm, prompts, **options):
    engine = LLMEngine(llm.model, tokenizer_eog_ids=tuple(llm.tokenizer.eog_ids), max_model_len=1024,
                       max_num_seqs=1, **options)
    params = SamplingParams(max_tokens=16, temperature=0)
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0
    return [s.generated_token_ids for s in seqs], engine.stats()


@pytest.fixture(scope="module")
def prompts(llm):
    return [llm.chat_prompt_ids([{"role": "user", "content": c}]) for c in CHATS]


@pytest.fixture(scope="module")
def plain(llm, prompts):
    return generate(llm, prompts)[0]


@pytest.mark.parametrize("mode", ["ngram", "self-draft"])
def test_greedy_identical_to_plain_decoding(llm, prompts, plain, mode):
    config = SpeculativeConfig("ngram" if mode == "ngram" else "draft", num_speculative_tokens=4, adaptive=False)
    draft = self_draft(llm.model, 2) if mode == "self-draft" else None
    spec, stats = generate(llm, prompts, speculative=config, draft_model=draft)
    for i, (a, b) in enumerate(zip(spec, plain)):
        assert a == b, f"prompt {i}: {llm.detokenize(a)!r} != {llm.detokenize(b)!r}"
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
