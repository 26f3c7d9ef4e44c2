"""Shared fixtures: tiny synthetic llama GGUF files, written once per test session."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from synthetic_gguf import write_tiny_llama


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
