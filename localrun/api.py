"""The public Python API: `localrun.LLM`."""
from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property

import torch

from localrun.chat_template import render_chat
from localrun.errors import UserError
from localrun.gguf_file import open_gguf
from localrun.loader import load_weights
from localrun.model.llama import Transformer
from localrun.models import resolve_model
from localrun.runner import SequenceRunner, Timeline
from localrun.sampling import SamplingParams
from localrun.text_stream import TextStream
from localrun.tokenizer import Tokenizer

DEFAULT_CTX = 4096


def default_threads() -> int:
    import psutil
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def default_dtype() -> torch.dtype:
    """The compute dtype on this CPU: bf16 only where the hardware has bf16 dot products
    (AVX512-BF16 or AMX); elsewhere torch emulates bf16 and float32 is several times faster."""
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        check = getattr(cpu, probe, None)
        if check is not None and check():
            return torch.bfloat16
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
        self.runner = SequenceRunner(self.model, self.n_ctx)
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

    def reset(self) -> None:
        """Forget the cached prefix (the next prompt is computed from scratch)."""
        self.runner.cached_ids = []

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
    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Complete `prompt` (text or token ids). Keyword arguments are SamplingParams fields:
        max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, seed, stop, ignore_eos."""
        pieces = []
        result = None
        for piece in self._run(prompt, kwargs):
            if isinstance(piece, GenerationResult):
                result = piece
            else:
                pieces.append(piece)
        return result

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Yield text pieces as they are generated (never a broken UTF-8 character).
        After the loop, `self.last_result` holds the GenerationResult."""
        for piece in self._run(prompt, kwargs):
            if isinstance(piece, GenerationResult):
                self.last_result = piece
            elif piece:
                yield piece

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

    def _run(self, prompt, kwargs) -> Iterator:
        arrival = time.perf_counter()
        kwargs = dict(kwargs)
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = (kwargs["stop"],)
        elif kwargs.get("stop") is not None:
            kwargs["stop"] = tuple(kwargs["stop"])
        else:
            kwargs.pop("stop", None)
        try:
            params = SamplingParams(**kwargs)
        except TypeError as e:
            raise UserError(f"unknown generation option: {e}") from None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self._check_ids(prompt)
        if not ids:
            raise UserError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise UserError(f"the prompt has {len(ids)} tokens but the context holds {self.n_ctx}; "
                            f"shorten it or raise --ctx")
        timeline = Timeline(arrival=arrival)
        text = TextStream(self.tokenizer, params.stop)
        stop_ids = self.tokenizer.eog_ids
        out_ids, finish = [], "length"
        for token in self.runner.generate(ids, params, stop_ids, timeline):
            if token in stop_ids and not params.ignore_eos:
                finish = "stop"
                break
            out_ids.append(token)
            yield text.feed(token)
            if text.stopped:
                finish = "stop"
                break
        yield text.finish()
        timeline.finish = time.perf_counter() if not timeline.finish else timeline.finish
        yield GenerationResult(text.text, out_ids, finish, timeline.timings())

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        return ids
