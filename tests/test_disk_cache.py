"""The disk tier of the prefix cache on the tiny synthetic model: a restart in a new process
reuses the prefix and gives the same greedy output as computing it; corrupt files are ignored;
blocks never cross models or KV layouts; the size bound holds; writes stay off the request path;
a stats file that is not what we write counts as zero, is said once, and is rewritten. The reference for every output is the same prompt run with no disk cache."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import httpx
import pytest

from localrun.api import LLM
from localrun.engine import disk_cache, disk_files, llm_engine
from localrun.engine.disk_cache import SUFFIX, DiskCacheConfig, model_fingerprint
from localrun.engine.sequence import Sequence
from localrun.errors import UserError
from server_harness import free_port, wait_until

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
GREEDY = dict(max_tokens=12, temperature=0, ignore_eos=True)


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 320) for _ in range(n)]


PROMPT = random_ids(200, seed=1)


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Never touch the user's cache."""
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def model_path(tiny_gguf):
    return tiny_gguf("F32")


@pytest.fixture(scope="module")
def reference(model_path):
    """PROMPT's greedy output with no disk cache."""
    return LLM(model_path, dtype="float32", n_threads=1).generate(PROMPT, **GREEDY).token_ids


def make_llm(path, cache_dir, **options):
    return LLM(path, dtype="float32", n_threads=1, disk_cache=True, cache_dir=cache_dir, **options)


def run(llm, prompt=PROMPT):
    result = llm.generate(prompt, **GREEDY)
    llm.close()
    return result


def block_files(cache_dir) -> list[Path]:
    return sorted(Path(cache_dir).glob(f"*/*{SUFFIX}"))


# --- restart ----------------------------------------------------------------------------

CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
from localrun.api import LLM
llm = LLM({path!r}, dtype="float32", n_threads=1, disk_cache=True, cache_dir={cache!r})
r = llm.generate({prompt!r}, max_tokens=12, temperature=0, ignore_eos=True)
print(json.dumps({{"ids": r.token_ids, "timings": r.timings}}))
"""  # no close(): the writes queued at exit must still reach the disk


def run_child(model_path, cache_dir):
    code = CHILD.format(tests=str(TESTS), path=str(model_path), cache=str(cache_dir), prompt=PROMPT)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_restart_in_a_new_process_loads_the_prefix_from_disk(model_path, reference, tmp_path):
    cold = run_child(model_path, tmp_path / "kv")
    assert cold["timings"]["cached_tokens_disk"] == 0
    assert len(block_files(tmp_path / "kv")) == (200 + 12 - 1) // 16   # prompt and reply, full blocks
    warm = run_child(model_path, tmp_path / "kv")
    t = warm["timings"]
    assert t["cached_tokens_disk"] == t["cached_tokens"] == (200 - 1) // 16 * 16
    assert t["cached_tokens_device"] == 0 and t["computed_prompt_tokens"] == 200 - t["cached_tokens"]
    assert cold["ids"] == warm["ids"] == reference


def test_engine_stats_and_persistent_counts(model_path, tmp_path):
    run(make_llm(model_path, tmp_path / "kv"))
    llm = make_llm(model_path, tmp_path / "kv")
    run(llm)
    stats = llm.engine.stats()
    assert stats["disk_cache_hit_tokens"] == 192 and stats["disk_cache_loaded_blocks"] == 12
    assert stats["disk_cache_bytes"] == sum(p.stat().st_size for p in block_files(tmp_path / "kv"))
    totals = disk_files.load_stats(tmp_path / "kv")
    assert totals["num_loaded_blocks"] == 12 and totals["num_written_blocks"] == 13


# --- corruption --------------------------------------------------------------------------

def flip_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncate", "flip_data", "flip_header", "empty"])
def test_corrupt_file_is_ignored_and_output_unchanged(model_path, reference, tmp_path, damage):
    run(make_llm(model_path, tmp_path / "kv"))
    llm = make_llm(model_path, tmp_path / "kv")
    ns_dir = Path(llm.engine.disk_cache.files.dir)
    hashes = llm.engine.block_manager._block_hashes(Sequence("probe", PROMPT), 12)
    victim = ns_dir / (hashes[5].hex() + SUFFIX)         # the sixth block of the prompt
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[:len(data) - 100])
    elif damage == "flip_data":
        flip_bit(victim, len(data) - 1000)               # inside the last tensor's bytes
    elif damage == "flip_header":
        flip_bit(victim, 20)                              # inside the JSON header
    else:
        victim.write_bytes(b"")
    with pytest.warns(UserWarning, match="corrupt KV cache file"):
        result = run(llm)
    assert result.token_ids == reference
    assert result.timings["cached_tokens_disk"] == 5 * 16    # blocks before the damaged one
    assert llm.engine.stats()["disk_cache_corrupt_files"] == 1


def test_corrupt_file_is_deleted_and_rewritten(model_path, reference, tmp_path):
    run(make_llm(model_path, tmp_path / "kv"))
    victim = block_files(tmp_path / "kv")[0]
    flip_bit(victim, victim.stat().st_size - 10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):   # the first run drops the bad file, the second writes it again
            assert run(make_llm(model_path, tmp_path / "kv")).token_ids == reference
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # nothing corrupt is left
        result = run(make_llm(model_path, tmp_path / "kv"))
    assert result.timings["cached_tokens_disk"] == 192 and result.token_ids == reference


# --- isolation ---------------------------------------------------------------------------

@pytest.mark.parametrize("other", [
    dict(model="seed1"),                 # same name and shapes, other weights
    dict(kv_type="int8"),
    dict(dtype="bfloat16"),
])
def test_blocks_never_cross_models_or_layouts(model_path, tiny_gguf, tmp_path, other):
    run(make_llm(model_path, tmp_path / "kv"))
    path = tiny_gguf("F32", seed=1) if other.get("model") else model_path
    options = {k: v for k, v in other.items() if k != "model"}
    llm = LLM(path, n_threads=1, disk_cache=True, cache_dir=tmp_path / "kv", **{"dtype": "float32", **options})
    result = run(llm)
    assert result.timings["cached_tokens_disk"] == 0
    assert llm.engine.stats()["disk_cache_loaded_blocks"] == 0
    namespaces = {p.parent.name for p in block_files(tmp_path / "kv")}
    assert len(namespaces) == 2                            # each wrote its own


def test_block_size_is_part_of_the_key(model_path, tmp_path):
    from localrun.engine.llm_engine import LLMEngine
    llm = LLM(model_path, dtype="float32", n_threads=1)
    config = DiskCacheConfig(tmp_path / "kv", model_fingerprint(model_path, llm.file.header.data_offset))
    seqs = []
    for block_size in (16, 8, 8):
        engine = LLMEngine(llm.model, num_blocks=128, block_size=block_size, disk_cache=config)
        seq = engine.add_request("r", PROMPT, llm_params())
        while engine.has_unfinished():
            engine.step()
        engine.flush()
        seqs.append(seq)
    assert [s.timeline.cached_tokens_by_tier.get("disk", 0) for s in seqs] == [0, 0, 192]
    assert seqs[0].generated_token_ids == seqs[1].generated_token_ids == seqs[2].generated_token_ids


def test_another_build_of_the_kernels_does_not_reuse_blocks(model_path, tmp_path, monkeypatch):
    """Blocks another build of the compiled kernels (or another instruction set) wrote differ from
    this build's in their last bits; greedy output at a near-tie then depended on the disk."""
    from localrun import kernels
    from localrun.engine.llm_engine import LLMEngine
    llm = LLM(model_path, dtype="float32", n_threads=1)
    config = DiskCacheConfig(tmp_path / "kv", model_fingerprint(model_path, llm.file.header.data_offset))
    this_build = kernels.signature()
    assert this_build != "none" and f"|{kernels.isa()}|" in this_build
    loaded = []
    for build in (this_build, "0123456789abcdef|avx2", this_build):
        monkeypatch.setattr(kernels, "signature", lambda build=build: build)
        engine = LLMEngine(llm.model, num_blocks=128, block_size=16, disk_cache=config)
        seq = engine.add_request("r", PROMPT, llm_params())
        while engine.has_unfinished():
            engine.step()
        engine.flush()
        loaded.append(seq.timeline.cached_tokens_by_tier.get("disk", 0))
    assert loaded == [0, 0, 192]


