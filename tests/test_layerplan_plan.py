"""The planner: the seed case, hand-computed placement and speed, pins, refusals, emitters."""
import json
from dataclasses import replace

import pytest

import layerplan
from layerplan import Machine, PlanError, plan, plan_to_dict, profile_builtin
from layerplan.buffers import BufferModel
from layerplan.devices import Device
from layerplan.gpu_presets import GENERIC, gpu_preset
from layerplan.model_profile import LayerProfile, ModelProfile
from layerplan.placement import place
from layerplan.planner import max_context
from layerplan.probe import host_device
from layerplan.settings import PlanSettings
from layerplan.units import GiB, KiB, MiB


def machine(*vram_gib: float, ram_gib: float = 64, cores: int = 8) -> Machine:
    gpus = tuple(replace(GENERIC.device(int(v * GiB)), name=f"GPU {i}") for i, v in enumerate(vram_gib))
    return Machine(gpus=gpus, host=host_device(int(ram_gib * GiB), int(ram_gib * GiB), cores))


SEED = dict(n_ctx=16384, n_parallel=2)


@pytest.fixture(scope="module")
def seed_plan():
    return plan(profile_builtin("llama2-7b:f16"), machine(24), **SEED)


def test_seed_case_fits_with_fewer_layers_so_the_kv_cache_has_room(seed_plan):
    p = seed_plan
    assert p.fits and 0 < p.n_gpu_layers < 32
    gpu = p.usage[0]
    # the KV cache of the offloaded layers lives beside them: 16384 x 2 tokens x 16 KiB per layer
    assert gpu.kv_bytes == p.n_gpu_layers * 32768 * 16 * KiB
    assert gpu.total_bytes <= gpu.budget_bytes
    assert any("KV cache" in reason for reason in p.reasons)
    # weights alone would allow all 32 layers: the plan is not "as many as fit"
    weights_only = place(p.profile, p.machine, replace(p.settings, kv_offload=False), 32)
    assert weights_only.usage[0].fits
    assert p.predicted.decode_tok_s > 0 and p.predicted.ttft_s > 0


def test_seed_case_layer_count_by_hand(seed_plan):
    """Budget 24 GiB - 512 MiB margin; per layer 404.8 MB of f16 weights (+32 KiB norms) and 512 MiB
    of KV; buffers: CUDA context, f32 activations of a 512-token ubatch, the f16 KQ mask."""
    p = seed_plan
    layer = 2 * (4 * 4096 * 4096 + 3 * 4096 * 11008) + 2 * 4096 * 4
    kv = 32768 * 16 * KiB
    # widest part of a layer: attention q + out (2 x 4096) + k, v (8192) = 16384, or the FFN 3 x 11008
    buffers = 384 * MiB + 512 * 4 * (2 * 4096 + max(2 * 4096 + 8192, 3 * 11008)) + 32768 * 512 * 2
    assert p.usage[0].buffer_bytes == buffers
    budget = 24 * GiB - 512 * MiB
    expected = (budget - buffers) // (layer + kv)
    assert p.n_gpu_layers == expected == 26


def test_seed_case_reports_weights_only_alternative_as_slower(seed_plan):
    text = " ".join(seed_plan.reasons)
    assert "--no-kv-offload" in text and "wins" in text


def test_more_gpu_layers_predict_faster_decode(seed_plan):
    fitting = [row for row in seed_plan.sweep if row.fits]
    speeds = [row.decode_tok_s for row in fitting]
    assert speeds == sorted(speeds)
    assert seed_plan.n_gpu_layers == fitting[-1].n_gpu_layers


def test_pinned_layers_that_do_not_fit_are_refused_with_what_to_change():
    p = plan(profile_builtin("llama2-7b:f16"), machine(24), n_gpu_layers=33, **SEED)
    assert p.n_gpu_layers == 33 and not p.fits
    refusals = [r for r in p.reasons if "does not fit" in r]
    assert len(refusals) == 1
    reason = refusals[0]
    assert reason.startswith("--gpu-layers 33 does not fit") and "lower --gpu-layers to 26" in reason
    assert "--kv-type q8_0" in reason and "--ctx" in reason


