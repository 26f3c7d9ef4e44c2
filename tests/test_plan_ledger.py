"""The memory ledger of localrun's engine: each tensor held as the engine holds it (memory-mapped
for the CPU kernels' types, packed or dequantized copies otherwise), the KV pool per device,
buffers, the CUDA context, the tokenizer, a draft model and the RAM KV tier; by hand and
against gguf-py's reading of the file."""
import json

import gguf
import pytest
from typer.testing import CliRunner

import layerplan
from layerplan.gguf_header import TensorInfo
from layerplan.ggml_types import GGML_TYPES_BY_NAME
from layerplan.ledger import (ENGINE_CUDA_CONTEXT_BYTES, ENGINE_CUDA_HOST_BYTES, TOKENIZER_BYTES_PER_MERGE,
                              TOKENIZER_BYTES_PER_TOKEN, EngineOptions, engine_ledger, held_bytes)
from layerplan.units import MiB
from localrun.cli.main import app


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


def info(name, kind, shape):
    from layerplan.ggml_types import tensor_bytes
    type_id = GGML_TYPES_BY_NAME[kind].id
    return TensorInfo(name, shape, type_id, 0, tensor_bytes(type_id, shape))


def test_each_tensor_as_the_engine_holds_it():
    cpu, no_kernels = EngineOptions(), EngineOptions(kernels=False)
    q4 = info("blk.0.attn_q.weight", "q4_0", (576, 1536))       # 1536 rows of 576 values
    assert held_bytes(q4, False, cpu) == (1536 * 576 // 32 * 18, True)              # the file's blocks, mapped
    # int4, and per 32 values a bf16 scale and zero and their rounding residuals
    assert held_bytes(q4, True, cpu) == (1536 * 576 // 2 + 1536 * 18 * 8, False)
    assert held_bytes(q4, False, no_kernels)[1] is False
    q8 = info("token_embd.weight", "q8_0", (576, 49152))
    assert held_bytes(q8, True, cpu) == (49152 * 576 + 49152 * 6, False)            # int8 + the row's f32, bf16 scale
    f16 = info("blk.0.ffn_up.weight", "f16", (64, 128))
    assert held_bytes(f16, False, cpu) == (64 * 128 * 4, False)                     # dequantized to float32
    assert held_bytes(f16, False, EngineOptions(dtype_bytes=2)) == (64 * 128 * 2, False)
    norm = info("blk.0.attn_norm.weight", "f32", (576,))
    assert held_bytes(norm, True, cpu) == (576 * 4, False)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q4_k", "q8_0"])
def test_a_copied_matrix_takes_what_the_engines_weight_object_holds(kind):
    """held_bytes of a matrix the engine copies (on a GPU, or with its kernels off) against the
    bytes of the weight object it builds for it (model/quant.py: Int4Weight, Int8Weight), here on
    the CPU: the same tensors as on a GPU (int4 packed two codes a byte either way)."""
    import numpy as np
    import torch
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as QT

    from localrun.model.quant import Int4Weight, Int8Weight, int4_groups
    qtype = QT[kind.upper()]
    n, k = 96, 512
    values, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, size=(n, k // values, size), dtype=np.uint8)
    f16_at = {QT.Q4_0: [0], QT.Q8_0: [0], QT.Q4_1: [0, 2], QT.Q4_K: [0, 2]}[qtype]
    for at in f16_at:                 # finite, small scales
        raw[:, :, at:at + 2] = np.full((n, k // values), 0.01, np.float16).view(np.uint8).reshape(n, -1, 2)
    raw = raw.reshape(n, -1)
    if kind == "q8_0":
        from gguf.quants import dequantize
        weight = Int8Weight.from_float(dequantize(raw, qtype).reshape(n, k), torch.device("cpu"))
    else:
        weight = Int4Weight.from_groups(int4_groups(raw, qtype, (n, k)), torch.device("cpu"))
    assert held_bytes(info("blk.0.ffn_up.weight", kind, (k, n)), True, EngineOptions()) == (weight.nbytes, False)


def test_ledger_of_a_file_against_gguf_py(tiny_gguf):
    path = tiny_gguf("Q8_0", n_layers=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320)
    profile = layerplan.profile_gguf(path)
    machine = layerplan.build_machine(ram="8GiB", probe_gpus=False)
    plan = layerplan.plan(profile, machine, n_ctx=256, n_parallel=2, n_gpu_layers=0)
    ledger = engine_ledger(plan)
    reader = gguf.GGUFReader(path)
    matrices = [t for t in reader.tensors if len(t.shape) > 1]
    vectors = [t for t in reader.tensors if len(t.shape) == 1]
    got = {i.what: i.n_bytes for i in ledger.items}
    assert got["weights, memory-mapped"] == sum(int(t.n_bytes) for t in matrices)
    assert got["weights, copied"] == sum(int(t.n_elements) * 4 for t in vectors)
    # f16 K and V (the engine's default for a float32 model): 2 layers x 512 slots x 2 KV heads x (64 + 64) x 2 B
    assert got["KV pool (256 x 2 tokens)"] == 2 * 512 * 2 * 128 * 2
    f32_kv = engine_ledger(plan, EngineOptions(kv_type="f32"))
    assert f32_kv.device_bytes(0) - ledger.device_bytes(0) == 2 * 512 * 2 * 128 * 2
    n_merges = len(reader.fields["tokenizer.ggml.merges"].data)
    assert got["tokenizer (vocabulary and tables)"] == 320 * TOKENIZER_BYTES_PER_TOKEN + n_merges * TOKENIZER_BYTES_PER_MERGE
    assert ledger.device_bytes(0, mapped=True) == got["weights, memory-mapped"]


def test_gpu_layers_are_copied_and_pay_the_cuda_context(tiny_gguf):
    path = tiny_gguf("Q8_0", n_layers=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320)
    profile = layerplan.profile_gguf(path)
    machine = layerplan.build_machine(vram=["8GiB"], ram="8GiB", probe_gpus=False)
    draft = layerplan.profile_builtin("llama2-7b:q4_0")
    plan = layerplan.plan(profile, machine, n_ctx=256, n_gpu_layers=3)   # both layers and the (tied) head
    ledger = engine_ledger(plan, EngineOptions(draft=draft, ram_kv_tier_bytes=64 * MiB))
    gpu = {i.what: i.n_bytes for i in ledger.items if i.device == 0}
    host = {i.what: i.n_bytes for i in ledger.items if i.device == 1}
    assert gpu["CUDA context, cuBLAS and kernels"] == ENGINE_CUDA_CONTEXT_BYTES and "weights, memory-mapped" not in gpu
    assert host["CUDA runtime (host side)"] == ENGINE_CUDA_HOST_BYTES
    # per layer q,k,v,o (256x256, 2 of 256x128) and gate, up, down (256x512 each) as int8 + an f32 and a bf16
    # scale per row,
    # and the tied head: a GPU copy of the 320 x 256 token table
    rows_and_cols = [(256, 256), (128, 256), (128, 256), (256, 256), (512, 256), (512, 256), (256, 512)]
    layer = sum(r * c + 6 * r for r, c in rows_and_cols) + 2 * 256 * 4       # + two f32 norms
    head = 320 * 256 + 6 * 320 + 256 * 4                                       # + output_norm
    assert gpu["weights, copied"] == 2 * layer + head
    assert host["weights, memory-mapped"] == 320 * 256 // 32 * 34              # token_embd stays mapped in RAM
    assert host["RAM KV tier (cap)"] == 64 * MiB
    assert host["draft model llama2-7b:q4_0 (weights and KV)"] == draft.weight_bytes + 32 * 256 * 32 * 256 * 2


@pytest.mark.parametrize("n_gpu_layers", [0, 3])
def test_compute_buffers_hold_logits_for_the_sampled_rows_only(tiny_gguf, n_gpu_layers):
    """The plan sizes the head's buffer for a whole prompt step's logits (llama.cpp's worst case);
    the engine projects one row per sequence: on the host those are the logits its buffers hand
    back already, on a GPU they are computed there first."""
    path = tiny_gguf("Q8_0", n_layers=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320)
    profile = layerplan.profile_gguf(path)
    machine = layerplan.build_machine(vram=["8GiB"], ram="8GiB", probe_gpus=False)
    plan = layerplan.plan(profile, machine, n_ctx=256, n_parallel=3, n_gpu_layers=n_gpu_layers, n_ubatch=512)
    head = plan.placement.head_device
    assert head == (0 if n_gpu_layers else 1)
    planned = plan.placement.usage[head].buffer_bytes - (384 * MiB if n_gpu_layers else 0)
    got = {i.what: i.n_bytes for i in engine_ledger(plan).items if i.device == head}
    expected = planned - 512 * 320 * 4 + (3 * 320 * 4 if n_gpu_layers else 0)
    assert got["compute buffers"] == expected


@pytest.fixture(scope="module")
def smollm2():
    from localrun.models import pull
    return str(pull("smollm2-135m", quiet=True))


@pytest.mark.model
def test_plan_prints_and_carries_the_ledger(smollm2):
    result = CliRunner().invoke(app, ["plan", smollm2, "--ctx", "1024", "--json"], catch_exceptions=False)
    data = json.loads(result.output.strip().splitlines()[-1])
    parts = {i["what"] for i in data["ledger"]}
    assert {"weights, memory-mapped", "KV pool (1024 x 1 tokens)", "tokenizer (vocabulary and tables)"} <= parts
    table = CliRunner().invoke(app, ["plan", smollm2, "--ctx", "1024"], catch_exceptions=False).output
    assert "Memory ledger" in table and "file-backed" in table


def test_the_kernels_multiply_the_types_the_ledger_maps():
    """localrun's kernels take their types from ENGINE_KERNEL_TYPES, under gguf's ids."""
    from layerplan.ledger import ENGINE_KERNEL_TYPES
    from localrun import kernels
    assert {name.lower() for name in kernels.KERNEL_TYPES} == ENGINE_KERNEL_TYPES
    assert all(gguf.GGMLQuantizationType[name] == type_id for name, type_id in kernels.KERNEL_TYPES.items())