def test_a_forced_instruction_set_is_part_of_the_kernels_signature():
    """LOCALRUN_ISA=avx2 changes which attention kernel an AVX-512 CPU without VNNI runs while its
    matmuls' ISA (kernels.isa()) reads avx2 either way: the variable as given is in the key."""
    code = "from localrun import kernels; print(kernels.signature())"

    def signature(**env):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={k: v for k, v in {**os.environ, **env}.items() if v is not None}).stdout.strip()
    plain, forced = signature(LOCALRUN_ISA=None), signature(LOCALRUN_ISA="avx2")
    assert plain.split("|")[0] == forced.split("|")[0] and forced.endswith("|avx2|avx2") and plain.endswith("|")


def test_a_file_moved_into_another_namespace_is_rejected(model_path, tiny_gguf, tmp_path):
    run(make_llm(model_path, tmp_path / "kv"))
    other = make_llm(tiny_gguf("F32", seed=1), tmp_path / "kv")
    target_dir = Path(other.engine.disk_cache.files.dir)
    for f in block_files(tmp_path / "kv"):               # forge: same names in the other namespace
        (target_dir / f.name).write_bytes(f.read_bytes())
    with pytest.warns(UserWarning, match="another format or model"):
        result = run(other)
    assert result.timings["cached_tokens_disk"] == 0


def test_model_fingerprint(model_path, tiny_gguf, tmp_path):
    header = LLM(model_path, dtype="float32", n_threads=1).file.header
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(model_path.read_bytes())
    assert model_fingerprint(copy, header.data_offset) == model_fingerprint(model_path, header.data_offset)
    assert model_fingerprint(tiny_gguf("F32", seed=1), header.data_offset) != model_fingerprint(
        model_path, header.data_offset)
    flip_bit(copy, header.data_offset + 3)                # a weight byte in the first sample
    assert model_fingerprint(copy, header.data_offset) != model_fingerprint(model_path, header.data_offset)


# --- the size bound and LRU --------------------------------------------------------------

def test_size_bound_holds_under_distinct_prompts(model_path, tmp_path):
    llm = make_llm(model_path, tmp_path / "kv")
    run(llm, random_ids(40, seed=1000))
    block_bytes = block_files(tmp_path / "kv")[0].stat().st_size
    bound = 10 * block_bytes + block_bytes // 2            # room for 10 blocks
    llm = make_llm(model_path, tmp_path / "kv", cache_disk=bound)
    prompts = [random_ids(48, seed=2000 + i) for i in range(15)]   # 3 full blocks each
    for prompt in prompts:
        run(llm, prompt)
        total = sum(p.stat().st_size for p in block_files(tmp_path / "kv"))
        assert total <= bound
        assert llm.engine.stats()["disk_cache_bytes"] == total
    assert llm.engine.disk_cache.stats.num_evicted_files >= 15 * 3 - 10
    # the newest prompt is still there, the oldest is gone (least recently used first)
    fresh = make_llm(model_path, tmp_path / "kv", cache_disk=bound)
    assert run(fresh, prompts[-1]).timings["cached_tokens_disk"] == 32
    fresh = make_llm(model_path, tmp_path / "kv", cache_disk=bound)
    assert run(fresh, prompts[0]).timings["cached_tokens_disk"] == 0


def test_a_hit_refreshes_a_block(model_path, tmp_path):
    first, second = random_ids(33, seed=1), random_ids(33, seed=2)   # 2 full blocks written each
    llm = make_llm(model_path, tmp_path / "kv")
    run(llm, first)
    run(llm, second)
    files = block_files(tmp_path / "kv")
    assert len(files) == 4
    size = files[0].stat().st_size
    hashes = llm.engine.block_manager._block_hashes(Sequence("probe", first), 2)
    firsts = {llm.engine.disk_cache.path(h) for h in hashes}
    for p in files:                                       # `first`'s blocks are the oldest
        os.utime(p, (1, 1) if p in firsts else (2, 2))
    llm = make_llm(model_path, tmp_path / "kv", cache_disk=5 * size)
    assert run(llm, first).timings["cached_tokens_disk"] == 32   # the hit touches both files
    run(llm, random_ids(17, seed=3))                      # one new block: 5 fit
    run(llm, random_ids(17, seed=4))                      # another: the least recent goes
    remaining = set(block_files(tmp_path / "kv"))
    assert firsts <= remaining and len(remaining) == 5


# --- off the hot path --------------------------------------------------------------------

