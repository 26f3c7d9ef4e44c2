"""Seats shared between requests: one request's n choices cannot hold every seat of the batch
while another request waits for one.

A request (a `group`: the n sequences of one HTTP request share it) is entitled to an equal
share of the seats among the requests that are running or waiting: `max_num_seqs // groups`,
at least one. Shares bind only under contention, so a request alone may take every seat:
- admission serves waiting sequences of requests below their share first (policy order
  within each class);
- when every seat is taken and a request below its share waits, the newest sequence of the
  request furthest above its share gives its seat up (preempted: its KV blocks are freed, its
  full blocks stay in the prefix cache, and it resumes when seats free up).

Without this, one chat with n=16 and no max_tokens held all 16 seats of a server for minutes
while a one-choice request waited. Plain Python, no torch (the engine core).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from localrun.engine.sequence import Sequence


def seat_share(max_num_seqs: int, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> int:
    """Seats each request is entitled to while others want seats."""
    groups = {s.group for s in running} | {s.group for s in waiting}
    return max(1, max_num_seqs // max(len(groups), 1))


def seats_held(running: Iterable[Sequence]) -> Counter:
    return Counter(s.group for s in running)


def under_share(seq: Sequence, held: Counter, share: int) -> bool:
    return held[seq.group] < share


def seat_victims(running: list[Sequence], waiting: list[Sequence], max_num_seqs: int) -> list[Sequence]:
    """The running sequences to preempt so that waiting requests below their share get a seat:
    one per such request, while every seat is taken, each the newest sequence of the request
    holding the most seats above its share. `running` is in arrival order."""
    if len(running) < max_num_seqs or not waiting:
        return []
    share = seat_share(max_num_seqs, running, waiting)
    held = seats_held(running)
    starved = []            # requests below their share with a sequence waiting, oldest first
    for seq in waiting:
        if under_share(seq, held, share) and seq.group not in starved:
            starved.append(seq.group)
    victims: list[Sequence] = []
    for group in starved:
        richest, count = max(held.items(), key=lambda item: item[1])
        if count <= share:
            break
        victim = next(s for s in reversed(running) if s.group == richest and s not in victims)
        victims.append(victim)
        held[richest] -= 1
        held[group] += 1        # the seat it frees goes to this request
    return victims
