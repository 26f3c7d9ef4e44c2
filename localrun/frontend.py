"""The text front end: what a user writes becomes token ids, and what the engine produces
becomes text. `LLM` and the server both go through it; neither touches the tokenizer or the
chat template on its own.

In (`FrontEnd`): text or token ids for a completion, messages for a chat (rendered by the
model's template, the oldest turns dropped until it fits the context), output constraints
(JSON schema, grammar, tool calls) and sampling options. Every prompt passes the same checks
once: its ids are in the vocabulary, it is not empty, and it leaves room in the context.

Out (`RequestText`, one per request): the engine's StepOutputs become text pieces (UTF-8
safe; a stop string never shows, not even in part), and at the end a finish reason and the
request's timings. End-of-generation tokens are not text and are not counted.

Torch-free: the grammar compiler (which needs torch) is imported only when a constraint is asked for.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from localrun.chat_template import render_chat
from localrun.context_shift import fit_messages, shift_prompt
from localrun.errors import ContextLengthExceeded, UserError
from localrun.sampling_params import InvalidSamplingParam, SamplingParams, TokenLogprob
from localrun.text_stream import TextStream
from localrun.tokenizer import Tokenizer


@dataclass
class ChatPrompt:
    ids: list[int]
    messages: list[dict]            # the messages rendered (the oldest may have been dropped)
    num_dropped: int                # how many of the oldest messages were left out to fit


class FrontEnd:
    """Prompts in, token ids out, for one model's tokenizer, chat template and context."""

    def __init__(self, tokenizer: Tokenizer, *, chat_template: str | None, n_ctx: int, n_vocab: int):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.n_ctx = n_ctx
        self.n_vocab = n_vocab

    @property
    def eog_ids(self) -> frozenset[int]:
        return self.tokenizer.eog_ids

    # -- text and ids -------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special)

    def detokenize(self, ids, special: bool = True) -> str:
        return self.tokenizer.decode(self.check_ids(ids), special=special)

    def check_ids(self, ids) -> list[int]:
        """ids as ints, each in the vocabulary (UserError naming the first that is not)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{self.n_vocab - 1})")
        return ids

    @cached_property
    def max_piece_bytes(self) -> int:
        """The longest token's text in bytes (control tokens written out)."""
        return max(1, max(len(self.tokenizer.piece(i, special=True)) for i in range(self.n_vocab)))

    # -- prompts ------------------------------------------------------------------------------
    def prompt_ids(self, prompt, *, shift: tuple[int, int] | None = None) -> list[int]:
        """A completion's prompt (text, or token ids) as checked ids: not empty, in the
        vocabulary, and short enough for the context (check_prompt). shift=(max_tokens, n_keep)
        first drops the oldest tokens past the first n_keep, so that the prompt and max_tokens
        (at most half the context) fit (LLM(context_shift=True))."""
        ids = self.tokenize(prompt) if isinstance(prompt, str) else self.check_ids(prompt)
        if not ids:
            raise UserError("the prompt is empty")
        if shift is not None:
            ids, _ = shift_prompt(ids, self.n_ctx, *shift)
        self.check_prompt(ids)
        return ids

    def check_prompt(self, ids: list[int], field: str = "prompt") -> None:
        """The one length check: a prompt must leave the context room for a token."""
        if len(ids) >= self.n_ctx:
            raise ContextLengthExceeded(field, f"the prompt has {len(ids)} tokens but the context holds "
                                               f"{self.n_ctx}; shorten it or raise --ctx")

    def reply_room(self, ids: list[int], max_tokens: int | None) -> int:
        """max_tokens for a reply to ids, checked against the room the context leaves (the
        server's rule: None means all of it, more than there is a ContextLengthExceeded)."""
        room = self.n_ctx - len(ids)
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise ContextLengthExceeded("max_tokens", f"max_tokens is {max_tokens} but the context of {self.n_ctx} "
                                                      f"leaves room for {room} tokens after the {len(ids)}-token prompt")
        return max_tokens

    def chat_ids(self, messages: list[dict], *, max_tokens: int | None = None, tools: list[dict] | None = None,
                 target: int | None = None) -> ChatPrompt:
        """The prompt of a conversation. The oldest turns go (the system prompt and the last turn
        stay) while the prompt plus the reply's tokens (max_tokens, at most half the context)
        would exceed n_ctx; `target` (a token count) drops more at once, so that later turns
        reuse the cached prefix."""
        if max_tokens is None:
            max_tokens = SamplingParams().max_tokens
        rendered: dict[int, list[int]] = {}     # kept lists differ in length: one render each

        def count(kept: list[dict]) -> int:
            if len(kept) not in rendered:
                rendered[len(kept)] = self.render_chat(kept, tools)
            return len(rendered[len(kept)])

        kept, dropped = fit_messages(messages, count, self.n_ctx, min(max_tokens, self.n_ctx // 2), target=target)
        count(kept)      # fit_messages saw it fit: shorter than the context, with room for the reply
        if not rendered[len(kept)]:      # a template that leaves these messages out (the engine refuses no tokens)
            raise UserError("the model's chat template renders these messages as an empty prompt; "
                            "give a message with text")
        return ChatPrompt(rendered[len(kept)], kept, dropped)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The ids of messages through the chat template, as they are (no fitting)."""
        tok = self.tokenizer
        bos = tok.token_text(tok.bos_id) if tok.bos_id is not None else ""
        eos = tok.token_text(tok.eos_id) if tok.eos_id is not None else ""
        text = render_chat(self.chat_template, messages, bos_token=bos, eos_token=eos, tools=tools)
        # templates that write BOS themselves (or start with it, as ChatML does for SmolLM2)
        # must not get a second one
        add_bos = tok.add_bos and not (bos and text.startswith(bos))
        return tok.encode(text, add_special=add_bos)

    # -- options -----------------------------------------------------------------------------
    @cached_property
    def grammar_compiler(self):
        """JSON schemas and grammars compiled to token masks for this vocabulary (cached)."""
        from localrun.grammar import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.tokenizer.eog_ids)

    def constraint(self, json_schema=None, grammar: str | None = None):
        """The compiled constraint for json_schema= (dict or JSON text) or grammar=. Without
        either, None, and the compiler (a walk over the vocabulary: 1.6 s for gemma-3's 262k
        tokens) is not built."""
        if json_schema is None and grammar is None:
            return None
        return self.grammar_compiler.from_options(json_schema, grammar)

    def tool_plan(self, tools: list[dict], tool_choice="auto", parallel_tool_calls: bool = True):
        """How a chat with `tools` runs on this model (localrun.tools.ToolPlan); ToolError
        (a UserError naming the field) for tools the template cannot take or an unknown name."""
        from localrun.tools import ToolPlan
        return ToolPlan.build(tools, tool_choice, parallel_tool_calls, self.chat_template, self.grammar_compiler)

    def sampling_params(self, options: dict) -> SamplingParams:
        """SamplingParams from keyword options; json_schema= or grammar= become its constraint,
        a single stop string a tuple of one."""
        options = dict(options)
        constraint = self.constraint(options.pop("json_schema", None), options.pop("grammar", None))
        if constraint is not None:
            if options.get("constraint") is not None:
                raise UserError("give one of json_schema, grammar and tools that force a call")
            options["constraint"] = constraint
        stop = options.pop("stop", None)
        if stop is not None:
            options["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        try:
            return SamplingParams(**options)
        except TypeError as e:
            raise UserError(f"unknown generation option: {e}") from None

    def check_logit_bias(self, params: SamplingParams) -> None:
        if params.logit_bias and params.logit_bias[-1][0] >= self.n_vocab:
            raise InvalidSamplingParam("logit_bias", f"logit_bias names token id {params.logit_bias[-1][0]}, "
                                                     f"outside the vocabulary (0..{self.n_vocab - 1})")

    # -- outputs -----------------------------------------------------------------------------
    def request_text(self, params: SamplingParams) -> RequestText:
        return RequestText(self.tokenizer, self.eog_ids, params)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of a prompt's n choices: choice i samples with seed + i, so a seeded request
    is reproducible choice by choice."""
    if params.seed is None:
        return [params] * n
    return [params if i == 0 else dataclasses.replace(params, seed=params.seed + i) for i in range(n)]


@dataclass
class Delta:
    """What one engine output adds to a request's text."""
    text: str = ""                      # may be empty (held back, or not text at all)
    token_id: int | None = None         # the reply's new token; None for a prefill chunk or an end of generation
    logprob: TokenLogprob | None = None
    stop_in_engine: bool = False        # a stop string ended the text: the caller ends the request in the engine


@dataclass
class Finish:
    text: str                           # what was held back until the end
    finish_reason: str                  # "stop" | "length" | "abort"
    timings: dict = field(default_factory=dict)


class RequestText:
    """One request's engine outputs -> text pieces, then its finish reason and timings."""

    def __init__(self, tokenizer: Tokenizer, eog_ids: frozenset[int], params: SamplingParams):
        self.stream = TextStream(tokenizer, params.stop)
        self.eog_ids = eog_ids if not params.ignore_eos else frozenset()
        self.token_ids: list[int] = []     # the reply's tokens (no end-of-generation token)
        self.logprobs: list[TokenLogprob] = []
        self.finished = False
        self._num_logprobs_taken = 0

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def stopped(self) -> bool:
        """A stop string ended the text."""
        return self.stream.stopped

    def feed(self, out) -> Delta:
        """out: the engine's StepOutput for this request."""
        delta = Delta()
        if out.token_id is not None and out.token_id not in self.eog_ids:
            delta.token_id = out.token_id
            self.token_ids.append(out.token_id)
            if out.logprob is not None:
                delta.logprob = out.logprob
                self.logprobs.append(out.logprob)
            delta.text = self.stream.feed(out.token_id)
            delta.stop_in_engine = self.stream.stopped and not out.finished
        self.finished = out.finished or self.stream.stopped
        return delta

    def take_logprobs(self) -> list[TokenLogprob]:
        """The logprobs recorded since the last call."""
        new = self.logprobs[self._num_logprobs_taken:]
        self._num_logprobs_taken = len(self.logprobs)
        return new

    def finish(self, seq, *, unmeasured=None) -> Finish:
        """The text held back, why the request ended and its timings (timings()); call once,
        when `finished`."""
        tail = self.stream.finish()
        reason = seq.finish_reason
        finish = "stop" if self.stopped or reason == "stop" else "abort" if reason == "abort" else "length"
        return Finish(tail, finish, timings(seq, len(self.token_ids), unmeasured=unmeasured))


def timings(seq, num_generated: int, *, unmeasured=None) -> dict:
    """A finished request's timings: the engine's timeline (seconds, tokens/s), the prompt
    tokens' speed, and generated_tokens counted as the reply's tokens (usage's count: an
    end-of-generation token is not text). A duration that was never measured (max_tokens=0:
    nothing ran) is `unmeasured`."""
    t = seq.timings()
    computed = t["prompt_tokens"] - (t["cached_tokens"] or 0)
    t["prefill_tok_s"] = computed / t["prefill_s"] if t.get("prefill_s") else None
    t["generated_tokens"] = num_generated
    for key in ("queue_s", "prefill_s", "ttft_s", "decode_tok_s"):
        if t[key] is None:
            t[key] = unmeasured
    return t
