"""Bounded metadata: every count, width and float the model allocates from or divides by is
checked before use, and a bad one is one UserError sentence naming the key (issue 22).
Each case is a tiny synthetic GGUF with one metadata value replaced."""
import math
import subprocess
import sys
import tracemalloc

import pytest
from gguf import GGUFValueType

import layerplan
from localrun.errors import UserError
from localrun.gguf_file import open_gguf
from synthetic_gguf import tiny_bpe_vocab, write_tiny_llama

U64 = GGUFValueType.UINT64
TOKENS = tiny_bpe_vocab(320)[0]

CASES = [   # (metadata replaced, fragment of the one sentence)
    ({"llama.block_count": 2**31 - 1}, "'llama.block_count' is 2,147,483,647; it must be from 1 to 4,096"),
    ({"llama.block_count": 0}, "'llama.block_count' is 0; it must be from 1"),
    ({"llama.attention.head_count": 0}, "'llama.attention.head_count' is 0; it must be from 1"),
    ({"llama.attention.head_count_kv": 0}, "'llama.attention.head_count_kv' is 0; it must be from 1"),
    ({"llama.embedding_length": 0}, "'llama.embedding_length' is 0; it must be from 1"),
    ({"llama.embedding_length": (2**40, U64)}, "'llama.embedding_length' is 1,099,511,627,776"),
    ({"llama.context_length": (2**40, U64)}, "'llama.context_length' is 1,099,511,627,776"),
    ({"llama.feed_forward_length": 0}, "'llama.feed_forward_length' is 0"),
    ({"llama.attention.key_length": 2**30}, "'llama.attention.key_length' is 1,073,741,824"),
    ({"general.alignment": 0}, "general.alignment is 0; it must be a power of two"),
    ({"general.alignment": 24}, "general.alignment is 24; it must be a power of two"),
    ({"llama.rope.freq_base": math.nan}, "'llama.rope.freq_base' is nan; it must be a finite number"),
    ({"llama.rope.freq_base": 0.0}, "'llama.rope.freq_base' is 0.0; it must be a finite number above 1"),
    ({"llama.rope.freq_base": math.inf}, "'llama.rope.freq_base' is inf"),
    ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "'llama.attention.layer_norm_rms_epsilon' is 0.0"),
    ({"llama.attention.layer_norm_rms_epsilon": math.nan}, "'llama.attention.layer_norm_rms_epsilon' is nan"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": math.nan}, "'llama.rope.scaling.factor' is nan"),
    ({"llama.rope.dimension_count": 32}, "RoPE over 32 of 64 head dimensions is not supported"),
    ({"llama.attention.head_count": "four"}, "'llama.attention.head_count' is a str, not an integer"),
    ({"llama.block_count": 2.5}, "'llama.block_count' is 2.5, not an integer"),
    ({"llama.attention.head_count_kv": [2, 1]}, "'llama.attention.head_count_kv' differs between layers (2, 1)"),
    ({"llama.attention.head_count_kv": [2]}, "'llama.attention.head_count_kv' lists 1 values for 2 layers"),
    ({"llama.attention.head_count": ["a", "b"]}, "'llama.attention.head_count' is a str, not an integer"),
    ({"llama.vocab_size": 321}, "the vocabulary lists 320 tokens for 321 embedding rows"),
    ({"tokenizer.ggml.bos_token_id": 5000}, "'tokenizer.ggml.bos_token_id' is 5,000; it must be from 0 to 319"),
    ({"tokenizer.ggml.tokens": list(range(320))}, "'tokenizer.ggml.tokens' is not an array of strings"),
    ({"tokenizer.ggml.tokens": None}, "the file has no vocabulary"),
    ({"tokenizer.ggml.scores": [0.0] * 10}, "'tokenizer.ggml.scores' has 10 entries for 320 tokens"),
    ({"tokenizer.ggml.token_type": [1.0] * 320}, "'tokenizer.ggml.token_type' is not an array of int32"),
    ({"tokenizer.ggml.model": 7}, "'tokenizer.ggml.model' is not text"),
    ({"tokenizer.ggml.model": "rwkv"}, "tokenizer model 'rwkv' is not supported (supported: gpt2, llama)"),
    # llama.cpp aborts the process on these two (GGML_ASSERT, or a C++ exception through its C API)
    ({"tokenizer.ggml.tokens": TOKENS[:5] + [TOKENS[4]] + TOKENS[6:]},
     f"the vocabulary lists the token {TOKENS[4]!r} twice (again at id 5)"),
    ({"tokenizer.ggml.tokens": TOKENS[:5] + ["", "[EMPTY_5]"] + TOKENS[7:]}, "the token '[EMPTY_5]' twice (again at id 6)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.token_type": ([6] * 320, GGUFValueType.ARRAY, GGUFValueType.INT32)},
     "byte token 0 is spelled '<|endoftext|>', not <0xHH>"),
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("metadata")
    return [write_tiny_llama(root / f"case{i}.gguf", tensor_type="F32", metadata=metadata)
            for i, (metadata, _) in enumerate(CASES)]


