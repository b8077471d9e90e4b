"""Serving metrics and the `serve --json` object, derived from the run's records only.

TTFT = first token time - arrival time. ITL = gaps between a request's consecutive tokens;
each step emits at most one token per request, so ITL per token and per step coincide.
Percentiles use engine.metrics.percentile (linear interpolation).
"""

from __future__ import annotations

from engine.metrics import percentile, prefill_cost
from engine.serving.records import ItemKind, RequestClass, RequestRecord, ServeStep
from engine.serving.loop import ServeResult
from engine.serving.scheduler import Policy

QUANTILES = (50, 90, 99)


def latency_by_class(requests: list[RequestRecord] | tuple[RequestRecord, ...]) -> dict:
    """{"long": {...}, "short": {...}}: request count, TTFT and ITL percentiles in ms
    (ITL pooled over the class's requests); None where a class has no values."""
    out = {}
    for cls in RequestClass:
        members = [r for r in requests if r.cls is cls]
        ttft = [r.ttft_ms for r in members]
        itl = [gap for r in members for gap in r.itl_ms]
        stats = {"requests": len(members), "output_tokens": sum(len(r.output_token_ids) for r in members)}
        stats |= {f"ttft_ms_p{q}": percentile(ttft, q) for q in QUANTILES}
        stats |= {f"itl_ms_p{q}": percentile(itl, q) for q in QUANTILES}
        stats["itl_ms_max"] = max(itl, default=None)
        out[cls.value] = stats
    return out


def in_flight(step: ServeStep, requests) -> list[RequestRecord]:
    """Requests that had arrived by the step's start and emitted their last token at or after
    its end."""
    return [r for r in requests if r.arrival_s <= step.start_s and r.token_times_s[-1] >= step.end_s]


def decode_traffic_active(steps, requests) -> bool:
    """Whether some prompt was prefilled while another request was already decoding (had its
    first token and more to come): the situation chunked prefill exists for."""
    for step in steps:
        prefilling = {i.request_id for i in step.items if i.kind is ItemKind.PREFILL}
        if prefilling and any(r.request_id not in prefilling and r.first_token_s <= step.start_s
                              for r in in_flight(step, requests)):
            return True
    return False


def summary(result: ServeResult) -> dict:
    steps, requests = result.steps, result.requests
    first_arrival = min(r.arrival_s for r in requests)
    end = max(r.token_times_s[-1] for r in requests)
    output_tokens = sum(len(r.output_token_ids) for r in requests)
    prefill_tokens = sum(i.tokens for s in steps for i in s.items if i.kind is ItemKind.PREFILL)
    span = end - first_arrival
    cfg = result.config
    return {
        # DESIGN.md's report fields
        "model": result.model,
        "device": result.device,
        "dtype": result.dtype,
        "evidence_class": result.workload.evidence,
        "workload": result.workload.name,
        "policy": cfg.policy.value,
        "chunk_size": cfg.chunk_size,
        "chunking": cfg.policy is not Policy.NONE,  # under none the chunk size is not used
        "token_budget": result.token_budget,
        "k": 0,  # no drafting: one token per request per step
        "temperature": cfg.sampling.temperature,
        "prompt_tokens": {c.value: [r.prompt_tokens for r in requests if r.cls is c] for c in RequestClass},
        "requests": len(requests),
        "concurrency": max((len(in_flight(s, requests)) for s in steps), default=0),
        "decode_traffic_active": decode_traffic_active(steps, requests),
        # totals
        "steps": len(steps),
        "step_tokens_max": max((s.tokens for s in steps), default=0),
        "output_tokens": output_tokens,
        "prefill_tokens": prefill_tokens,
        "wall_s": span,  # first arrival to last token
        "output_tokens_per_s": output_tokens / span if span > 0 else None,
        "tokens_per_s": (output_tokens + prefill_tokens) / span if span > 0 else None,
        "itl": "per token (one token per request per step, so also per step)",
        "by_class": latency_by_class(requests),
        "prefix_cache": prefix_cache_summary(result, prefill_tokens),
        "ttft_ms_p50_later": percentile([r.ttft_ms for r in sorted(requests, key=lambda r: r.arrival_s)[1:]], 50),
        "by_request": {r.request_id: {"ttft_ms": r.ttft_ms, "prompt_tokens": r.prompt_tokens,
                                      "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens}
                       for r in requests},
    }


def prefix_cache_summary(result: ServeResult, prefill_tokens: int) -> dict:
    """Prompt tokens requested, reused from the prefix cache and computed; the blended prefill
    cost (computed / requested: 1.0 without the cache); the cache's own counters."""
    cfg, requests = result.config, result.requests
    requested = sum(r.prompt_tokens for r in requests)
    reused = sum(r.reused_tokens for r in requests)
    out = {"on": cfg.prefix_cache, "block_size": cfg.prefix_block if cfg.prefix_cache else None,
           "budget_tokens": cfg.prefix_budget if cfg.prefix_cache else None,
           "requested_tokens": requested, "reused_tokens": reused, "computed_tokens": prefill_tokens,
           "prefill_cost": prefill_cost(requested, reused) if requested else None,
           "reused_share": reused / requested if requested else None}
    return out | (result.cache_stats.to_jsonable() if result.cache_stats is not None else {})


def report(result: ServeResult) -> dict:
    """The `serve --json` object: steps, requests, summary, settings and the workload (with
    literal prompts, so the file can be replayed with --workload FILE)."""
    cfg = result.config
    return {
        "settings": {
            "policy": cfg.policy.value, "chunk_size": cfg.chunk_size, "token_budget": result.token_budget,
            "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.sampling.temperature,
            "top_k": cfg.sampling.top_k, "top_p": cfg.sampling.top_p, "seed": cfg.sampling.seed,
            "prefix_cache": cfg.prefix_cache, "prefix_block": cfg.prefix_block, "prefix_budget": cfg.prefix_budget,
        },
        "steps": [s.to_jsonable() for s in result.steps],
        "requests": [r.to_jsonable() for r in result.requests],
        "summary": summary(result),
        "workload": result.workload.to_jsonable(),
    }
