"""Executing a plan: layerplan's placement becomes a DeviceMap, `auto` is all-CPU without a GPU,
and a map with two device groups (both the CPU here) moves the activations once per boundary
and computes exactly what the one-group model computes."""
from __future__ import annotations

import pytest
import torch

import layerplan
from localrun.api import LLM
from localrun.errors import UserError
from localrun.model.llama import Transformer
from localrun.placement import HOST, DeviceMap, all_on, device_map_from_plan, parse_layer_count, plan_device_map

IDS = [5, 77, 300, 12, 12, 199, 3, 250, 41, 8, 160, 90, 17, 311, 64, 2]


def split_map(n_layers: int, first_group_layers: int, devices: tuple[str, str] = (HOST, HOST)) -> DeviceMap:
    """The first `first_group_layers` layers in group 0 on devices[0], the rest and the head in
    group 1 on devices[1] (the embedding stays on the host): a two-group map."""
    k = first_group_layers
    return DeviceMap((devices[0],) * k + (devices[1],) * (n_layers - k), (0,) * k + (1,) * (n_layers - k),
                     devices[1], 1, summary=f"plan: layers 0-{k - 1} on {devices[0]}, "
                     f"layers {k}-{n_layers - 1} and the output head on {devices[1]}")



def test_parse_layer_count():
    assert parse_layer_count("auto") is None and parse_layer_count(None) is None
    assert parse_layer_count("12") == 12
    for bad in ("lots", "-1"):
        with pytest.raises(UserError, match="^n_gpu_layers takes 'auto' or a number"):
            parse_layer_count(bad)
    with pytest.raises(UserError, match="^n_cpu_moe takes 'auto' or a number"):
        parse_layer_count("some", "n_cpu_moe")


def test_auto_without_gpu_is_all_cpu(tiny_gguf):
    cpu_only = layerplan.build_machine(ram="16GiB")
    dm = plan_device_map(tiny_gguf("Q4_0"), "auto", n_ctx=256, machine=cpu_only)
    assert set(dm.layer_devices) == {"cpu"} and dm.head_device == "cpu" and dm.boundaries() == 0
    with pytest.raises(UserError, match="needs a GPU"):
        plan_device_map(tiny_gguf("Q4_0"), 2, n_ctx=256, machine=cpu_only)


def test_plan_with_a_gpu_offloads_the_last_layers(tiny_gguf):
    """llama.cpp's -ngl: the last N layers on the GPU; n_layers + 1 adds the output head."""
    path = tiny_gguf("Q4_0", n_layers=4)
    machine = layerplan.build_machine(vram=["24GiB"], ram="16GiB")
    profile = layerplan.profile_gguf(path)
    dm = device_map_from_plan(layerplan.plan(profile, machine, n_ctx=256, n_gpu_layers=2, with_sweep=False))
    assert dm.layer_devices == ("cpu", "cpu", "cuda:0", "cuda:0") and dm.head_device == "cpu"
    assert dm.boundaries() == 2 and dm.n_gpu_layers == 2            # host -> GPU -> host (the head)
    dm = device_map_from_plan(layerplan.plan(profile, machine, n_ctx=256, n_gpu_layers=5, with_sweep=False))
    assert set(dm.layer_devices) == {"cuda:0"} and dm.head_device == "cuda:0" and dm.boundaries() == 1
    assert dm.summary.startswith("plan: 4/4 layers on GPU")


@pytest.mark.parametrize("tensor_type", ["F32", "Q4_1"])
def test_two_cpu_groups_cross_once_and_match_one_group(tiny_gguf, monkeypatch, tensor_type):
    path = tiny_gguf(tensor_type, n_layers=4)
    one = LLM(path, n_threads=1)
    two = LLM(path, n_threads=1)
    n = one.config.n_layers
    weights_kind = type(one.model.layers[0].attention.wqkv)
    # rebuild the second model with layers 0-1 in group 0 and 2-3 plus the head in group 1
    from localrun.executor import build_model
    two.model = build_model(two.file, n_ctx=two.n_ctx, dtype=two.dtype, quantized=two.quantized,
                            device_map=split_map(n, 2))
    assert type(two.model.layers[0].attention.wqkv) is weights_kind
    assert [layer.group for layer in two.model.layers] == [0, 0, 1, 1]
    crossings = []
    original = Transformer.cross

    def counting_cross(x, freqs, device):
        crossings.append(device)
        return original(x, freqs, device)

    monkeypatch.setattr(Transformer, "cross", staticmethod(counting_cross))
    expected = one.logits(IDS)
    assert crossings == []                                   # one group: nothing moves
    got = two.logits(IDS)
    assert len(crossings) == split_map(n, 2).boundaries() == 2   # embedding -> group 0 -> group 1
    assert torch.equal(got, expected)
    # the paged engine (KV per layer device) generates the same tokens through the boundary
    crossings.clear()
    a = one.generate(IDS, max_tokens=6, temperature=0, ignore_eos=True).token_ids
    b = two.generate(IDS, max_tokens=6, temperature=0, ignore_eos=True).token_ids
    assert a == b and len(crossings) == 2 * 6                 # one prefill + five decode steps, 2 each


