"""Routing requests over several replicas, each with its own prefix cache: a SIMULATION.

Evidence class: simulation. Nothing here runs a model forward during the simulation. What is
real: the requests (a workload's prompts, tokenized by the model's own tokenizer, with their
arrival times), the prefix cache (engine.serving.prefix_cache, the serving loop's own, with its
blocks, budget and LRU eviction; it holds no tensors here) and the costs, measured on the real
model by `measure_costs` (seconds per prompt token of prefill, seconds per decode step) unless
given. What is simplified: each replica serves one request at a time, first come first served
(no batching, no chunked prefill), and a request's time is its computed prompt tokens x the
prefill cost + (its output tokens - 1) x the decode cost.

Policies (seed 000's "prefix caching plus cache-aware routing"):
- round-robin: request i goes to replica i mod N, whatever the replicas hold.
- cache-aware: the replica that would give the first token soonest, counting both its queue
  and the part of the prompt its cache does not hold (wait + uncached tokens x the prefill
  cost); on a tie the longer cached prefix, then the lowest index. Routing by the longest cached
  prefix alone piles every question about a document onto one replica while others idle;
  weighing the wait against the saved prefill is what cache-aware routers do (SGLang's router
  balances prefix matches against load).
- least-loaded: the replica free soonest, ignoring caches (the usual load balancer).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from enum import Enum

from engine.errors import InputError
from engine.metrics import percentile
from engine.models import LoadedModel
from engine.serving.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET_TOKENS, PrefixCache
from engine.serving.workload import Workload

SIMULATION = "simulation"
MAX_REPLICAS = 64


class RoutePolicy(Enum):
    ROUND_ROBIN = "round-robin"
    CACHE_AWARE = "cache-aware"
    LEAST_LOADED = "least-loaded"


@dataclass(frozen=True)
class Costs:
    prefill_s_per_token: float
    decode_s_per_step: float
    source: str  # where the numbers come from

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_step"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 60:
                raise InputError(f"{name.replace('_', ' ')} must be a number of seconds in (0, 60) (got {value!r})")


def measure_costs(target: LoadedModel, prompt_tokens: int = 256, decode_steps: int = 16, repeats: int = 2) -> Costs:
    """Per-token prefill and per-step decode seconds of the real model, from plain runs of the
    engine (the shortest of `repeats`)."""
    from engine.decoding import DecodeConfig, generate
    from engine.serving.workload import shipped_text
    from engine.trace import PrefillChunk, Step

    ids = target.encode(shipped_text(400), raw=True)[:max(1, min(prompt_tokens, target.max_context - decode_steps - 2))]
    prefill, decode = [], []
    for _ in range(repeats):
        events = list(generate(target, ids, DecodeConfig(max_new_tokens=decode_steps + 1, ignore_eos=True)))
        prefill.append(sum(e.duration_s for e in events if isinstance(e, PrefillChunk)) / len(ids))
        ends = [e.end_s for e in events if isinstance(e, Step)]  # step 0: the prefill's first token
        decode.append(statistics.median(b - a for a, b in zip(ends, ends[1:])))
    return Costs(min(prefill), min(decode),
                 f"measured: {target.name} on {target.device} {str(target.dtype).removeprefix('torch.')}, "
                 f"{len(ids)}-token prefill, {decode_steps} decode steps, best of {repeats}, {time.strftime('%Y-%m-%d')}")


@dataclass(frozen=True)
class RoutedRequest:
    request_id: str
    replica: int
    arrival_s: float
    start_s: float  # when its replica took it
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    reused_tokens: int

    @property
    def ttft_ms(self) -> float:
        return (self.first_token_s - self.arrival_s) * 1000


@dataclass(frozen=True)
class RouteResult:
    policy: RoutePolicy
    replicas: int
    requests: tuple[RoutedRequest, ...]

    def summary(self) -> dict:
        reqs = self.requests
        requested = sum(r.prompt_tokens for r in reqs)
        reused = sum(r.reused_tokens for r in reqs)
        ttft = [r.ttft_ms for r in reqs]
        per_replica = [sum(1 for r in reqs if r.replica == i) for i in range(self.replicas)]
        return {
            "policy": self.policy.value, "replicas": self.replicas, "requests": len(reqs),
            "hit_rate": reused / requested if requested else None,  # prompt tokens served from a cache
            "requests_with_a_hit": sum(1 for r in reqs if r.reused_tokens) / len(reqs) if reqs else None,
            "prefill_cost": (requested - reused) / requested if requested else None,
            "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p90": percentile(ttft, 90), "ttft_ms_p99": percentile(ttft, 99),
            "makespan_s": max((r.finish_s for r in reqs), default=0.0) - min((r.arrival_s for r in reqs), default=0.0),
            "requests_per_replica": per_replica,
        }


class _NoKV:
    """The simulation caches blocks without tensors."""

    reused = 0

    @staticmethod
    def entries(start: int, end: int):
        return (), ()


def simulate(prompts: list[list[int]], arrivals: list[float], outputs: list[int], ids: list[str],
             replicas: int, policy: RoutePolicy, costs: Costs,
             block_size: int = DEFAULT_BLOCK_SIZE, budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> RouteResult:
    """Route the requests (in arrival order) and play them out on the replicas' clocks."""
    if not isinstance(replicas, int) or isinstance(replicas, bool) or not 1 <= replicas <= MAX_REPLICAS:
        raise InputError(f"replicas must be an integer in 1..{MAX_REPLICAS} (got {replicas!r})")
    caches = [PrefixCache(block_size, budget_tokens) for _ in range(replicas)]
    free_at = [0.0] * replicas
    routed = []
    for i in sorted(range(len(prompts)), key=lambda i: arrivals[i]):
        prompt, arrival = prompts[i], arrivals[i]
        if policy is RoutePolicy.ROUND_ROBIN:
            chosen = len(routed) % replicas
        elif policy is RoutePolicy.LEAST_LOADED:
            chosen = min(range(replicas), key=lambda r: (max(free_at[r], arrival), r))
        else:
            def first_token(r: int, cached: int) -> float:  # this replica's wait, then the uncached prefill
                return max(free_at[r], arrival) + (len(prompt) - cached) * costs.prefill_s_per_token

            held = [caches[r].peek(prompt) for r in range(replicas)]
            chosen = min(range(replicas), key=lambda r: (first_token(r, held[r]), -held[r], r))
        cache = caches[chosen]
        blocks = cache.match(prompt)
        reused = len(blocks) * block_size
        start = max(arrival, free_at[chosen])
        first = start + (len(prompt) - reused) * costs.prefill_s_per_token
        finish = first + max(0, outputs[i] - 1) * costs.decode_s_per_step
        cache.insert(prompt, len(prompt), _NoKV())
        cache.release(blocks)
        free_at[chosen] = finish
        routed.append(RoutedRequest(ids[i], chosen, arrival, start, first, finish, len(prompt), reused))
    order = {rid: n for n, rid in enumerate(ids)}
    return RouteResult(policy, replicas, tuple(sorted(routed, key=lambda r: order[r.request_id])))


