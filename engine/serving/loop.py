"""The serving loop: requests arrive on a real clock and share the model step by step.

Each engine step runs five phases (the timeline legend uses the same words):
1 admit (every request whose arrival time has passed), 2 schedule (the policy packs decode
tokens and prefill chunks into the token budget), 3 forward (one packed forward for all of
them), 4 sample (one token for each request that decoded or finished its prefill),
5 record (a ServeStep; a RequestRecord for each request that finished).

The clock is real wall time: a request is admitted at the first step boundary after
`arrival_s` seconds, and its TTFT counts from `arrival_s`, so time spent waiting behind a
running step is part of it, as in a real server. When nothing is live the loop sleeps until
the next arrival.

Every request draws its sampling uniforms from its own generator seeded with the run's seed,
one per output token, exactly as a solo run (engine.decoding.generate) does; so each request's
output is its solo output, greedy or sampled.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.decoding import MAX_NEW_TOKENS
from engine.errors import InputError
from engine.models import LoadedModel
from engine.sampling import SamplingConfig, choose, probs_from_logits
from engine.serving.packed import Segment, forward_packed
from engine.serving.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET_TOKENS, CacheStats, PrefixCache, RequestKV
from engine.serving.records import ItemKind, RequestRecord, ServeStep, StepItem
from engine.serving.scheduler import Live, Policy, schedule
from engine.serving.workload import Workload, WorkloadRequest


@dataclass(frozen=True)
class ServeConfig:
    policy: Policy = Policy.DECODE_FIRST
    chunk_size: int = 256  # most prompt tokens of one request in one step (not used by `none`)
    token_budget: int | None = None  # most tokens in one step; None: see budget()
    max_new_tokens: int | None = None  # replaces every request's own limit; None keeps them
    sampling: SamplingConfig = SamplingConfig()
    prefix_cache: bool = False  # reuse the KV of prompt prefixes already prefilled (engine.serving.prefix_cache)
    prefix_block: int = DEFAULT_BLOCK_SIZE  # tokens per cached block
    prefix_budget: int = DEFAULT_BUDGET_TOKENS  # most tokens the cache holds

    def __post_init__(self) -> None:
        if self.prefix_cache:
            PrefixCache(self.prefix_block, self.prefix_budget)  # checks both
        if not isinstance(self.policy, Policy):
            raise InputError(f"unknown policy {self.policy!r} ({', '.join(p.value for p in Policy)})")
        if not _is_int(self.chunk_size) or self.chunk_size < 1:
            raise InputError(f"chunk size must be an integer >= 1 (got {self.chunk_size})")
        if self.token_budget is not None and (not _is_int(self.token_budget) or self.token_budget < 1):
            raise InputError(f"token budget must be an integer >= 1 (got {self.token_budget})")
        if self.max_new_tokens is not None and (
            not _is_int(self.max_new_tokens) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS
        ):
            raise InputError(f"max new tokens must be in 1..{MAX_NEW_TOKENS} (got {self.max_new_tokens})")

    def budget(self, prompt_lengths: list[int]) -> int:
        """The step token budget. Default: one full chunk next to a decode of every request
        (under `none`: the longest prompt, which must fit one step)."""
        if self.token_budget is not None:
            return self.token_budget
        if self.policy is Policy.NONE:
            return max(max(prompt_lengths), len(prompt_lengths))
        return self.chunk_size + len(prompt_lengths)


@dataclass
class _Request:
    """A request's mutable state inside the loop."""

    spec: WorkloadRequest
    prompt_ids: list[int]
    max_new_tokens: int
    rng: torch.Generator
    cache: RequestKV = field(default_factory=RequestKV)
    prefilled: int = 0
    started: bool = False  # scheduled at least once (its prefix-cache lookup is then final)
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)

    @property
    def reused(self) -> int:
        return self.cache.reused

    def live(self) -> Live:
        return Live(self.spec.request_id, len(self.prompt_ids), self.prefilled, len(self.output))

    def record(self, stop_reason: str) -> RequestRecord:
        return RequestRecord(
            request_id=self.spec.request_id, cls=self.spec.cls, arrival_s=self.spec.arrival_s,
            prompt_tokens=len(self.prompt_ids), first_token_s=self.times[0], token_times_s=tuple(self.times),
            output_token_ids=tuple(self.output), stop_reason=stop_reason, reused_tokens=self.reused,
        )


def encode_workload(target: LoadedModel, workload: Workload, cfg: ServeConfig) -> list[list[int]]:
    """Prompt token ids of every request, checked against the model's context and the budget."""
    if not workload.requests:
        raise InputError("the workload has no requests")
    if cfg.chunk_size > target.max_context:
        raise InputError(f"chunk size {cfg.chunk_size} is above the model's context {target.max_context}")
    prompts = [target.encode(r.prompt, raw=workload.raw, system=r.system) for r in workload.requests]
    for r, ids in zip(workload.requests, prompts):
        if not ids:
            raise InputError(f"request {r.request_id}: the prompt is empty")
        if len(ids) + 1 > target.max_context:
            raise InputError(
                f"request {r.request_id}: the prompt has {len(ids)} tokens; "
                f"this model's context is {target.max_context}"
            )
    longest = max(len(ids) for ids in prompts)
    budget = cfg.budget([len(ids) for ids in prompts])
    if cfg.policy is Policy.NONE and budget < longest:
        raise InputError(
            f"policy none runs a whole prompt in one step: token budget {budget} is below the longest prompt "
            f"({longest} tokens)"
        )
    return prompts