def test_llm_reports_the_plan(tiny_gguf):
    llm = LLM(tiny_gguf("F32"), n_threads=1, n_gpu_layers="auto")
    assert llm.plan_summary.startswith("plan: all 2 layers") and "cpu" in llm.plan_summary
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="needs a GPU"):
            LLM(tiny_gguf("F32"), n_threads=1, n_gpu_layers=1)


def test_all_on_has_no_boundaries():
    assert all_on("cpu", 3).boundaries() == 0
    assert split_map(4, 1).boundaries() == 2


def test_cli_gpu_layers(tiny_gguf):
    """-ngl goes through layerplan: the plan's summary is printed; a GPU count without a GPU is
    one sentence and exit code 2."""
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "localrun.cli", "generate", str(tiny_gguf("F32")), "-p", "the",
                               "-n", "2", "-t", "1", *args], capture_output=True, text=True, timeout=120)

    ok = run("-ngl", "auto")
    assert ok.returncode == 0 and "plan: all 2 layers" in ok.stderr, ok.stderr
    if not torch.cuda.is_available():
        bad = run("--gpu-layers", "2")
        assert bad.returncode == 2 and "needs a GPU" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


def test_the_engine_allocates_the_kv_budget_the_plan_prints(tiny_gguf, monkeypatch):
    """What `localrun plan --json` gives a device as `kv_budget_bytes` is what the engine's pool
    takes there. The host's RAM is made tight, so the plan's budget, not parallel x ctx, decides:
    the pool holds the budget's whole blocks (100 of them here), not a share of free memory."""
    from layerplan.report import plan_to_dict
    path = tiny_gguf("F32", n_layers=4)
    profile = layerplan.profile_gguf(path)
    n_ctx, n_parallel = 256, 8

    def machine(ram: int):
        return layerplan.build_machine(ram=str(ram), probe_gpus=False)

    def host_budget(m) -> int:
        plan = layerplan.plan(profile, m, n_ctx=n_ctx, n_parallel=n_parallel, kv_type="f16", with_sweep=False)
        return plan_to_dict(plan)["devices"][-1]["kv_budget_bytes"]
    token_bytes = layerplan.kv_bytes_per_token(profile, "f16")
    target = 100 * 16 * token_bytes + token_bytes // 2        # 100 blocks and half a token's bytes
    roomy = 64 * 2**30
    tight = machine(roomy - (host_budget(machine(roomy)) - target))
    assert host_budget(tight) == target < n_ctx * n_parallel * token_bytes
    monkeypatch.setattr(layerplan, "probe_machine", lambda: tight)
    llm = LLM(path, n_threads=1, n_ctx=n_ctx, n_parallel=n_parallel, kv_type="f16")
    assert llm.model.device_map.kv_budget == (("cpu", target),)
    engine = llm.engine
    assert engine.bytes_per_token == token_bytes
    assert engine.num_blocks == 100
    # roomy: parallel x ctx decides, as the plan's kv_bytes say
    monkeypatch.setattr(layerplan, "probe_machine", lambda: machine(roomy))
    llm = LLM(path, n_threads=1, n_ctx=n_ctx, n_parallel=n_parallel, kv_type="f16")
    assert llm.engine.num_blocks * 16 == n_ctx * n_parallel


def test_a_gpu_plan_sizes_each_devices_pool_from_its_own_budget(tiny_gguf):
    """Layers split between a GPU and the host: each device's pool room is the plan's budget
    there (no free-memory probe of the GPU), and the device with the least room per token
    decides how many tokens the pool holds."""
    from localrun.engine.llm_engine import default_num_tokens
    path = tiny_gguf("Q4_0", n_layers=4)
    profile = layerplan.profile_gguf(path)
    plan = layerplan.plan(profile, layerplan.build_machine(vram=["1GiB"], ram="16GiB"), n_ctx=256,
                          n_gpu_layers=3, with_sweep=False)
    gpu_budget, host_budget = plan.kv_budget_bytes()
    dm = device_map_from_plan(plan)
    assert dm.layer_devices == ("cpu", "cuda:0", "cuda:0", "cuda:0")
    assert dm.kv_budget == (("cuda:0", gpu_budget), ("cpu", host_budget)) and 0 < gpu_budget < host_budget
    assert dm.kv_budget_on("cuda:0") == gpu_budget and all_on("cpu", 4).kv_budget_on("cpu") is None
    per_layer_token = 100
    devices = [torch.device(d) for d in dm.layer_devices]           # no tensor is placed: no GPU needed
    assert default_num_tokens(devices, per_layer_token, dm.kv_budget_on) == min(
        gpu_budget // (3 * per_layer_token), host_budget // per_layer_token)
    # what another pool (the sliding-window layers') takes on a device is not the KV's to use
    assert default_num_tokens(devices, per_layer_token, dm.kv_budget_on,
                              lambda d: gpu_budget // 2 if d == "cuda:0" else 0) == min(
        (gpu_budget - gpu_budget // 2) // (3 * per_layer_token), host_budget // per_layer_token)
