"""Structured output: JSON schemas and grammars compiled to a per-token mask, failing closed.

The mask comes from llguidance (Microsoft's grammar engine, the one llama.cpp links for
`--grammar` with LLGUIDANCE=ON). Chosen over xgrammar and outlines-core after measuring all
three on SmolLM2's 49,152-token vocabulary (benchmarks/grammar_mask.py, docs/server.md):
llguidance compiles a 10-field schema in ~1 ms and masks a token in ~0.1 ms; xgrammar is as
fast but pulls transformers and triton into the install; outlines-core compiles in ~180 ms
and answers a list of allowed ids (0.3 ms a token before it is a mask). llguidance also reads
GBNF (llama.cpp's grammar format) and Lark, and builds its tokenizer from token bytes.

Failing closed: a JSON schema is first checked against the subset of keywords we know the
mask enforces (`check_schema`); any other keyword is refused by name (`GrammarError`, a
400 naming it), never silently ignored. llguidance's own errors and warnings (about parts of
a schema or grammar it would not enforce) are refused the same way.

Compiled grammars are cached by their canonical text (`GrammarCompiler`, an LRU); each
sequence gets its own copy of the compiled matcher (`Constraint.new_matcher`).
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import torch

from localrun.cpu_info import lower_thread_priority
from localrun.errors import UserError

# The JSON Schema keywords the mask enforces (checked against jsonschema in the tests), and
# those that only annotate. Anything else is refused by name.
SUPPORTED_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "minLength", "maxLength", "pattern", "format", "anyOf", "oneOf", "allOf", "$ref", "$defs",
    "definitions",
})
ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default", "examples",
                         "deprecated", "readOnly", "writeOnly"})
SUPPORTED_FORMATS = frozenset({"date-time", "date", "time", "email", "uuid", "ipv4"})
JSON_TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
CACHE_SIZE = 64
# A schema's or grammar's text, at most: real schemas (tool sets included) are a few KB, and
# the cost of a mask grows with the grammar (a 500 KB `const` took 4 s for its first mask).
MAX_SOURCE_BYTES = 128 * 1024
# A repetition count in a grammar (`x{m,n}`), at most: llama.cpp's GBNF parser refuses more
# (MAX_REPETITION_THRESHOLD); llguidance compiled "x"{1000000} in 4 s, then gave up mid-reply.
MAX_REPETITION = 2000
GRAMMAR_NICE = 10         # the grammar thread's nice value: ~10% of a core against busy engine threads
_REPETITION = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')     # a string literal: its braces are text


class GrammarError(UserError, ValueError):
    """A schema or grammar we cannot enforce; `field` names the request field (a 400)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def check_schema(schema, field: str = "json_schema", where: str = "schema") -> None:
    """Refuse (GrammarError) anything in `schema` outside the enforced subset, naming it."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(field, f"{where} must be a JSON object (a schema), got {type(schema).__name__}")
    for key, value in schema.items():
        here = f"{where}.{key}"
        if key in ANNOTATIONS:
            continue
        if key not in SUPPORTED_KEYWORDS:
            raise GrammarError(field, f"the JSON schema keyword '{key}' (at {here}) is not supported: "
                                      f"the output could not be held to it; see docs/server.md for the subset")
        if key == "type":
            types = value if isinstance(value, list) else [value]
            bad = [t for t in types if t not in JSON_TYPES]
            if bad or not types:
                raise GrammarError(field, f"{here}: unknown type {bad[0] if bad else value!r}")
        elif key == "properties" or key in ("$defs", "definitions"):
            if not isinstance(value, dict):
                raise GrammarError(field, f"{here} must be an object")
            for name, sub in value.items():
                check_schema(sub, field, f"{here}.{name}")
        elif key in ("items", "additionalProperties"):
            check_schema(value, field, here)
        elif key in ("prefixItems", "anyOf", "oneOf", "allOf"):
            if not isinstance(value, list) or not value:
                raise GrammarError(field, f"{here} must be a non-empty list of schemas")
            for i, sub in enumerate(value):
                check_schema(sub, field, f"{here}[{i}]")
        elif key == "required":
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise GrammarError(field, f"{here} must be a list of property names")
        elif key == "enum":
            if not isinstance(value, list) or not value:
                raise GrammarError(field, f"{here} must be a non-empty list")
        elif key == "format" and value not in SUPPORTED_FORMATS:
            raise GrammarError(field, f"the string format {value!r} (at {here}) is not supported; "
                                      f"supported: {', '.join(sorted(SUPPORTED_FORMATS))}")
        elif key == "$ref" and not (isinstance(value, str) and value.startswith("#")):
            raise GrammarError(field, f"{here}: only local references ('#/$defs/...') are supported")
        elif key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minItems", "maxItems",
                     "minLength", "maxLength"):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise GrammarError(field, f"{here} must be a number")


class Matcher:
    """One sequence's grammar state: the mask of the tokens that may come next, and the
    tokens consumed so far.

    The mask for the next token is computed ahead, on the compiler's grammar thread, as soon
    as the tokens before it are known (`advance`): the engine thread never computes one. The
    scheduler leaves a sequence out of a step until its mask is `ready`, so a costly grammar
    slows its own request, not the others' steps. The first mask (the grammar's start) was
    computed when the grammar was compiled, at the door."""

    def __init__(self, ll_matcher, n_vocab: int, first_allowed: torch.Tensor, worker: Executor):
        self._m = ll_matcher
        self.n_vocab = n_vocab
        self._worker = worker
        self._pending: Future = Future()
        self._pending.set_result(first_allowed)

    def advance(self, token_ids: list[int]) -> None:
        """Consume token_ids and compute the mask after them, on the grammar thread."""
        self._pending = self._worker.submit(self._advance, list(token_ids))

    def ready(self) -> bool:
        """The next token's mask is computed (or its computation failed)."""
        return self._pending.done()

    def wait(self, timeout: float | None = None) -> None:
        wait_futures([self._pending], timeout)

    def allowed(self) -> torch.Tensor:
        """(n_vocab,) bool: the tokens the grammar allows next (EOS once it is complete).
        Waits for the grammar thread if the mask is not ready; raises the grammar's error."""
        return self._pending.result()

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) with every token the grammar forbids at -inf."""
        allowed = self.allowed()
        if logits.shape[0] > allowed.shape[0]:      # the model's padding rows: never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(logits.shape[0] - allowed.shape[0])])
        return logits.masked_fill(~allowed[:logits.shape[0]], float("-inf"))

    def consume(self, token_id: int) -> None:
        """Consume one token now (raises if the grammar refuses it)."""
        self.advance([token_id])
        self.allowed()

    @property
    def is_accepting(self) -> bool:
        self.allowed()         # the grammar thread is done with the matcher
        return self._m.is_accepting()

    # --- on the grammar thread ---------------------------------------------------------------
    def _advance(self, token_ids: list[int]) -> torch.Tensor:
        for token_id in token_ids:
            if not self._m.consume_token(token_id):
                raise RuntimeError(f"the grammar refused token {token_id}"
                                   + (f" ({_short(self._m.get_error())})" if self._m.is_error() else ""))
        return compute_allowed(self._m, self.n_vocab)


def compute_allowed(ll_matcher, n_vocab: int) -> torch.Tensor:
    """(n_vocab,) bool: the tokens ll_matcher allows next (RuntimeError if it is in error)."""
    bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    ll_matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    if ll_matcher.is_error():
        raise RuntimeError(f"grammar matcher: {_short(ll_matcher.get_error())}")
    return torch.from_numpy(np.unpackbits(bits.view(np.uint8), bitorder="little")[:n_vocab].astype(bool))


@dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled grammar (from a schema, a grammar text, or a tool-call format)."""
    kind: str            # "json_schema" | "json_object" | "grammar" | "lark"
    key: str             # its canonical source: the cache key
    _template: object    # llguidance.LLMatcher at the start state
    n_vocab: int
    first_allowed: torch.Tensor     # (n_vocab,) bool: the start state's mask, computed at compile time
    _worker: Executor               # the compiler's grammar thread

    def new_matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy(), self.n_vocab, self.first_allowed, self._worker)


