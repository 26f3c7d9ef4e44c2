"""Model profiles from GGUF headers and built-in shapes, against gguf-py and published figures."""
import time

import gguf
import pytest

from layerplan import profile_builtin, profile_gguf, read_header
from layerplan.builtin_shapes import SHAPES, tensor_type
from layerplan.ggml_types import GGML_TYPES
from layerplan.gguf_header import GGUFFormatError
from layerplan.weight_format import as_weight_dtype


@pytest.fixture(scope="module")
def smollm2():
    from localrun.models import pull
    return pull("smollm2-135m", quiet=True)


def test_type_table_matches_gguf_py():
    for type_id, info in GGML_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)] == (info.block_size, info.type_size)


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                         "Q4_K", "Q5_K", "Q6_K"])
def test_header_matches_gguf_reader_tensor_by_tensor(tiny_gguf, tensor_type):
    path = tiny_gguf(tensor_type)
    ours, reference = read_header(path), gguf.GGUFReader(path)
    assert ours.data_offset == reference.data_offset
    theirs = {t.name: t for t in reference.tensors}
    assert {t.name for t in ours.tensors} == set(theirs)
    for t in ours.tensors:
        ref = theirs[t.name]
        assert (t.n_bytes, t.type_id, t.shape) == (ref.n_bytes, int(ref.tensor_type), tuple(int(d) for d in ref.shape))
        assert ours.data_offset + t.offset == ref.data_offset
    assert profile_gguf(path).weight_bytes == sum(int(t.n_bytes) for t in reference.tensors)


def test_not_a_gguf_file_is_refused(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        read_header(bad)
    good = tmp_path / "cut.gguf"
    good.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") + (9).to_bytes(8, "little"))
    with pytest.raises(GGUFFormatError, match="ends early"):
        read_header(good)


@pytest.mark.model
def test_smollm2_weight_bytes_equal_the_files_tensor_sizes_byte_for_byte(smollm2):
    """The reference is the file itself: its tensors, laid end to end in offset order, must tile the
    data section exactly (gguf-py's reader is compared tensor by tensor on the synthetic files above;
    on this file it needs seconds to decode the vocabulary)."""
    profile, header = profile_gguf(smollm2), read_header(smollm2)
    data_bytes = smollm2.stat().st_size - header.data_offset
    assert profile.weight_bytes == data_bytes == 96_576_768
    end = 0
    for t in sorted(header.tensors, key=lambda t: t.offset):
        assert t.offset == end, t.name
        end = t.offset + t.n_bytes
    assert end == data_bytes
    per_layer = {}
    for t in header.tensors:
        if t.name.startswith("blk."):
            per_layer[int(t.name.split(".")[1])] = per_layer.get(int(t.name.split(".")[1]), 0) + t.n_bytes
    assert [layer.weight_bytes for layer in profile.layers] == [per_layer[i] for i in range(30)]
    # by hand: 7 Q4_1 matrices (20 bytes per 32 values) and 2 f32 norms per layer
    params = 576 * 576 * 2 + 576 * 192 * 2 + 576 * 1536 * 3
    assert profile.layers[0].weight_bytes == params // 32 * 20 + 2 * 576 * 4


@pytest.mark.model
def test_smollm2_profile_shape(smollm2):
    started = time.perf_counter()
    p = profile_gguf(smollm2)
    assert time.perf_counter() - started < 1.0
    assert (p.n_layers, p.d_model, p.n_ff, p.n_vocab, p.n_ctx_train) == (30, 576, 1536, 49152, 8192)
    assert (p.layers[0].n_head, p.layers[0].n_kv_head, p.layers[0].head_dim_k) == (9, 3, 64)
    assert p.tied_embeddings and p.quantization == "Q4_1"
    assert p.embedding_bytes == 49152 * 576 // 32 * 34  # token_embd is Q8_0
    assert p.head_bytes == p.embedding_bytes + 576 * 4  # the tied head is a copy of token_embd + output_norm
    assert p.n_params == 134_479_872


@pytest.mark.model
def test_as_weight_dtype_counts_params_at_the_runtime_dtype(smollm2):
    p = profile_gguf(smollm2)
    bf16 = as_weight_dtype(p, "bf16")
    vectors = sum(layer.vector_bytes for layer in p.layers) + 576 * 4  # f32 norms stay f32
    assert bf16.weight_bytes == 2 * p.n_params + vectors


# Published GGUF file sizes (bytes, rounded as the hosting pages show them) and parameter counts.
PUBLISHED = [
    ("llama2-7b:q4_k_m", 4.08e9, 6.74e9), ("llama2-7b:q4_0", 3.83e9, 6.74e9), ("llama2-7b:q8_0", 7.16e9, 6.74e9),
    ("llama3.1-8b:q4_k_m", 4.92e9, 8.03e9), ("llama3.1-8b:q8_0", 8.54e9, 8.03e9),
    ("llama3.1-70b:q4_k_m", 42.5e9, 70.6e9), ("mistral-7b:q4_k_m", 4.37e9, 7.25e9),
    ("qwen2.5-7b:q4_k_m", 4.68e9, 7.62e9), ("qwen2.5-14b:q4_k_m", 8.99e9, 14.77e9),
    ("qwen2.5-32b:q4_k_m", 19.85e9, 32.76e9), ("gemma2-9b:q4_k_m", 5.76e9, 9.24e9),
]


@pytest.mark.parametrize("name, file_bytes, n_params", PUBLISHED)
def test_builtin_shapes_match_published_files(name, file_bytes, n_params):
    profile = profile_builtin(name)
    assert profile.weight_bytes == pytest.approx(file_bytes, rel=0.01)
    assert profile.n_params == pytest.approx(n_params, rel=0.01)


def test_builtin_f16_is_16_bits_per_weight_and_every_shape_builds():
    for name, shape in SHAPES.items():
        bits = profile_builtin(f"{name}:f16").bits_per_weight
        if shape.gpt_oss:  # released with mxfp4 experts (4.25 bits), which an f16 file keeps
            assert 4.25 < bits < 6
        else:
            assert bits == pytest.approx(16.0, abs=0.01)


def test_q4_k_m_mix_follows_llama_cpp():
    shape = SHAPES["llama2-7b"]
    assert tensor_type("q4_k_m", "output", 0, shape, 4096) == "q6_k"
    assert tensor_type("q4_k_m", "attn_q", 5, shape, 4096) == "q4_k"
    # use_more_bits: the first and last eighth of the layers, and every third in between
    assert [tensor_type("q4_k_m", "attn_v", i, shape, 4096) for i in (0, 3, 4, 5, 6, 28)] == \
        ["q6_k", "q6_k", "q4_k", "q4_k", "q6_k", "q6_k"]
    assert tensor_type("q4_0", "output", 0, shape, 4096) == "q6_k"
    assert tensor_type("q8_0", "output", 0, shape, 4096) == "q8_0"
    assert tensor_type("q4_k_m", "attn_v", 20, SHAPES["llama3.1-70b"], 8192) == "q5_k"  # the 70B bump


def test_unknown_shape_or_quant_is_refused():
    with pytest.raises(ValueError, match="not a built-in shape"):
        profile_builtin("llama9-1b")
    with pytest.raises(ValueError, match="unknown quantization"):
        profile_builtin("llama2-7b:q9_9")
