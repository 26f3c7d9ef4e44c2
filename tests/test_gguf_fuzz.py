"""GGUF reading is total (issue 21): hostile header cases, then hypothesis-driven mutations of a
tiny synthetic GGUF (byte flips, truncations, length and count fields set to extremes) through
`localrun info` and `localrun.LLM(...)`. Asserted for every mutation: no traceback (a clean exit
or one UserError sentence), no hang (pytest-timeout, and a per-call time bound), bounded memory.
Then mutated vocabularies and tokenizer fields through llama.cpp's own loader and tokenizer
(issue 76): refused in one sentence, or loaded and tokenized without a signal.

LOCALRUN_FUZZ_EXAMPLES=N runs N examples per fuzz test instead of the CI's bounded number, and
`pytest -s` prints the counts (tried / clean errors / loaded)."""
from __future__ import annotations

import os
import resource
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.main import get_command
from click.testing import CliRunner

from localrun.cli.main import app
from localrun.errors import UserError
from synthetic_gguf import header_fields, write_tiny_llama

N_EXAMPLES = int(os.environ.get("LOCALRUN_FUZZ_EXAMPLES", "0"))
SMALL = dict(tensor_type="F32", n_layers=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=128)
EXTREMES = (0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1, 2**64 - 1)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("fuzz") / "base.gguf", **SMALL)
    data = path.read_bytes()
    return data, header_fields(data)


def mutations(data: bytes, fields) -> st.SearchStrategy[bytes]:
    header_end = max(offset + size for offset, size, _, _ in fields)
    flips = st.lists(st.tuples(st.integers(0, header_end - 1), st.integers(0, 255)), min_size=1, max_size=4)
    extremes = st.tuples(st.sampled_from(fields), st.one_of(st.sampled_from(EXTREMES), st.integers(0, 2**64 - 1)))
    cut = st.integers(0, len(data) - 1)

    def flip(changes):
        out = bytearray(data)
        for at, byte in changes:
            out[at] = byte
        return bytes(out)

    def extreme(arg):
        (offset, size, _, _), value = arg
        out = bytearray(data)
        out[offset:offset + size] = (value % 2**(8 * size)).to_bytes(size, "little")
        return bytes(out)

    return st.one_of(flips.map(flip), extremes.map(extreme), cut.map(lambda n: data[:n]))


COMMAND = get_command(app)   # built once: typer rebuilds it on every invoke otherwise


def run_info(path: Path) -> tuple[int, str]:
    """`localrun info` in-process, exit code and message as main() gives them."""
    result = CliRunner().invoke(COMMAND, ["info", str(path), "--json"])
    if isinstance(result.exception, UserError):
        return 2, f"error: {result.exception}"
    assert result.exception is None or isinstance(result.exception, SystemExit), \
        f"{type(result.exception).__name__}: {result.exception}"
    return result.exit_code, result.output


def assert_one_sentence(message: str) -> None:
    assert "Traceback" not in message and "\n" not in message.strip(), message


COUNTS: dict[str, Counter] = {"info": Counter(), "LLM": Counter()}


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    for name, counts in COUNTS.items():
        if counts:
            print(f"\nGGUF fuzz through {name}: {counts['tried']} mutations tried, {counts['clean error']} clean "
                  f"errors, {counts['loaded']} loaded, 0 tracebacks")


@pytest.mark.timeout(300)
def test_mutated_files_through_info(base, tmp_path):
    data, fields = base
    path = tmp_path / "mutant.gguf"

    @settings(max_examples=N_EXAMPLES or 500, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(data, fields))
    def check(mutant):
        path.write_bytes(mutant)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        t0 = time.perf_counter()
        code, message = run_info(path)
        peak = tracemalloc.get_traced_memory()[1] - before
        assert time.perf_counter() - t0 < 10, "info took over 10 s"
        assert peak < 64 << 20, f"info allocated {peak:,} bytes for a {len(mutant):,}-byte file"
        COUNTS["info"]["tried"] += 1
        if code == 2:
            assert message.startswith("error: ")
            assert_one_sentence(message)
            COUNTS["info"]["clean error"] += 1
        else:
            assert code == 0, message
            COUNTS["info"]["loaded"] += 1

    tracemalloc.start()
    try:
        check()
    finally:
        tracemalloc.stop()
    assert COUNTS["info"]["clean error"] > COUNTS["info"]["tried"] // 4   # the mutations do reach the checks


