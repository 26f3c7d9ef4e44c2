"""`--measure`: short micro-benchmarks of this machine, cached, used in place of preset figures.

Host, in the compute dtype: matrix-vector products of a small and a large matrix (what a
decode step runs), fitted as a fixed cost per call plus bytes / bandwidth, and the throughput
of a 512-token matmul (what prefill runs). Through torch when it is importable (the engine's
own kernels, so a dtype the CPU only emulates shows up as slow), else numpy's BLAS in f32.
GPU (only with a CUDA build of torch):
device memory bandwidth (a large copy), f16 matmul throughput, and host-to-device bandwidth
over PCIe from pinned memory. Results are stored as JSON under $LOCALRUN_HOME/layerplan/ with a
fingerprint of the machine (CPU model and flags, cores, RAM, GPUs and driver, localrun's version),
and ignored when the fingerprint no longer matches.

Timings taken while other work runs describe that moment, not the machine. Measuring waits (a
bounded time) until other processes leave the CPU, then records how many cores they kept busy
while it ran (layerplan.quiet: the machine's busy time less ours); a calibration during which they
used more than quiet.QUIET_CORES on average is `suspect`: `save` refuses it and the caller says so
in one line. Where that cannot be measured (no /proc/stat) the 1-minute load average decides: more
than QUIET_LOAD runnable tasks when measuring began, or more than our own threads on top of that
when it ended. The load average is recorded either way.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from layerplan import quiet
from layerplan.home import localrun_home
from layerplan.devices import Device, Machine

CALIBRATION_FILE = "calibration.json"   # the latest calibration of this machine, whatever model timed its engine
ENGINE_FILE = "engine-{key}.json"       # and the latest one of each model file (engine_key): the fitted figures
                                        # are the host's through one model's shapes, and two models' differ by more
                                        # than the host moves (2 Zen 3 cores, one hour: KV read at 4.1 GB/s through
                                        # gemma-3-270m's 256-wide heads, 7.9 through SmolLM2's)
# What the fitted figures mean to the speed model; bumped when that changes (2: a prompt chunk after
# cached tokens attends them unmasked and its own tokens causally), so that older measurements,
# fitted under the old meaning, are measured again rather than misread. Also bumped when the
# engine's own step changes by more than noise while the package version stays (3: the sampler
# works on top-k's candidates, ~4 ms less per sampled row on SmolLM2: the calibration samples at
# the default temperature, and its 4-sequence decode step went from 33-39 to 16-25 ms; 4: every
# engine on AVX2 multiplies decode rows in the lane layout, now 0.88-0.92x the rows' step at 4
# sequences, and the sampler's top-k is one compiled pass; 5: prompt rows go through the integer
# kernel (prompt_math int8: 1.5-2x the prefill of the float path), and AVX-512 multiplies 9 or more
# rows 16 lanes per register; 6: decode over a third cache fill, and the KV bytes the CPU's caches
# hold between steps, free in the model; 7: the AVX2 lane kernel's 6-row passes, and a decode batch's
# own KV read rate; 8: decode attention's rate over an int8 or fp8 cache, timed on its own, and the
# attention kernel's prefetches in parts, with a quantized pool's scales; 10: a middle decode fill,
# the cached KV and its bandwidth a least-squares fit over the three fills past the short one, the
# batch's rate over its middle and long fills, and the memory bandwidth the engine's where its
# steps need more than the matvec's; 9 was a reverted middle-fill attempt whose saved calibrations
# must not be read as 10's; 11: the small ops of a batched step on both threads and q/k/v read in
# place by the attention kernel, a 4-row decode step ~0.5 ms less, 16 rows ~1.5-2 ms; 12: every engine
# timing the median of rounds spread over the calibration, where decode timings were the fastest of
# repeats back to back; an int8 or fp8 cache's rates fitted to its long steps themselves).
SPEED_MODEL_REVISION = 12
QUIET_LOAD = 0.5     # runnable tasks besides ours (1-minute load average) below which a machine is quiet
QUIET_WAIT_S = 60.0  # the longest measuring waits for other processes to leave the CPU
DRIFT_LIMIT = 0.15   # an engine calibration whose first timing's later rounds moved by more from its first is suspect
                     # (10% while its timings were taken within seconds; now each is the median of rounds spread
                     # over the calibration, between its two halves: SmolLM2's halves 10.5-12.9% apart in three
                     # attempts, every speed ratio of the runs after it within 0.97-1.12; docs/layerplan.md)
MISFIT_LIMIT = 0.15  # and one whose timings the fitted speed model misses by more: one of them met a slower
                     # host (on a 2-core Zen 3 VM an int8 engine's short-fill step took 11.0 ms where float16's
                     # took 7.5 in the same calibration, drift 9.5%: the worst timing missed by 26%; quiet
                     # calibrations there stay within 4-7%)


@dataclass(frozen=True)
class GPUCalibration:
    index: int
    name: str
    memory_bandwidth: float   # bytes/s
    compute_flops: float      # f16 matmul flop/s
    link_bandwidth: float     # host -> device bytes/s, pinned memory


@dataclass(frozen=True)
class Calibration:
    fingerprint: str
    host_bandwidth: float            # bytes/s a matrix-vector product streams weights at
    host_flops: float                # matmul flop/s (a 512-token batch) in `dtype`
    host_matmul_overhead_s: float    # fixed cost of one matrix-vector call in `dtype`
    host_layer_overhead_s: float | None = None  # per layer besides matmuls (torch only), None: default
    host_attention_call_s: float | None = None  # one decode attention call, part of the layer overhead
    dtype: str = "f32"               # the compute dtype measured
    backend: str = "numpy"           # numpy, or torch (the engine's own kernels)
    threads: int = 0
    gpus: tuple[GPUCalibration, ...] = ()
    measured_at: str = ""
    host_step_overhead_s: float | None = None  # per forward step besides layers and head (engine calibration)
    host_kv_bandwidth: float | None = None     # bytes/s decode attention reads the KV cache at (engine calibration)
    engine_model: str = ""           # what the engine calibration timed (localrun/calibrate_engine.py)
    load_before: float = 0.0         # 1-minute load average when measuring began
    load_after: float = 0.0          # and when it ended (our own threads included)
    suspect: bool = False            # taken with other work on the CPU: not saved, not to be trusted
    host_decode_flops: float | None = None       # matmul flop/s of decode rows (engine calibration)
    host_unpack_bandwidth: float | None = None   # bytes/s a prompt step unpacks weights at (engine calibration)
    host_attention_flops: float | None = None    # flop/s of prompt attention after cached tokens (engine calibration)
    host_causal_attention_flops: float | None = None  # and from an empty cache (engine calibration)
    other_cpu: float | None = None   # cores other processes kept busy while measuring (None: not measurable)
    host_kv_cached_bytes: float | None = None  # KV bytes a decode step reads from the CPU's caches (engine calibration)
    host_kv_batch_bandwidth: float | None = None  # bytes/s a batch of host_kv_batch_rows decode rows reads KV at
    host_kv_batch_rows: int | None = None         # (engine calibration; None: one rate for every step)
    drift: float | None = None       # the engine calibration's first timing retaken last: slower over faster - 1
    engine_reference_s: float | None = None  # that timing (one sequence, short fill, all layers), seconds: a later
                                             # run times it again to see how far the machine's speed moved since
    engine_reference_long_s: float | None = None  # and at the long fill: memory-bound, it moves with the host's
                                                  # memory traffic, which the short one barely sees
    misfit: float | None = None      # the engine calibration's worst timing, |measured / modelled - 1| after the fit
    engine_key: str = ""             # the model file the engine calibration timed (engine_key(path)), '' for none
    engine_build: str = ""           # the build of localrun's kernels it timed (localrun.engine_build), '' for none
    host_kv_decode_flops: dict[str, list[float]] | None = None  # KV type -> [flop/s of one decode row's attention
                                                # over such a cache, of a batch's, the batch's rows] (engine
                                                # calibration, the quantized types it times)

    def _cause(self) -> tuple[str, str]:
        """(why the calibration is suspect, what measured it) for a suspect calibration."""
        if self.drift is not None and self.drift > DRIFT_LIMIT:
            return (f"the machine's speed moved by {self.drift:.0%} while measuring",
                    "the same decode step, timed first and last; on a virtual machine, other tenants of its host")
        if self.misfit is not None and self.misfit > MISFIT_LIMIT:
            return (f"one of its timings is {self.misfit:.0%} off what the others say",
                    "the speed model fitted to all of them; on a virtual machine, other tenants of its host slow "
                    "some timings")
        return "taken under load", self.load_note

    @property
    def suspect_cause(self) -> str:
        """Why the calibration is suspect, in a few words ('' when it is not)."""
        return self._cause()[0] if self.suspect else ""

    @property
    def suspect_reason(self) -> str:
        """suspect_cause with what was measured ('' when it is not suspect)."""
        if not self.suspect:
            return ""
        cause, measured = self._cause()
        return f"{cause} ({measured})"

    @property
    def load_note(self) -> str:
        others = "" if self.other_cpu is None else f"other processes used {self.other_cpu:.2f} cores while measuring; "
        return (f"{others}1-minute load {self.load_before:.1f} before and {self.load_after:.1f} after measuring, "
                f"on {os.cpu_count()} CPUs")


def default_cache_dir() -> Path:
    return localrun_home() / "layerplan"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> str:
    """A short digest of the CPU's feature flags (AVX2, AVX-512, AMX...): kernels dispatch on them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                return hashlib.sha256(flags.encode()).hexdigest()[:12]
    except OSError:
        pass
    return platform.machine()


