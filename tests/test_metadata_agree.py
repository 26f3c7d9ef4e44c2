"""The model builder (localrun.config.ModelConfig) and the planner (layerplan's ModelProfile)
read one GGUF header: they must agree on every fact both hold, defaults included."""
from __future__ import annotations

import pytest

import layerplan
from localrun.api import LLM
from synthetic_gguf import write_tiny_model


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3", "gemma3"])
def test_config_and_profile_agree(tmp_path, architecture):
    path = write_tiny_model(tmp_path / f"{architecture}.gguf", architecture=architecture, tensor_type="Q8_0")
    c = LLM(path, dtype="float32", n_threads=1).model.config
    p = layerplan.profile_gguf(path)
    assert (p.architecture, p.n_layers, p.d_model, p.n_ff, p.n_vocab, p.n_ctx_train) == \
           (c.architecture, c.n_layers, c.n_embd, c.n_ff, c.n_vocab, c.context_length)
    assert {(l.n_kv_head, l.head_dim_k, l.head_dim_v) for l in p.layers} == {(c.n_head_kv, c.head_dim, c.head_dim)}
    assert p.tied_embeddings == c.tied_output
    windows = [l.sliding_window for l in p.layers]
    assert [w is not None for w in windows] == ([*c.local_layers] or [False] * c.n_layers)
    assert {w for w in windows if w is not None} <= {c.sliding_window}
