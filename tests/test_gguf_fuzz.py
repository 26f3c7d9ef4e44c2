"""GGUF reading is total (issue 21): hostile header cases, then hypothesis-driven mutations of a
tiny synthetic GGUF (byte flips, truncations, length and count fields set to extremes) through
`localrun info` and `localrun.LLM(...)`. Asserted for every mutation: no traceback (a clean exit
or one UserError sentence), no hang (pytest-timeout, and a per-call time bound), bounded memory.

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
