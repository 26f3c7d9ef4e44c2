"""Shared fixtures: tiny synthetic llama GGUF files, written once per test session."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from synthetic_gguf import write_tiny_llama

# Every paged KV pool starts as NaN in the tests (localrun/engine/paged_kv.py), and in the
# processes they start: a read of a slot no token was written to fails every time, not by luck.
os.environ.setdefault("LOCALRUN_POISON_KV", "1")


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """Factory `tiny_gguf(tensor_type="F32", **options) -> Path` of a synthetic llama GGUF.

    `options` are `write_tiny_llama`'s keywords (n_layers, tied_output, rope_scaling, seed, ...).
    Each distinct (tensor_type, options) is written once per session and then reused.
    """
    root = tmp_path_factory.mktemp("tiny_gguf")
    written: dict[str, Path] = {}

    def make(tensor_type="F32", **options) -> Path:
        type_name = getattr(tensor_type, "name", str(tensor_type))
        key = json.dumps([type_name, options], sort_keys=True)
        if key not in written:
            path = root / f"tiny-llama-{len(written)}-{type_name}.gguf"
            written[key] = write_tiny_llama(path, tensor_type=type_name, **options)
        return written[key]

    return make


# The numerics-sensitive tests: their results depend on which kernels torch (and our compiled
# kernels) pick for this CPU. CI runs them a second time with the AVX2 kernels forced
# (ATEN_CPU_CAPABILITY=avx2 LOCALRUN_ISA=avx2 pytest -m numerics) on hosts that have AVX-512.
# One entry per file ("test_x.py": every test in it) or test ("test_x.py::test_name": that
# test, all its parameters). The one list; the marker is registered in pyproject.toml.
NUMERICS_TESTS = (
    "test_fidelity.py",                                        # localrun vs llama.cpp, KV types
    "test_reference.py::test_reference_agrees_with_llama_cpp",  # the numpy reference vs llama.cpp
    "test_reference.py::test_reference_attention_matches_torch_sdpa",
    "test_model.py",                                           # torch model vs the reference, batching
    "test_quant.py",                                           # quantized weights and their kernels
    "test_ci.py::test_torch_runs_the_kernels_ci_forces",       # the forced ISA is the one in force
    "test_paged_engine.py::test_paged_attention_equals_contiguous_cache",
    "test_paged_engine.py::test_quantized_kv_agrees_with_f32_kv",
    "test_paged_engine.py::test_continuous_batching_equals_each_request_alone",
    "test_speculative.py::test_greedy_output_equals_plain_decoding",
    "test_speculative.py::test_speculative_and_plain_requests_share_a_batch_under_preemption",
    "test_speculative.py::test_rowwise_verify_attends_each_row_exactly_as_a_decode_segment",
    "test_speculative.py::test_adaptive_engine_keeps_output_and_reports",
    "test_speculative_model.py::test_greedy_identical_to_plain_decoding",
    "test_openai_sampling.py::test_greedy_with_a_penalty_follows_a_hand_loop_over_llm_logits",   # engine vs LLM.logits
    "test_openai_sampling.py::test_logprobs_match_llm_logits_in_value_rank_and_sum",
    "test_fused_block.py",                                     # one-call decode block vs the Python block
    "test_families.py",                                        # qwen2/qwen3/gemma3 vs the reference, llama.cpp
    "test_sliding_window.py",
    "test_gemma_fidelity.py",                                  # the real gemma-3-270m vs llama.cpp
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        file_name, test_name = item.path.name, item.originalname
        if file_name in NUMERICS_TESTS or f"{file_name}::{test_name}" in NUMERICS_TESTS:
            item.add_marker(pytest.mark.numerics)