def _gpu_driver() -> str:
    """The NVIDIA driver version through NVML, '' without one."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no pynvml, no driver, no GPU: nothing to key on
        return ""


def _localrun_version() -> str:
    try:
        return importlib.metadata.version("localrun")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def fingerprint(machine: Machine) -> str:
    """What must stay the same for old measurements to still describe this machine: the CPU model
    and its flags, cores and RAM, the GPUs and their driver, the localrun version measured with, and
    the speed model's revision."""
    gpus = ",".join(f"{g.index}:{g.name}" for g in machine.gpus if g.index is not None)
    driver = _gpu_driver() if gpus else ""
    return (f"{_cpu_model()}|flags {_cpu_flags()}|{os.cpu_count()}|{round(machine.host.total_bytes / 2**30)}GiB|"
            f"{gpus}|driver {driver}|localrun {_localrun_version()}|speed model {SPEED_MODEL_REVISION}")


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def is_suspect(load_before: float, load_after: float, threads: int, other_cpu: float | None = None) -> bool:
    """Other work ran while measuring: other processes kept more than quiet.QUIET_CORES cores busy
    on average (when that was measured), else more than QUIET_LOAD tasks before we began, or more
    than our own `threads` (plus QUIET_LOAD) by the end."""
    if other_cpu is not None:
        return other_cpu > quiet.QUIET_CORES
    return load_before > QUIET_LOAD or load_after > threads + QUIET_LOAD


