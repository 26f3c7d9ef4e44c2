"""Grammars that cannot be enforced are refused at the door (one short sentence, never
llguidance's internals), and grammar masks are computed off the engine thread: a sequence
whose next mask is not ready sits steps out while the others go on, and still produces the
tokens it would have produced without waiting (issue 76)."""
from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import Executor, Future

import pytest

from localrun.api import LLM
from localrun.grammar import MAX_SOURCE_BYTES, GrammarError

HOSTILE = {
    "a rule cycle with no text": ("grammar", "root ::= a\na ::= b\nb ::= a"),
    "a schema that is only a reference to itself": ("json_schema", {"$ref": "#"}),
    "a million repetitions": ("grammar", 'root ::= "x"{1000000}'),
    "20,000 alternatives": ("grammar", "root ::= " + " | ".join(f'"w{i}"' for i in range(20_000))),
    "a 500 KB const": ("json_schema", {"const": "y" * 500_000}),
}
INTERNALS = ("NoExtensionBias", "non-verbose", "Traceback", "llguidance", "Earley")


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    return LLM(tiny_gguf("F32", context_length=512), dtype="float32", n_threads=1, n_parallel=4)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_grammars_are_one_short_sentence_at_the_door(tiny, case):
    kind, source = HOSTILE[case]
    with pytest.raises(GrammarError) as e:
        tiny.constraint(**{kind: source})
    message = str(e.value)
    assert e.value.field == kind
    assert len(message) < 300 and "\n" not in message, message
    assert not any(word in message for word in INTERNALS), message


def test_the_size_bound_is_the_source_text(tiny):
    n = MAX_SOURCE_BYTES - len(json.dumps({"const": ""}, separators=(",", ":")))
    with pytest.raises(GrammarError, match=f"the limit is {MAX_SOURCE_BYTES:,}"):
        tiny.constraint(json_schema={"const": "y" * (n + 1)})
    grammar = 'root ::= "ab" | "cd"'
    assert tiny.constraint(grammar=grammar + " " * (MAX_SOURCE_BYTES - len(grammar))) is not None


def test_a_grammar_that_ends_before_min_tokens_ends_the_reply(tiny):
    """min_tokens bans the end of generation, the grammar allows nothing else: the grammar's
    end wins (before, every logit was -inf and sampling failed)."""
    for temperature in (0.0, 1.0):
        r = tiny.generate("x", grammar='root ::= "yes"', min_tokens=8, max_tokens=16, temperature=temperature, seed=2)
        assert (r.text, r.finish_reason) == ("yes", "stop")


class HeldExecutor(Executor):
    """Runs submitted work only when the test releases it (a grammar thread that is slow for as
    long as the test wants)."""

    def __init__(self):
        self.held: list[tuple[Future, object, tuple]] = []
        self.lock = threading.Lock()

    def submit(self, fn, *args):
        future = Future()
        with self.lock:
            self.held.append((future, fn, args))
        return future

    def release(self) -> int:
        with self.lock:
            held, self.held = self.held, []
        for future, fn, args in held:
            try:
                future.set_result(fn(*args))
            except Exception as e:      # noqa: BLE001 - handed to whoever waits
                future.set_exception(e)
        return len(held)


def test_a_sequence_waiting_for_its_mask_sits_out_while_others_decode(tiny):
    """A plain request and a grammar request run together. While the grammar thread holds
    the grammar request's next mask, steps go on with the plain request alone; released, the
    grammar request goes on, and its text is what it writes with masks that are always ready."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999999}},
              "required": ["n"], "additionalProperties": False}
    options = {"max_tokens": 12, "temperature": 1.0, "seed": 5}
    expected = tiny.generate("data:", json_schema=schema, **options).text
    engine, frontend = tiny.engine, tiny.frontend
    held = HeldExecutor()
    constraint = dataclasses.replace(tiny.constraint(json_schema=schema), _worker=held)
    params = frontend.sampling_params({**options, "constraint": constraint})
    plain = frontend.sampling_params({"max_tokens": 40, "temperature": 0.0, "ignore_eos": True})
    engine.add_request("plain", frontend.prompt_ids("Once upon"), plain)
    seq = engine.add_request("json", frontend.prompt_ids("data:"), params)
    outputs = engine.step()          # both prefill; the grammar request samples with its first mask
    assert {o.seq.request_id for o in outputs} == {"plain", "json"}
    num_generated = seq.num_generated_tokens
    for _ in range(5):               # its next mask is held: the plain request decodes alone
        outputs = engine.step()
        assert [o.seq.request_id for o in outputs] == ["plain"]
    assert seq.num_generated_tokens == num_generated
    while not seq.is_finished:
        held.release()
        engine.step()
    while engine.has_unfinished():
        engine.step()
    text = tiny.tokenizer.decode([t for t in seq.generated_token_ids if t not in frontend.eog_ids])
    assert text == expected


def test_when_every_running_sequence_waits_for_its_mask_the_step_is_empty(tiny):
    held = HeldExecutor()
    constraint = dataclasses.replace(tiny.constraint(grammar='root ::= "ab" "cd" "ef"'), _worker=held)
    engine, frontend = tiny.engine, tiny.frontend
    seq = engine.add_request("only", frontend.prompt_ids("x"),
                             frontend.sampling_params({"max_tokens": 8, "constraint": constraint}))
    engine.step()
    assert engine.step() == [] and not seq.is_finished      # waits (briefly), computes nothing
    while not seq.is_finished:
        held.release()
        engine.step()
    assert seq.finish_reason == "stop"
