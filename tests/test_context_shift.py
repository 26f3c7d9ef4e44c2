"""Chats longer than the context: fit_messages against a linear-scan reference and hand-computed
cases, shift_prompt, a 30-turn chat through LLM.chat and through `localrun chat` on the tiny
model, and a generation that reaches the end of the context."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from localrun.api import LLM
from localrun.context_shift import fit_messages, shift_prompt, split_turns
from localrun.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def count_chars(messages):
    """A stand-in tokenizer: one token per character of content, plus 2 per message."""
    return sum(len(m["content"]) + 2 for m in messages)


def msg(role, n, tag="x"):
    return {"role": role, "content": tag * n}


def test_split_turns():
    sys_msg, u1, a1, u2 = msg("system", 1), msg("user", 1), msg("assistant", 1), msg("user", 2)
    assert split_turns([sys_msg, u1, a1, u2]) == ([sys_msg], [[u1, a1], [u2]])
    assert split_turns([a1, u1]) == ([], [[a1], [u1]])


def test_fit_messages_hand_computed():
    history = [msg("system", 8), msg("user", 8, "a"), msg("assistant", 8, "b"),
               msg("user", 8, "c"), msg("assistant", 8, "d"), msg("user", 8, "e")]   # 10 tokens each
    assert fit_messages(history, count_chars, 80, 20) == (history, 0)            # 60 + 20 fits
    kept, dropped = fit_messages(history, count_chars, 70, 20)                    # drop one turn (2 messages)
    assert dropped == 2 and kept == [history[0]] + history[3:]
    kept, dropped = fit_messages(history, count_chars, 70, 20, target=45)         # drop down to 25 tokens
    assert dropped == 4 and kept == [history[0], history[5]]
    with pytest.raises(UserError, match="more than the context"):
        fit_messages([msg("system", 50), msg("user", 50)], count_chars, 100, 10)


def linear_reference(messages, n_ctx, reserve, target):
    """Drop whole turns one at a time from the oldest, the plain way."""
    system, turns = split_turns(messages)
    reserve = max(reserve, 1)        # room for at least one generated token
    if count_chars(messages) + reserve <= n_ctx:
        return 0
    for k in range(1, len(turns)):
        if count_chars(system + [m for t in turns[k:] for m in t]) + reserve <= target:
            return len(messages) - len(system) - sum(len(t) for t in turns[k:])
    return len(messages) - len(system) - len(turns[-1])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=20), st.integers(0, 3),
       st.integers(60, 200), st.integers(0, 40), st.integers(0, 60))
def test_fit_messages_matches_a_linear_scan(lengths, num_system, n_ctx, reserve, slack):
    messages = [msg("system", 5)] * num_system + [
        msg("user" if i % 2 == 0 else "assistant", n) for i, n in enumerate(lengths)]
    target = n_ctx - slack
    try:
        kept, dropped = fit_messages(messages, count_chars, n_ctx, reserve, target=target)
    except UserError:
        system, turns = split_turns(messages)
        assert count_chars(system + turns[-1]) >= n_ctx
        return
    assert dropped == linear_reference(messages, n_ctx, reserve, target)
    assert kept[:num_system] == messages[:num_system] and kept == messages[:num_system] + messages[num_system + dropped:]
    assert count_chars(kept) < n_ctx


def test_shift_prompt():
    ids = list(range(100))
    assert shift_prompt(ids, 128, 16) == (ids, 0)
    kept, dropped = shift_prompt(ids, 64, 16, n_keep=4)          # room for 48 prompt tokens
    assert dropped == 52 and kept == list(range(4)) + list(range(56, 100))
    assert shift_prompt(ids, 64, 200)[0] == list(range(68, 100))   # reserve capped at half the context
    with pytest.raises(UserError, match="n_keep"):
        shift_prompt(ids, 64, 16, n_keep=48)


@pytest.fixture(scope="module")
def tiny_llm(tiny_gguf):
    return LLM(tiny_gguf("F32"), dtype="float32", n_threads=1, n_ctx=128)


def test_thirty_turn_chat_with_a_small_context(tiny_llm):
    system = {"role": "system", "content": "You are terse."}
    history, total_dropped = [system], 0
    for turn in range(30):
        history.append({"role": "user", "content": f"question {turn} about something"})
        result = tiny_llm.chat(history, max_tokens=8, temperature=0, ignore_eos=True)
        assert result.finish_reason == "length" and len(result.token_ids) == 8
        total_dropped = max(total_dropped, result.dropped_messages)
        sent, _ = tiny_llm.fit_chat(history, 8)
        assert sent[0] == system and sent[-1] == history[-1]
        assert len(tiny_llm.chat_prompt_ids(sent)) + 8 <= tiny_llm.n_ctx
        assert result.dropped_messages == len(history) - len(sent)
        history.append({"role": "assistant", "content": result.text})
    assert total_dropped > 0


def test_generation_at_the_end_of_the_context_stops_with_length(tiny_llm):
    prompt = list(range(3, 3 + 120))
    result = tiny_llm.generate(prompt, max_tokens=100, temperature=0, ignore_eos=True)
    assert result.finish_reason == "length" and len(result.token_ids) == 128 - 120


def test_cli_chat_thirty_turns(tiny_gguf, tmp_path):
    lines = "".join(f"question number {i} please\n" for i in range(30)) + "/exit\n"
    proc = subprocess.run(
        [sys.executable, "-m", "localrun.cli", "chat", str(tiny_gguf("F32")), "--ctx", "128", "-n", "8",
         "--temperature", "0", "--system", "You are terse.", "--cache-dir", str(tmp_path / "kv"), "-t", "1"],
        input=lines, capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "LOCALRUN_HOME": str(tmp_path / "home"), "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr
    notices = [line for line in proc.stderr.splitlines() if "context full" in line]
    assert notices and all("system prompt stays" in line for line in notices)
    assert proc.stderr.count("ttft") == 30                   # every turn got a reply
    assert list((tmp_path / "kv").glob("*/*.safetensors"))   # chat keeps the disk cache on by default


def test_raw_prompt_context_shift_policy(tiny_gguf):
    path = tiny_gguf("F32")
    prompt = list(range(3, 3 + 200))
    with pytest.raises(UserError, match="context holds 128"):
        LLM(path, dtype="float32", n_threads=1, n_ctx=128).generate(prompt, max_tokens=8, temperature=0)
    shifting = LLM(path, dtype="float32", n_threads=1, n_ctx=128, context_shift=True, n_keep=5)
    shifted = shifting.generate(prompt, max_tokens=8, temperature=0, ignore_eos=True)
    kept = prompt[:5] + prompt[200 - 115:]                   # 128 - 8 = 120 tokens: 5 kept + 115 newest
    plain = LLM(path, dtype="float32", n_threads=1, n_ctx=128).generate(kept, max_tokens=8, temperature=0,
                                                                        ignore_eos=True)
    assert shifted.token_ids == plain.token_ids and shifted.timings["prompt_tokens"] == 120
