"""Acceptance rules on hand-built tables over a small vocabulary."""

import pytest
import torch

from engine.acceptance import (
    TokenKind,
    greedy_accept,
    one_hot_probs,
    residual_distribution,
    speculative_sample,
    typical_accept,
)

V = 6


def logits_with_argmax(argmaxes):
    """(len, V) logits whose row i has its maximum at argmaxes[i]."""
    rows = torch.zeros(len(argmaxes), V)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
    return rows


@pytest.mark.parametrize("reject_at", [0, 1, 2, 3])
def test_greedy_rejects_at_first_mismatch_and_emits_target_argmax(reject_at):
    target_argmax = [1, 2, 3, 4, 5]
    draft = target_argmax[:4]
    draft[reject_at] = 0  # wrong token at reject_at
    a = greedy_accept(torch.tensor(draft), logits_with_argmax(target_argmax))
    assert a.accepted == reject_at
    assert a.next_token == target_argmax[reject_at]
    assert a.rejected_at == reject_at
    assert a.kinds() == (TokenKind.ACCEPTED,) * reject_at + (TokenKind.RECOVERED,)


def test_greedy_all_accepted_then_bonus():
    a = greedy_accept(torch.tensor([1, 2, 3]), logits_with_argmax([1, 2, 3, 4]))
    assert (a.accepted, a.next_token, a.rejected_at) == (3, 4, None)
    assert a.kinds()[-1] is TokenKind.BONUS and len(a.kinds()) == 4


def test_greedy_with_no_draft_is_plain_decoding():
    a = greedy_accept(torch.zeros(0, dtype=torch.long), logits_with_argmax([3]))
    assert (a.accepted, a.next_token, a.kinds()) == (0, 3, (TokenKind.BONUS,))


def _uniform_target(k):
    return torch.full((k + 1, V), 1.0 / V)


@pytest.mark.parametrize("reject_at", [0, 1, 2])
def test_sampling_forced_rejection_at_each_position(reject_at):
    k = 3
    draft_ids = torch.tensor([0, 1, 2])
    draft_probs = torch.full((k, V), 0.02)
    for i, t in enumerate(draft_ids.tolist()):
        draft_probs[i, t] = 0.9  # the draft is overconfident: accept prob = (1/6) / 0.9
    target = _uniform_target(k)
    ratio = (1 / V) / 0.9
    uniforms = torch.tensor([ratio / 2] * k)
    uniforms[reject_at] = ratio + 0.01  # just above the accept probability: rejected
    a = speculative_sample(draft_ids, draft_probs, target, uniforms, 0.5)
    assert a.accepted == reject_at and a.rejected_at == reject_at
    assert a.accept_probs == pytest.approx([ratio] * (reject_at + 1))
    # the recovered token comes from max(0, target - draft): never the rejected token itself
    assert a.next_token != int(draft_ids[reject_at])


def test_sampling_all_accepted_then_bonus_from_last_target_row():
    k = 2
    draft_ids = torch.tensor([4, 4])
    draft_probs = torch.full((k, V), 1.0 / V)
    target = torch.full((k + 1, V), 1.0 / V)
    target[k] = torch.tensor([0, 0, 0, 0, 0, 1.0])  # the bonus must be token 5
    a = speculative_sample(draft_ids, draft_probs, target, torch.tensor([0.99, 0.99]), 0.3)
    assert (a.accepted, a.next_token, a.rejected_at) == (2, 5, None)
    assert a.accept_probs == (1.0, 1.0)  # target >= draft: always accepted


def test_one_hot_draft_accepts_with_target_probability():
    draft_ids = torch.tensor([2])
    target = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.0, 0.0], [1.0, 0, 0, 0, 0, 0]])
    probs = one_hot_probs(draft_ids, V)
    kept = speculative_sample(draft_ids, probs, target, torch.tensor([0.29]), 0.0)
    rejected = speculative_sample(draft_ids, probs, target, torch.tensor([0.31]), 0.99)
    assert kept.accepted == 1 and kept.accept_probs == pytest.approx((0.3,))
    assert rejected.accepted == 0 and rejected.next_token == 3  # residual: target with token 2 removed


def test_residual_distribution():
    target = torch.tensor([0.5, 0.3, 0.2, 0, 0, 0])
    draft = torch.tensor([0.7, 0.1, 0.2, 0, 0, 0])
    assert torch.allclose(residual_distribution(target, draft), torch.tensor([0, 1.0, 0, 0, 0, 0]))
    assert torch.allclose(residual_distribution(target, target), target)  # no mass: fall back


def test_typical_acceptance_is_a_different_rule():
    # target prefers token 0 but gives the draft's token 1 enough mass to pass the threshold
    target = torch.tensor([[0.6, 0.4, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    a = typical_accept(torch.tensor([1]), target, 0.0)
    assert a.accepted == 1
    exact = speculative_sample(torch.tensor([1]), one_hot_probs(torch.tensor([1]), V), target, torch.tensor([0.5]), 0.0)
    assert exact.accepted == 0  # the exact rule keeps it only with probability 0.4
