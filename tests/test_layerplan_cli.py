"""`localrun plan` end to end, the device probe with a fake NVML, and calibration bookkeeping."""
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from layerplan import calibrate, probe
from layerplan.devices import Machine
from layerplan.machine_spec import build_machine
from layerplan.units import GiB
from localrun.cli.main import app

ROOT = Path(__file__).resolve().parent.parent
SEED_ARGS = ["plan", "llama2-7b:f16", "--vram", "24GiB", "--ctx", "16384", "--parallel", "2", "--ram", "64GiB"]


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def smollm2():
    from localrun.models import pull
    return pull("smollm2-135m", quiet=True)


def invoke(args):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_seed_case_table_and_json():
    result = invoke(SEED_ARGS)
    assert result.exit_code == 0, result.output
    assert "n_gpu_layers 26 of 33" in result.output and "KV cache" in result.output
    assert "-ngl 26 -c 32768 -np 2" in result.output
    data = json.loads(invoke(SEED_ARGS + ["--json"]).output.strip().splitlines()[-1])
    assert data["n_gpu_layers"] == 26 and data["fits"] and data["n_layers"] == 32
    assert [d["kind"] for d in data["devices"]] == ["gpu", "cpu"]


def test_pin_that_does_not_fit_exits_1_with_the_reason():
    result = invoke(SEED_ARGS + ["-ngl", "33", "--json"])
    assert result.exit_code == 1
    data = json.loads(result.output.strip().splitlines()[-1])
    assert not data["fits"] and any("lower --gpu-layers to 26" in r for r in data["reasons"])


def test_emit_commands():
    server = invoke(SEED_ARGS + ["--emit", "llama-server"]).output
    assert server.strip().startswith("llama-server -m llama2-7b-f16.gguf -ngl 26")
    vllm = invoke(SEED_ARGS + ["--emit", "vllm"]).output
    assert "vllm serve meta-llama/Llama-2-7b-chat-hf" in vllm


def test_presets_and_several_gpus():
    data = json.loads(invoke(["plan", "llama3.1-70b:q4_k_m", "--gpu", "rtx3090", "--gpu", "rtx3090",
                              "--ram", "64GiB", "-c", "8192", "--json"]).output.strip().splitlines()[-1])
    assert data["fits"] and data["n_gpu_layers"] == 81
    assert [d["name"] for d in data["devices"]] == ["RTX 3090", "RTX 3090", "CPU"]
    assert "-ts" in data["llama_cpp_flags"]


@pytest.mark.parametrize("args, message", [
    (["plan", "no-such-model"], "not a .gguf file, a catalog model"),
    (["plan", "llama2-7b:q9"], "unknown quantization"),
    (["plan", "llama2-7b", "-ngl", "many"], "takes 'auto' or a number"),
    (["plan", "llama2-7b", "--vram", "lots"], "not a size"),
    (["plan", "llama2-7b", "--gpu", "voodoo2"], "unknown GPU"),
    (["plan", "llama2-7b", "--kv-type", "q3"], "--kv-type takes f32, bf16, f16, int8, fp8, not 'q3'."),
    (["plan", "llama2-7b", "--kv-type", "q3", "--emit", "llama-server"], "unknown KV type"),
    (["plan", "llama2-7b", "--emit", "ollama"], "--emit takes"),
    (["plan", "llama2-7b", "-ngl", "4", "--ram", "64GiB"], None),  # no GPU here, unless this machine has one
])
def test_user_errors_are_one_sentence(args, message):
    from localrun.errors import UserError
    if message is None:
        if probe.probe_gpus_nvml():
            pytest.skip("this machine has a GPU")
        message = "needs a GPU"
    with pytest.raises(UserError, match=message):
        CliRunner().invoke(app, args, catch_exceptions=False)