class _VocabAdapter:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, EOS, a tokenize call."""

    def __init__(self, tokenizer, eos_ids: list[int]):
        self.tokens = [tokenizer.piece(i, special=True) for i in range(tokenizer.n_vocab)]
        # control tokens spell nothing in text: the grammar never produces them as text
        self.special_token_ids = [i for i in range(tokenizer.n_vocab)
                                  if self.tokens[i] and not tokenizer.piece(i, special=False)]
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = tokenizer.bos_id
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        data = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(data, add_special=False, parse_special=False)


class GrammarCompiler:
    """Compiles schemas and grammars for one vocabulary; compiled results are cached by their
    canonical text (LRU, CACHE_SIZE). Thread-safe."""

    def __init__(self, tokenizer, eos_ids):
        import llguidance
        self._ll = llguidance
        eos = sorted(eos_ids) or [tokenizer.eos_id]
        self.n_vocab = tokenizer.n_vocab
        self.ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_VocabAdapter(tokenizer, eos)),
                                                   eos_token=eos)
        self._cache: OrderedDict[tuple[str, str], Constraint] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        # every matcher's masks after the first are computed here, off the engine thread, at a
        # lower priority than the engine's threads: a costly grammar takes CPU from its own
        # request, not from the batch's steps (GRAMMAR_NICE; docs/measurements.md)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localrun-grammar",
                                          initializer=lower_thread_priority, initargs=(GRAMMAR_NICE,))
        # compiles (and their first mask: up to a second or two within the bounds) on a thread of
        # their own at the same priority, so that they hold neither the batch nor other masks
        self._compile_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="localrun-grammar-compile",
                                                  initializer=lower_thread_priority, initargs=(GRAMMAR_NICE,))

    # --- the kinds of constraint ---------------------------------------------------------
    def from_options(self, json_schema=None, grammar: str | None = None) -> Constraint | None:
        """The Python API's options: json_schema (a dict or JSON text) or grammar (GBNF, Lark)."""
        if json_schema is not None and grammar is not None:
            raise GrammarError("grammar", "give json_schema or grammar, not both")
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except ValueError as e:
                raise GrammarError("json_schema", f"json_schema is not valid JSON ({e})") from None
        if json_schema is not None:
            return self.json_schema(json_schema, "json_schema")
        return None if grammar is None else self.grammar(grammar, "grammar")

    def json_schema(self, schema, field: str = "json_schema") -> Constraint:
        """Output that is one JSON value matching `schema` (checked: fails closed)."""
        check_schema(schema, field)
        # not sorted: properties come out in the order the schema gives them
        key = json.dumps(schema, separators=(",", ":"))
        check_size(key, field)
        return self._compiled("json_schema", key, field,
                              lambda: self._ll.LLMatcher.grammar_from_json_schema(
                                  key, defaults={"whitespace_flexible": False}))

    def json_object(self) -> Constraint:
        """OpenAI's JSON mode: any JSON object."""
        return self.json_schema({"type": "object"}, "response_format")

    def grammar(self, text: str, field: str = "grammar") -> Constraint:
        """A grammar in llama.cpp's GBNF (or Lark, which llguidance reads natively)."""
        if not isinstance(text, str) or not text.strip():
            raise GrammarError(field, f"{field} must be a non-empty grammar (GBNF or Lark)")
        check_size(text, field)
        from llguidance.gbnf_to_lark import any_to_lark
        try:
            lark = any_to_lark(text)
        except Exception as e:      # noqa: BLE001 - the converter's parse errors are the user's
            raise GrammarError(field, f"{field} does not parse as GBNF: {_short(e, 200)}") from None
        return self.lark(lark, field, kind="grammar")

    def lark(self, lark: str, field: str, kind: str = "lark") -> Constraint:
        check_repetitions(lark, field)
        return self._compiled(kind, lark, field, lambda: self._ll.LLMatcher.grammar_from_lark(lark))

    # --- compiling, cached -----------------------------------------------------------------
    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def _compiled(self, kind: str, key: str, field: str, build) -> Constraint:
        with self._lock:
            hit = self._cache.get((kind, key))
            if hit is not None:
                self._cache.move_to_end((kind, key))
                return hit
        constraint = self._compile_worker.submit(self._compile, kind, key, field, build).result()
        with self._lock:
            self._cache[(kind, key)] = constraint
            self.num_compiled += 1
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return constraint

    def _compile(self, kind: str, key: str, field: str, build) -> Constraint:
        """On the compile thread: the grammar checked, its matcher built, its start state's mask."""
        try:
            grammar = build()
        except Exception as e:      # noqa: BLE001 - a schema llguidance cannot read
            raise GrammarError(field, f"{field} cannot be compiled: {_reason(e)}") from None
        is_error, messages = self._ll.LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error or messages:    # a warning means part of it would not be enforced: refuse
            raise GrammarError(field, f"{field} cannot be enforced: {_reason(messages[0] if messages else '')}")
        limits = self._ll.LLParserLimits(verbose_errors=False)     # errors without the grammar's text
        template = self._ll.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if template.is_error():
            raise GrammarError(field, f"{field} cannot be enforced: {_reason(template.get_error())}")
        try:    # the start state's mask: errors that only show at the first token show here
            first_allowed = compute_allowed(template, self.n_vocab)
        except RuntimeError as e:
            raise GrammarError(field, f"{field} cannot be enforced: {_reason(e)}") from None
        if not first_allowed.any():
            raise GrammarError(field, f"{field} cannot be enforced: {_NO_START}")
        return Constraint(kind, key, template, self.n_vocab, first_allowed, self._worker)