def test_pinned_layers_that_fit_are_kept_and_compared_with_auto():
    p = plan(profile_builtin("llama2-7b:f16"), machine(24), n_gpu_layers=10, **SEED)
    assert p.fits and p.n_gpu_layers == 10 and not p.auto
    assert any(r.startswith("--gpu-layers 10 fits") and "auto would choose 26" in r for r in p.reasons)


def test_gpu_layers_above_the_count_mean_all():
    p = plan(profile_builtin("llama3.1-8b:q4_k_m"), machine(24), n_ctx=8192, n_gpu_layers=99)
    assert p.n_gpu_layers == 33 and p.fits and p.usage[0].holds_head
    assert "means all" in p.reasons[0]


def test_pinned_gpu_layers_without_a_gpu_is_an_error():
    with pytest.raises(PlanError, match="needs a GPU"):
        plan(profile_builtin("llama2-7b:q4_0"), machine(), n_gpu_layers=5)


def test_unpinned_context_is_lowered_until_it_fits_and_says_so():
    tiny_ram = machine(ram_gib=4.5)
    p = plan(profile_builtin("llama2-7b:q4_0"), tiny_ram)
    assert p.fits and p.settings.n_ctx < 4096
    assert any("lowered from 4096" in reason for reason in p.reasons)
    pinned = plan(profile_builtin("llama2-7b:q4_0"), tiny_ram, n_ctx=4096)
    assert not pinned.fits and pinned.settings.n_ctx == 4096
    assert "lower --ctx to" in pinned.reasons[-1]


def test_nothing_fits_names_the_device_and_the_fix():
    p = plan(profile_builtin("llama3.1-70b:q4_k_m"), machine(8, ram_gib=16), n_ctx=8192)
    assert not p.fits
    assert p.reasons[-1].startswith("Nothing fits") and "CPU" in p.reasons[-1]


def test_no_gpu_plan_keeps_everything_on_the_host():
    p = plan(profile_builtin("qwen2.5-7b:q4_k_m"), machine(), n_ctx=8192)
    assert p.n_gpu_layers == 0 and len(p.usage) == 1 and p.fits
    host = p.usage[0]
    assert host.kv_bytes == 8192 * p.kv_bytes_per_token
    assert host.weights_bytes == p.profile.weight_bytes
    assert "no GPU" in p.reasons[0]


def test_kv_offload_off_keeps_all_kv_in_host_memory():
    p = plan(profile_builtin("llama2-7b:f16"), machine(24), kv_offload=False, **SEED)
    assert p.usage[0].kv_bytes == 0 and p.usage[-1].kv_bytes == 16 * GiB
    assert p.n_gpu_layers == 33
    assert "-nkvo" in layerplan.llama_cpp_flags(p)


def test_two_gpus_split_contiguously_with_the_head_on_the_last():
    p = plan(profile_builtin("llama3.1-70b:q4_k_m"), machine(24, 24), n_ctx=8192)
    assert p.fits and p.n_gpu_layers == 81
    first, second = p.usage[0], p.usage[1]
    assert second.holds_head and not first.holds_head
    assert first.n_layers + second.n_layers == 80
    devices = p.placement.layer_devices
    assert list(devices) == sorted(devices)  # contiguous runs: GPU 0's layers come first
    flags = layerplan.llama_cpp_flags(p)
    assert flags[flags.index("-ts") + 1] == f"{first.n_layers},{second.n_layers + 1}"


def test_max_context_is_the_edge_of_fitting():
    profile, m = profile_builtin("llama3.1-8b:q4_k_m"), machine(16)
    settings = PlanSettings(n_ctx=8192)
    largest = max_context(profile, m, settings, 33, limit=10**6)
    assert place(profile, m, replace(settings, n_ctx=largest), 33).fits
    assert not place(profile, m, replace(settings, n_ctx=largest + 1), 33).fits


def test_plan_respects_every_budget_with_quantized_kv():
    p = plan(profile_builtin("qwen2.5-32b:q4_k_m"), machine(24), n_ctx=32768, kv_type="q8_0")
    assert p.fits and all(u.total_bytes <= u.budget_bytes for u in p.usage)
    assert p.kv_bytes_per_token == round(64 * 8 * 128 * 2 * 34 / 32)


