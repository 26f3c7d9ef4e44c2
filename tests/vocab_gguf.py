"""Vocabulary-only GGUF files: a llama architecture's hyperparameters and a tokenizer, no
tensors. Enough for llama.cpp's vocab-only load and for localrun's Tokenizer, and quick to
write, so that tests can try many vocabularies.

`bpe_tokenizer()` is synthetic_gguf's byte-level BPE vocabulary ("gpt2"), `spm_tokenizer()` a
small SentencePiece one ("llama") with all 256 byte tokens, as real SentencePiece files have.
Both return the tokenizer keys as a dict that a test edits before `write_vocab_gguf`."""
from __future__ import annotations

from pathlib import Path

import gguf
from gguf.gguf_writer import GGUFValue

from synthetic_gguf import BOS_TOKEN_ID, EOS_TOKEN_ID, tiny_bpe_vocab

T = gguf.GGUFValueType
TokenType = gguf.TokenType

_HPARAMS = {"llama.block_count": 1, "llama.context_length": 256, "llama.embedding_length": 64,
            "llama.feed_forward_length": 128, "llama.attention.head_count": 2,
            "llama.attention.head_count_kv": 1, "llama.rope.dimension_count": 32}

# words the SentencePiece vocabulary spells with pieces (every prefix of "▁word" is a piece,
# so SentencePiece's pair merges can reach the whole word)
_SPM_WORDS = ("the", "fox", "and", "dog", "hello", "world", "is", "in", "a")


def bpe_tokenizer() -> dict:
    tokens, token_types, merges = tiny_bpe_vocab(320)
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": token_types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": BOS_TOKEN_ID,
            "tokenizer.ggml.eos_token_id": EOS_TOKEN_ID, "tokenizer.ggml.add_bos_token": False}


def spm_tokenizer() -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    token_types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'"]
    for word in _SPM_WORDS:
        pieces += [("▁" + word)[:n] for n in range(2, len(word) + 2)]
    pieces = list(dict.fromkeys(p for p in pieces if p not in tokens))
    return {"tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens + pieces,
            "tokenizer.ggml.token_type": [int(t) for t in token_types] + [int(TokenType.NORMAL)] * len(pieces),
            # a longer piece scores higher, so that merges prefer whole words
            "tokenizer.ggml.scores": [0.0] * len(tokens) + [float(len(p)) - 100.0 for p in pieces],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}


# the GGUF type of each tokenizer key, as llama.cpp's converter writes it
KEY_TYPES = {"tokenizer.ggml.model": T.STRING, "tokenizer.ggml.pre": T.STRING,
             "tokenizer.ggml.tokens": (T.ARRAY, T.STRING), "tokenizer.ggml.merges": (T.ARRAY, T.STRING),
             "tokenizer.ggml.token_type": (T.ARRAY, T.INT32), "tokenizer.ggml.scores": (T.ARRAY, T.FLOAT32),
             "tokenizer.ggml.add_bos_token": T.BOOL, "tokenizer.ggml.add_eos_token": T.BOOL,
             "tokenizer.ggml.add_space_prefix": T.BOOL}


def write_vocab_gguf(path: str | Path, tokenizer: dict) -> Path:
    """A tensor-less llama GGUF with these tokenizer keys. A value is written with the key's
    usual type (KEY_TYPES; special token ids as uint32), or as given by a `GGUFValue`."""
    path = Path(path)
    writer = gguf.GGUFWriter(path, "llama")
    for key, value in _HPARAMS.items():
        writer.add_uint32(key, value)
    for key, value in tokenizer.items():
        if not isinstance(value, GGUFValue):
            kind = KEY_TYPES.get(key, T.UINT32)
            value = GGUFValue(value, *kind) if isinstance(kind, tuple) else GGUFValue(value, kind)
        writer.kv_data[0][key] = value
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