def _median_seconds(fn, repeats: int) -> float:
    """Median wall time of fn: the machine may be shared, and a run meets the typical load."""
    fn()  # warm up: page in, spin up threads, build kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def fit_matvec(small: tuple[int, float, float], large: tuple[int, float, float]) -> tuple[float, float]:
    """(bytes/s, fixed seconds per call) of t = calls * fixed + bytes / bandwidth through two
    (calls, bytes, seconds) timings of decode-like passes over many weight matrices."""
    (c1, b1, t1), (c2, b2, t2) = small, large
    det = c1 * b2 - c2 * b1
    if det == 0:
        return b2 / t2, 0.0
    fixed = (t1 * b2 - t2 * b1) / det            # Cramer's rule on [c b] [fixed, 1/bw] = t
    inv_bw = (c1 * t2 - c2 * t1) / det
    if fixed < 0 or inv_bw <= 0:                 # noise: fall back to pure bandwidth
        return b2 / t2, 0.0
    return 1.0 / inv_bw, fixed


# Decode-like passes: a row of distinct matrices shaped like a transformer's (n x 4n, then 4n x n),
# together far bigger than the caches, each multiplied by one vector in turn, as a decode step
# streams its weights. A lone repeated matrix stays in cache and overstates the bandwidth (2-3x
# on a 2-core AVX2 host), and a square matrix streams faster than the skinny ones models have.
PASS_BYTES = 256 << 20
SMALL_PASS_WIDTH, LARGE_PASS_WIDTH = 576, 2048
MATMUL_TOKENS, MATMUL_SIDE = 512, 2048
OPS_PER_LAYER = 40  # small tensor ops an eager PyTorch llama layer runs besides matmuls and attention