@pytest.mark.parametrize("i", range(len(CASES)), ids=[next(iter(m)) for m, _ in CASES])
def test_bad_metadata_is_one_sentence(files, i):
    tracemalloc.start()
    try:
        with pytest.raises(UserError) as err:
            open_gguf(files[i])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(err.value)
    assert CASES[i][1] in message and "\n" not in message, message
    assert files[i].name in message.split(":")[0]
    assert peak < 32 << 20, f"{peak:,} bytes allocated to refuse {files[i].name}"


def test_layerplan_refuses_absurd_counts_before_allocating(files):
    """The planner's own profile bounds the same values (it runs without localrun)."""
    i = next(i for i, (m, _) in enumerate(CASES) if m == {"llama.block_count": 2**31 - 1})
    with pytest.raises(layerplan.GGUFFormatError, match="'llama.block_count' is 2,147,483,647"):
        layerplan.profile_gguf(files[i])


def test_per_layer_head_counts_are_supported_when_equal(tmp_path):
    path = write_tiny_llama(tmp_path / "per-layer.gguf", tensor_type="F32",
                            metadata={"llama.attention.head_count": [4, 4], "llama.attention.head_count_kv": [2, 2],
                                      "llama.feed_forward_length": [512, 512]})
    config = open_gguf(path).config
    assert (config.n_head, config.n_head_kv, config.n_ff) == (4, 2, 512)
    profile = layerplan.profile_gguf(path)
    assert [layer.n_kv_head for layer in profile.layers] == [2, 2]


def test_planner_takes_per_layer_kv_heads_that_differ(tmp_path):
    """layerplan models per-layer KV heads (some families store them so); localrun's llama refuses them by name."""
    path = write_tiny_llama(tmp_path / "differ.gguf", tensor_type="F32",
                            metadata={"llama.attention.head_count_kv": [2, 1]})
    assert [layer.n_kv_head for layer in layerplan.profile_gguf(path).layers] == [2, 1]


def test_tensor_shape_must_match_metadata(tmp_path):
    path = write_tiny_llama(tmp_path / "ffn.gguf", tensor_type="F32", metadata={"llama.feed_forward_length": 256})
    with pytest.raises(UserError, match=r"tensor 'blk.0.ffn_gate.weight' has shape \[256, 512\]; the metadata says "
                                        r"\[256, 256\]"):
        open_gguf(path)


def test_tokenizer_refuses_huge_text_in_one_sentence(tmp_path):
    """The buffer llama.cpp writes ids into is sized by the text (never by the file's trained
    context), and a text past any context is refused before llama.cpp sees it."""
    from localrun.tokenizer import MAX_TEXT_BYTES, Tokenizer
    tok = Tokenizer(write_tiny_llama(tmp_path / "ctx.gguf", tensor_type="F32", context_length=1 << 28))
    assert tok.decode(tok.encode("the fox and the dog " * 50, add_special=False)) == "the fox and the dog " * 50
    with pytest.raises(UserError, match=f"is too long to tokenize \\(the limit is {MAX_TEXT_BYTES:,}\\)"):
        tok.encode("x" * (MAX_TEXT_BYTES + 1))


def test_tokenizer_validates_before_llama_cpp_can_abort(files):
    """A duplicated token text makes llama.cpp's vocab-only load abort the process
    (GGML_ASSERT(id_to_token.size() == token_to_id.size())); the Tokenizer refuses it first."""
    i = next(i for i, (m, f) in enumerate(CASES) if "twice (again at id 5)" in f)
    code = f"from localrun.tokenizer import Tokenizer; Tokenizer({str(files[i])!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "UserError" in proc.stderr and "twice (again at id 5)" in proc.stderr, proc.stderr
