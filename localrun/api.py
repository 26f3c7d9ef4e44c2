"""The public Python API: `localrun.LLM`."""
from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch

from layerplan.kv_cache import default_kv_type
from localrun.engine.llm_engine import LLMEngine
from localrun.engine_config import DEFAULT_PROMPT_MATH, EngineConfig
from localrun.errors import UserError
from localrun.gguf_file import GGUFModelFile, open_gguf
from localrun.executor import build_model, use_quantized
from localrun.frontend import FrontEnd, choice_params
from localrun.model.llama import Transformer
from localrun.models import resolve_model
from localrun.runner import SequenceRunner
from localrun.sampling_params import TokenLogprob
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
    finish_reason: str                      # "stop" | "length" | "abort"; chat with tools: "tool_calls"
    timings: dict = field(default_factory=dict)
    dropped_messages: int = 0               # chat: oldest messages left out to fit the context
    logprobs: list[TokenLogprob] | None = None   # per generated token, when logprobs= was given
    tool_calls: list[dict] | None = None    # chat with tools: OpenAI-shaped calls parsed from the reply


MAX_N = 16      # choices per prompt (n): each is a sequence of the engine; they share the prompt's KV


class LLM:
    """A GGUF model on the native PyTorch engine.

    >>> llm = LLM("smollm2-135m")
    >>> llm.generate("The capital of France is", max_tokens=8, temperature=0).text
    """

    def __init__(self, model: str | os.PathLike | GGUFModelFile | None = None, config: EngineConfig | None = None,
                 **options):
        """model: a .gguf path, a catalog name (default: smollm2-135m), or a header already read
        and checked (gguf_file.open_gguf). The options are
        EngineConfig's fields (localrun/engine_config.py says what each does), given as an
        EngineConfig, as keywords (LLM(path, n_ctx=2048, n_parallel=8)), or both (the keywords
        win); all are checked before the model loads."""
        config = EngineConfig(**options) if config is None else dataclasses.replace(config, **options)
        self.engine_config = config
        self.file = model if isinstance(model, GGUFModelFile) else open_gguf(resolve_model(model))
        self.model_path = self.file.path
        self.config = self.file.config
        self.n_threads = config.n_threads or default_threads()
        torch.set_num_threads(self.n_threads)
        self.n_ctx = config.n_ctx or min(self.config.context_length, DEFAULT_CTX)
        dtype = config.dtype
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else (dtype or default_dtype())
        if config.kv_type is None:      # the KV type's one default, for the plan and the pool alike
            self.engine_config = config = dataclasses.replace(config, kv_type=default_kv_type(self.dtype))
        t0 = time.perf_counter()
        self.quantized = use_quantized(config.quantized, dtype)
        self.model = build_model(self.file, n_ctx=self.n_ctx, dtype=self.dtype, quantized=self.quantized,
                                 n_gpu_layers=config.n_gpu_layers, n_parallel=config.n_parallel,
                                 kv_type=config.kv_type, prompt_math=config.prompt_math)
        self.plan_summary = self.model.device_map.summary
        self.load_s = time.perf_counter() - t0
        self.disk_cache_config = self._disk_cache_config(config)
        self.last_dropped_messages = 0      # by the last chat() to fit the context
        self._engine: LLMEngine | None = None
        self._request_ids = itertools.count()
        self.speculative, self.draft_model = load_speculative(
            config.speculative, target=self.model, target_tokenizer=lambda: self.tokenizer, dtype=self.dtype,
            n_ctx=self.n_ctx, quantized=self.quantized, num_speculative_tokens=config.num_speculative_tokens,
            adaptive=config.speculative_adaptive, n_parallel=config.n_parallel, prompt_math=config.prompt_math)

    @property
    def context_warning(self) -> str | None:
        """One sentence when the context asked for exceeds the one the model was trained for
        (accepted, as llama.cpp accepts it: positions past it are extrapolated)."""
        trained = self.config.context_length
        if self.n_ctx <= trained:
            return None
        return (f"the context of {self.n_ctx} tokens exceeds the {trained} this model was trained for; "
                f"output past {trained} tokens may degrade")

    @property
    def kv_type(self) -> str:
        """The engine's KV type: the one asked for (in the engine's words: q8_0 is int8), else the
        default for the compute dtype (layerplan.kv_cache.default_kv_type)."""
        return self.engine_config.kv_type

    def _disk_cache_config(self, config: EngineConfig):
        from localrun.engine.disk_cache import DiskCacheConfig, model_fingerprint
        from localrun.models import localrun_home
        if not config.disk_cache:
            return None
        root = Path(config.cache_dir).expanduser() if config.cache_dir is not None else localrun_home() / "kv-cache"
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"cannot use {root} as the KV cache directory ({e.strerror})") from None
        return DiskCacheConfig(root, model_fingerprint(self.model_path, self.file.header.data_offset),
                               config.cache_disk)

    def close(self) -> None:
        """Finish writing the disk cache (also done at exit)."""
        if self._engine is not None:
            self._engine.flush()

    # -- tokens ---------------------------------------------------------------------------
    @cached_property
    def frontend(self) -> FrontEnd:
        """Prompts to token ids and engine outputs to text (localrun/frontend.py)."""
        return FrontEnd(Tokenizer(self.model_path), chat_template=self.config.chat_template, n_ctx=self.n_ctx,
                        n_vocab=self.n_vocab)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    @property
    def n_vocab(self) -> int:
        return self.config.n_vocab

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.frontend.tokenize(text, add_special)

    def detokenize(self, ids: list[int], special: bool = True) -> str:
        """Text of token ids; control tokens such as <|im_start|> are written out unless
        special=False, so detokenize(tokenize(text)) == text."""
        return self.frontend.detokenize(ids, special)

    @cached_property
    def runner(self) -> SequenceRunner:
        """The reference path behind logits(): a contiguous KV cache, allocated on first use
        so that generation alone never pays for it."""
        return SequenceRunner(self.model, self.n_ctx)

    def reset(self) -> None:
        """Forget cached prefixes (the next prompt is computed from scratch, unless the disk
        cache holds it: `localrun cache clear` empties that)."""
        if "runner" in self.__dict__:
            self.runner.cached_ids = []
        if self._engine is not None:
            self._engine.reset_prefix_cache()

    # -- logits ---------------------------------------------------------------------------
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits at every position: float32 (len(ids), n_vocab)."""
        ids = self.frontend.check_ids(ids)
        if not ids:
            raise UserError("logits of no tokens: give at least one token id")
        if len(ids) > self.n_ctx:
            raise UserError(f"{len(ids)} tokens do not fit the context of {self.n_ctx}")
        self.reset()
        out = torch.cat([self.runner.forward(ids[i:i + 512], i, all_logits=True)
                         for i in range(0, len(ids), 512)])
        return out.float()

    # -- generation -----------------------------------------------------------------------
    def generate(self, prompt: str | list[int] | list[str] | list[list[int]], *, n: int = 1, **kwargs):
        """Complete `prompt` (text or token ids). Keyword arguments are SamplingParams fields:
        max_tokens, temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty,
        frequency_penalty, seed, stop, ignore_eos, logit_bias, logprobs (k: each token's logprob
        and the k most likely, k <= 20; in result.logprobs), and json_schema= (a dict or JSON
        text) or grammar= (GBNF or Lark) to hold the output to it.
        A list of prompts runs them together (continuous batching) and returns a list.
        n > 1 (at most MAX_N) gives n choices of one prompt, as a list: one prefill, n decodes;
        choice i samples with seed + i, so a seeded call is reproducible choice by choice."""
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise UserError(f"n must be an integer in [1, {MAX_N}], got {n!r}")
        many = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        prompts = list(prompt) if many else [prompt]
        expanded = [p for p in prompts for _ in range(n)]
        results: dict[int, GenerationResult] = {}
        for index, item in self._run(expanded, kwargs, n=n):
            if isinstance(item, GenerationResult):
                results[index] = item
        flat = [results[i] for i in range(len(expanded))]
        grouped = [flat[i * n:(i + 1) * n] for i in range(len(prompts))] if n > 1 else flat
        return grouped if many else grouped[0]

    def stream(self, prompt: str | list[int], **kwargs) -> Iterator[str]:
        """Yield text pieces as they are generated (never a broken UTF-8 character).
        After the loop, `self.last_result` holds the GenerationResult."""
        for _, item in self._run([prompt], kwargs):
            if isinstance(item, GenerationResult):
                self.last_result = item
            elif item:
                yield item

    def chat(self, messages: list[dict], *, stream: bool = False, tools: list[dict] | None = None,
             tool_choice: str | dict = "auto", parallel_tool_calls: bool = True, **kwargs):
        """Reply to a conversation ([{role, content}, ...]) through the model's chat template.
        Returns a GenerationResult, or an iterator of text pieces when stream=True.
        A conversation too long for the context loses its oldest turns (the system prompt
        stays); result.dropped_messages (self.last_dropped_messages) says how many went.
        tools: OpenAI tool definitions, rendered by the template; tool_choice "auto", "none",
        "required" or {"type": "function", "function": {"name": ...}} (the last two enforced
        by a grammar); the calls the reply makes land in result.tool_calls (OpenAI-shaped)."""
        plan = self.tool_plan(tools, tool_choice, parallel_tool_calls) if tools else None
        if plan is not None and plan.constraint is not None:
            kwargs["constraint"] = plan.constraint
        prompt = self.frontend.chat_ids(messages, max_tokens=kwargs.get("max_tokens"),
                                        tools=plan.tools if plan is not None else None)
        self.last_dropped_messages = prompt.num_dropped
        if stream:
            return self.stream(prompt.ids, **kwargs)
        result = self.generate(prompt.ids, **kwargs)
        result.dropped_messages = prompt.num_dropped
        if plan is not None and plan.tools:
            content, calls = plan.parse(result.text)
            if calls:
                result.text, result.tool_calls = content or "", [c.to_openai() for c in calls]
                if result.finish_reason == "stop":
                    result.finish_reason = "tool_calls"
        return result

    def tool_plan(self, tools: list[dict], tool_choice="auto", parallel_tool_calls: bool = True):
        """How a chat with `tools` runs on this model (localrun.tools.ToolPlan); ToolError
        (a UserError naming the field) for tools the template cannot take or an unknown name."""
        return self.frontend.tool_plan(tools, tool_choice, parallel_tool_calls)

    @property
    def grammar_compiler(self):
        """JSON schemas and grammars compiled to token masks for this vocabulary (cached)."""
        return self.frontend.grammar_compiler

    def constraint(self, json_schema=None, grammar: str | None = None):
        """The compiled constraint for generate's json_schema= (dict or JSON text) or grammar=
        (None without either)."""
        return self.frontend.constraint(json_schema, grammar)

    def fit_chat(self, messages: list[dict], max_tokens: int | None = None, *,
                 target: int | None = None, tools: list[dict] | None = None) -> tuple[list[dict], int]:
        """(messages that fit, number dropped): the oldest turns go when the prompt plus the
        reply's tokens (max_tokens, at most half the context) would exceed n_ctx. `target`
        (a token count) drops more at once, so that later turns reuse the cached prefix."""
        prompt = self.frontend.chat_ids(messages, max_tokens=max_tokens, tools=tools, target=target)
        return prompt.messages, prompt.num_dropped

    def chat_prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The token ids of messages through the chat template, as they are (no fitting)."""
        return self.frontend.render_chat(messages, tools)

    @property
    def engine(self) -> LLMEngine:
        """The paged, continuously batched engine (built on first use: it needs the tokenizer's
        end-of-generation ids)."""
        if self._engine is None:
            self._engine = LLMEngine(self.model, self.engine_config, tokenizer_eog_ids=tuple(self.tokenizer.eog_ids),
                                     clock=time.perf_counter, disk_cache=self.disk_cache_config,
                                     speculative=self.speculative, draft_model=self.draft_model)
        return self._engine

    def _run(self, prompts: list, kwargs, n: int = 1) -> Iterator[tuple[int, str | GenerationResult]]:
        """Run prompts through the engine; yield (prompt index, text piece), and at the end of
        each request (prompt index, GenerationResult). With n > 1, prompts holds each prompt n
        times in a row, and copy i of a seeded prompt samples with seed + i."""
        arrival = time.perf_counter()
        frontend, engine = self.frontend, self.engine
        params = frontend.sampling_params(kwargs)
        per_prompt = choice_params(params, n) * (len(prompts) // n)
        shift = (params.max_tokens, self.engine_config.n_keep) if self.engine_config.context_shift else None
        requests = {f"req-{next(self._request_ids)}": (i, frontend.prompt_ids(prompt, shift=shift))
                    for i, prompt in enumerate(prompts)}
        texts = {rid: frontend.request_text(params) for rid in requests}
        try:
            for rid, (i, ids) in requests.items():
                engine.add_request(rid, ids, per_prompt[i], arrival_time=arrival)
            pending = set(requests)
            while pending:
                for out in engine.step():
                    rid = out.seq.request_id
                    if rid not in pending:
                        continue
                    if out.error is not None:      # this request's sampling failed (the engine went on)
                        raise RuntimeError(f"generation failed: {out.error}")
                    index, text = requests[rid][0], texts[rid]
                    delta = text.feed(out)
                    if delta.text:
                        yield index, delta.text
                    if delta.stop_in_engine:
                        engine.finish_request(rid, "stop")
                    if text.finished:
                        pending.discard(rid)
                        done = text.finish(out.seq, unmeasured=0.0)
                        if done.text:
                            yield index, done.text
                        yield index, GenerationResult(text.text, text.token_ids, done.finish_reason, done.timings,
                                                      logprobs=text.logprobs if params.logprobs is not None else None)
        finally:   # Ctrl-C or an abandoned stream: free the requests' blocks
            for rid in requests:
                engine.abort(rid)


def load_speculative(spec: str | None, *, target: Transformer, target_tokenizer, dtype: torch.dtype, n_ctx: int,
                     quantized: bool = False, num_speculative_tokens: int = 4, adaptive: bool = True,
                     n_parallel: int = 1, prompt_math: str = DEFAULT_PROMPT_MATH):
    """(SpeculativeConfig or None, draft Transformer or None) for LLM(speculative=spec):
    None (off), "ngram" (prompt lookup), "self:N" (the target's first N layers as the draft),
    or a draft model's .gguf path or catalog name, whose vocabulary must be the target's
    (target_tokenizer: a function returning the target's Tokenizer, loaded only if needed).
    A draft model file is resolved, opened and built here, like the target (quantized or not,
    placed by layerplan, for n_parallel sequences, its prompt rows multiplied as prompt_math
    says): the engine gets a built model."""
    from localrun.engine.draft_model import check_vocab_compatible, self_draft
    from localrun.engine.speculative import SpeculativeConfig
    if not spec:
        return None, None
    if spec == "ngram":
        return SpeculativeConfig("ngram", num_speculative_tokens, adaptive), None
    config = SpeculativeConfig("draft", num_speculative_tokens, adaptive)
    if spec.startswith("self:"):
        try:
            num_layers = int(spec[len("self:"):])
        except ValueError:
            raise UserError(f"Write a self-draft as self:N with N a number of layers, got {spec!r}.") from None
        return config, self_draft(target, num_layers)
    path = resolve_model(spec)
    draft_tokenizer = Tokenizer(path)
    pieces = lambda tok: [tok.piece(i, special=True) for i in range(tok.n_vocab)]   # noqa: E731
    check_vocab_compatible(pieces(target_tokenizer()), pieces(draft_tokenizer), path.name)
    return config, build_model(open_gguf(path), n_ctx=n_ctx, dtype=dtype, quantized=quantized, n_parallel=n_parallel,
                               prompt_math=prompt_math)
