"""MoE models in layerplan: expert tensors profiled from a GGUF header, built-in MoE shapes
against their published sizes, experts-in-RAM placements, speed from active bytes, and the
llama.cpp flags (--n-cpu-moe, -ot) the plan emits. Figures are hand-computed in the comments."""
import json
from dataclasses import replace

import gguf
import numpy as np
import pytest
from typer.testing import CliRunner

import layerplan
from layerplan import Machine, plan, profile_builtin, profile_gguf
from layerplan.devices import Device
from layerplan.emit import llama_cpp_flags, override_tensor_pattern
from layerplan.model_profile import LayerProfile, ModelProfile
from layerplan.placement import place
from layerplan.settings import PlanSettings
from layerplan.speed import predict
from layerplan.units import GiB, MiB
from localrun.cli.main import app

D, N_HEAD, N_KV, HEAD_DIM, N_FF_EXP, N_EXPERT, N_USED, N_LAYERS = 64, 4, 2, 16, 32, 4, 2, 2


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """A two-layer qwen3moe-style file: f32 attention and router, f16 experts (4, 2 used), one
    f16 shared expert of width 32 per layer."""
    path = tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("tiny-moe")
    w.add_block_count(N_LAYERS)
    w.add_context_length(1024)
    w.add_embedding_length(D)
    w.add_feed_forward_length(N_FF_EXP)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_expert_count(N_EXPERT)
    w.add_expert_used_count(N_USED)
    w.add_uint32("qwen3moe.expert_shared_count", 1)
    w.add_vocab_size(100)
    f32, f16 = np.float32, np.float16
    w.add_tensor("token_embd.weight", np.zeros((100, D), f32))
    w.add_tensor("output_norm.weight", np.zeros(D, f32))
    w.add_tensor("output.weight", np.zeros((100, D), f32))
    for il in range(N_LAYERS):
        b = f"blk.{il}."
        w.add_tensor(b + "attn_norm.weight", np.zeros(D, f32))
        w.add_tensor(b + "attn_q.weight", np.zeros((N_HEAD * HEAD_DIM, D), f32))
        w.add_tensor(b + "attn_k.weight", np.zeros((N_KV * HEAD_DIM, D), f32))
        w.add_tensor(b + "attn_v.weight", np.zeros((N_KV * HEAD_DIM, D), f32))
        w.add_tensor(b + "attn_output.weight", np.zeros((D, N_HEAD * HEAD_DIM), f32))
        w.add_tensor(b + "ffn_norm.weight", np.zeros(D, f32))
        w.add_tensor(b + "ffn_gate_inp.weight", np.zeros((N_EXPERT, D), f32))
        w.add_tensor(b + "ffn_gate_exps.weight", np.zeros((N_EXPERT, N_FF_EXP, D), f16))
        w.add_tensor(b + "ffn_up_exps.weight", np.zeros((N_EXPERT, N_FF_EXP, D), f16))
        w.add_tensor(b + "ffn_down_exps.weight", np.zeros((N_EXPERT, D, N_FF_EXP), f16))
        w.add_tensor(b + "ffn_gate_shexp.weight", np.zeros((N_FF_EXP, D), f16))
        w.add_tensor(b + "ffn_up_shexp.weight", np.zeros((N_FF_EXP, D), f16))
        w.add_tensor(b + "ffn_down_shexp.weight", np.zeros((D, N_FF_EXP), f16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_moe_header_profile(moe_gguf):
    p = profile_gguf(moe_gguf)
    assert (p.n_expert, p.n_expert_used, p.n_expert_shared, p.is_moe) == (4, 2, 1, True)
    layer = p.layers[0]
    # experts: 3 tensors x 4 experts x 32 x 64 values x 2 bytes (f16); the shared expert is dense
    assert layer.expert_bytes == 3 * 4 * 32 * 64 * 2 == 49_152
    assert layer.expert_params == 3 * 4 * 32 * 64
    attention = (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64) * 4
    shared, router, norms = 3 * 32 * 64 * 2, 4 * 64 * 4, 2 * 64 * 4
    assert layer.weight_bytes == attention + layer.expert_bytes + shared + router + norms
    assert (layer.n_matmuls, layer.n_expert_matmuls) == (4 + 1 + 3 + 3, 3)
    assert p.expert_bytes == 2 * 49_152 and p.active_expert_bytes == 49_152  # 2 of 4 experts
    assert p.weight_bytes == sum(t.n_bytes for t in gguf.GGUFReader(moe_gguf).tensors)


@pytest.mark.parametrize("name, params_b, file_gb", [
    ("qwen3-30b-a3b:q4_k_m", 30.5, 18.6),   # Qwen's own GGUF release
    ("qwen3-30b-a3b:q8_0", 30.5, 32.5),
    ("gpt-oss-20b", 20.9, 12.1),            # mxfp4 experts, q8_0 elsewhere (ggml-org's file)
    ("gpt-oss-20b:f16", 20.9, 13.8),        # the experts stay mxfp4 in an "f16" file
    ("mixtral-8x7b:q4_0", 46.7, 26.4),
])
def test_builtin_moe_shapes_match_published_sizes(name, params_b, file_gb):
    p = profile_builtin(name)
    assert p.is_moe
    assert p.n_params / 1e9 == pytest.approx(params_b, rel=0.01)
    assert p.weight_bytes / 1e9 == pytest.approx(file_gb, rel=0.01)


def test_qwen3_moe_expert_bytes_by_hand():
    p = profile_builtin("qwen3-30b-a3b:q4_k_m")
    assert (p.n_layers, p.n_expert, p.n_expert_used, p.d_model) == (48, 128, 8, 2048)
    # gate/up: 2048 values per row = 8 q4_k blocks of 144 bytes, 768 rows -> 884,736 bytes each;
    # down: 768 values = 3 blocks; layer 0 gets q6_k (210 B/block) as llama.cpp's Q4_K_M does, layer 6 q4_k
    assert p.layers[0].expert_bytes == 128 * (2 * 884_736 + 3 * 210 * 2048) == 391_643_136
    assert p.layers[6].expert_bytes == 128 * 3 * 884_736 == 339_738_624
    assert p.active_expert_bytes == pytest.approx(p.expert_bytes * 8 / 128)


def _toy(n_layers=4, expert=400 * MiB, dense=100 * MiB) -> ModelProfile:
    layers = tuple(LayerProfile(index=i, weight_bytes=dense + expert, params=1000, expert_bytes=expert,
                                expert_params=800, n_matmuls=8, n_expert_matmuls=3, n_head=8, n_kv_head=2,
                                head_dim_k=64, head_dim_v=64) for i in range(n_layers))
    return ModelProfile(name="toy-moe", architecture="qwen3moe", quantization="X", n_layers=n_layers, d_model=512,
                        n_ff=0, n_vocab=1000, n_ctx_train=4096, layers=layers, embedding_bytes=10 * MiB,
                        output_bytes=10 * MiB, head_bytes=10 * MiB, head_params=512_000, tied_embeddings=False,
                        n_expert=8, n_expert_used=2)


def _machine(vram=8 * GiB) -> Machine:
    gpu = Device("GPU", "gpu", vram, vram, memory_bandwidth=1e12, compute_flops=1e18, link_bandwidth=1e10,
                 link_latency_s=1e-5)
    host = Device("CPU", "cpu", 64 * GiB, 64 * GiB, memory_bandwidth=1e11, compute_flops=1e18)
    return Machine(gpus=(gpu,), host=host)


def test_experts_of_the_first_layers_go_to_ram():
    p, m, s = _toy(), _machine(), PlanSettings(n_ctx=1024)
    all_gpu, two = place(p, m, s, 5), place(p, m, s, 5, n_cpu_moe=2)
    assert two.expert_devices == (1, 1, 0, 0) and two.layer_devices == (0, 0, 0, 0)
    assert all_gpu.usage[0].weights_bytes - two.usage[0].weights_bytes == 2 * 400 * MiB
    assert two.usage[1].weights_bytes == 10 * MiB + 2 * 400 * MiB  # token_embd + the experts of 2 layers
    assert two.usage[0].kv_bytes == all_gpu.usage[0].kv_bytes  # the KV cache stays with its layer


def test_decode_speed_comes_from_active_expert_bytes():
    """Decode of one token: the host runs the experts of 2 layers, reading 2 of 8 experts each:
    2 x (400 MiB x 2/8 / 100 GB/s + 2 transfers of 512 f32 over the link: 10 us + 2048 B / 10 GB/s)."""
    p, m, s = _toy(), _machine(), PlanSettings(n_ctx=1024)
    predicted = predict(p, m, place(p, m, s, 5, n_cpu_moe=2), s)
    expected_host = 2 * (400 * MiB * 2 / 8 / 1e11 + 2 * (1e-5 + 512 * 4 / 1e10))
    assert predicted.decode_s_by_device[1] == pytest.approx(expected_host, rel=1e-9)
    # all on the CPU: dense bytes + active expert bytes + the head, all at 100 GB/s
    cpu_only = predict(p, m, place(p, m, s, 0), s)
    kv = sum(layer.n_kv_head * 128 * 2 for layer in p.layers) * (512 + 1)  # f16 K and V of 512 cached tokens + 1
    by_hand = (4 * (100 * MiB + 100 * MiB) + 10 * MiB + kv) / 1e11
    assert cpu_only.decode_s_by_device[1] == pytest.approx(by_hand, rel=1e-9)


def test_auto_keeps_the_fewest_experts_in_ram_that_fit():
    p = profile_builtin("qwen3-30b-a3b:q4_k_m")
    m = layerplan.build_machine(vram=["16GiB"], ram="64GiB", probe_gpus=False)
    result = plan(p, m, n_ctx=4096)
    k = result.n_cpu_moe
    assert result.fits and result.n_gpu_layers == 49 and 0 < k < 48
    assert not place(p, m, result.settings, 49, n_cpu_moe=k - 1).fits  # one layer's experts fewer: too big
    # and it beats the best whole-layer split, which runs most experts from RAM
    whole = plan(p, m, n_ctx=4096, n_cpu_moe=0)
    assert whole.n_gpu_layers < 48 and result.predicted.decode_tok_s > whole.predicted.decode_tok_s
    assert any("does not run MoE" in r for r in result.reasons)


def test_flags_and_override_pattern():
    assert override_tensor_pattern(3, 48) == r"blk\.(0|1|2)\.ffn_(up|down|gate)_exps=CPU"
    assert override_tensor_pattern(48, 48) == r"\.ffn_(up|down|gate)_exps=CPU"
    p = profile_builtin("qwen3-30b-a3b:q4_k_m")
    m = layerplan.build_machine(vram=["16GiB"], ram="64GiB", probe_gpus=False)
    assert llama_cpp_flags(plan(p, m, n_ctx=4096, n_cpu_moe=5, n_gpu_layers=49))[:4] == ["-ngl", "49", "--n-cpu-moe", "5"]
    assert "--cpu-moe" in llama_cpp_flags(plan(p, m, n_ctx=4096, n_cpu_moe=60, n_gpu_layers=49))


def invoke(args):
    return CliRunner().invoke(app, args, catch_exceptions=False)


def test_cli_emit_json_and_refusals():
    base = ["plan", "qwen3-30b-a3b:q4_k_m", "--vram", "16GiB", "--ram", "64GiB"]
    server = invoke(base + ["--emit", "llama-server"])
    assert server.exit_code == 0
    lines = server.output.strip().splitlines()
    assert lines[0].startswith("# builds without --n-cpu-moe") and "-ot 'blk\\.(0|" in lines[0]
    assert lines[-1].startswith("llama-server -m qwen3-30b-a3b-q4_k_m.gguf -ngl 49 --n-cpu-moe ")
    data = json.loads(invoke(base + ["--json"]).output.strip().splitlines()[-1])
    assert data["n_cpu_moe"] > 0 and data["moe"]["n_expert"] == 128 and not data["moe"]["engine_runs_it"]
    assert data["moe"]["expert_bytes_in_ram"] == sum(
        layer.expert_bytes for layer in profile_builtin("qwen3-30b-a3b:q4_k_m").layers[:data["n_cpu_moe"]])
    table = invoke(base).output
    assert "does not run MoE" in table and "routed experts of the first" in table
    from localrun.errors import UserError
    with pytest.raises(UserError, match="applies to MoE models only"):
        invoke(["plan", "llama2-7b", "--n-cpu-moe", "2", "--vram", "8GiB"])
    with pytest.raises(UserError, match="takes 'auto' or a number"):
        invoke(base + ["--n-cpu-moe", "some"])


def test_dense_plans_are_unchanged_by_the_moe_knob():
    p = profile_builtin("llama2-7b:f16")
    m = layerplan.build_machine(vram=["24GiB"], ram="64GiB", probe_gpus=False)
    assert plan(p, m, n_ctx=16384, n_parallel=2).n_cpu_moe == 0
    assert replace(place(p, m, PlanSettings(n_ctx=4096), 10), n_cpu_moe=0) == place(p, m, PlanSettings(n_ctx=4096), 10)
