"""Acceptance rules: which drafted tokens the target keeps, and what it emits after them.

Pure functions: tensors and uniform draws in, an `Acceptance` out. No model, no globals.

Names, mapped once to Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
Decoding", Algorithm 1): their p(x) (the target model) is our `target_probs`, their q(x) (the
approximation model) is our `draft_probs`, their gamma is our k, their r ~ U(0, 1) are our
`accept_uniforms`.

Vocabulary (DESIGN.md): a drafted token kept is *accepted*; at the first rejection the target
emits a *recovered* token sampled from norm(max(0, target_probs - draft_probs)); when all k
drafts are accepted it emits a *bonus* token from target_probs at position k. So a step emits
accepted + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from engine.sampling import sample


class TokenKind(str, Enum):
    ACCEPTED = "accepted"
    RECOVERED = "recovered"
    BONUS = "bonus"


@dataclass(frozen=True)
class Acceptance:
    accepted: int  # number of drafted tokens kept (a prefix of the draft)
    next_token: int  # the recovered token (if a draft was rejected) or the bonus token
    accept_probs: tuple[float, ...]  # min(1, target/draft) per examined drafted token
    rejected_at: int | None  # draft position of the first rejection, None if all accepted

    def kinds(self) -> tuple[TokenKind, ...]:
        """Kind of each emitted token: accepted..., then recovered or bonus."""
        last = TokenKind.BONUS if self.rejected_at is None else TokenKind.RECOVERED
        return (TokenKind.ACCEPTED,) * self.accepted + (last,)


def greedy_accept(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Greedy verification: keep the longest prefix where draft == target argmax.

    draft_ids: (k,) drafted tokens. target_logits: (k+1, V): row i scores the token after the
    context plus the first i drafts. The token emitted after the kept prefix is the target's
    argmax there (recovered at a mismatch, bonus after a full match), so the output is
    token-for-token plain greedy decoding.

    >>> logits = torch.tensor([[0., 5, 0], [0, 0, 5], [5, 0, 0]])  # argmax: 1, 2, 0
    >>> a = greedy_accept(torch.tensor([1, 0]), logits)
    >>> a.accepted, a.next_token, [k.value for k in a.kinds()]
    (1, 2, ['accepted', 'recovered'])
    """
    k = draft_ids.shape[0]
    target_argmax = torch.argmax(target_logits, dim=-1)  # (k+1,)
    matches = (draft_ids == target_argmax[:k]).tolist()
    accepted = next((i for i, ok in enumerate(matches) if not ok), k)
    rejected_at = accepted if accepted < k else None
    examined = min(k, accepted + 1)
    accept_probs = tuple(1.0 if matches[i] else 0.0 for i in range(examined))
    return Acceptance(accepted, int(target_argmax[accepted].item()), accept_probs, rejected_at)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target_probs - draft_probs)) over the vocabulary (V,).

    If the residual has no mass (target == draft), any rejection had probability 0; fall back
    to target_probs so the function is total.
    """
    residual = torch.clamp(target_probs - draft_probs, min=0)
    mass = residual.sum()
    if mass <= 0:
        return target_probs
    return residual / mass


def one_hot_probs(draft_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """The draft distribution of a drafter that proposes without one (prompt lookup): (k, V)."""
    return torch.nn.functional.one_hot(draft_ids, vocab).float()


def speculative_sample(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniform: float,
) -> Acceptance:
    """Exact speculative sampling (Leviathan et al. 2023, Algorithm 1).

    draft_ids: (k,). draft_probs: (k, V), the drafter's distribution at each drafted position.
    target_probs: (k+1, V). accept_uniforms: (k,) draws in [0, 1). sample_uniform: the draw for
    the recovered or bonus token. Draft i is accepted while
    accept_uniforms[i] < target_probs[i, x_i] / draft_probs[i, x_i] (i.e. with probability
    min(1, target/draft)); the output is distributed exactly as sampling from the target.

    Worked example: the draft proposes token 0 with draft prob 0.8 where the target gives 0.4;
    accept prob is 0.5. A draw of 0.7 rejects it, and the recovered token comes from
    max(0, target - draft) = [0, 0.4, 0.2] normalised.

    >>> a = speculative_sample(torch.tensor([0]), torch.tensor([[0.8, 0.0, 0.2]]),
    ...     torch.tensor([[0.4, 0.4, 0.2], [1/3, 1/3, 1/3]]), torch.tensor([0.7]), 0.5)
    >>> a.accepted, a.next_token, a.accept_probs, a.rejected_at
    (0, 1, (0.5,), 0)
    """
    k = draft_ids.shape[0]
    accept_probs: list[float] = []
    for i in range(k):
        x = int(draft_ids[i])
        q = float(draft_probs[i, x])
        p = float(target_probs[i, x])
        ratio = 1.0 if q <= 0 else min(1.0, p / q)
        accept_probs.append(ratio)
        if not float(accept_uniforms[i]) < ratio:
            recovered = sample(residual_distribution(target_probs[i], draft_probs[i]), sample_uniform)
            return Acceptance(i, recovered, tuple(accept_probs), i)
    return Acceptance(k, sample(target_probs[k], sample_uniform), tuple(accept_probs), None)


class AcceptRule(str, Enum):
    EXACT = "exact"  # greedy match, or Leviathan et al.'s rule when sampling
    TYPICAL = "typical"  # LOSSY teaching variant: Medusa's typical acceptance


def typical_accept(
    draft_ids: torch.Tensor,
    target_probs: torch.Tensor,
    sample_uniform: float,
    epsilon: float = 0.09,
    delta: float = 0.3,
) -> Acceptance:
    """LOSSY: typical acceptance (Cai et al. 2024, Medusa, section 2.3.1).

    Keeps draft x_i while target_probs[i, x_i] > min(epsilon, delta * exp(-H(target_probs[i]))),
    then samples the next token from target_probs (not the residual). It accepts more drafts
    than the exact rule but the output no longer has the target's distribution; it exists to
    show that, and the quality gate must catch it.

    >>> a = typical_accept(torch.tensor([1]), torch.tensor([[0.5, 0.3, 0.2], [0.0, 1.0, 0.0]]), 0.5)
    >>> a.accepted, a.next_token
    (1, 1)
    """
    k = draft_ids.shape[0]
    accept_probs: list[float] = []
    for i in range(k):
        row = target_probs[i]
        entropy = float(-(row * torch.log(row.clamp_min(1e-30))).sum())
        threshold = min(epsilon, delta * float(torch.exp(torch.tensor(-entropy))))
        ok = float(row[int(draft_ids[i])]) > threshold
        accept_probs.append(1.0 if ok else 0.0)
        if not ok:
            return Acceptance(i, sample(row, sample_uniform), tuple(accept_probs), i)
    return Acceptance(k, sample(target_probs[k], sample_uniform), tuple(accept_probs), None)
