"""Typed, frozen records of a serving run: one per engine step, one per request.

The CLI JSON, the metrics and the timeline are all derived from these. Times are seconds since
the run started (its clock starts before the first request can arrive).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from engine.trace import to_jsonable


class ItemKind(StrEnum):  # str() is the value, so records read like their JSON
    PREFILL = "prefill"  # a chunk of a request's prompt
    DECODE = "decode"  # a request's last output token, fed to get the next one
    CACHED = "cached"  # a request's prompt prefix served from the prefix cache: not computed


class RequestClass(StrEnum):
    LONG = "long"  # a long prompt (a document): its TTFT is what chunking trades
    SHORT = "short"  # a chat turn: its ITL is what a long prefill hurts


@dataclass(frozen=True)
class StepItem:
    """What one request fed to one engine step: sequence positions [start, end).

    For a prefill chunk that is the prompt token range; a decode feeds one position, the
    request's last output token. A cached item (the prefix cache's hit, in the request's first
    step) computes nothing: its KV entries were reused."""

    request_id: str
    kind: ItemKind
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start

    def to_jsonable(self) -> dict:
        return to_jsonable(self) | {"tokens": self.tokens}


@dataclass(frozen=True)
class ServeStep:
    """One engine step: a single batched forward over every scheduled item, then sampling."""

    index: int
    start_s: float
    end_s: float  # when this step's tokens were emitted
    items: tuple[StepItem, ...]

    @property
    def tokens(self) -> int:
        """Tokens computed by the step's forward (cached prefixes are not)."""
        return sum(item.tokens for item in self.items if item.kind is not ItemKind.CACHED)

    def to_jsonable(self) -> dict:
        return {"index": self.index, "start_s": self.start_s, "end_s": self.end_s,
                "items": [item.to_jsonable() for item in self.items]}


@dataclass(frozen=True)
class RequestRecord:
    """A finished request. Each step emits at most one token per request, so ITL per token and
    per step are the same gaps."""

    request_id: str
    cls: RequestClass
    arrival_s: float
    prompt_tokens: int
    first_token_s: float
    token_times_s: tuple[float, ...]  # emission time of every output token
    output_token_ids: tuple[int, ...]
    stop_reason: str  # "eos" or "max_new_tokens"
    reused_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens this request's prefill computed."""
        return self.prompt_tokens - self.reused_tokens

    @property
    def ttft_ms(self) -> float:
        """Time from arrival to the first output token (queueing included)."""
        return (self.first_token_s - self.arrival_s) * 1000

    @property
    def itl_ms(self) -> list[float]:
        """Gaps between consecutive output tokens."""
        times = self.token_times_s
        return [(b - a) * 1000 for a, b in zip(times, times[1:])]

    def to_jsonable(self) -> dict:
        return to_jsonable(self) | {"ttft_ms": self.ttft_ms, "itl_ms": self.itl_ms,
                                    "prefilled_tokens": self.prefilled_tokens}
