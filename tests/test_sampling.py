import math

import pytest
import torch

from engine.errors import InputError
from engine.sampling import SamplingConfig, choose, probs_from_logits, sample

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])


def test_greedy_probs_are_plain_softmax_and_choice_is_argmax():
    cfg = SamplingConfig()
    probs = probs_from_logits(LOGITS, cfg)
    assert torch.allclose(probs, torch.softmax(LOGITS, -1))
    assert choose(probs, LOGITS, cfg, 0.999) == 0


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_logits(temperature):
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=temperature))
    assert torch.allclose(probs, torch.softmax(LOGITS / temperature, -1))


def test_top_k_keeps_k_tokens_renormalised():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0, top_k=2))
    expected = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    assert torch.allclose(probs[:2], expected) and probs[2:].sum() == 0


def test_top_p_keeps_smallest_set_reaching_mass():
    base = torch.softmax(LOGITS, -1)  # [0.547, 0.201, 0.122, 0.074, 0.027]
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0, top_p=0.7))
    kept = (probs > 0).nonzero().flatten().tolist()
    assert kept == [0, 1]  # 0.547 < 0.7, 0.547 + 0.201 >= 0.7
    assert torch.allclose(probs[:2], base[:2] / base[:2].sum())


def test_top_p_one_keeps_all_and_top_k_larger_than_vocab_is_off():
    probs = probs_from_logits(LOGITS, SamplingConfig(temperature=1.0, top_p=1.0, top_k=50))
    assert torch.allclose(probs, torch.softmax(LOGITS, -1))


def test_sample_inverts_the_cdf():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    assert [sample(probs, u) for u in (0.0, 0.05, 0.1, 0.69, 0.7, 0.999999)] == [0, 0, 2, 2, 3, 3]


def test_sample_never_returns_zero_probability_token():
    probs = torch.tensor([0.5, 0.5, 0.0])
    assert sample(probs, 0.9999999999) == 1


def test_sample_frequencies_match_probs():
    probs = torch.tensor([0.2, 0.5, 0.3])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(3)
    for u in torch.rand(20000, generator=gen).tolist():
        counts[sample(probs, u)] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.015)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -0.1}, {"temperature": math.nan}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"seed": -3}],
)
def test_bad_sampling_settings_are_refused(kwargs):
    with pytest.raises(InputError):
        SamplingConfig(**kwargs)
