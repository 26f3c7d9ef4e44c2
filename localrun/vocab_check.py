"""What llama.cpp's vocab-only load assumes of a GGUF's vocabulary, checked beforehand.

llama.cpp reads the vocabulary arrays through raw pointers sized by the token count and checks
some of its assumptions only with asserts that abort the whole process (a duplicated token
text: GGML_ASSERT(id_to_token.size() == token_to_id.size())). A damaged or hostile file is
refused here with one sentence instead."""
from __future__ import annotations

import re

from layerplan.gguf_header import GGUFFormatError, GGUFHeader, read_array, shown

# GGUF value type ids (gguf-py's GGUFValueType), and the item type llama.cpp reads each array as
_INT32, _FLOAT32, _STRING, _ARRAY = 5, 6, 8, 9
_VOCAB_ARRAYS = {"tokenizer.ggml.tokens": _STRING, "tokenizer.ggml.scores": _FLOAT32,
                 "tokenizer.ggml.token_type": _INT32, "tokenizer.ggml.merges": _STRING}
_VOCAB_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")


def check_vocabulary(header: GGUFHeader) -> None:
    """Raise GGUFFormatError unless the vocabulary metadata has the types and lengths llama.cpp's
    vocab-only load assumes (it checks some of them only with asserts that abort the process)."""
    md, types = header.metadata, header.value_types or {}
    if "tokenizer.ggml.tokens" not in md:
        raise GGUFFormatError("the file has no vocabulary (tokenizer.ggml.tokens)")
    for key, item_type in _VOCAB_ARRAYS.items():
        if key in md and types.get(key, (_ARRAY, item_type)) != (_ARRAY, item_type):
            raise GGUFFormatError(f"'{key}' is not an array of {_TYPE_NAMES[item_type]}")
    n_tokens = len(md["tokenizer.ggml.tokens"])
    if not n_tokens:
        raise GGUFFormatError("the vocabulary (tokenizer.ggml.tokens) is empty")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        if key in md and len(md[key]) != n_tokens:
            raise GGUFFormatError(f"'{key}' has {len(md[key]):,} entries for {n_tokens:,} tokens")
    for key in _VOCAB_STRINGS:
        if key in md and not isinstance(md[key], str):
            raise GGUFFormatError(f"'{key}' is not text")
    model = md.get("tokenizer.ggml.model")
    if model not in _TOKENIZER_MODELS:
        raise GGUFFormatError(f"tokenizer model '{shown(str(model))}' is not supported (supported: "
                              f"{', '.join(_TOKENIZER_MODELS)})")
    _check_token_texts(header, model)


def _check_token_texts(header: GGUFHeader, model: str) -> None:
    """llama.cpp asserts that token texts are distinct (an empty one counts as "[EMPTY_<id>]"),
    and reads a SentencePiece byte token's value from its text "<0xHH>"."""
    tokens = read_array(header, "tokenizer.ggml.tokens", raw_strings=True)
    seen = set()
    for i, text in enumerate(tokens):
        text = text or f"[EMPTY_{i}]".encode()
        if text in seen:
            raise GGUFFormatError(f"the vocabulary lists the token {shown(text.decode('utf-8', 'replace'))!r} "
                                  f"twice (again at id {i:,})")
        seen.add(text)
    if model == "llama" and "tokenizer.ggml.token_type" in header.metadata:
        types = read_array(header, "tokenizer.ggml.token_type")
        for i, (text, token_type) in enumerate(zip(tokens, types)):
            if token_type == _BYTE_TOKEN and not _BYTE_TEXT.fullmatch(text):
                raise GGUFFormatError(f"byte token {i:,} is spelled {shown(text.decode('utf-8', 'replace'))!r}, "
                                      "not <0xHH>")


_TYPE_NAMES = {_INT32: "int32", _FLOAT32: "float32", _STRING: "strings"}
_TOKENIZER_MODELS = ("gpt2", "llama")    # BPE and SentencePiece: what llama-architecture files use
_BYTE_TOKEN = 6                          # gguf-py's TokenType.BYTE
_BYTE_TEXT = re.compile(rb"<0x[0-9A-Fa-f]{2}>")
