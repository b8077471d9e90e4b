"""Scheduling policies: which tokens of which requests go into the next engine step.

Pure functions over a snapshot of the live requests, so every policy's rule is testable
without a model. A step holds at most `budget` tokens (vLLM's max_num_batched_tokens); a
request's prefill chunk holds at most `chunk_size` tokens (vLLM's long_prefill_token_threshold).

- none: no chunking, as engines worked before chunked prefill. While any admitted request
  still needs its prefill, a step runs whole prompts only (as many as fit the budget) and
  every decode waits; otherwise a step runs the decodes.
- decode-first (vLLM V1): every running decode first, then the rest of the budget filled with
  prefill chunks in arrival order. Decodes never wait for a long prompt; the prompt waits.
- prefill-first: prefill chunks first, in arrival order, then decodes with what is left.

>>> live = [Live("a", prompt_tokens=4, prefilled=4, generated=2), Live("b", prompt_tokens=10, prefilled=0, generated=0)]
>>> [(i.request_id, i.kind.value, i.start, i.end) for i in schedule(Policy.DECODE_FIRST, live, chunk_size=4, budget=6)]
[('a', 'decode', 5, 6), ('b', 'prefill', 0, 4)]
>>> [(i.request_id, i.kind.value, i.start, i.end) for i in schedule(Policy.PREFILL_FIRST, live, chunk_size=8, budget=8)]
[('b', 'prefill', 0, 8)]
>>> [(i.request_id, i.kind.value, i.start, i.end) for i in schedule(Policy.NONE, live, chunk_size=4, budget=10)]
[('b', 'prefill', 0, 10)]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from engine.serving.records import ItemKind, StepItem


class Policy(Enum):
    NONE = "none"
    DECODE_FIRST = "decode-first"
    PREFILL_FIRST = "prefill-first"


@dataclass(frozen=True)
class Live:
    """What the scheduler sees of an admitted, unfinished request."""

    request_id: str
    prompt_tokens: int
    prefilled: int  # prompt tokens already in its KV cache
    generated: int  # output tokens so far

    @property
    def decoding(self) -> bool:
        return self.prefilled == self.prompt_tokens


def schedule(policy: Policy, live: Sequence[Live], chunk_size: int, budget: int) -> list[StepItem]:
    """The items of the next step, for requests given in arrival order. With budget >= 1 and
    anything live, at least one item is scheduled (so the loop always makes progress); under
    `none` the budget must hold the longest prompt."""
    decodes = [r for r in live if r.decoding]
    prefills = [r for r in live if not r.decoding]
    if policy is Policy.NONE:
        if prefills:
            return _whole_prompts(prefills, budget)
        return _decodes(decodes, budget)
    if policy is Policy.DECODE_FIRST:
        items = _decodes(decodes, budget)
        return items + _chunks(prefills, chunk_size, budget - len(items))
    items = _chunks(prefills, chunk_size, budget)
    return items + _decodes(decodes, budget - sum(i.tokens for i in items))


def _decodes(requests: Sequence[Live], budget: int) -> list[StepItem]:
    """One token each: the last output token, at position prompt + generated - 1."""
    return [
        StepItem(r.request_id, ItemKind.DECODE, r.prompt_tokens + r.generated - 1, r.prompt_tokens + r.generated)
        for r in requests[: max(0, budget)]
    ]


def _chunks(requests: Sequence[Live], chunk_size: int, budget: int) -> list[StepItem]:
    items = []
    for r in requests:
        n = min(chunk_size, r.prompt_tokens - r.prefilled, budget)
        if n <= 0:
            break
        items.append(StepItem(r.request_id, ItemKind.PREFILL, r.prefilled, r.prefilled + n))
        budget -= n
    return items


def _whole_prompts(requests: Sequence[Live], budget: int) -> list[StepItem]:
    items = []
    for r in requests:
        n = r.prompt_tokens - r.prefilled
        if n > budget:
            break
        items.append(StepItem(r.request_id, ItemKind.PREFILL, r.prefilled, r.prompt_tokens))
        budget -= n
    return items