def test_writes_do_not_block_requests(model_path, reference, tmp_path, monkeypatch):
    gate = threading.Event()
    real_write = disk_cache.BlockFiles._write

    def slow_write(self, *args):
        assert gate.wait(30)
        return real_write(self, *args)

    monkeypatch.setattr(disk_cache.BlockFiles, "_write", slow_write)
    llm = make_llm(model_path, tmp_path / "kv")
    result = llm.generate(PROMPT, **GREEDY)              # returns while every write waits
    assert result.token_ids == reference and block_files(tmp_path / "kv") == []
    gate.set()
    llm.close()
    assert len(block_files(tmp_path / "kv")) == 13


def test_writes_wait_for_the_engine_to_be_idle(model_path, reference, tmp_path, monkeypatch):
    """Without slack to give, no block is written while a request is in flight (a write
    competes with the step for the CPU); all are written once the engine is idle, without a
    flush."""
    monkeypatch.setattr(llm_engine, "DISK_WRITE_SHARE", 0.0)
    busy_at_write = []
    real_write = disk_cache.BlockFiles._write

    def recording_write(self, *args):
        busy_at_write.append(llm.engine.scheduler.has_unfinished())
        return real_write(self, *args)

    monkeypatch.setattr(disk_cache.BlockFiles, "_write", recording_write)
    llm = make_llm(model_path, tmp_path / "kv")
    seq_a = llm.engine.add_request("a", PROMPT, llm_params())
    llm.engine.add_request("b", random_ids(120, seed=7), llm_params())
    while not seq_a.is_finished:
        llm.engine.step()
    assert busy_at_write == [], "a block was written while requests were in flight"
    files = llm.engine.disk_cache.files
    assert files.queue.unfinished_tasks > 0
    while llm.engine.has_unfinished():
        llm.engine.step()
    deadline = time.monotonic() + 30
    while files.queue.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.01)
    assert busy_at_write and not any(busy_at_write)
    assert len(block_files(tmp_path / "kv")) == 13 + 8     # 211 and 131 computed tokens, 16 a block
    assert llm.generate(PROMPT, **GREEDY).token_ids == reference


def test_a_busy_engine_writes_in_the_windows_between_its_steps(model_path, reference, tmp_path, monkeypatch):
    """Under load that never pauses, blocks are written, each one inside a window the engine
    opens between two steps (the slack below an ITL target here), none beside a step."""
    seen = []
    real_write = disk_cache.BlockFiles._write

    def recording_write(self, *args):
        seen.append((llm.engine.scheduler.has_unfinished(), self.in_window))
        return real_write(self, *args)

    monkeypatch.setattr(disk_cache.BlockFiles, "_write", recording_write)
    llm = make_llm(model_path, tmp_path / "kv")
    llm.engine.set_itl_target(0.5)
    seqs = [llm.engine.add_request("a", PROMPT, llm_params())]
    for i in range(4):                   # a new request each time one finishes: never idle
        while not seqs[-1].is_finished:
            llm.engine.step()
        seqs.append(llm.engine.add_request(str(i), random_ids(100, seed=20 + i), llm_params()))
        busy_writes = [w for w in seen if w[0]]
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert seqs[0].generated_token_ids == reference
    assert busy_writes, "no block was written while the engine was busy"
    assert all(in_window for busy, in_window in busy_writes), "a block was written beside a step"
    assert llm.engine.stats()["disk_cache_write_drops"] == 0


def test_write_windows_take_a_bounded_share_of_a_busy_engine(model_path, tmp_path, monkeypatch):
    """Without an ITL target a window is a tenth of the step before it, however slow the disk."""
    gate = threading.Event()
    real_write = disk_cache.BlockFiles._write
    monkeypatch.setattr(disk_cache.BlockFiles, "_write", lambda self, *a: gate.wait(30) and real_write(self, *a))
    llm = make_llm(model_path, tmp_path / "kv")
    execute_s = []
    real_execute = llm.engine.runner.execute

    def timed_execute(batch):
        start = time.perf_counter()
        try:
            return real_execute(batch)
        finally:
            execute_s.append(time.perf_counter() - start)

    monkeypatch.setattr(llm.engine.runner, "execute", timed_execute)
    llm.generate(PROMPT, **GREEDY)
    window_s = llm.engine.stats()["disk_cache_window_s"]
    gate.set()
    llm.close()
    assert 0 < window_s <= llm_engine.DISK_WRITE_SHARE * sum(execute_s) + 0.002 * len(execute_s)


