"""scripts/gpu_check.py runs only where a GPU is lent (rarely, and never in CI): what of it runs
without one is checked here, so that it has not rotted when a GPU session comes. Its synthetic
model loads and the engine runs it without the tokenizer (llama-cpp-python is not on GPU
machines), and its prediction for a placement on a GPU counts the weights as the engine holds them."""
import importlib.util
import sys
from pathlib import Path

import pytest

import layerplan
from layerplan.ledger import ENGINE_CUDA_CONTEXT_BYTES

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def synthetic(gpu_check, tmp_path_factory):
    return gpu_check.write_synthetic_q4_0(tmp_path_factory.mktemp("gpu_check") / "s.gguf", 2, 256)


def test_the_engine_runs_the_synthetic_model_without_the_tokenizer(gpu_check, synthetic, monkeypatch):
    from localrun import LLM
    from localrun.calibrate_engine import decode_step_seconds, prefill_seconds, timed_steps
    from localrun.sampling_params import SamplingParams
    monkeypatch.setitem(sys.modules, "llama_cpp", None)            # import llama_cpp now raises ImportError
    llm = LLM(synthetic, n_ctx=96, n_gpu_layers=0, n_threads=1)
    assert llm.config.n_layers == 2 and llm.config.n_embd == 256
    steps, seqs = timed_steps(gpu_check._engine(llm), [list(range(4, 68))], SamplingParams(max_tokens=5, ignore_eos=True))
    assert prefill_seconds(steps)[0] == 64 and decode_step_seconds(steps, 1) > 0
    assert seqs[0].num_generated_tokens == 5


def test_the_prediction_on_a_gpu_counts_what_the_engine_holds_there(gpu_check, synthetic):
    machine = layerplan.build_machine(vram=["8GiB"], ram="8GiB", probe_gpus=False)
    got = gpu_check.predicted(synthetic, 3, 96, 64, 8, "f16", machine=machine)   # both layers and the head
    # per layer q, o (256 x 256), k, v (128 x 256: one KV head of 128), gate, up (768 x 256), down (256 x 768)
    # as int4 with bf16 scale, zero and their residuals per 32 values (0.75 B a value) + two f32 norms;
    # the tied head: the 320 x 256 token table likewise + the f32 output norm
    layer = (2 * 256 * 256 + 2 * 128 * 256 + 3 * 768 * 256) * 3 // 4 + 2 * 256 * 4
    assert got["gpu_items"]["weights, copied"] == 2 * layer + 320 * 256 * 3 // 4 + 256 * 4
    assert got["gpu_items"]["CUDA context, cuBLAS and kernels"] == ENGINE_CUDA_CONTEXT_BYTES
    assert got["gpu_bytes"] == sum(got["gpu_items"].values())
    assert got["prefill_tok_s"] > 0 and got["decode_tok_s"] > 0
    none = gpu_check.predicted(synthetic, 0, 96, 64, 8, "f16", machine=machine)
    assert none["gpu_bytes"] == 0 and none["gpu_items"] == {}
