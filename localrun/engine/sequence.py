"""One request as the engine sees it: its tokens, its place in the KV cache, its timeline.

Token model: `token_ids` is the prompt followed by the generated tokens. The first
`num_computed_tokens` of them have their K/V written in the sequence's blocks
(`block_table`); the rest still have to go through the model. A prefill computes many
tokens at once (possibly in chunks), a decode computes the single last token, and a
token is sampled whenever a step computes up to the end of `token_ids`.

Speculative decoding: before a step, a proposer may put guesses for the next tokens in
`draft_token_ids`. They are not part of `token_ids`: the step computes them after the last
token, and only the ones the target model accepts are appended (see engine/speculative.py).
"""
from __future__ import annotations

import enum
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # localrun.sampling imports torch; the engine core must not
    from localrun.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued; holds no KV blocks
    RUNNING = "running"      # admitted; holds KV blocks (prefill in progress or decoding)
    PREEMPTED = "preempted"  # its blocks were freed to make room; waits to be recomputed
    FINISHED = "finished"    # stopped, hit a length limit, or aborted; holds no KV blocks


@dataclass
class SequenceTimeline:
    """Monotonic timestamps (seconds) of one request's life; None until the event happens."""
    arrival: float | None = None
    first_scheduled: float | None = None
    prefill_done: float | None = None     # the whole prompt has its K/V in the cache
    first_token: float | None = None
    finish: float | None = None
    prefill_chunks: list[tuple[float, int]] = field(default_factory=list)  # (done at, num tokens)
    num_cached_tokens: int = 0            # prompt tokens served by the prefix cache, first admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, loaded from a lower tier ("disk")
    num_preemptions: int = 0
    num_scheduled_steps: int = 0


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None = None   # scheduler reads max_tokens, ignore_eos
    arrival_time: InitVar[float | None] = None  # default: the scheduler's clock when added
    token_ids: list[int] = field(init=False, repr=False)  # prompt + generated
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None      # "stop", "length" or "abort"
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    num_cached_tokens: int = 0            # of those, reused from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)     # logical block -> physical block id
    block_hashes: list[bytes] = field(default_factory=list, repr=False)  # chained hash per full block
    arrival_index: int = -1               # set by the scheduler: lower is served first
    num_bypassed: int = 0                 # requests that arrived later but were admitted while it waited
    timeline: SequenceTimeline = field(default_factory=SequenceTimeline, repr=False)
    draft_token_ids: list[int] = field(default_factory=list)   # proposed for the next step only
    draft_probs: object = field(default=None, repr=False)  # (k, V) draft distribution; None: deterministic
    num_draft_tokens: int = 0             # drafted tokens the target verified, over the request
    num_accepted_tokens: int = 0          # of those, accepted
    group: str = ""                       # the request it belongs to (n choices share one); default: request_id

    def __post_init__(self, arrival_time):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)
        self.timeline.arrival = arrival_time
        self.group = self.group or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than one token to compute, or the prompt's own last token (no output yet)."""
        return self.num_uncomputed_tokens > 1 or self.num_generated_tokens == 0

    @property
    def is_sampler_ready(self) -> bool:
        """Its next token can be sampled without waiting: False while its grammar's mask is
        still being computed off the engine thread (the scheduler leaves it out of the step)."""
        state = getattr(self.sampling_params, "state", None)
        return state is None or state.ready()

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def timings(self) -> dict[str, float | int | None]:
        """The request's timeline in the shape `result.timings` exposes (seconds, tokens/s)."""
        t = self.timeline

        def between(start, end):
            return None if start is None or end is None else end - start

        decode_s = between(t.first_token, t.finish)
        num_decoded = self.num_generated_tokens - 1
        return {
            "queue_s": between(t.arrival, t.first_scheduled),
            "prefill_s": between(t.first_scheduled, t.prefill_done),
            "ttft_s": between(t.arrival, t.first_token),
            "decode_tok_s": num_decoded / decode_s if decode_s and num_decoded > 0 else None,
            "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": t.num_cached_tokens,
            "cached_tokens_device": t.num_cached_tokens - sum(t.cached_tokens_by_tier.values()),
            "cached_tokens_ram": t.cached_tokens_by_tier.get("ram", 0),
            "cached_tokens_disk": t.cached_tokens_by_tier.get("disk", 0),
            "computed_prompt_tokens": self.num_prompt_tokens - t.num_cached_tokens,
            "generated_tokens": self.num_generated_tokens,
            "preemptions": t.num_preemptions,
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": (self.num_accepted_tokens / self.num_draft_tokens
                                if self.num_draft_tokens else None),
        }
