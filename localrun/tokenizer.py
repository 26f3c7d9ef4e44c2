"""Tokenizer: llama.cpp's own vocabulary (llama-cpp-python, vocab-only load), so token ids
are identical to llama.cpp's by construction, plus an incremental UTF-8-safe detokenizer."""
from __future__ import annotations

import codecs
import collections
import ctypes
import os
import re
import threading
from functools import cached_property

from layerplan.gguf_header import GGUFFormatError, read_header, shown
from localrun.errors import UserError
from localrun.vocab_check import check_vocabulary

MAX_TEXT_BYTES = 16 << 20   # far past any context; llama.cpp takes ~1 s per MB and counts in int32


class _LlamaLog:
    """llama.cpp's log lines during a load, kept rather than printed, so that a failed load
    can say why in its one sentence.

    Only the log is captured, through llama.cpp's log callback; fd 2 is left alone. When
    llama.cpp aborts the process instead of failing the load (a GGML_ASSERT, or a C++
    exception through its C API), its last words (the assert's file, line and condition, or
    the exception's what()) are written straight to fd 2 and so still reach the terminal or
    the server's log. llama-cpp-python's own quiet mode (verbose=False) would point fd 2 at
    /dev/null for the load, and such an abort would die without a word; vocab_check refuses
    every abort known beforehand, and this keeps an unknown one diagnosable."""

    _lock = threading.Lock()     # the callback is process-wide: one capture at a time
    MAX_LINES = 200

    def __init__(self, llama_cpp):
        self._lib = llama_cpp
        self.lines: collections.deque[tuple[int, str]] = collections.deque(maxlen=self.MAX_LINES)

    def __enter__(self) -> _LlamaLog:
        self._lock.acquire()

        @self._lib.llama_log_callback
        def capture(level: int, text: bytes, user_data) -> None:
            text = text.decode("utf-8", "replace") if text else ""
            if level == _LOG_CONTINUE and self.lines:
                level, text = self.lines[-1][0], self.lines.pop()[1] + text
            self.lines.append((level, text))

        self._callback = capture      # kept alive while llama.cpp holds it
        self._lib.llama_log_set(capture, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc) -> None:
        from llama_cpp._logger import llama_log_callback   # llama-cpp-python's, as it installed it
        self._lib.llama_log_set(llama_log_callback, ctypes.c_void_p(0))
        self._lock.release()

    def first_error(self) -> str | None:
        """The first error llama.cpp logged (the cause; later ones say what failed because of
        it), without the name of the function that logged it."""
        error = next((text.strip() for level, text in self.lines if level == _LOG_ERROR and text.strip()), None)
        return error and shown(re.sub(r"^\w+: (error loading model: )?", "", error), limit=300)


_LOG_ERROR, _LOG_CONTINUE = 4, 5    # ggml.h's ggml_log_level (NONE, DEBUG, INFO, WARN, ERROR, CONT)


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
        with _LlamaLog(llama_cpp) as log:
            try:
                # the model object alone: llama_cpp.Llama would also compile the file's chat
                # template with an unbounded jinja2 (localrun renders templates itself, bounded).
                # verbose=True only stops llama-cpp-python silencing fd 2 (see _LlamaLog)
                params = llama_cpp.llama_model_default_params()
                params.vocab_only = True
                self._model = LlamaModel(path_model=os.fspath(path), params=params, verbose=True)
            except Exception as e:   # any failure inside llama.cpp's load is about this file
                raise UserError(f"{path}: llama.cpp could not load the vocabulary ({log.first_error() or e})") from None
        self._vocab = self._model.vocab
        self.n_vocab = self._model.n_vocab()
        self._check_special_tokens(path)

    def _check_special_tokens(self, path) -> None:
        """llama.cpp asserts (and aborts) at the first tokenize that adds a BOS or EOS token the
        vocabulary lacks; vocab_check refuses such files from the header, and this asks the
        loaded vocabulary itself, in case a default of llama.cpp's was missed there."""
        lib, vocab = self._lib, self._vocab
        for name, adds, token in (("BOS", lib.llama_vocab_get_add_bos, lib.llama_vocab_bos),
                                  ("EOS", lib.llama_vocab_get_add_eos, lib.llama_vocab_eos)):
            if adds(vocab) and token(vocab) < 0:
                raise UserError(f"{path}: the vocabulary has no {name} token, yet llama.cpp is to add one to every "
                                "text (it would abort there)")

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids as llama.cpp gives them. `add_special` adds BOS when the model asks for it;
        `parse_special` turns control-token text such as <|im_start|> into its id."""
        if not text:
            return [self.bos_id] if add_special and self.add_bos and self.bos_id is not None else []
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError as e:    # a lone surrogate, as JSON's "\\ud800" gives
            raise UserError(f"the text is not valid Unicode (a lone surrogate at character {e.start:,})") from None
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
