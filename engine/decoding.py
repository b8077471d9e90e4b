"""The decoding loop: prefill (optionally chunked), then target steps that verify drafts.

Plain decoding is the same loop with no drafter: every step drafts k = 0 tokens and the target
emits one. Each step runs five phases, named as in the UI legend and the lessons:
1 draft, 2 verify, 3 accept, 4 commit/rollback KV, 5 record.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from engine.acceptance import (
    Acceptance,
    AcceptRule,
    TokenKind,
    greedy_accept,
    one_hot_probs,
    residual_distribution,
    speculative_sample,
    typical_accept,
)
from engine.draft_length import DraftLengthFit, fits
from engine.drafters.base import Drafter
from engine.errors import InputError
from engine.kv import growing_cache
from engine.models import LoadedModel
from engine.mtp.tree import greedy_accept_tree, keep_path, tree_inputs
from engine.sampling import SamplingConfig, choose, probs_from_logits
from engine.trace import MAX_OUTPUT_TOKENS, TOP_N, EmittedToken, PrefillChunk, Step, TopToken

MAX_K = 16
MAX_NEW_TOKENS = MAX_OUTPUT_TOKENS  # a run's cap; a trace with more tokens is refused on loading


@dataclass(frozen=True)
class DecodeConfig:
    max_new_tokens: int = 128
    k: int = 4  # draft length (the papers' gamma); the starting length when adaptive
    adaptive: bool = False  # grow k by 2 after a fully accepted step, shrink by 1 otherwise
    # draft each step as far as pays on this machine's verify curve, k at most (chains;
    # engine.draft_length): exact, like any draft length
    fit_k: bool = False
    prefill_chunk: int = 0  # prefill the prompt in chunks of this many tokens; 0: one forward
    sampling: SamplingConfig = SamplingConfig()
    rule: AcceptRule = AcceptRule.EXACT  # TYPICAL is lossy (teaching only)
    ignore_eos: bool = False  # run to max_new_tokens (benchmarks, statistical tests)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise InputError(f"max new tokens must be in 1..{MAX_NEW_TOKENS} (got {self.max_new_tokens})")
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise InputError(f"k (draft length) must be in 1..{MAX_K} (got {self.k})")
        if not isinstance(self.prefill_chunk, int) or self.prefill_chunk < 0:
            raise InputError(f"prefill chunk must be >= 1 tokens, or 0 for one forward (got {self.prefill_chunk})")


class RunClock:
    """Seconds since the run started, not counting the time a consumer held a yielded record
    (a user between two Step clicks, a UI rendering a step): timings measure the engine."""

    def __init__(self) -> None:
        self._origin = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._origin

    @contextmanager
    def handed_out(self) -> Iterator[None]:
        begin = time.perf_counter()
        try:
            yield
        finally:
            self._origin += time.perf_counter() - begin


@dataclass(frozen=True)
class Finished:
    stop_reason: str  # "eos", "max_new_tokens", "context" (the model's context is full) or "stopped"


Event = PrefillChunk | Step | Finished


def next_k(k: int, accepted: int, drafted: int) -> int:
    """Adaptive draft length (transformers' heuristic): +2 after all drafts were accepted,
    -1 otherwise, within 1..MAX_K.

    >>> next_k(4, 4, 4), next_k(4, 2, 4), next_k(1, 0, 1), next_k(16, 16, 16)
    (6, 3, 1, 16)
    """
    if drafted == 0:
        return k
    return min(MAX_K, k + 2) if accepted == drafted else max(1, k - 1)


def check_prompt(target: LoadedModel, prompt_ids: list[int], cfg: DecodeConfig) -> None:
    if not prompt_ids:
        raise InputError("the prompt is empty")
    if len(prompt_ids) + 1 > target.max_context:
        raise InputError(
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {target.max_context}"
        )
    if cfg.prefill_chunk > target.max_context:
        raise InputError(f"prefill chunk {cfg.prefill_chunk} is above the model's context {target.max_context}")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def prefill(
    target: LoadedModel, prompt_ids: list[int], cache: DynamicCache, chunk: int, clock: RunClock,
    feature_layers: tuple[int, ...] = (),
) -> Iterator[PrefillChunk | tuple[torch.Tensor, torch.Tensor]]:
    """Run the prompt through the target in chunks; yields a PrefillChunk per forward, then the
    logits (V,) for the first output token and the final hidden states (T, H) of the prompt
    ((T, (1 + F) H) with F feature layers: see `hidden_of`)."""
    size = chunk or len(prompt_ids)
    ids = torch.tensor([prompt_ids], device=target.device)  # (1, T)
    hidden = []
    for index, start in enumerate(range(0, len(prompt_ids), size)):
        end = min(start + size, len(prompt_ids))
        start_s = clock.now()
        out = target.model(
            input_ids=ids[:, start:end], cache=cache, use_cache=True, logits_to_keep=1, output_hidden_states=True
        )
        hidden.append(hidden_of(out.hidden_states, feature_layers))  # (chunk, (1 + F) H)
        _sync(target.device)
        chunk_record = PrefillChunk(index, start, end, start_s, clock.now() - start_s)
        with clock.handed_out():
            yield chunk_record
    yield out.logits[0, -1], torch.cat(hidden)  # (V,), (T, H)


def hidden_of(states: tuple[torch.Tensor, ...], feature_layers: tuple[int, ...]) -> torch.Tensor:
    """A forward's hidden states for the drafter, batch row 0: the final ones (n, H), or with
    feature layers (a drafter's `feature_layers`: i is the state after i decoder layers,
    transformers' hidden_states[i]) the final ones and then each of those side by side, (n, (1 + F) H)."""
    if not feature_layers:
        return states[-1][0]
    return torch.cat([states[-1][0]] + [states[i][0] for i in feature_layers], dim=-1)


@torch.inference_mode()
def verify(
    target: LoadedModel, cache: DynamicCache, last_token: int, draft_ids: torch.Tensor,
    parents: tuple[int, ...] | None = None, feature_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: one target forward over [last token, drafts...] appended to the cache.

    Returns float32 logits (n, V) and final hidden states (n, H), n = drafts + 1: row i scores
    the token after the context plus the first i drafts. A tree of drafts (parents given) gets
    position ids by depth and a mask letting each draft see only its ancestors: row i + 1 then
    scores the token after draft i's path (engine.mtp.tree)."""
    ids = torch.tensor([[last_token] + draft_ids.tolist()], device=target.device)  # (1, n)
    tree = {} if parents is None else tree_inputs(parents, cache.get_seq_length(), target.device, target.dtype)
    out = target.model(input_ids=ids, cache=cache, use_cache=True, output_hidden_states=True, **tree)
    return out.logits[0].float(), hidden_of(out.hidden_states, feature_layers)


def accept(
    cfg: DecodeConfig,
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_logits: torch.Tensor,
    target_probs: torch.Tensor,
    draws: torch.Tensor,
) -> Acceptance:
    """Phase 3: the acceptance rule of this run; draws (k+1,) are the uniforms (the last one
    samples the recovered or bonus token)."""
    if cfg.rule is AcceptRule.TYPICAL:
        return typical_accept(draft_ids, target_probs, float(draws[-1]))
    if cfg.sampling.greedy:
        return greedy_accept(draft_ids, target_logits)
    return speculative_sample(draft_ids, draft_probs, target_probs, draws[:-1], float(draws[-1]))


def rollback(cache: DynamicCache, drafted: int, accepted: int, tree_path: tuple[int, ...] | None = None) -> None:
    """Phase 4: drop the KV entries of rejected drafts; the cache then holds the context up to
    (not including) the token the step emitted last. After a tree, tree_path (the accepted
    drafts' indices) says which entries to keep."""
    if tree_path is not None:
        keep_path(cache, cache.get_seq_length() - drafted - 1, tree_path)
    elif drafted > accepted:
        cache.crop(accepted - drafted)


def _top(target: LoadedModel, probs: torch.Tensor, n: int = TOP_N) -> tuple[TopToken, ...]:
    values, ids = torch.topk(probs, n)
    return tuple(TopToken(int(i), target.token_text(int(i)), float(v)) for v, i in zip(values.tolist(), ids.tolist()))


def _head_top(target: LoadedModel, proposal) -> tuple[tuple[TopToken, ...], ...]:
    """Each draft depth's top candidates (MTP heads), enough to cover the tree's ranks."""
    if proposal is None or proposal.head_probs is None:
        return ()
    widest = [1 + max((r[d] for r in proposal.ranks if len(r) > d), default=-1) for d in range(len(proposal.head_probs))]
    return tuple(_top(target, row, max(TOP_N, n)) for row, n in zip(proposal.head_probs, widest))


def _emitted(target, tokens, kinds, probs_rows) -> tuple[EmittedToken, ...]:
    return tuple(
        EmittedToken(tok, target.token_text(tok), kind, float(row[tok]), _top(target, row),
                     special=tok in target.special_ids, raw_bytes=target.partial_bytes(tok))
        for tok, kind, row in zip(tokens, kinds, probs_rows)
    )


def _truncate(tokens: list[int], eos: frozenset[int], budget: int) -> tuple[list[int], bool]:
    """Cut emitted tokens at the first EOS (kept) and at the token budget."""
    for i, tok in enumerate(tokens[:budget]):
        if tok in eos:
            return tokens[: i + 1], True
    return tokens[:budget], False


def generate(
    target: LoadedModel,
    prompt_ids: list[int],
    cfg: DecodeConfig,
    drafter: Drafter | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    verify_ms: Sequence[float] = (),
) -> Iterator[Event]:
    """Decode from prompt_ids; yields PrefillChunk, then Step records, then Finished.

    With drafter=None this is plain decoding (one token per target step); greedy output equals
    transformers' generate(do_sample=False). With a drafter, greedy output is the same tokens
    and sampled output has the target's distribution. cfg.fit_k reads the target's verify curve
    (verify_ms, or engine.verify_curve's measurement when not given).
    """
    check_prompt(target, prompt_ids, cfg)
    sampling = cfg.sampling
    clock = RunClock()
    target_rng = torch.Generator().manual_seed(sampling.seed)  # accept and sample draws
    draft_rng = torch.Generator().manual_seed(sampling.seed + 1)  # the drafter's own draws
    eos = frozenset() if cfg.ignore_eos else target.eos_token_ids
    cache = growing_cache()  # DynamicCache that grows in place (engine/kv.py)
    feature_layers = tuple(getattr(drafter, "feature_layers", ()))  # earlier layers the drafter reads too
    for item in prefill(target, prompt_ids, cache, cfg.prefill_chunk, clock, feature_layers):
        if isinstance(item, PrefillChunk):
            yield item
        else:
            logits, hidden = item
    probs = probs_from_logits(logits, sampling)
    u = float(torch.rand((), generator=target_rng))
    first = choose(probs, logits, sampling, u)
    now = clock.now()
    first_step = Step(
        index=0, drafter="prefill", k=0, draft_token_ids=(), draft_texts=(), draft_probs=(),
        target_probs=(), accept_probs=(), accept_uniforms=(),
        sample_uniform=None if sampling.greedy else u, accepted=0,
        emitted=_emitted(target, [first], [TokenKind.BONUS], [probs]), residual_top=(), draft_top=(),
        kv_len_before=0, kv_len_after=len(prompt_ids), draft_s=0.0, verify_s=now, end_s=now,
    )
    with clock.handed_out():
        yield first_step
    context = list(prompt_ids) + [first]
    produced = 1
    if first in eos or produced >= cfg.max_new_tokens:
        yield Finished("eos" if first in eos else "max_new_tokens")
        return
    if drafter is not None:
        drafter.observe(context, 0, hidden)
    k = cfg.k
    drafter_name = drafter.name if drafter else "none"
    fit = None
    if cfg.fit_k and fits(drafter):
        if not verify_ms:
            from engine.verify_curve import curve_for

            verify_ms = curve_for(target).ms
        fit = DraftLengthFit(verify_ms)
    step_index = 1
    while True:
        if should_stop():
            yield Finished("stopped")
            return
        kv_before = cache.get_seq_length()  # (== len(context) - 1: the last token is not cached)
        budget = cfg.max_new_tokens - produced
        room = target.max_context - len(context)
        if room <= 0:  # the policy for a long run: stop when the model's context is full
            yield Finished("context")
            return
        # never draft past the token budget or the context: a step emits drafts + 1
        k_step = max(0, min(k, budget - 1, room - 1)) if drafter else 0
        if fit is not None and k_step:
            k_step = fit.cap(k_step, (drafter_name,))

        # 1 draft
        begin = time.perf_counter()
        proposal = drafter.propose(context, k_step, sampling, draft_rng).within(k_step) if k_step else None
        if fit is not None and proposal is not None and proposal.parents is None:
            proposal = proposal.within(fit.best(proposal.source or drafter_name, k_step))
        draft_ids = proposal.token_ids if proposal is not None else torch.zeros(0, dtype=torch.long)
        _sync(target.device)
        draft_s = time.perf_counter() - begin
        drafted = int(draft_ids.shape[0])
        parents = proposal.parents if proposal is not None and drafted else None  # None: a chain
        if parents is not None and (not sampling.greedy or cfg.rule is not AcceptRule.EXACT):
            raise InputError("a tree of drafts is verified greedily only (temperature 0, exact rule)")

        # 2 verify: one target forward over [last token, drafts...]
        begin = time.perf_counter()
        target_logits, hidden = verify(target, cache, context[-1], draft_ids, parents,
                                       feature_layers)  # (drafted+1, V), (drafted+1, H or (1 + F) H)
        target_probs = probs_from_logits(target_logits, sampling)  # (drafted+1, V)

        # 3 accept
        if drafted and proposal.probs is not None:
            draft_probs = proposal.probs.to(target_probs.device)
        else:
            draft_probs = one_hot_probs(draft_ids, target_probs.shape[-1]).to(target_probs.device)
        draws = torch.rand(drafted + 1, generator=target_rng)
        if parents is None:
            result = accept(cfg, draft_ids.to(target_probs.device), draft_probs, target_logits, target_probs, draws)
            path = tuple(range(result.accepted))
        else:
            result, path = greedy_accept_tree(draft_ids, parents, target_logits)
        rows = [0] + [i + 1 for i in path]  # the verify rows that chose each emitted token
        tokens = [int(draft_ids[i]) for i in path] + [result.next_token]
        tokens, hit_eos = _truncate(tokens, eos, budget)

        # 4 commit/rollback KV: keep the last token and the accepted drafts
        rollback(cache, drafted, result.accepted, None if parents is None else path)
        _sync(target.device)
        verify_s = time.perf_counter() - begin

        # 5 record
        kinds = result.kinds()[: len(tokens)]
        residual = ()
        if result.rejected_at is not None and not sampling.greedy:
            i = result.rejected_at
            residual = _top(target, residual_distribution(target_probs[i], draft_probs[i]), 10)
        draft_list = draft_ids.tolist()
        parent_rows = range(drafted) if parents is None else [p + 1 for p in parents]
        record = Step(
            index=step_index,
            drafter=(proposal.source if proposal is not None and proposal.source else drafter_name),
            k=drafted,
            draft_token_ids=tuple(draft_list),
            draft_texts=tuple(target.token_text(t) for t in draft_list),
            draft_raw_bytes=tuple(target.partial_bytes(t) for t in draft_list),
            draft_probs=tuple(float(draft_probs[i, t]) for i, t in enumerate(draft_list)),
            target_probs=tuple(float(target_probs[r, t]) for r, t in zip(parent_rows, draft_list)),
            accept_probs=result.accept_probs,
            accept_uniforms=() if sampling.greedy else tuple(draws[: len(result.accept_probs)].tolist()),
            sample_uniform=None if sampling.greedy else float(draws[-1]),
            accepted=result.accepted,
            emitted=_emitted(target, tokens, kinds, target_probs[rows]),
            residual_top=residual,
            draft_top=tuple(_top(target, draft_probs[i], 3) for i in range(drafted)) if proposal and proposal.probs is not None else (),
            kv_len_before=kv_before,
            kv_len_after=cache.get_seq_length(),
            draft_s=draft_s,
            verify_s=verify_s,
            end_s=clock.now(),
            draft_parents=parents or (),
            accepted_nodes=path if parents is not None else (),
            draft_ranks=proposal.ranks if proposal is not None else (),
            head_top=_head_top(target, proposal),
        )
        with clock.handed_out():
            yield record
        context.extend(tokens)
        produced += len(tokens)
        if drafter is not None:
            drafter.observe(context, result.accepted, hidden[rows[: len(tokens)]])
            if fit is not None and parents is None:
                fit.record(record.drafter, drafted, result.accepted, draft_s)
            if cfg.adaptive:
                k = next_k(k, result.accepted, drafted)
        step_index += 1
        if hit_eos or produced >= cfg.max_new_tokens:
            yield Finished("eos" if hit_eos else "max_new_tokens")
            return