def llm_params():
    from localrun.sampling import SamplingParams
    return SamplingParams(**GREEDY)


def test_full_queue_drops_writes_instead_of_waiting(model_path, tmp_path, monkeypatch):
    gate = threading.Event()
    real_write = disk_cache.BlockFiles._write
    monkeypatch.setattr(disk_cache.BlockFiles, "_write", lambda self, *a: gate.wait(30) and real_write(self, *a))
    llm = LLM(model_path, dtype="float32", n_threads=1)
    llm.disk_cache_config = DiskCacheConfig(tmp_path / "kv", "x", queue_blocks=2)
    llm.generate(PROMPT, **GREEDY)
    stats = llm.engine.stats()
    gate.set()
    llm.close()
    # two queued and at most one in the writer's hands at each store() call; the rest dropped
    written = len(block_files(tmp_path / "kv"))
    assert 2 <= written <= 4 and written + stats["disk_cache_write_drops"] == 13


# --- options and the CLI -----------------------------------------------------------------

def test_default_dir_is_under_localrun_home(model_path, tmp_path):
    llm = LLM(model_path, dtype="float32", n_threads=1, disk_cache=True)
    assert llm.disk_cache_config.root == tmp_path / "home" / "kv-cache"
    assert LLM(model_path, dtype="float32", n_threads=1).disk_cache_config is None   # off by default


def test_bad_size_is_a_user_error(model_path):
    with pytest.raises(UserError, match="not a size"):
        LLM(model_path, n_threads=1, disk_cache=True, cache_disk="lots")
    with pytest.raises(UserError, match="positive"):
        LLM(model_path, n_threads=1, disk_cache=True, cache_disk=0)


def test_cli_cache_show_and_clear(model_path, tmp_path):
    run(make_llm(model_path, tmp_path / "kv"))
    run(make_llm(model_path, tmp_path / "kv"))

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "localrun.cli", "cache", *args], capture_output=True,
                              text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    shown = json.loads(cli("--cache-dir", str(tmp_path / "kv"), "--json"))
    assert shown["files"] == 13 and shown["bytes"] == sum(p.stat().st_size for p in block_files(tmp_path / "kv"))
    assert shown["stats"]["num_loaded_blocks"] == 12
    assert "13 blocks" in cli("--cache-dir", str(tmp_path / "kv"))
    assert "removed 13 blocks" in cli("clear", "--cache-dir", str(tmp_path / "kv"))
    assert block_files(tmp_path / "kv") == []
    assert json.loads(cli("--cache-dir", str(tmp_path / "kv"), "--json"))["files"] == 0


def test_cache_command_never_imports_torch(tmp_path):
    """`localrun cache` reads the directory only: no torch (~3 s of imports) to list or clear it."""
    code = ("import sys\nfrom localrun.cli.main import main\nsys.argv = ['localrun', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\nprint('torch' in sys.modules)")
    for args in (["cache", "--cache-dir", str(tmp_path), "--json"], ["cache", "clear", "--cache-dir", str(tmp_path)]):
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "False", (proc.stdout, proc.stderr)


# --- the stats file as untrusted input (issue 76) ---------------------------------------------

BAD_STATS = [
    ("a string count", b'{"num_loaded_blocks": "12"}', """'num_loaded_blocks' is "12", not a count >= 0"""),
    ("a negative count", b'{"num_written_blocks": -1}', "'num_written_blocks' is -1, not a count >= 0"),
    ("a float count", b'{"num_written_blocks": 1.5}', "'num_written_blocks' is 1.5, not a count >= 0"),
    ("a boolean count", b'{"num_corrupt": true}', "'num_corrupt' is true, not a count >= 0"),
    ("a count past 2**63", b'{"num_loaded_bytes": 9223372036854775808}', "'num_loaded_bytes' is 9223372036854775808"),
    ("a null count", b'{"num_evicted_files": null}', "'num_evicted_files' is null"),
    ("NaN seconds", b'{"load_s": NaN}', "'load_s' is NaN, not a number of seconds >= 0"),
    ("infinite seconds", b'{"window_s": -Infinity}', "'window_s' is -Infinity"),
    ("an object count", b'{"num_write_drops": {"a": 1}}', "'num_write_drops' is {\"a\": 1}"),
    ("a list", b"[1, 2]", "it is not a JSON object"),
    ("null", b"null", "it is not a JSON object"),
    ("a string", b'"stats"', "it is not a JSON object"),
    ("empty", b"", "it is not valid JSON"),
    ("truncated", b'{"num_loaded_blocks": 1', "it is not valid JSON"),
    ("not UTF-8", b'{"num_loaded_blocks": 1, "\xff": 2}', "it is not valid JSON"),
    ("a 5000-digit count", b'{"num_loaded_blocks": ' + b"9" * 5000 + b"}", "it is not valid JSON"),
    ("deep nesting", b"[" * 30_000 + b"]" * 30_000, "it is not valid JSON"),
    ("huge", b'{"num_loaded_blocks": 1}' + b" " * (1 << 20), "it is not a regular file of at most 65,536 bytes"),
]


