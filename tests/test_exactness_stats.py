"""Speculative sampling reproduces the target's distribution; a lossy rule does not.

A tiny target with a 64-token vocabulary and a different tiny draft model. Many seeded runs
give empirical distributions of the 2nd and 3rd output tokens (the first ones drafted and
verified); the exact marginals come from the target itself. A chi-square test at a fixed
false-alarm rate (alpha = 1e-3, seeds fixed, so the outcome is deterministic) must pass for the
exact rule and fail for typical acceptance (lossy).
"""

import pytest
import torch
from scipy.stats import chi2

from engine.acceptance import AcceptRule
from engine.decoding import DecodeConfig, generate
from engine.drafters import DrafterSpec, build_drafter
from engine.models import load_model
from engine.sampling import SamplingConfig
from engine.trace import Step
from tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 17, 42, 8]
RUNS = 3000
ALPHA = 1e-3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    target = load_model(str(tiny_llama(root / "t", seed=10, layers=2, scale=2.0)))
    draft = str(tiny_llama(root / "d", seed=11, layers=1, scale=2.0))
    return target, draft


@torch.inference_mode()
def exact_marginals(target, temperature):
    """P(x2) and P(x3) under the target, by enumerating x1 (and x1, x2)."""
    def next_probs(prefixes):
        logits = target.model(input_ids=torch.tensor(prefixes)).logits[:, -1].float()
        return torch.softmax(logits / temperature, -1)

    p1 = next_probs([PROMPT])[0]  # (V,)
    V = p1.shape[0]
    p2_given_1 = next_probs([PROMPT + [a] for a in range(V)])  # (V, V)
    joint12 = p1[:, None] * p2_given_1
    p3_given_12 = next_probs([PROMPT + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    p3 = (joint12[:, :, None] * p3_given_12).sum((0, 1))
    return joint12.sum(0), p3


def chi_square_pvalue(counts, probs):
    expected = probs * counts.sum()
    big = expected >= 5  # pool the rare bins so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    stat = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    return float(chi2.sf(stat, df=len(obs) - 1))


def sample_counts(target, draft, rule, temperature=1.0, stop=0.0, max_new_tokens=3, verify_ms=()):
    V = target.vocab_size
    counts2, counts3 = torch.zeros(V), torch.zeros(V)
    drafter = build_drafter(target, DrafterSpec("draft-model", draft=draft, draft_stop=stop))
    for seed in range(RUNS):
        cfg = DecodeConfig(max_new_tokens=max_new_tokens, k=2, rule=rule, ignore_eos=True, fit_k=bool(verify_ms),
                           sampling=SamplingConfig(temperature=temperature, seed=seed))
        out = [t.token_id for e in generate(target, PROMPT, cfg, drafter, verify_ms=verify_ms)
               if isinstance(e, Step) for t in e.emitted]
        counts2[out[1]] += 1
        counts3[out[2]] += 1
    return counts2, counts3


def test_speculative_sampling_has_the_target_distribution(models):
    target, draft = models
    p2, p3 = exact_marginals(target, 1.0)
    c2, c3 = sample_counts(target, draft, AcceptRule.EXACT)
    assert chi_square_pvalue(c2, p2) > ALPHA
    assert chi_square_pvalue(c3, p3) > ALPHA


def test_a_confidence_stop_keeps_the_target_distribution(models):
    """Chains cut after a draft the drafter doubts (draft_stop): which drafts are proposed
    depends only on the drafter's own draws, so the output distribution is still the target's.
    The tiny draft is nearly flat (a drawn token's probability 0.011-0.026), so the stop sits at
    its median: about half the chains are cut."""
    target, draft = models
    p2, p3 = exact_marginals(target, 1.0)
    c2, c3 = sample_counts(target, draft, AcceptRule.EXACT, stop=0.017, max_new_tokens=4)  # (room for 2 drafts)
    assert chi_square_pvalue(c2, p2) > ALPHA
    assert chi_square_pvalue(c3, p3) > ALPHA
    spec = DrafterSpec("draft-model", draft=draft, draft_stop=0.017)
    cfg = lambda seed: DecodeConfig(max_new_tokens=4, k=2, ignore_eos=True, sampling=SamplingConfig(temperature=1.0, seed=seed))
    lengths = [len(e.draft_probs) for seed in range(40) for e in generate(target, PROMPT, cfg(seed), build_drafter(target, spec))
               if isinstance(e, Step) and e.index == 1]
    assert 1 in lengths and 2 in lengths  # the stop cut some chains and not others


# a forward over 3 tokens costs 1.15x one: before any record (first draft accepted at the prior
# 0.5) two drafts pay; after a first draft was rejected (its rate 1/3) only one does
FIT_CURVE = (1000.0, 1000.0, 1150.0)


def test_fitted_draft_lengths_keep_the_target_distribution(models):
    """fit_k chooses a step's draft length from the earlier steps' acceptance: step 2 drafts two
    tokens after step 1 accepted its first draft, one after it was rejected, so the 3rd output
    token (step 2's first when step 1 emitted one) comes from a draft length that depends on
    what the target did before. The marginals are still the target's."""
    target, draft = models
    p2, p3 = exact_marginals(target, 1.0)
    c2, c3 = sample_counts(target, draft, AcceptRule.EXACT, max_new_tokens=6, verify_ms=FIT_CURVE)
    assert chi_square_pvalue(c2, p2) > ALPHA
    assert chi_square_pvalue(c3, p3) > ALPHA
    second = set()
    for seed in range(40):
        cfg = DecodeConfig(max_new_tokens=6, k=2, ignore_eos=True, fit_k=True,
                           sampling=SamplingConfig(temperature=1.0, seed=seed))
        steps = [e for e in generate(target, PROMPT, cfg, build_drafter(target, DrafterSpec("draft-model", draft=draft)),
                                     verify_ms=FIT_CURVE) if isinstance(e, Step)]
        assert steps[1].k == 2  # no record yet: the prior
        if len(steps) > 2:
            second.add((steps[1].accepted > 0, steps[2].k))
    assert (False, 1) in second and (True, 2) in second, second  # the length followed step 1's outcome


def test_lossy_typical_acceptance_fails_the_same_test(models):
    target, draft = models
    p2, p3 = exact_marginals(target, 1.0)
    c2, c3 = sample_counts(target, draft, AcceptRule.TYPICAL)
    assert min(chi_square_pvalue(c2, p2), chi_square_pvalue(c3, p3)) < ALPHA


def test_pure_rule_matches_target_on_a_table():
    """The acceptance function alone, on a hand-built 5-token table, with 40,000 draws."""
    from engine.acceptance import speculative_sample

    gen = torch.Generator().manual_seed(0)
    target = torch.tensor([[0.1, 0.4, 0.2, 0.25, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    draft = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2]])
    counts = torch.zeros(5)
    for _ in range(40000):
        u = torch.rand(3, generator=gen)
        x = int(torch.searchsorted(torch.cumsum(draft[0], 0), u[0:1] * 0.999999))
        a = speculative_sample(torch.tensor([x]), draft, target, u[1:2], float(u[2]))
        counts[x if a.accepted else a.next_token] += 1
    assert chi_square_pvalue(counts, target[0]) > ALPHA