def serve(target: LoadedModel, workload: Workload, cfg: ServeConfig,
          stats: CacheStats | None = None) -> Iterator[ServeStep | RequestRecord]:
    """Run the workload; yields a ServeStep per engine step and a RequestRecord per finished
    request, as they happen. With the prefix cache on, `stats` (if given) is kept up to date
    with the run's cache counters."""
    prompts = encode_workload(target, workload, cfg)
    prefix = PrefixCache(cfg.prefix_block, cfg.prefix_budget) if cfg.prefix_cache else None
    if prefix is not None and stats is not None:
        prefix.stats = stats
    budget = cfg.budget([len(ids) for ids in prompts])
    eos = frozenset() if workload.ignore_eos else target.eos_token_ids
    waiting = [
        _Request(spec, ids, cfg.max_new_tokens or spec.max_new_tokens, torch.Generator().manual_seed(cfg.sampling.seed))
        for spec, ids in zip(workload.requests, prompts)
    ]  # in arrival order
    running: list[_Request] = []  # admitted and unfinished, in arrival order
    t0 = time.perf_counter()
    index = 0
    while waiting or running:
        # 1 admit
        now = time.perf_counter() - t0
        while waiting and waiting[0].spec.arrival_s <= now:
            running.append(waiting.pop(0))
        if not running:
            time.sleep(waiting[0].spec.arrival_s - now)
            continue

        # (prefix cache) a request not yet started takes the longest cached prefix of its
        # prompt, looked up again at each step until it is first scheduled
        if prefix is not None:
            for req in running:
                if not req.started:
                    prefix.release(list(req.cache.blocks))
                    req.cache = RequestKV(prefix.match(req.prompt_ids))
                    req.prefilled = req.cache.reused

        # 2 schedule
        items = schedule(cfg.policy, [r.live() for r in running], cfg.chunk_size, budget)
        by_id = {r.spec.request_id: r for r in running}
        start_s = time.perf_counter() - t0
        cached = []  # the reused prefix of each request starting now, shown in its first step
        for item in items:
            req = by_id[item.request_id]
            if not req.started:
                req.started = True
                if req.reused:
                    cached.append(StepItem(item.request_id, ItemKind.CACHED, 0, req.reused))

        # 3 forward: one packed sequence holding every item's tokens
        token_ids, positions, segments, keep, samplers = [], [], [], [], []
        for item in items:
            req = by_id[item.request_id]
            lo = len(token_ids)
            token_ids += req.prompt_ids[item.start:item.end] if item.kind is ItemKind.PREFILL else [req.output[-1]]
            positions += range(item.start, item.end)
            segments.append(Segment(lo, len(token_ids), req.cache))
            if item.kind is ItemKind.DECODE or item.end == len(req.prompt_ids):
                keep.append(len(token_ids) - 1)  # its last position scores the next token
                samplers.append(req)
        logits = forward_packed(target, token_ids, positions, tuple(segments), keep)  # (len(keep), V)
        for item in items:
            if item.kind is ItemKind.PREFILL:
                req = by_id[item.request_id]
                req.prefilled = item.end
                if prefix is not None:
                    prefix.insert(req.prompt_ids, req.prefilled, req.cache)

        # 4 sample
        for req, row in zip(samplers, logits):
            probs = probs_from_logits(row, cfg.sampling)
            req.output.append(choose(probs, row, cfg.sampling, float(torch.rand((), generator=req.rng))))
        if target.device.startswith("cuda"):
            torch.cuda.synchronize()
        end_s = time.perf_counter() - t0

        # 5 record
        yield ServeStep(index, start_s, end_s, tuple(cached + items))
        index += 1
        for req in samplers:
            req.times.append(end_s)
            stop = _stop_reason(req, eos, target.max_context)
            if stop:
                running.remove(req)
                if prefix is not None:
                    prefix.release(list(req.cache.blocks))
                yield req.record(stop)


def _stop_reason(req: _Request, eos: frozenset[int], max_context: int) -> str | None:
    """As in a solo run: EOS (kept), the token limit, or a full context."""
    if req.output[-1] in eos:
        return "eos"
    if len(req.output) >= req.max_new_tokens or len(req.prompt_ids) + len(req.output) >= max_context:
        return "max_new_tokens"
    return None


@dataclass(frozen=True)
class ServeResult:
    model: str
    device: str
    dtype: str
    workload: Workload
    config: ServeConfig
    token_budget: int  # the budget the run used (the default resolved)
    steps: tuple[ServeStep, ...]
    requests: tuple[RequestRecord, ...]  # in workload (arrival) order
    cache_stats: CacheStats | None = None  # with the prefix cache on


def run_serve(target: LoadedModel, workload: Workload, cfg: ServeConfig) -> ServeResult:
    """Run the workload to the end and collect its records."""
    steps: list[ServeStep] = []
    finished: dict[str, RequestRecord] = {}
    stats = CacheStats() if cfg.prefix_cache else None
    for record in serve(target, workload, cfg, stats):
        if isinstance(record, ServeStep):
            steps.append(record)
        else:
            finished[record.request_id] = record
    lengths = [r.prompt_tokens for r in finished.values()]
    return ServeResult(
        model=target.name, device=target.device, dtype=str(target.dtype).removeprefix("torch."),
        workload=workload, config=cfg, token_budget=cfg.budget(lengths), steps=tuple(steps),
        requests=tuple(finished[r.request_id] for r in workload.requests), cache_stats=stats,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