@pytest.mark.model
def test_plan_on_the_real_file_is_fast_and_torch_free(smollm2, tmp_path):
    code = ("import sys, time; t = time.perf_counter(); from localrun.cli.main import app; "
            "from typer.testing import CliRunner; "
            f"r = CliRunner().invoke(app, ['plan', {str(smollm2)!r}, '--json']); "
            "print(r.output.strip().splitlines()[-1]); print('torch' in sys.modules, time.perf_counter() - t)")
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"LOCALRUN_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    wall = time.perf_counter() - started
    data = json.loads(out[-2])
    torch_loaded, _ = out[-1].split()
    assert torch_loaded == "False"
    assert data["n_layers"] == 30 and data["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    assert data["devices"][-1]["weights_bytes"] == 96_576_768  # all of it in host memory, as stored
    assert wall < 2.0, f"localrun plan took {wall:.2f} s"


class FakeNVML:
    """An RTX 4090 as NVML reports it: 10501 MHz memory clock, 384-bit bus, PCIe 4.0 x16."""
    NVML_CLOCK_MEM = 2

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 1
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return b"NVIDIA GeForce RTX 4090"
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(total=24 * GiB, free=22 * GiB)
    def nvmlDeviceGetMaxClockInfo(self, h, kind): return 10501
    def nvmlDeviceGetMemoryBusWidth(self, h): return 384
    def nvmlDeviceGetMaxPcieLinkGeneration(self, h): return 4
    def nvmlDeviceGetMaxPcieLinkWidth(self, h): return 16


def test_nvml_probe_reads_memory_bandwidth_and_pcie():
    (gpu,) = probe.probe_gpus_nvml(FakeNVML())
    assert (gpu.name, gpu.total_bytes, gpu.free_bytes, gpu.index, gpu.source) == ("RTX 4090", 24 * GiB, 22 * GiB, 0, "nvml")
    assert gpu.memory_bandwidth == pytest.approx(10501e6 * 2 * 48 * 0.75)  # 1008 GB/s peak
    assert gpu.link_bandwidth == pytest.approx(1.969e9 * 16 * 0.8)
    assert gpu.compute_flops == pytest.approx(165.2e12 * 0.6)  # matched to the rtx4090 preset


def test_nvml_failure_means_no_nvml_gpus():
    class Broken(FakeNVML):
        def nvmlInit(self): raise RuntimeError("driver not loaded")
    assert probe.probe_gpus_nvml(Broken()) is None


def test_cpu_torch_is_recognised_without_importing_it():
    code = "import sys; from layerplan.probe import installed_torch_is_cuda_build as f; f(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT).stdout.strip() == "False"


def test_simulated_machine_from_flags():
    m = build_machine(vram=["20GiB"], gpu=["rtx3090", "rtx3090"], ram="32GiB", probe_gpus=False)
    assert [g.free_bytes for g in m.gpus] == [20 * GiB, 20 * GiB] and m.gpus[0].total_bytes == 24 * GiB
    assert m.host.free_bytes == 32 * GiB
    with pytest.raises(ValueError, match="--vram values"):
        build_machine(vram=["8GiB", "8GiB", "8GiB"], gpu=["rtx3090", "rtx3090"], probe_gpus=False)


def test_matvec_fit_recovers_overhead_and_bandwidth():
    # t = calls * 50 us + bytes / 20 GB/s: 48 small matrices vs 4 large ones, ~256 MB each pass
    small = (48, 254e6, 48 * 50e-6 + 254e6 / 20e9)
    large = (4, 268e6, 4 * 50e-6 + 268e6 / 20e9)
    bandwidth, overhead = calibrate.fit_matvec(small, large)
    assert bandwidth == pytest.approx(20e9) and overhead == pytest.approx(50e-6)


def test_calibration_cache_round_trip_and_fingerprint(tmp_path):
    machine = build_machine(probe_gpus=False)
    cal = calibrate.Calibration(fingerprint=calibrate.fingerprint(machine), host_bandwidth=12e9, host_flops=3e11,
                                host_matmul_overhead_s=4e-6, host_layer_overhead_s=1e-4, dtype="float32", backend="torch")
    calibrate.save(cal, tmp_path)
    assert calibrate.load(machine, tmp_path) == cal
    applied = calibrate.apply(machine, cal)
    assert (applied.host.memory_bandwidth, applied.host.compute_flops, applied.host.layer_overhead_s) == (12e9, 3e11, 1e-4)
    other = Machine(gpus=(), host=machine.host.with_free(machine.host.total_bytes * 4))
    assert calibrate.load(other, tmp_path) is None  # another machine's figures are ignored