def _pass_shapes(width: int, element_bytes: int) -> list[tuple[int, int]]:
    count = max(2, PASS_BYTES // (4 * width * width * element_bytes))
    return [(4 * width, width) if i % 2 == 0 else (width, 4 * width) for i in range(count)]


def _measure_host_numpy(repeats: int) -> dict:
    import numpy as np

    def pass_seconds(width: int) -> tuple[int, int, float]:
        ws = [np.ones(shape, np.float32) for shape in _pass_shapes(width, 4)]
        xs = [np.ones(w.shape[1], np.float32) for w in ws]
        seconds = _median_seconds(lambda: [w @ x for w, x in zip(ws, xs)], repeats)
        return len(ws), sum(w.nbytes for w in ws), seconds

    bandwidth, overhead = fit_matvec(pass_seconds(SMALL_PASS_WIDTH), pass_seconds(LARGE_PASS_WIDTH))
    x, w = np.ones((MATMUL_TOKENS, MATMUL_SIDE), np.float32), np.ones((MATMUL_SIDE, MATMUL_SIDE), np.float32)
    flops = 2 * MATMUL_TOKENS * MATMUL_SIDE**2 / _median_seconds(lambda: x @ w, max(3, repeats // 2))
    return dict(host_bandwidth=bandwidth, host_flops=flops, host_matmul_overhead_s=overhead,
                dtype="f32", backend="numpy", threads=os.cpu_count() or 1)


def _measure_host_torch(dtype: str, threads: int | None, repeats: int) -> dict:
    import torch
    import torch.nn.functional as F

    if threads:
        torch.set_num_threads(threads)
    torch_dtype = getattr(torch, {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}.get(dtype, dtype))
    size = torch.empty((), dtype=torch_dtype).element_size()

    def pass_seconds(width: int) -> tuple[int, int, float]:
        ws = [torch.ones(shape, dtype=torch_dtype) for shape in _pass_shapes(width, size)]
        xs = [torch.ones(1, w.shape[1], dtype=torch_dtype) for w in ws]
        seconds = _median_seconds(lambda: [F.linear(x, w) for w, x in zip(ws, xs)], repeats)
        return len(ws), sum(w.numel() for w in ws) * size, seconds

    with torch.inference_mode():
        bandwidth, overhead = fit_matvec(pass_seconds(SMALL_PASS_WIDTH), pass_seconds(LARGE_PASS_WIDTH))
        x = torch.ones(MATMUL_TOKENS, MATMUL_SIDE, dtype=torch_dtype)
        w = torch.ones(MATMUL_SIDE, MATMUL_SIDE, dtype=torch_dtype)
        flops = 2 * MATMUL_TOKENS * MATMUL_SIDE**2 / _median_seconds(lambda: F.linear(x, w), max(3, repeats // 2))
        a, b = torch.ones(64, dtype=torch_dtype), torch.ones(64, dtype=torch_dtype)

        def small_ops():
            for _ in range(200):
                torch.add(a, b)
        op_s = _median_seconds(small_ops, repeats) / 200
        attention_s = _median_seconds(_decode_attention(torch_dtype), repeats)
    return dict(host_bandwidth=bandwidth, host_flops=flops, host_matmul_overhead_s=overhead,
                host_layer_overhead_s=OPS_PER_LAYER * op_s + attention_s, host_attention_call_s=attention_s,
                dtype=str(torch_dtype).removeprefix("torch."), backend="torch", threads=torch.get_num_threads())


def _decode_attention(torch_dtype):
    """One decode step's attention call (1 query, GQA, a short cache) as the engine runs it: its
    fixed cost (thread-pool wake-up, kernel dispatch) is what a layer pays beyond bytes and flops."""
    import torch
    import torch.nn.functional as F

    n_head, n_kv_head, head_dim, n_cached = 8, 2, 64, 256
    q = torch.randn(1, n_head, 1, head_dim, dtype=torch_dtype)
    k = torch.randn(1, n_kv_head, n_cached, head_dim, dtype=torch_dtype)
    try:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    except TypeError:  # torch before enable_gqa: expand the KV heads
        k = k.repeat_interleave(n_head // n_kv_head, dim=1)
        return lambda: F.scaled_dot_product_attention(q, k, k)


def measure_host(dtype: str = "f32", threads: int | None = None, repeats: int = 7) -> dict:
    """Host figures in the compute dtype: through torch (the engine's kernels) when it is
    importable, else numpy's BLAS in f32."""
    if importlib.util.find_spec("torch") is not None:
        return _measure_host_torch(dtype, threads, repeats)
    return _measure_host_numpy(repeats)


def measure_gpus(repeats: int = 5) -> tuple[GPUCalibration, ...]:
    """Bandwidth, f16 compute and PCIe of each CUDA GPU; () without a CUDA build of torch."""
    from layerplan.probe import installed_torch_is_cuda_build

    if not installed_torch_is_cuda_build():
        return ()
    import torch

    if not torch.cuda.is_available():
        return ()
    results = []
    for index in range(torch.cuda.device_count()):
        dev = torch.device("cuda", index)

        def timed(fn) -> float:
            def run():
                fn()
                torch.cuda.synchronize(dev)
            return _median_seconds(run, repeats)

        src = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        dst = torch.empty_like(src)
        bandwidth = 2 * src.numel() / timed(lambda: dst.copy_(src))  # read + write
        a = torch.randn(4096, 4096, dtype=torch.float16, device=dev)
        flops = 2 * 4096**3 / timed(lambda: a @ a)
        host = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        link = host.numel() / timed(lambda: src.copy_(host, non_blocking=True))
        results.append(GPUCalibration(index, torch.cuda.get_device_name(index), bandwidth, flops, link))
        del src, dst, a, host
    return tuple(results)


def measure(machine: Machine, dtype: str = "f32", threads: int | None = None) -> Calibration:
    """Measure this machine: the host in `dtype`, and its CUDA GPUs when a CUDA torch is installed;
    the load average before and after decides whether the result is `suspect`."""
    quiet.wait_until_quiet(QUIET_WAIT_S)
    before, others = load_average(), quiet.OtherCPU()
    host = measure_host(dtype, threads)
    gpus = measure_gpus()
    after, other_cpu = load_average(), others.cores()
    return Calibration(fingerprint=fingerprint(machine), **host, gpus=gpus,
                       measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"), load_before=before, load_after=after,
                       other_cpu=other_cpu, suspect=is_suspect(before, after, host.get("threads") or 1, other_cpu))


def engine_key(model_path) -> str:
    """Which model file an engine calibration belongs to: its name and size (the same file, the
    same shapes and kernels; a re-quantized one differs in size)."""
    path = Path(model_path)
    return f"{path.name}|{path.stat().st_size}"


def _engine_path(key: str, cache_dir: Path | None) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / ENGINE_FILE.format(key=digest)


def save(calibration: Calibration, cache_dir: Path | None = None) -> Path | None:
    """Write the calibration for later plans (as this machine's latest and, when it timed a model's
    engine, as that model's); None (nothing written) when it is suspect."""
    if calibration.suspect:
        return None
    path = (cache_dir or default_cache_dir()) / CALIBRATION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(calibration), indent=2) + "\n"
    path.write_text(text)
    if calibration.engine_key:
        _engine_path(calibration.engine_key, cache_dir).write_text(text)
    return path


def load(machine: Machine, cache_dir: Path | None = None, model=None, engine_build: str | None = None) -> Calibration | None:
    """The cached calibration of this machine, or None (none cached, unreadable, or another machine's).
    With `model` (a GGUF path), the calibration of that model's engine where one was saved, else
    the machine's latest (another model's engine figures: the host's, seen through other shapes).
    With `engine_build` (the running localrun's, which layerplan cannot compute without it), an
    engine calibration taken with another build of the kernels is passed over: its figures
    describe the old library."""
    if model is not None:
        try:
            own = _read(_engine_path(engine_key(model), cache_dir), machine, engine_build)
        except OSError:         # no such file to key on
            own = None
        if own is not None:
            return own
    return _read((cache_dir or default_cache_dir()) / CALIBRATION_FILE, machine, engine_build)


def _read(path: Path, machine: Machine, engine_build: str | None = None) -> Calibration | None:
    try:
        raw = json.loads(path.read_text())
        calibration = Calibration(**{**raw, "gpus": tuple(GPUCalibration(**g) for g in raw.get("gpus", ()))})
    except (OSError, ValueError, TypeError):
        return None
    if calibration.suspect or calibration.fingerprint != fingerprint(machine):
        return None
    if engine_build is not None and calibration.engine_key and calibration.engine_build != engine_build:
        return None
    return calibration


def _calibrated_gpu(gpu: Device, measured: dict[int, GPUCalibration]) -> Device:
    m = measured.get(gpu.index) if gpu.index is not None else None
    if m is None:
        return gpu
    return replace(gpu, memory_bandwidth=m.memory_bandwidth, compute_flops=m.compute_flops,
                   link_bandwidth=m.link_bandwidth, source="measured")


def apply(machine: Machine, calibration: Calibration) -> Machine:
    """This machine with measured figures in place of defaults, for its own (probed) devices."""
    measured = {g.index: g for g in calibration.gpus}
    host = replace(machine.host, memory_bandwidth=calibration.host_bandwidth, compute_flops=calibration.host_flops,
                   matmul_overhead_s=calibration.host_matmul_overhead_s,
                   layer_overhead_s=(machine.host.layer_overhead_s if calibration.host_layer_overhead_s is None
                                     else calibration.host_layer_overhead_s),
                   step_overhead_s=calibration.host_step_overhead_s or 0.0,
                   kv_bandwidth=calibration.host_kv_bandwidth or 0.0,
                   kv_cached_bytes=calibration.host_kv_cached_bytes or 0.0,
                   kv_batch_bandwidth=calibration.host_kv_batch_bandwidth or 0.0,
                   kv_batch_rows=calibration.host_kv_batch_rows or 0,
                   decode_flops=calibration.host_decode_flops or 0.0,
                   unpack_bandwidth=calibration.host_unpack_bandwidth or 0.0,
                   attention_flops=calibration.host_attention_flops or 0.0,
                   causal_attention_flops=calibration.host_causal_attention_flops or 0.0,
                   kv_decode_flops=tuple((name, one, batch, int(rows)) for name, (one, batch, rows)
                                         in sorted((calibration.host_kv_decode_flops or {}).items())),
                   source=(f"measured {calibration.dtype}"
                           + (" with localrun's engine" if calibration.engine_model else "")
                           + (f" on {calibration.engine_key.split('|')[0]}"
                              if calibration.engine_model and calibration.engine_key else "")
                           + (f", suspect: {calibration.suspect_cause}" if calibration.suspect else "")))
    return Machine(gpus=tuple(_calibrated_gpu(g, measured) for g in machine.gpus), host=host)