def check_repetitions(lark: str, field: str) -> None:
    """Refuse a repetition count over MAX_REPETITION (outside string literals; inside regexes too)."""
    for match in _REPETITION.finditer(_QUOTED.sub('""', lark)):
        count = max(int(n) for n in match.groups() if n)
        if count > MAX_REPETITION:
            raise GrammarError(field, f"{field} repeats an item {count:,} times; the limit is {MAX_REPETITION:,}")


def check_size(text: str, field: str) -> None:
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_SOURCE_BYTES:
        raise GrammarError(field, f"{field} is {size:,} bytes; the limit is {MAX_SOURCE_BYTES:,}")


_NO_START = "no text can start it (a rule that refers only to itself, or to rules that never reach any text)"
# llguidance's error codes and phrases, as one sentence a client can act on
_REASONS = (("NoExtensionBias", _NO_START),
            ("too many expressions", "it is too large or too repetitive to enforce"),
            ("max_items_in_row", "a rule has too many alternatives"),
            ("Earley", "it is too ambiguous to enforce (too many alternatives at one point)"),
            ("grammar size", "it is too large to enforce"),
            ("fuel", "it is too costly to enforce (a pattern or repetition too large)"))


def _reason(message) -> str:
    """llguidance's message as our sentence: a known cause named, else its first line, short."""
    text = str(message)
    for needle, reason in _REASONS:
        if needle.lower() in text.lower():
            return reason
    first = next((line for line in text.splitlines() if line.strip() and "non-verbose" not in line), "")
    return _short(first, 200) or "llguidance refused it"


def _short(message, limit: int = 300) -> str:
    message = " ".join(str(message).split())
    return message if len(message) <= limit else message[:limit] + "..."