@pytest.mark.timeout(300)
def test_mutated_files_through_llm(base, tmp_path):
    """LLM(...) builds the model and loads llama.cpp's vocabulary: no traceback, no crash."""
    from localrun import LLM
    data, fields = base
    path = tmp_path / "mutant.gguf"
    path.write_bytes(data)      # the unharmed file first: one-time costs (kernel builds, imports) stay untimed
    LLM(str(path), n_ctx=32, n_threads=1, n_parallel=1, n_gpu_layers=0).tokenize("the fox")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    @settings(max_examples=N_EXAMPLES or 150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutations(data, fields))
    def check(mutant):
        path.write_bytes(mutant)
        COUNTS["LLM"]["tried"] += 1
        t0 = time.perf_counter()
        try:
            llm = LLM(str(path), n_ctx=32, n_threads=1, n_parallel=1, n_gpu_layers=0)
            ids = llm.tokenize("the fox")
            assert ids and all(0 <= i < llm.n_vocab for i in ids)
            COUNTS["LLM"]["loaded"] += 1
        except UserError as e:
            assert_one_sentence(str(e))
            COUNTS["LLM"]["clean error"] += 1
        assert time.perf_counter() - t0 < 60, "LLM(...) took over 60 s"   # a shared 2-core machine

    check()
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before   # KiB
    assert grown < 2 << 20, f"peak memory grew by {grown:,} KiB"


# --- vocabularies and tokenizer fields through llama.cpp's loader (issue 76) --------------------
#
# Each mutant is a vocabulary-only GGUF (tests/vocab_gguf.py) with one to three tokenizer fields
# edited, loaded by localrun's Tokenizer and tokenized (spaces, non-ASCII, special-token text, a
# NUL) in a forked child (tests/vocab_probe.py). The property: localrun refuses the file in one
# sentence, or the child finishes; a child killed by a signal fails the test. Every refused
# mutant also goes to llama.cpp unchecked, the reference that counts how many refusals stood
# between the process and an abort.

TOKENS_KEY = "tokenizer.ggml.tokens"
SPECIAL_ID_KEYS = [f"tokenizer.ggml.{name}_token_id" for name in
                   ("bos", "eos", "unknown", "padding", "eot", "seperator", "mask", "fim_pre")]
TEXT_ALPHABET = "ab ▁Ġ<>0xC3\x00é世"


