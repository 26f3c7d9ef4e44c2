"""Keeping a conversation (or a prompt) inside the context window.

Chat: when the rendered conversation plus the tokens reserved for the reply would exceed
`n_ctx`, the leading system message(s) stay and the oldest turns go, a turn being a user
message with the replies after it; the last turn always stays. Which turns go is found by
bisection over the number dropped (the prompt only gets shorter as more are dropped).

Dropping just enough on every turn would move the start of the conversation each time, so
nothing after the system prompt could come from the prefix cache. A caller that keeps the
history (the CLI chat) passes a `target` below `n_ctx`: it drops a bigger piece once, like
llama.cpp's context shift, and the following turns reuse the cached prefix again.

Raw prompts: `shift_prompt` keeps the first `n_keep` tokens (llama.cpp's --keep) and drops
the oldest tokens after them.
"""
from __future__ import annotations

from collections.abc import Callable

from localrun.errors import ContextLengthExceeded, UserError


def split_turns(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """(leading system messages, turns): each turn starts at a user message (the first may
    start with whatever precedes the first user message)."""
    num_system = 0
    while num_system < len(messages) and messages[num_system].get("role") == "system":
        num_system += 1
    turns: list[list[dict]] = []
    for message in messages[num_system:]:
        if message.get("role") == "user" or not turns:
            turns.append([message])
        else:
            turns[-1].append(message)
    return messages[:num_system], turns


def fit_messages(messages: list[dict], count_tokens: Callable[[list[dict]], int], n_ctx: int,
                 reserve: int, *, target: int | None = None) -> tuple[list[dict], int]:
    """Drop the oldest turns so that count_tokens(kept) + reserve <= n_ctx.

    When dropping is needed, drop until count_tokens(kept) + reserve <= target (default
    n_ctx; lower it to drop more at once). Returns (kept messages, number of messages
    dropped). Raises UserError if the system messages and the last turn alone do not leave
    a token to generate."""
    reserve = max(reserve, 1)          # a prompt must leave room for at least one new token
    if count_tokens(messages) + reserve <= n_ctx:
        return list(messages), 0
    goal = n_ctx if target is None else min(target, n_ctx)
    system, turns = split_turns(messages)

    def kept(num_dropped: int) -> list[dict]:
        return system + [m for turn in turns[num_dropped:] for m in turn]

    low, high = 1, max(len(turns) - 1, 0)       # the last turn always stays
    if high < low or count_tokens(kept(high)) + reserve > goal:
        best = high                              # nothing short of dropping all fits the goal
    else:
        while low < high:                        # the fewest drops that reach the goal
            mid = (low + high) // 2
            if count_tokens(kept(mid)) + reserve <= goal:
                high = mid
            else:
                low = mid + 1
        best = low
    result = kept(best)
    if count_tokens(result) >= n_ctx:
        raise ContextLengthExceeded("messages", f"The system prompt and the last message take {count_tokens(result)} tokens, "
                        f"more than the context of {n_ctx}; shorten them or raise --ctx.")
    return result, len(messages) - len(result)


def shift_prompt(ids: list[int], n_ctx: int, reserve: int, n_keep: int = 0) -> tuple[list[int], int]:
    """Keep the first n_keep tokens and the newest ones so that len(result) + reserve <= n_ctx,
    with reserve (the tokens to generate) capped at half the context so that a large
    max_tokens does not wipe out the prompt. Returns (ids, number dropped)."""
    budget = n_ctx - max(min(reserve, n_ctx // 2), 1)
    if len(ids) <= budget:
        return list(ids), 0
    if n_keep >= budget:
        raise UserError(f"n_keep ({n_keep}) leaves no room in the context of {n_ctx} tokens.")
    num_dropped = len(ids) - budget
    return ids[:n_keep] + ids[n_keep + num_dropped:], num_dropped
