"""The vocabulary as llama.cpp will read it, checked from the GGUF header before llama.cpp sees
the file.

llama.cpp (llama-vocab.cpp: `llama_vocab::impl::load`, then `tokenize`) reports most problems
with an exception that its loader catches (a missing key, a key of the wrong type, an unknown
pre-tokenizer: the load fails, the process lives), but a few only with a GGML_ASSERT or with a
C++ exception that crosses its C API; both abort the whole process. For the tokenizer models
localrun accepts ("gpt2": BPE, "llama": SentencePiece) those are:

- at load, `GGML_ASSERT(id_to_token.size() == token_to_id.size())`: two tokens with one text.
  llama.cpp reads a text as a C string, so `b"a\\x00b"` is "a", and an empty one becomes
  "[EMPTY_<id>]" (which may in turn equal another token's text);
- at tokenize, SentencePiece's byte fallback: a character that no token covers (a space when
  "▁" is no token, any rare character) is looked up byte by byte as "<0xHH>", then as the
  one-byte text, with `token_to_id.at()`: std::out_of_range if neither is a token;
- at tokenize, `GGML_ASSERT(special_bos_id != LLAMA_TOKEN_NULL)` when the model adds a BOS
  token and has none in range (likewise EOS);
- at tokenize, BPE's `find_bpe_rank` asserts that no symbol holds a space: every pre-tokenizer
  maps spaces to other characters first (GPT-2's byte encoding, or "▁") but "whitespace".

Each is one sentence here (GGUFFormatError). The rest of the load path was read for the same
hazards and needs nothing: special ids out of range are disabled with a warning, merges are
split at their first space after the first byte and never asserted on, token types out of
range read as "undefined", a byte token spelled too short throws inside the load's try, and
the precompiled charsmap belongs to "t5", which is refused. What llama.cpp refuses with an
exception (the load fails, the process lives) is refused here too where a sentence is cheap
(types, lengths, missing merges, byte tokens not spelled <0xHH>), so that `localrun info`
says what `generate` would. tests/test_vocab_check.py runs each case through llama.cpp."""
from __future__ import annotations

import re

from layerplan.gguf_header import GGUFFormatError, GGUFHeader, read_array, shown

# GGUF value type ids (gguf-py's GGUFValueType), and the item type llama.cpp reads each array as
_UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = 4, 5, 6, 7, 8, 9
_VOCAB_ARRAYS = {"tokenizer.ggml.tokens": _STRING, "tokenizer.ggml.scores": _FLOAT32,
                 "tokenizer.ggml.token_type": _INT32, "tokenizer.ggml.merges": _STRING}
_VOCAB_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_TYPE_NAMES = {_INT32: "int32", _FLOAT32: "float32", _STRING: "strings"}
_TOKENIZER_MODELS = ("gpt2", "llama")    # BPE and SentencePiece: what llama-architecture files use
_BYTE_TOKEN = 6                          # gguf-py's TokenType.BYTE
_BYTE_TEXT = re.compile(rb"<0x[0-9A-Fa-f]{2}>")

# Every special-token id key llama.cpp reads (as uint32; another type fails its load)
_SPECIAL_ID_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in (
    "bos", "eos", "eot", "eom", "unknown", "seperator", "padding", "mask", "fim_pre", "fim_suf", "fim_mid",
    "fim_pad", "fim_rep", "fim_sep", "prefix", "suffix", "middle"))
_ADD_KEYS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token")   # bools
# llama.cpp's default (BOS, EOS) ids per tokenizer model, used when the file names none in range
_DEFAULT_BOS_EOS = {"llama": (1, 2), "gpt2": (11, 11)}
# BPE pre-tokenizers whose default is to add BOS (the file's add_bos_token overrides it), and
# those that add it whatever the file says (llama-vocab.cpp, the pre-tokenizer table)
_PRE_ADDS_BOS = frozenset(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                           "lfm2", "jina-v5-nano", "tekken", "chameleon"))
_PRE_ALWAYS_ADDS_BOS = frozenset(("gemma4", "granite-embed-multi-311m"))
# The bytes valid UTF-8 can hold: SentencePiece falls back to these for text no token covers
# (0xC0, 0xC1 and 0xF5-0xFF never occur in UTF-8)
_UTF8_BYTES = tuple(b for b in range(0xF5) if b not in (0xC0, 0xC1))


def check_vocabulary(header: GGUFHeader) -> None:
    """Raise GGUFFormatError unless the vocabulary metadata is what llama.cpp's vocab-only load
    and its tokenizer assume (some of it they check only with asserts that abort the process)."""
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
    for key, wanted, name in [*((k, _UINT32, "uint32") for k in _SPECIAL_ID_KEYS),
                              *((k, _BOOL, "bool") for k in _ADD_KEYS)]:
        if key in md and types.get(key) != wanted:
            raise GGUFFormatError(f"'{key}' is not a {name}, the type llama.cpp reads it as")
    model = md.get("tokenizer.ggml.model")
    if model not in _TOKENIZER_MODELS:
        raise GGUFFormatError(f"tokenizer model '{shown(str(model))}' is not supported (supported: "
                              f"{', '.join(_TOKENIZER_MODELS)})")
    known = _check_token_texts(header)
    if model == "llama":
        _check_sentencepiece(header, known)
    else:
        _check_bpe(header)
    _check_bos_eos(header, model, n_tokens)


