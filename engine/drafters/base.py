"""The Drafter protocol, the proposal it returns, and the registry of drafters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from engine.errors import InputError
from engine.models import LoadedModel
from engine.mtp.tree import prune
from engine.sampling import SamplingConfig


@dataclass(frozen=True)
class DraftProposal:
    token_ids: torch.Tensor  # (k',) drafted tokens, k' <= k (a drafter may find nothing to propose)
    probs: torch.Tensor | None  # (k', V) draft_probs after the shared transform; None: one-hot
    # who proposed these drafts when not the run's own drafter (LookupFirst's lookups:
    # "prompt-lookup"); the step's record names it as its drafter. "": the run's drafter
    source: str = ""
    # a tree of drafts (engine.mtp.tree): parents[i] is draft i's parent, -1 the last context
    # token; None: a chain. Trees are verified greedily.
    parents: tuple[int, ...] | None = None
    # the drafter's distribution at each draft depth when it does not depend on the path
    # (MTP heads: one row per head), (depth, V); the step records each row's top candidates
    head_probs: torch.Tensor | None = None
    ranks: tuple[tuple[int, ...], ...] = ()  # tree drafts: each draft's path of ranks in head_probs

    def within(self, k: int) -> DraftProposal:
        """This proposal cut to draft length k: a chain's first k drafts, a tree's drafts at
        depth <= k."""
        heads = None if self.head_probs is None else self.head_probs[:k]
        if self.parents is None:
            probs = None if self.probs is None else self.probs[:k]
            return replace(self, token_ids=self.token_ids[:k], probs=probs, head_probs=heads)
        keep, parents = prune(self.parents, k)
        return replace(
            self, token_ids=self.token_ids[keep], probs=None if self.probs is None else self.probs[keep],
            parents=parents, head_probs=heads, ranks=tuple(self.ranks[i] for i in keep) if self.ranks else (),
        )


class Drafter(Protocol):
    name: str

    def propose(
        self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator
    ) -> DraftProposal:
        """Draft up to k tokens continuing `context` (prompt + output so far)."""
        ...

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        """Told after the prefill (accepted = 0) and after each step: the new context, how many
        drafts were kept, and the target's final hidden states (n, H) at the positions whose
        logits chose the last n tokens of context (n = the prompt length after the prefill, the
        step's emitted count after a step). MTP heads draft from the last row; native MTP layers
        need every row; others may ignore it. A drafter with a `feature_layers` attribute (a
        tuple of i: the state after i decoder layers, transformers' hidden_states[i]) gets (n, (1 + F) H) instead:
        the final hidden states, then those layers' (an MTP module with EAGLE-3's fused features)."""
        ...


@dataclass(frozen=True)
class DrafterSpec:
    """What a run asks for; each drafter reads the fields it needs."""

    method: str
    draft: str | None = None  # draft-model: preset, folder or hub id; mtp: a folder of trained heads
    ngram_max: int = 3  # prompt-lookup: longest n-gram matched
    ngram_min: int = 1  # prompt-lookup: shortest n-gram matched
    exit_layer: int = 0  # early-exit: layers used (0: a quarter of the target's layers)
    tree: str | None = None  # mtp: tree shape name (None: chain drafting)
    # draft-model (distilled) and mtp heads: "trained" scores only the drafting vocabulary shipped
    # with the weights (engine/drafters/vocab.py), "full" every token
    draft_vocab: str = "trained"
    # mtp: which MTP module drafts. "auto": the target's own MTP layers if its config declares
    # them, else a trained DeepSeek-style module (engine/mtp/module.py) if one is shipped for it
    # (chains; trees take the shipped heads first), else trained Medusa-style heads. "module" or
    # "heads" asks for one kind.
    mtp_kind: str = "auto"
    # draft-model, early-exit and mtp chains (module or native layers): end the chain after a draft whose own
    # probability (the draft's softmax; with sampling, of the token it drew) is below this; 0:
    # always draft k. A confidence cut-off as transformers' assistant_confidence_threshold and
    # EAGLE-2's dynamic drafting use: a draft the drafter doubts is seldom accepted, and the ones
    # after it even less, so stopping saves their drafting time. Exact: which drafts are proposed
    # never changes what the acceptance rule emits.
    draft_stop: float = 0.0
    # draft-model, early-exit, mtp: n > 0 looks for an earlier occurrence of the context's last
    # n..max(n, ngram_max) tokens before each step; where one is found, what followed it is the
    # draft (prompt lookup, no model run) and the drafter sits the step out; 0: off. Copy-heavy
    # text (summaries, retrieved passages, code edits) repeats long spans a model drafter guesses
    # token by token. Exact: the drafts are one-hot, the standard acceptance rule applies.
    lookup_first: int = 0
    # with lookup_first and a tree (mtp tree=...): the lookup's drafts join the drafter's tree as
    # one more branch (sharing the nodes it coincides with) instead of replacing it, so a step
    # whose lookup is wrong still has the tree's other paths, at the price of verifying the tree
    # on copy-heavy steps too (as lookahead decoding verifies n-gram guesses beside its own)
    lookup_join: bool = False
    # mtp with a trained module: a drafting step's products (the module's block and the drafting
    # vocabulary's LM head rows) multiply by int8 copies of its 16-bit weights on a CPU
    # (engine/drafters/int8.py): drafting steps cost less, and a draft can differ where the
    # module's top two are nearly tied; the output never does (the target verifies every draft)
    draft_int8: bool = True

    def __post_init__(self) -> None:
        check_stop(self.draft_stop)
        check_lookup(self.lookup_first)
        if self.lookup_join and not self.lookup_first:
            raise InputError("lookup join needs lookup-first (the n-gram length the lookup matches)")


def check_stop(value: float) -> float:
    if not isinstance(value, (int, float)) or not 0.0 <= float(value) < 1.0:
        raise InputError(f"draft stop must be a probability in [0, 1) (got {value!r})")
    return float(value)


LOOKUP_MAX = 16  # the longest n-gram lookup_first may ask for (prompt_lookup.MAX_NGRAM)


def check_lookup(value: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= LOOKUP_MAX:
        raise InputError(f"lookup-first must be an n-gram length in 1..{LOOKUP_MAX}, or 0 for off (got {value!r})")
    return value


LOOKUP_DRAFTERS = ("draft-model", "early-exit", "mtp")  # drafters that run a model: lookup_first can spare them a step


DrafterFactory = Callable[[LoadedModel, DrafterSpec], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(method: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[method] = factory
        return factory

    return deco


def drafter_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def build_drafter(target: LoadedModel, spec: DrafterSpec) -> Drafter | None:
    """The drafter for spec.method; None for plain decoding ("baseline")."""
    if spec.method == "baseline":
        return None
    factory = _REGISTRY.get(spec.method)
    if factory is None:
        raise InputError(f"unknown method {spec.method!r} (baseline, {', '.join(_REGISTRY)})")
    if spec.lookup_first and spec.method not in LOOKUP_DRAFTERS:
        raise InputError(f"lookup-first is for drafters that run a model ({', '.join(LOOKUP_DRAFTERS)}), "
                         f"not {spec.method}")
    drafter = factory(target, spec)
    if spec.lookup_first:
        from engine.drafters.prompt_lookup import LookupFirst

        if spec.lookup_join and getattr(drafter, "tree", None) is None:
            raise InputError("lookup join is for a drafter's tree (mtp with a tree shape); "
                             "a chain's lookup replaces its drafts")
        drafter = LookupFirst(drafter, spec.lookup_first, max(spec.lookup_first, spec.ngram_max), spec.lookup_join)
    return drafter