@pytest.mark.parametrize("name,content,why", BAD_STATS, ids=[b[0] for b in BAD_STATS])
def test_a_bad_stats_file_reads_as_zero_counts_and_one_sentence(tmp_path, name, content, why):
    (tmp_path / "stats.json").write_bytes(content)
    counts, problem = disk_files.read_stats(tmp_path)
    assert counts == {} and disk_files.load_stats(tmp_path) == {}
    assert problem.startswith(f"ignoring the KV cache stats file {tmp_path / 'stats.json'} ({why}"), problem
    assert problem.endswith("); its counts start again from zero") and "\n" not in problem


@pytest.mark.parametrize("kind", ["directory", "fifo", "endless", "unreadable"])
def test_a_stats_path_that_is_no_small_file_never_blocks_or_raises(tmp_path, kind):
    path = tmp_path / "stats.json"
    if kind == "directory":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)                     # opening it to read would wait for a writer forever
    elif kind == "endless":
        path.symlink_to("/dev/zero")
    else:
        path.write_text("{}")
        path.chmod(0)
        if os.access(path, os.R_OK):
            pytest.skip("running as root: every file is readable")
    counts, problem = disk_files.read_stats(tmp_path)
    assert counts == {} and problem is not None and str(path) in problem
    assert disk_files.summarize(tmp_path)["stats"] == {}


def test_a_good_stats_file_keeps_its_counts_and_drops_unknown_keys(tmp_path):
    (tmp_path / "stats.json").write_text('{"num_loaded_blocks": 3, "load_s": 0.25, "window_s": 2, "future": "x"}')
    assert disk_files.read_stats(tmp_path) == ({"num_loaded_blocks": 3, "load_s": 0.25, "window_s": 2}, None)


def test_a_bad_stats_file_is_rewritten_with_this_processs_counts(model_path, tmp_path, caplog):
    (tmp_path / "kv").mkdir()
    (tmp_path / "kv" / "stats.json").write_text('{"num_loaded_blocks": "12", "num_written_blocks": 100}')
    with caplog.at_level("WARNING", logger="localrun.engine.disk_cache"):
        run(make_llm(model_path, tmp_path / "kv"))            # 200 + 11 tokens in KV: 13 blocks of 16 written
    counts, problem = disk_files.read_stats(tmp_path / "kv")
    assert problem is None
    assert counts["num_written_blocks"] == 13 and counts["num_loaded_blocks"] == 0
    assert [r.getMessage() for r in caplog.records if "stats file" in r.getMessage()] == [
        f"ignoring the KV cache stats file {tmp_path / 'kv' / 'stats.json'} ('num_loaded_blocks' is \"12\", "
        "not a count >= 0); its counts start again from zero"]