def as_llama_reads(text: bytes, token_id: int) -> bytes:
    """A token's text as llama.cpp keys it: a C string (up to the first NUL byte), and an empty
    one renamed "[EMPTY_<id>]"."""
    return text.split(b"\0", 1)[0] or b"[EMPTY_%d]" % token_id


def _check_token_texts(header: GGUFHeader) -> set[bytes]:
    """Token texts are distinct as llama.cpp reads them, and a byte token's value is read from
    its text "<0xHH>" (llama.cpp's token_to_byte, for BPE and SentencePiece alike). Returns the
    set of texts as llama.cpp reads them."""
    raw = read_array(header, "tokenizer.ggml.tokens", raw_strings=True)
    as_read = b"\0" in b"".join(raw) or not all(raw)      # else every text reads as it is stored
    texts = [as_llama_reads(text, i) for i, text in enumerate(raw)] if as_read else raw
    distinct = set(texts)
    if len(distinct) != len(texts):
        first_id: dict[bytes, int] = {}
        for i, text in enumerate(texts):
            j = first_id.setdefault(text, i)
            if j != i:
                cut = b"\0" in raw[i] or b"\0" in raw[j]
                raise GGUFFormatError(f"the vocabulary lists the token {_shown(text)!r} twice (again at id {i:,})"
                                      + (", reading each text up to its first NUL byte as llama.cpp does" if cut
                                         else ""))
    if "tokenizer.ggml.token_type" in header.metadata:
        types = read_array(header, "tokenizer.ggml.token_type")
        for i, (text, token_type) in enumerate(zip(texts, types)):
            if token_type == _BYTE_TOKEN and not _BYTE_TEXT.fullmatch(text):
                raise GGUFFormatError(f"byte token {i:,} is spelled {_shown(text)!r}, not <0xHH>")
    return distinct


def _check_sentencepiece(header: GGUFHeader, known: set[bytes]) -> None:
    """SentencePiece needs, for every byte text can hold, a byte token "<0xHH>" (or the one-byte
    text itself) for its byte fallback, and its scores (they are its merge order: without them
    llama.cpp does not abort, but splits text as the model never saw it)."""
    missing = [b for b in _UTF8_BYTES if b"<0x%02X>" % b not in known and bytes((b,)) not in known]
    if missing:
        others = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise GGUFFormatError(f"the SentencePiece vocabulary (tokenizer model 'llama') lacks the byte token "
                              f"<0x{missing[0]:02X}>{others}, which llama.cpp needs for text no token covers "
                              f"(it would abort on such text)")
    if "tokenizer.ggml.scores" not in header.metadata:
        raise GGUFFormatError("the SentencePiece vocabulary (tokenizer model 'llama') has no token scores "
                              "(tokenizer.ggml.scores)")


def _check_bpe(header: GGUFHeader) -> None:
    """BPE needs its merges, and a pre-tokenizer that leaves no space inside a word: llama.cpp
    asserts that no BPE symbol holds one. Every pre-tokenizer but "whitespace" maps spaces to
    other characters first (GPT-2's byte encoding, or "▁")."""
    if "tokenizer.ggml.merges" not in header.metadata:
        raise GGUFFormatError("the BPE vocabulary (tokenizer model 'gpt2') has no merges (tokenizer.ggml.merges)")
    if _c_string(header.metadata.get("tokenizer.ggml.pre", "")) == "whitespace":
        raise GGUFFormatError("the BPE pre-tokenizer 'whitespace' leaves spaces inside words, which llama.cpp's "
                              "BPE asserts against (it would abort on two spaces in a row)")


def _check_bos_eos(header: GGUFHeader, model: str, n_tokens: int) -> None:
    """When llama.cpp adds BOS (or EOS) to a text, the model must have one in range: llama.cpp
    takes the file's id if in range, else its default for the model if in range, else none."""
    md = header.metadata
    pre = _c_string(md.get("tokenizer.ggml.pre", ""))
    adds_bos = model == "llama" or pre in _PRE_ADDS_BOS
    adds_bos = md.get("tokenizer.ggml.add_bos_token", adds_bos) or (model == "gpt2" and pre in _PRE_ALWAYS_ADDS_BOS)
    adds_eos = md.get("tokenizer.ggml.add_eos_token", False)
    for name, adds, default in (("BOS", adds_bos, _DEFAULT_BOS_EOS[model][0]),
                                ("EOS", adds_eos, _DEFAULT_BOS_EOS[model][1])):
        key = f"tokenizer.ggml.{name.lower()}_token_id"
        token_id = md[key] if key in md and md[key] < n_tokens else default if default < n_tokens else None
        if adds and token_id is None:
            raise GGUFFormatError(f"the vocabulary has no {name} token ('{key}' names none of its {n_tokens:,} "
                                  f"tokens), yet llama.cpp is to add one to every text (it would abort there)")


def _c_string(text: str) -> str:
    return text.split("\0", 1)[0]


def _shown(text: bytes) -> str:
    return shown(text.decode("utf-8", "replace"))