def simulate_workload(target: LoadedModel, workload: Workload, replicas: int, policies: list[RoutePolicy],
                      costs: Costs, block_size: int = DEFAULT_BLOCK_SIZE,
                      budget_tokens: int = DEFAULT_BUDGET_TOKENS) -> dict:
    """Every policy on the same requests; the report's JSON object (evidence class: simulation)."""
    PrefixCache(block_size, budget_tokens)  # checks the settings
    prompts = [target.encode(r.prompt, raw=workload.raw, system=r.system) for r in workload.requests]
    for r, ids in zip(workload.requests, prompts):  # as the serving loop would refuse it
        if len(ids) + r.max_new_tokens > target.max_context:
            raise InputError(f"request {r.request_id}: {len(ids)} prompt tokens + {r.max_new_tokens} new do not fit "
                             f"this model's context ({target.max_context})")
    arrivals = [r.arrival_s for r in workload.requests]
    outputs = [r.max_new_tokens for r in workload.requests]
    ids = [r.request_id for r in workload.requests]
    results = [simulate(prompts, arrivals, outputs, ids, replicas, p, costs, block_size, budget_tokens) for p in policies]
    return {
        "evidence_class": SIMULATION,
        "workload": workload.name, "model": target.name, "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts), "replicas": replicas,
        "block_size": block_size, "budget_tokens_per_replica": budget_tokens,
        "costs": {"prefill_ms_per_token": costs.prefill_s_per_token * 1000,
                  "decode_ms_per_step": costs.decode_s_per_step * 1000, "source": costs.source},
        "simplified": "each replica serves one request at a time, first come first served (no batching)",
        "results": [r.summary() | {"by_request": [vars(q) | {"ttft_ms": q.ttft_ms} for q in r.requests]}
                    for r in results],
    }