def vocab_edits(n_tokens: int) -> st.SearchStrategy:
    """Edits of a tokenizer dict (vocab_gguf's keys), each a function tokenizer -> tokenizer."""
    from gguf.gguf_writer import GGUFValue
    from vocab_gguf import T

    ids = st.one_of(st.integers(0, n_tokens - 1), st.sampled_from([0, 1, 2, 3, 3 + 0x20, 3 + 0xC3, 3 + 0xE2, 259]))

    def set_item(key, i, value):
        def edit(t):
            if key not in t or not isinstance(t[key], list):
                return t
            items = list(t[key])
            items[i % len(items)] = value(items, i % len(items)) if callable(value) else value
            return {**t, key: items}
        return edit

    def set_key(key, value):
        return lambda t: {**t, key: value}

    token_text = st.one_of(
        st.just(""),
        st.integers(0, 8).map(lambda k: lambda items, i: items[i][:k] + "\0" + items[i][k:]),   # a NUL inside
        st.integers(0, n_tokens - 1).map(lambda j: lambda items, i: items[j % len(items)]),     # a duplicate
        st.integers(0, n_tokens - 1).map(lambda j: f"[EMPTY_{j}]"),
        st.tuples(st.integers(0, 255), st.booleans()).map(lambda a: f"<0x{a[0]:02X}>" if a[1] else f"<0x{a[0]:02x}>"),
        st.text(TEXT_ALPHABET, min_size=1, max_size=4),
    )
    merge = st.one_of(st.sampled_from(["", "a", " a b", "a  b", "a b c", "a\0 b", "Ġ Ġ", "a\0", "▁ ▁"]),
                      st.text(TEXT_ALPHABET, max_size=5))
    score = st.one_of(st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, 1e38]), st.floats(-1e3, 1e3))
    special_id = st.one_of(st.integers(0, n_tokens + 20), st.sampled_from([2**32 - 1, 10, 11, 12]), st.none(),
                           st.integers(-2, 5).map(lambda v: GGUFValue(v, T.INT32)))

    def truncate(k):
        return lambda t: {key: (v[:k] if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                                 "tokenizer.ggml.scores") and isinstance(v, list) else v)
                          for key, v in t.items()}

    return st.one_of(
        st.builds(lambda i, v: set_item("tokenizer.ggml.tokens", i, v), ids, token_text),
        st.builds(lambda i, v: set_item("tokenizer.ggml.token_type", i, v), ids,
                  st.one_of(st.integers(-1, 8), st.integers(-2**31, 2**31 - 1))),
        st.integers(0, 8).map(lambda v: lambda t: {**t, "tokenizer.ggml.token_type": [v] * len(t[TOKENS_KEY])}),
        st.builds(lambda i, v: set_item("tokenizer.ggml.scores", i, v), ids, score),
        st.builds(lambda i, v: set_item("tokenizer.ggml.merges", i, v), st.integers(0, 200), merge),
        st.sampled_from(["tokenizer.ggml.scores", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                         "tokenizer.ggml.pre"]).map(lambda key: set_key(key, None)),
        st.sampled_from(["gpt2", "llama", "bert", "t5", "", "gpt2\0", "llama\0x"]).map(
            lambda v: set_key("tokenizer.ggml.model", v)),
        st.sampled_from(["default", "llama3", "llama-bpe", "smollm", "gemma4", "tekken", "qwen2", "whitespace",
                         "nonesuch", "llama3\0x"]).map(lambda v: set_key("tokenizer.ggml.pre", v)),
        st.builds(set_key, st.sampled_from(SPECIAL_ID_KEYS), special_id),
        st.builds(set_key, st.sampled_from(["tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                                            "tokenizer.ggml.add_space_prefix"]), st.sampled_from([True, False, None])),
        st.sampled_from([1, 2, 3, 5, 11, 12, 100, 258, 259]).map(truncate),
    )


VOCAB_COUNTS: Counter = Counter()


@pytest.fixture(scope="module")
def vocab_probe():
    from vocab_probe import VocabProbe
    probe = VocabProbe()
    yield probe
    probe.close()
    if VOCAB_COUNTS:
        print(f"\nvocabulary fuzz through llama.cpp: {VOCAB_COUNTS['tried']} mutants, {VOCAB_COUNTS['loaded']} loaded "
              f"and tokenized, {VOCAB_COUNTS['refused']} refused ({VOCAB_COUNTS['refused, llama.cpp aborts']} of "
              f"which llama.cpp alone aborts on, {VOCAB_COUNTS['refused, llama.cpp fails']} it refuses itself, "
              f"{VOCAB_COUNTS['refused, llama.cpp loads']} it loads), 0 signals")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("base", ["bpe", "spm"])
def test_mutated_vocabularies_through_llama_cpp(vocab_probe, tmp_path, base):
    from vocab_gguf import bpe_tokenizer, spm_tokenizer, write_vocab_gguf
    tokenizer = bpe_tokenizer() if base == "bpe" else spm_tokenizer()
    path = tmp_path / "mutant.gguf"
    before = VOCAB_COUNTS.copy()

    @settings(max_examples=N_EXAMPLES or 100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(vocab_edits(len(tokenizer[TOKENS_KEY])), min_size=1, max_size=3))
    def check(edits):
        mutant = tokenizer
        for edit in edits:
            mutant = edit(mutant)
        try:
            write_vocab_gguf(path, {k: v for k, v in mutant.items() if v is not None})
        except ValueError:      # gguf-py writes no empty array; llama.cpp never sees such a file
            return
        VOCAB_COUNTS["tried"] += 1
        ours = vocab_probe.probe("localrun", path)
        assert ours.outcome != "signal", f"localrun's checks passed a file llama.cpp aborts on: {ours.detail}"
        assert ours.outcome in ("ok", "refused"), ours    # "error": an exception other than UserError
        if ours.outcome == "ok":
            VOCAB_COUNTS["loaded"] += 1
            return
        assert_one_sentence(ours.detail)
        VOCAB_COUNTS["refused"] += 1
        unchecked = vocab_probe.probe("llama.cpp", path).outcome
        VOCAB_COUNTS[{"signal": "refused, llama.cpp aborts", "error": "refused, llama.cpp fails"}.get(
            unchecked, "refused, llama.cpp loads")] += 1

    check()
    found = VOCAB_COUNTS - before
    assert found["refused, llama.cpp aborts"] > 0 and found["loaded"] > 0, found   # the edits reach both sides