def _toy_profile(n_layers=4, weight_bytes=100 * MiB) -> ModelProfile:
    layers = tuple(LayerProfile(index=i, weight_bytes=weight_bytes, params=weight_bytes // 2, n_head=8,
                                n_kv_head=8, head_dim_k=64, head_dim_v=64, n_matmuls=7) for i in range(n_layers))
    return ModelProfile(name="toy", architecture="llama", quantization="F16", n_layers=n_layers, d_model=512,
                        n_ff=2048, n_vocab=1000, n_ctx_train=2048, layers=layers, embedding_bytes=MiB,
                        output_bytes=MiB, head_bytes=MiB, head_params=512 * 1000, tied_embeddings=False)


def test_decode_speed_by_hand_on_one_cpu():
    """One CPU, 4 layers of 100 MiB: decode time = sum over layers of max(bytes / bandwidth, flops /
    compute) + overheads, plus the output head."""
    profile = _toy_profile()
    cpu = Device("CPU", "cpu", 64 * GiB, 64 * GiB, memory_bandwidth=10e9, compute_flops=1e12,
                 layer_overhead_s=50e-6, matmul_overhead_s=5e-6)
    m = Machine(gpus=(), host=cpu)
    p = plan(profile, m, n_ctx=1024, n_gpu_layers=0, prompt_tokens=1, with_sweep=False)
    kv_per_token = 8 * 128 * 2  # per layer, f16
    seen = 512                   # decode is predicted at half the context
    kv_read = kv_per_token * (seen + 1)
    attention_flops = 2 * 1 * seen * 8 * 128
    layer_s = (100 * MiB / 10e9) + 7 * 5e-6 + 50e-6 + max(kv_read / 10e9, attention_flops / 1e12)
    head_s = max(MiB / 10e9, 2 * 512 * 1000 / 1e12) + 5e-6
    assert p.predicted.decode_tok_s == pytest.approx(1 / (4 * layer_s + head_s), rel=1e-9)


def test_buffers_grow_with_context_batch_and_vocabulary():
    profile = profile_builtin("llama3.1-8b:q4_k_m")
    small = BufferModel.of(profile, PlanSettings(n_ctx=4096, n_ubatch=512))
    assert small.head_bytes == 512 * 128256 * 4
    assert BufferModel.of(profile, PlanSettings(n_ctx=32768)).attention_scratch_bytes > small.attention_scratch_bytes
    assert BufferModel.of(profile, PlanSettings(n_ctx=4096, n_ubatch=1024)).activation_bytes == 2 * small.activation_bytes


def test_json_has_the_documented_fields(seed_plan):
    data = json.loads(json.dumps(plan_to_dict(seed_plan)))
    for key in ("n_layers", "n_gpu_layers", "fits", "reasons", "kv_bytes_per_token", "devices", "predicted"):
        assert key in data
    assert data["n_layers"] == 32 and data["kv_bytes_per_token"] == 512 * KiB
    for device in data["devices"]:
        assert device["kind"] in ("gpu", "cpu")
        assert device["total_bytes"] == device["weights_bytes"] + device["kv_bytes"] + device["buffer_bytes"]
        assert {"name", "free_bytes"} <= set(device)
    assert set(data["predicted"]) >= {"decode_tok_s", "prefill_tok_s", "ttft_s"}


def test_emitted_commands(seed_plan):
    server = layerplan.llama_server_command(seed_plan)
    assert server.startswith("llama-server -m llama2-7b-f16.gguf -ngl 26 -c 32768 -np 2")
    vllm = layerplan.vllm_command(seed_plan, hf_repo="meta-llama/Llama-2-7b-chat-hf")
    assert "vllm serve meta-llama/Llama-2-7b-chat-hf --max-model-len 16384 --max-num-seqs 2" in vllm
    assert "--cpu-offload-gb" in vllm
    q8 = plan(profile_builtin("llama2-7b:f16"), machine(24), kv_type="q8_0", **SEED)
    assert "-ctk q8_0 -ctv q8_0" in layerplan.llama_server_command(q8)
    assert "fp8" in layerplan.vllm_command(q8)


def test_gpu_presets_build_devices():
    rtx = gpu_preset("RTX4090").device()
    assert rtx.total_bytes == 24 * GiB and rtx.kind == "gpu"
    assert rtx.memory_bandwidth == pytest.approx(1008e9 * 0.75)
    with pytest.raises(ValueError, match="unknown GPU"):
        gpu_preset("voodoo2")
