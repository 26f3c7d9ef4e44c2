"""Tokenizer: llama.cpp's own vocabulary (llama-cpp-python, vocab-only load), so token ids
are identical to llama.cpp's by construction, plus an incremental UTF-8-safe detokenizer."""
from __future__ import annotations

import codecs
import contextlib
import os
import sys
from functools import cached_property

from layerplan.gguf_header import GGUFFormatError, read_header
from localrun.errors import UserError
from localrun.vocab_check import check_vocabulary

MAX_TEXT_BYTES = 16 << 20   # far past any context; llama.cpp takes ~1 s per MB and counts in int32


@contextlib.contextmanager
def _quiet_stderr():
    """Silence C-level writes to fd 2 for the duration (Python's sys.stderr is untouched)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class Tokenizer:
    def __init__(self, path: str | os.PathLike):
        try:
            import llama_cpp
        except ImportError:
            raise UserError("llama-cpp-python is not installed; run the set-up (make setup)") from None
        from llama_cpp._internals import LlamaModel   # pinned version (scripts/setup.sh)
        self._lib = llama_cpp
        try:    # validate first: llama.cpp aborts on some malformed vocabularies
            check_vocabulary(read_header(path))
        except GGUFFormatError as e:
            raise UserError(f"{path}: {e.detail}") from None
        except OSError as e:
            raise UserError(f"{path}: cannot be read ({e.strerror})") from None
        try:
            with _quiet_stderr():   # llama.cpp logs context warnings even with verbose=False
                # the model object alone: llama_cpp.Llama would also compile the file's chat
                # template with an unbounded jinja2 (localrun renders templates itself, bounded)
                params = llama_cpp.llama_model_default_params()
                params.vocab_only = True
                self._model = LlamaModel(path_model=os.fspath(path), params=params, verbose=False)
        except Exception as e:   # any failure inside llama.cpp's load is about this file
            raise UserError(f"{path}: llama.cpp could not load the vocabulary ({e})") from None
        self._vocab = self._model.vocab
        self.n_vocab = self._model.n_vocab()

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids as llama.cpp gives them. `add_special` adds BOS when the model asks for it;
        `parse_special` turns control-token text such as <|im_start|> into its id."""
        if not text:
            return [self.bos_id] if add_special and self.add_bos and self.bos_id is not None else []
        data = text.encode("utf-8")
        if len(data) > MAX_TEXT_BYTES:
            raise UserError(f"a text of {len(data):,} bytes is too long to tokenize (the limit is {MAX_TEXT_BYTES:,})")
        # a token covers at least one byte; special tokens (BOS, EOS) may be added: the buffer
        # is sized by the text, never by the file's trained context
        n_max = len(data) + 8
        while True:
            ids = (self._lib.llama_token * n_max)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), ids, n_max, add_special, parse_special)
            if n >= 0:
                return list(ids[:n])
            assert -n > n_max, f"llama_tokenize asks for {-n} tokens with room for {n_max}"
            n_max = -n

    def decode(self, ids: list[int], *, special: bool = False) -> str:
        return b"".join(self.piece(i, special=special) for i in ids).decode("utf-8", errors="replace")

    def piece(self, token_id: int, *, special: bool = False) -> bytes:
        """The bytes a token contributes to the text (control tokens give b'' unless special)."""
        table = self._special_pieces if special else self._pieces
        if not 0 <= token_id < len(table):
            raise UserError(f"token id {token_id} is outside the vocabulary (0..{len(table) - 1})")
        return table[token_id]

    @cached_property
    def _pieces(self) -> list[bytes]:
        return self._piece_table(special=False)

    @cached_property
    def _special_pieces(self) -> list[bytes]:
        return self._piece_table(special=True)

    def _piece_table(self, *, special: bool) -> list[bytes]:
        """Every token's bytes via llama_token_to_piece (which returns the length, or minus
        the size it needs when the buffer is too small)."""
        import ctypes
        size = 64
        buf = ctypes.create_string_buffer(size)
        table = []
        for i in range(self.n_vocab):
            n = self._lib.llama_token_to_piece(self._vocab, i, buf, size, 0, special)
            if n < 0:
                big = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._vocab, i, big, -n, 0, special)
                table.append(big.raw[:n])
            else:
                table.append(buf.raw[:n])
        return table

    @property
    def bos_id(self) -> int | None:
        t = self._model.token_bos()
        return None if t < 0 else t

    @property
    def eos_id(self) -> int | None:
        t = self._model.token_eos()
        return None if t < 0 else t

    @property
    def add_bos(self) -> bool:
        return bool(self._lib.llama_vocab_get_add_bos(self._vocab))

    @cached_property
    def eog_ids(self) -> frozenset[int]:
        """End-of-generation tokens (EOS, EOT, <|im_end|>, ...) as llama.cpp marks them."""
        return frozenset(i for i in range(self.n_vocab) if self._lib.llama_vocab_is_eog(self._vocab, i))

    def token_text(self, token_id: int) -> str:
        return self.piece(token_id, special=True).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    """Feeds token ids, returns only complete UTF-8 text, so a stream never shows a broken
    multi-byte character (emoji split across tokens, for instance)."""

    def __init__(self, tokenizer: Tokenizer, *, special: bool = False):
        self.tokenizer, self.special = tokenizer, special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        return self._decoder.decode(self.tokenizer.piece(token_id, special=self.special))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