def test_cli_cache_with_a_bad_stats_file_warns_and_shows_zero(tmp_path):
    (tmp_path / "stats.json").write_text('{"num_loaded_blocks": "12"}')      # issue 76's reproduction

    def cli(*args):
        proc = subprocess.run([sys.executable, "-m", "localrun.cli", "cache", "--cache-dir", str(tmp_path), *args],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert " ".join(proc.stderr.split()).startswith("warning: ignoring the KV cache stats file"), proc.stderr
        return proc.stdout

    assert "loaded 0 blocks (0 B), written 0" in cli()
    shown = json.loads(cli("--json"))
    assert shown["stats"] == {} and "'num_loaded_blocks' is \"12\"" in shown["stats_warning"]


def test_a_server_on_a_bad_stats_file_stops_cleanly_on_sigterm(model_path, tmp_path):
    """Issue 76: the server's close() added its counts to a string and exited 1 with a traceback."""
    cache = tmp_path / "kv"
    cache.mkdir()
    (cache / "stats.json").write_text('{"num_written_blocks": "many"}')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "localrun.cli", "serve", str(model_path), "--port", str(port),
                             "--threads", "1", "--ctx", "1024", "--cache-dir", str(cache)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def up():
        try:
            return httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
    try:
        assert wait_until(lambda: up() or proc.poll() is not None, timeout=60) and proc.poll() is None
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={           # 40 + 3 tokens in KV: 2 blocks of 16
            "prompt": random_ids(40, seed=2), "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in output, output
    assert "ignoring the KV cache stats file" in output
    counts, problem = disk_files.read_stats(cache)
    assert problem is None and counts["num_written_blocks"] == 2 and counts["num_loaded_blocks"] == 0


# --- the real model: a 1,500-token prompt across two processes ------------------------------

REAL_CHILD = """
import json, sys
from localrun.api import LLM
llm = LLM({path!r}, n_ctx=2048, disk_cache=True, cache_dir={cache!r})
text = "The history of computing is a story of abstraction, told one machine at a time. "
ids = []
while len(ids) < 1500:
    ids += llm.tokenize(text + str(len(ids)), add_special=not ids)
if {warm}:                                          # the first 1488 tokens (93 blocks) in memory first
    llm.generate(ids[:1488], max_tokens=1, temperature=0)
margins, forward = [], llm.engine.runner.forward
def recording_forward(batch):                      # the top-2 gap of each step's sampled row
    out = forward(batch)
    top = out[-1].topk(2).values
    margins.append(float(top[0] - top[1]))
    return out
llm.engine.runner.forward = recording_forward
r = llm.generate(ids[:1500], max_tokens=24, temperature=0, ignore_eos=True)
print(json.dumps({{"ids": r.token_ids, "timings": r.timings, "margins": margins[-24:]}}))
"""

@pytest.mark.model
def test_restart_with_the_real_model(tmp_path):
    from localrun.models import DEFAULT_MODEL, pull
    path = pull(DEFAULT_MODEL, quiet=True)

    def child(warm):
        code = REAL_CHILD.format(path=str(path), cache=str(tmp_path / "kv"), warm=warm)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO), "LOCALRUN_HOME": str(tmp_path / "home")})
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    # The first process computes the prompt's first 1488 tokens, then the whole prompt over them
    # as a prefix-cache hit in memory; the restarted one finds the same 93 blocks on disk. Both
    # compute the last 12 tokens as a 12-row chunk over the same stored bytes, so the disk cache
    # must give the in-memory cache's logits bit for bit, and the same greedy text throughout.
    first, second = child(True), child(False)
    assert first["timings"]["cached_tokens"] == 1488 and not first["timings"].get("cached_tokens_disk")
    assert second["timings"]["cached_tokens_disk"] == second["timings"]["cached_tokens"] == 1488
    assert first["ids"] == second["ids"]
    assert first["margins"] == second["margins"]


# --- the pool's block copy, for every KV type ----------------------------------------------

@pytest.mark.parametrize("kv_type", ["f32", "bf16", "int8", "fp8"])
def test_copy_blocks_round_trip(kv_type):
    import torch

    from localrun.engine.paged_kv import PagedKVCache, fp8_dtype
    if kv_type == "fp8" and fp8_dtype() is None:
        pytest.skip("no float8 in this torch")
    cache = PagedKVCache(num_blocks=8, block_size=4, n_layers=2, n_head_kv=2, head_dim=32, kv_type=kv_type,
                         compute_dtype=torch.float32)
    view = cache.sequence_view([5, 2, 7])
    torch.manual_seed(0)
    for layer in range(2):
        view.update(layer, 0, torch.randn(12, 2, 32), torch.randn(12, 2, 32))
    copies = cache.copy_blocks([5, 2, 7])
    for block_id, tensors in zip([1, 3, 0], copies):      # the same content in other blocks
        cache.write_block(block_id, tensors)
    for layer in range(2):
        original = cache.gather(layer, torch.tensor([5, 2, 7]), 12)
        restored = cache.gather(layer, torch.tensor([1, 3, 0]), 12)
        assert all(torch.equal(a, b) for a, b in zip(original, restored))
    assert set(copies[0]) == set(cache.block_layout())
