"""KV cache sizes against hand-computed figures (issue 3)."""
import pytest

from layerplan import kv_bytes_per_token, kv_type, profile_builtin
from layerplan.kv_cache import layer_kv_bytes, layer_kv_tokens
from layerplan.units import GiB, KiB, parse_bytes


def test_llama31_8b_f16_is_128_kib_per_token():
    # 32 layers x 8 KV heads x 128 head dim x (K + V) x 2 bytes = 131072
    assert kv_bytes_per_token(profile_builtin("llama3.1-8b:q4_k_m"), "f16") == 128 * KiB


def test_llama31_8b_32k_tokens_take_4_gib_f16_and_2_125_gib_q8_0():
    profile = profile_builtin("llama3.1-8b:f16")
    assert kv_bytes_per_token(profile, "f16") * 32768 == 4 * GiB
    # q8_0 stores 32 values in 34 bytes: 128 KiB * 34/64 per token
    assert kv_bytes_per_token(profile, "q8_0") * 32768 == int(2.125 * GiB)
    assert kv_bytes_per_token(profile, "int8") == kv_bytes_per_token(profile, "q8_0")


def test_llama2_7b_mha_is_512_kib_per_token():
    # 32 layers x 32 KV heads (no GQA) x 128 x 2 x 2 bytes
    assert kv_bytes_per_token(profile_builtin("llama2-7b:f16"), "f16") == 512 * KiB


@pytest.mark.parametrize("name, bytes_per_value", [("f32", 4), ("f16", 2), ("bf16", 2), ("fp8", 1),
                                                    ("q8_0", 34 / 32), ("q4_0", 18 / 32), ("q4_1", 20 / 32)])
def test_kv_types_use_llama_cpp_block_sizes(name, bytes_per_value):
    assert kv_type(name).bytes_for(3200) == pytest.approx(3200 * bytes_per_value)


def test_unknown_kv_type_is_refused():
    with pytest.raises(ValueError, match="unknown KV type"):
        kv_type("q3_k")


def test_sliding_window_layers_hold_only_the_window():
    gemma = profile_builtin("gemma2-9b:q8_0")
    local, global_ = gemma.layers[0], gemma.layers[1]
    assert local.sliding_window == 4096 and global_.sliding_window is None
    assert layer_kv_tokens(local, 8192, 2) == 4096 * 2
    assert layer_kv_tokens(global_, 8192, 2) == 8192 * 2
    # 8 KV heads x 256 head dim x (K + V) x 2 bytes per token
    assert layer_kv_bytes(global_, kv_type("f16"), 8192, 1) == 8192 * 8 * 256 * 2 * 2


@pytest.mark.parametrize("text, value", [("24GiB", 24 * GiB), ("24G", 24 * GiB), ("24GB", 24 * 10**9),
                                         ("512MiB", 512 * 2**20), ("1.5GiB", int(1.5 * GiB)), ("100", 100)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_parse_bytes_refuses_nonsense():
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
