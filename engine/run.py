"""A run end to end: request -> model, prompt ids, drafter -> events -> Trace -> report.

The CLI, the app and the benchmarks all go through here, so a run means the same everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.acceptance import AcceptRule
from engine.decoding import DecodeConfig, Event, Finished, generate
from engine.draft_length import fits
from engine.drafters import DrafterSpec, build_drafter
from engine.errors import InputError
from engine.metrics import summary
from engine.models import LoadedModel, load_model
from engine.trace import PrefillChunk, RunInfo, Step, Trace, to_jsonable
from engine.verify_curve import curve_for

MAX_PROMPT_CHARS = 100_000


@dataclass(frozen=True)
class RunRequest:
    prompt: str
    model: str = "embedded"  # preset name, local folder or allowed hub id
    raw: bool = False  # skip the chat template
    decode: DecodeConfig = DecodeConfig()
    drafter: DrafterSpec = field(default_factory=lambda: DrafterSpec("baseline"))
    dtype: str = "auto"  # the preset's dtype unless set (engine.models.choose_dtype)
    kernels: str = "auto"  # "stock": transformers' own kernels, not batch-invariant (benchmarks)


@dataclass
class Prepared:
    """What a run needs before its first step; the app keeps one per session for stepping."""

    request: RunRequest
    target: LoadedModel
    prompt_ids: list[int]
    drafter: object | None
    info: RunInfo


def prepare(request: RunRequest) -> Prepared:
    if not isinstance(request.prompt, str) or not request.prompt.strip():
        raise InputError("the prompt is empty")
    if len(request.prompt) > MAX_PROMPT_CHARS:
        raise InputError(f"the prompt is {len(request.prompt)} characters (limit {MAX_PROMPT_CHARS})")
    target = load_model(request.model, dtype=request.dtype, kernels=request.kernels)
    prompt_ids = target.encode(request.prompt, raw=request.raw)
    drafter = build_drafter(target, request.drafter)
    cfg = request.decode
    info = RunInfo(
        model=request.model,
        method=request.drafter.method,
        drafter=getattr(drafter, "name", "none"),
        k=cfg.k if drafter else 0,
        adaptive=cfg.adaptive and drafter is not None,
        fit_k=cfg.fit_k and fits(drafter),
        temperature=cfg.sampling.temperature,
        top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p,
        seed=cfg.sampling.seed,
        max_new_tokens=cfg.max_new_tokens,
        prefill_chunk=cfg.prefill_chunk,
        device=target.device,
        dtype=str(target.dtype).removeprefix("torch."),
        prompt_text=request.prompt,
        prompt_token_ids=tuple(prompt_ids),
        lossy=cfg.rule is not AcceptRule.EXACT,
        dtype_reason=target.dtype_reason,
        batch_invariant=target.batch_invariant,
        verify_ms=curve_for(target).ms,
    )
    return Prepared(request, target, prompt_ids, drafter, info)


def events(prepared: Prepared, should_stop: Callable[[], bool] = lambda: False) -> Iterator[Event]:
    return generate(prepared.target, prepared.prompt_ids, prepared.request.decode, prepared.drafter, should_stop,
                    prepared.info.verify_ms)


def collect(info: RunInfo, stream: Iterator[Event], on_event: Callable[[Event], None] | None = None) -> Trace:
    """Drain an event stream into a Trace."""
    prefill: list[PrefillChunk] = []
    steps: list[Step] = []
    stop_reason = "stopped"
    for event in stream:
        if on_event:
            on_event(event)
        if isinstance(event, PrefillChunk):
            prefill.append(event)
        elif isinstance(event, Step):
            steps.append(event)
        elif isinstance(event, Finished):
            stop_reason = event.stop_reason
    return Trace(info, tuple(prefill), tuple(steps), stop_reason)


def run(request: RunRequest, on_event: Callable[[Event], None] | None = None) -> Trace:
    prepared = prepare(request)
    return collect(prepared.info, events(prepared), on_event)


def report(trace: Trace, baseline_step_s: float | None = None) -> dict:
    """The CLI's --json object (a stable contract; later features add keys, never rename)."""
    steps = [
        {
            "index": s.index,
            "k": s.k,
            "draft_token_ids": list(s.draft_token_ids),
            "accepted": s.accepted,
            "emitted_token_ids": list(s.emitted_token_ids),
            "kinds": [t.kind.value for t in s.emitted],
            "draft_probs": list(s.draft_probs),
            "target_probs": list(s.target_probs),
            "draft_ms": s.draft_s * 1000,
            "verify_ms": s.verify_s * 1000,
            "time_ms": s.end_s * 1000,
        }
        for s in trace.steps
    ]
    return {
        "method": trace.info.method,
        "model": trace.info.model,
        "lossy": trace.info.lossy,
        "device": trace.info.device,
        "dtype": trace.info.dtype,
        "prompt_tokens": len(trace.info.prompt_token_ids),
        "output_token_ids": trace.output_token_ids,
        "text": trace.text,
        "stop_reason": trace.stop_reason,
        "settings": {k: v for k, v in to_jsonable(trace.info).items() if k not in ("prompt_text", "prompt_token_ids")},
        "prefill_chunks": [to_jsonable(c) for c in trace.prefill],
        "steps": steps,
        "metrics": summary(trace.steps, trace.prefill, baseline_step_s, trace.info.verify_ms),
    }
