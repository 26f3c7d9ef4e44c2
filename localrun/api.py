"""The public Python API: `localrun.LLM`."""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch

from localrun.chat_template import render_chat
from localrun.engine.llm_engine import LLMEngine
from localrun.errors import UserError
from localrun.gguf_file import open_gguf
from localrun.loader import load_weights
from localrun.model.llama import Transformer
from localrun.models import resolve_model
from localrun.runner import SequenceRunner
from localrun.sampling import SamplingParams
from localrun.text_stream import TextStream
from localrun.tokenizer import Tokenizer

DEFAULT_CTX = 4096


def default_threads() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_dtype() -> torch.dtype:
    """float32. bf16 (dtype="bfloat16") makes prefill several times faster on CPUs with AMX
    or AVX512-BF16, but it agrees less with llama.cpp (SmolLM2, 586 teacher-forced tokens:
    top-1 95.05% and KL 0.0043 in bf16, against 95.6% and 0.0031 in float32), and on CPUs
    without bf16 hardware torch emulates it and it is about 4x slower than float32."""
    return torch.float32


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str                      # "stop" | "length"
    timings: dict = field(default_factory=dict)


class LLM:
    """A GGUF model on the native PyTorch engine.

    >>> llm = LLM("smollm2-135m")
    >>> llm.generate("The capital of France is", max_tokens=8, temperature=0).text
    """

    def __init__(self, model: str | os.PathLike | None = None, *, n_ctx: int | None = None,
                 n_threads: int | None = None, dtype: torch.dtype | str | None = None,
                 n_parallel: int = 4, kv_type: str | None = None, enable_prefix_caching: bool = True,
                 verbose: bool = False):
        self.model_path = resolve_model(model)
        self.file = open_gguf(self.model_path)
        self.config = self.file.config
        self.n_threads = n_threads or default_threads()
        if self.n_threads < 1:
            raise UserError(f"n_threads must be >= 1, got {self.n_threads}")
        torch.set_num_threads(self.n_threads)
        self.n_ctx = n_ctx or min(self.config.context_length, DEFAULT_CTX)
        if self.n_ctx < 2:
            raise UserError(f"n_ctx must be at least 2, got {self.n_ctx}")
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or default_dtype())
        t0 = time.perf_counter()
        weights = load_weights(self.file, self.dtype)
        self.model = Transformer(self.config, weights, max_positions=self.n_ctx)
        self.load_s = time.perf_counter() - t0
        if n_parallel < 1:
            raise UserError(f"n_parallel must be >= 1, got {n_parallel}")
        self.n_parallel, self.kv_type = n_parallel, kv_type
        self.enable_prefix_caching = enable_prefix_caching
        self._engine: LLMEngine | None = None
        self._request_ids = itertools.count()
        self.verbose = verbose

    # -- tokens ---------------------------------------------------------------------------
    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.model_path)

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids: list[int], special: bool = True) -> str:
        """Text of token ids; control tokens such as <|im_start|> are written out unless
        special=False, so detokenize(tokenize(text)) == text."""
        return self.tokenizer.decode(self._check_ids(ids), special=special)

    @cached_property
    def runner(self) -> SequenceRunner:
        """The reference path behind logits(): a contiguous KV cache, allocated on first use
        so that generation alone never pays for it."""
        return SequenceRunner(self.model, self.n_ctx)

    def reset(self) -> None:
        """Forget cached prefixes (the next prompt is computed from scratch)."""
        if "runner" in self.__dict__:
            self.runner.cached_ids = []
        if self._engine is not None:
            self._engine.reset_prefix_cache()

    # -- logits ---------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position: float32 (len(ids), n_vocab)."""
        ids = self._check_ids(ids)
        if len(ids) > self.n_ctx:
            raise UserError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        self.reset()
        out = torch.cat([self.runner.forward(ids[i:i + 512], i, all_logits=True)
                         for i in range(0, len(ids), 512)])
        return out.float()

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompt: str | list[int] | list[str] | list[list[int]], **kwargs):
        """Complete `prompt` (text or token ids). Keyword arguments are SamplingParams fields:
        max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, ignore_eos.
        A list of prompts runs them together (continuous batching) and returns a list."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            results: dict[int, GenerationResult] = {}
            for item in self._run(list(prompt), kwargs):
                if isinstance(item[1], GenerationResult):
                    results[item[0]] = item[1]
            return [results[i] for i in range(len(prompt))]
        return next(r for _, r in self._run([prompt], kwargs) if isinstance(r, GenerationResult))

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Yield text pieces as they are generated (never a broken UTF-8 character).
        After the loop, `self.last_result` holds the GenerationResult."""
        for _, item in self._run([prompt], kwargs):
            if isinstance(item, GenerationResult):
                self.last_result = item
            elif item:
                yield item

    def chat(self, messages: list[dict], *, stream: bool = False, **kwargs):
        """Reply to a conversation ([{role, content}, ...]) through the model's chat template.
        Returns a GenerationResult, or an iterator of text pieces when stream=True."""
        ids = self.chat_prompt_ids(messages)
        return self.stream(ids, **kwargs) if stream else self.generate(ids, **kwargs)

    def chat_prompt_ids(self, messages: list[dict]) -> list[int]:
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        text = render_chat(self.config.chat_template, messages, bos_token=bos, eos_token=eos)
        # templates that write BOS themselves (or start with it, as ChatML does for SmolLM2)
        # must not get a second one
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        return tok.encode(text, add_special=add_bos)

    @property
    def engine(self) -> LLMEngine:
        """The paged, continuously batched engine (built on first use: it needs the tokenizer's
        end-of-generation ids)."""
        if self._engine is None:
            self._engine = LLMEngine(self.model, tokenizer_eog_ids=tuple(self.tokenizer.eog_ids),
                                     max_model_len=self.n_ctx, kv_type=self.kv_type,
                                     max_num_seqs=self.n_parallel, clock=time.perf_counter,
                                     enable_prefix_caching=self.enable_prefix_caching)
        return self._engine

    def _params(self, kwargs) -> SamplingParams:
        kwargs = dict(kwargs)
        stop = kwargs.pop("stop", None)
        if stop is not None:
            kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        try:
            return SamplingParams(**kwargs)
        except TypeError as e:
            raise UserError(f"unknown generation option: {e}") from None

    def _run(self, prompts: list, kwargs) -> Iterator[tuple[int, str | GenerationResult]]:
        """Run prompts through the engine; yield (prompt index, text piece), and at the end of
        each request (prompt index, GenerationResult)."""
        arrival = time.perf_counter()
        params = self._params(kwargs)
        engine, eog = self.engine, self.tokenizer.eog_ids
        requests = {}
        for i, prompt in enumerate(prompts):
            ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_ids(prompt)
            if not ids:
                raise UserError("the prompt is empty")
            if len(ids) >= self.n_ctx:
                raise UserError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                                f"shorten it or raise --ctx")
            requests[f"req-{next(self._request_ids)}"] = (i, ids)
        texts = {rid: TextStream(self.tokenizer, params.stop) for rid in requests}
        out_ids = {rid: [] for rid in requests}
        try:
            for rid, (_, ids) in requests.items():
                engine.add_request(rid, ids, params, arrival_time=arrival)
            pending = set(requests)
            while pending:
                for out in engine.step():
                    rid = out.seq.request_id
                    if rid not in pending:
                        continue
                    index, text = requests[rid][0], texts[rid]
                    if out.token_id is not None and not (out.token_id in eog and not params.ignore_eos):
                        out_ids[rid].append(out.token_id)
                        piece = text.feed(out.token_id)
                        if piece:
                            yield index, piece
                        if text.stopped and not out.finished:
                            engine.finish_request(rid, "stop")
                            out = out._replace(finished=True)
                    if out.finished:
                        pending.discard(rid)
                        tail = text.finish()
                        if tail:
                            yield index, tail
                        finish = "stop" if text.stopped or out.seq.finish_reason == "stop" else "length"
                        yield index, GenerationResult(text.text, out_ids[rid], finish, self._timings(out.seq))
        finally:   # Ctrl-C or an abandoned stream: free the requests' blocks
            for rid in requests:
                engine.abort(rid)

    @staticmethod
    def _timings(seq) -> dict:
        t = seq.timings()
        computed = t["prompt_tokens"] - (t["cached_tokens"] or 0)
        t["prefill_tok_s"] = computed / t["prefill_s"] if t.get("prefill_s") else None
        for key in ("queue_s", "prefill_s", "ttft_s", "decode_tok_s"):
            t[key] = t[key] or 0.0
        return t

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        return ids
