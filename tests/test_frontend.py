"""The text front end: one path from prompts to ids and from engine outputs to text, shared
by LLM and the server (finish reasons, end of generation, stop strings, timings, checks)."""
from __future__ import annotations

import threading
import time

import pytest

from localrun.engine.sequence import Sequence
from localrun.errors import UserError
from localrun.frontend import ContextLengthExceeded, FrontEnd, RequestText, choice_params, timings
from localrun.sampling_params import SamplingParams

EOG = 9


class FakeTokenizer:
    """Token i is the byte string PIECES[i]; token 9 ends generation; text is one token per char."""
    pieces = [b"a", b"b", b"c", b" ", b"S", b"T", b"O", b"P", b"!", b""]
    eog_ids = frozenset({EOG})
    bos_id = eos_id = None
    add_bos = False

    def piece(self, token_id, *, special=False):
        return self.pieces[token_id]

    def encode(self, text, *, add_special=True):
        return [self.pieces.index(c.encode()) for c in text]


class Out:
    """An engine StepOutput's fields."""

    def __init__(self, token_id, finished=False, logprob=None):
        self.token_id, self.finished, self.logprob, self.error = token_id, finished, logprob, None


def finished_seq(reason: str, prompt=(0, 1)) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams())
    seq.finish_reason = reason
    return seq


def run(outputs, **params):
    text = RequestText(FakeTokenizer(), FakeTokenizer.eog_ids, SamplingParams(**params))
    pieces, stops = [], 0
    for out in outputs:
        delta = text.feed(out)
        pieces.append(delta.text)
        stops += delta.stop_in_engine
        if text.finished:
            break
    return text, pieces, stops


def test_end_of_generation_is_not_text_and_not_counted():
    text, pieces, stops = run([Out(0), Out(1), Out(EOG, finished=True)])
    done = text.finish(finished_seq("stop"))
    assert "".join(pieces) == "ab" and text.token_ids == [0, 1] and stops == 0
    assert done.finish_reason == "stop" and done.timings["generated_tokens"] == 2


def test_ignore_eos_keeps_the_end_of_generation_token():
    text, _, _ = run([Out(0), Out(EOG), Out(1, finished=True)], ignore_eos=True)
    assert text.token_ids == [0, EOG, 1] and text.finish(finished_seq("length")).finish_reason == "length"


def test_a_stop_string_ends_the_request_in_the_engine_once():
    text, pieces, stops = run([Out(i) for i in (0, 3, 4, 5, 6, 7, 8)], stop=("STOP",))
    assert text.finished and stops == 1 and "".join(pieces) == "a " and text.text == "a "
    assert text.finish(finished_seq("stop")).finish_reason == "stop"


def test_a_stop_string_on_the_last_token_needs_no_engine_stop():
    text, _, stops = run([Out(4), Out(5), Out(6), Out(7, finished=True)], stop=("STOP",))
    assert stops == 0 and text.finish(finished_seq("length")).finish_reason == "stop"


@pytest.mark.parametrize("reason,expected", [("length", "length"), ("abort", "abort"), ("stop", "stop")])
def test_finish_reasons(reason, expected):
    text, _, _ = run([Out(0, finished=True)])
    assert text.finish(finished_seq(reason)).finish_reason == expected


def test_logprobs_are_taken_once():
    text, _, _ = run([Out(0, logprob="l0"), Out(1, logprob="l1")])
    assert text.take_logprobs() == ["l0", "l1"] and text.take_logprobs() == []


def test_timings_count_the_reply_and_mark_what_was_never_measured():
    seq = finished_seq("length", prompt=(0, 1, 2))       # max_tokens=0: nothing ran
    assert timings(seq, 0)["ttft_s"] is None and timings(seq, 0, unmeasured=0.0)["ttft_s"] == 0.0
    assert timings(seq, 5)["generated_tokens"] == 5 and timings(seq, 0)["prefill_tok_s"] is None


def frontend(n_ctx=8) -> FrontEnd:
    return FrontEnd(FakeTokenizer(), chat_template=None, n_ctx=n_ctx, n_vocab=len(FakeTokenizer.pieces))


def test_prompt_checks_in_one_place():
    fe = frontend()
    assert fe.prompt_ids("abc") == [0, 1, 2] and fe.prompt_ids([2, 1]) == [2, 1]
    with pytest.raises(UserError, match="outside the vocabulary"):
        fe.prompt_ids([0, 10])
    with pytest.raises(UserError, match="empty"):
        fe.prompt_ids("")
    with pytest.raises(ContextLengthExceeded, match="8 tokens but the context holds 8") as e:
        fe.prompt_ids("abcabcab")
    assert e.value.field == "prompt"
    assert fe.prompt_ids("abcabcab", shift=(4, 1)) == [0, 2, 0, 1]   # the first token and the newest


def test_reply_room():
    fe = frontend()
    assert fe.reply_room([0, 1, 2], None) == 5 and fe.reply_room([0, 1, 2], 5) == 5
    with pytest.raises(ContextLengthExceeded) as e:
        fe.reply_room([0, 1, 2], 6)
    assert e.value.field == "max_tokens"


def test_choices_sample_with_seed_plus_index():
    assert [p.seed for p in choice_params(SamplingParams(seed=7), 3)] == [7, 8, 9]
    assert [p.seed for p in choice_params(SamplingParams(), 2)] == [None, None]


def test_sampling_options():
    params = frontend().sampling_params({"stop": "x", "max_tokens": 3})
    assert params.stop == ("x",) and params.max_tokens == 3
    with pytest.raises(UserError, match="unknown generation option"):
        frontend().sampling_params({"nonsense": 1})


def test_the_front_end_imports_no_torch():
    import subprocess
    import sys
    code = "import sys, localrun.frontend; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the server's engine thread ---------------------------------------------------------------

class FakeEngine:
    """Records which thread calls stats(): only the engine thread may touch the engine."""

    def __init__(self):
        self.threads = set()

    def stats(self):
        self.threads.add(threading.current_thread().name)
        return {"num_blocks_used": 0, "calls": len(self.threads)}

    def has_unfinished(self):
        return False


def test_metrics_read_a_snapshot_taken_on_the_engine_thread():
    from localrun.server.engine_loop import EngineLoop
    from localrun.server.metrics import ServerMetrics
    from prometheus_client import generate_latest
    engine = FakeEngine()
    loop = EngineLoop(engine, frontend())
    metrics = ServerMetrics(loop.stats)
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while "localrun-engine" not in engine.threads and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.threads.clear()
        scrape = generate_latest(metrics.registry).decode()
        assert "localrun_kv_blocks_used 0.0" in scrape and loop.alive
        time.sleep(0.2)     # a few idle turns of the loop
    finally:
        loop.stop()
    assert engine.threads <= {"localrun-engine"}
