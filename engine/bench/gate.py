"""The quality gate: does a method change what the target model would have written?

It runs the baseline (plain decoding, exact rule, the prompt prefilled in one forward) and the
method on an evaluation set. The method's decode config may prefill in chunks (prefill_chunk):
then the gate also checks that chunked prefill changes nothing, and the method may be
"baseline" itself (plain decoding with chunked prefill against plain decoding without).

Greedy (temperature 0): every output must be token-for-token the baseline's. At the first
divergence it reports the position, both tokens (ids and text) and the target's logit gap
there, from one extra target forward over the shared prefix: logit(baseline token) -
logit(method token), and the margin between the target's top two. A gap near 0 means a
near-tie flipped by numerics (batched verification rounds differently); a large gap is a bug or
a lossy rule.

Sampling (temperature > 0): outputs differ run to run, so the gate compares distributions.
Each prompt is sampled `samples` times per side with distinct seeds (baseline seeds s..s+N-1,
method seeds s+N..s+2N-1, so the two samples are independent). At every output position j the
tokens give two empirical distributions, and their total-variation distance
TV_j = 1/2 sum_x |f_baseline(x) - f_method(x)| is the statistic; the gate looks at the largest
TV over all prompts and positions.

Threshold, from the sample size at a fixed false-alarm rate alpha (a permutation test): if the
method samples from the target's distribution, as it must, the 2N sequences of a prompt are
exchangeable between the labels "baseline" and "method". Relabelling them at random (each
prompt independently) B times gives B draws of max TV from its exact null distribution for this
sample size. The threshold is the ceil((1 - alpha)(B + 1))-th smallest draw; the gate fails iff
the observed max TV exceeds it, which is the same as the permutation p-value
(1 + #{null >= observed}) / (B + 1) being <= alpha. So a correct method fails with probability
at most alpha, whatever the vocabulary, the number of positions or their dependence (the max
over positions and prompts is permuted jointly, so no multiple-testing correction is needed).
The threshold shrinks like 1/sqrt(N): with N samples and about U likely tokens at a position,
E[TV] under the null is about 1/2 * sum_x sqrt(2 f(x)(1 - f(x)) / N) * sqrt(2/pi), roughly
0.56 sqrt(U / N) for U equally likely tokens. A lossy rule (typical acceptance) shifts the
distribution by a fixed amount and fails once N is large enough; the permutations are seeded,
so a given run's verdict is reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from engine.acceptance import AcceptRule
from engine.bench.methods import BASELINE, DrafterOptions, check_buildable, check_registered
from engine.bench.prompts import Prompt
from engine.decoding import DecodeConfig
from engine.errors import InputError
from engine.models import LoadedModel, load_model
from engine.run import RunRequest, run

SCHEMA = "speclab.gate/1"
MAX_SAMPLES = 100_000
MAX_PERMUTATIONS = 100_000
PERMUTATION_BATCH = 64
TOP_DIFFERENCES = 3


@dataclass(frozen=True)
class GateConfig:
    model: str
    method: str
    prompts: tuple[Prompt, ...]
    decode: DecodeConfig  # k, sampling, the method's acceptance rule, max_new_tokens
    options: DrafterOptions = DrafterOptions()
    samples: int = 200  # runs per side per prompt when sampling
    alpha: float = 0.01  # false-alarm rate of the sampling test
    permutations: int = 1000

    def __post_init__(self) -> None:
        check_registered(self.method)
        if self.method == BASELINE and not self.decode.prefill_chunk:
            raise InputError("the gate compares a method with the baseline: choose a drafter method "
                             "(or a prefill chunk, to check chunked prefill)")
        if not self.prompts:
            raise InputError("the gate has no prompts")
        if not isinstance(self.samples, int) or not 10 <= self.samples <= MAX_SAMPLES:
            raise InputError(f"samples must be in 10..{MAX_SAMPLES} (got {self.samples})")
        if not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < 0.5:
            raise InputError(f"alpha must be in (0, 0.5) (got {self.alpha})")
        least = math.ceil(1 / self.alpha) - 1  # fewer permutations cannot reach level alpha
        if not isinstance(self.permutations, int) or not least <= self.permutations <= MAX_PERMUTATIONS:
            raise InputError(f"permutations must be in {least}..{MAX_PERMUTATIONS} at alpha {self.alpha} "
                             f"(got {self.permutations})")

    @property
    def greedy(self) -> bool:
        return self.decode.sampling.greedy


@dataclass(frozen=True)
class TokenRef:
    token_id: int
    text: str


@dataclass(frozen=True)
class Divergence:
    """Where a greedy method first left the baseline's output."""

    position: int  # output token index
    baseline: TokenRef | None  # None: that output ended first
    method: TokenRef | None
    target_logit_gap: float | None  # logit(baseline token) - logit(method token) at that position
    target_top2_margin: float  # the target's logit margin between its top two there


@dataclass(frozen=True)
class Difference:
    """A token whose frequency differs between the two samples at a position."""

    token: TokenRef
    baseline_freq: float
    method_freq: float


@dataclass(frozen=True)
class PromptVerdict:
    prompt: str
    prompt_tokens: int
    passed: bool
    compared_tokens: int  # greedy: output tokens compared; sampling: positions x samples per side
    divergence: Divergence | None = None  # greedy
    tv: tuple[float, ...] = ()  # sampling: TV distance per output position
    worst_position: int | None = None  # sampling: the position of the largest TV
    differences: tuple[Difference, ...] = ()  # sampling: the most different tokens there


@dataclass(frozen=True)
class GateResult:
    passed: bool
    mode: str  # "greedy" or "sampling"
    method: str
    accept: str
    lossy: bool
    model: str
    device: str
    dtype: str
    k: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    prefill_chunk: int  # the method's prefill chunk (0: one forward, as the baseline always)
    samples: int | None  # sampling only
    alpha: float | None
    permutations: int | None
    threshold: float | None  # max TV allowed (sampling)
    max_tv: float | None
    p_value: float | None
    prompts: tuple[PromptVerdict, ...]
    schema: str = SCHEMA


def _request(cfg: GateConfig, prompt: Prompt, method: str, seed: int, reference: bool = False) -> RunRequest:
    rule = AcceptRule.EXACT if method == BASELINE else cfg.decode.rule  # the baseline is plain decoding
    decode = replace(cfg.decode, rule=rule, ignore_eos=True, sampling=replace(cfg.decode.sampling, seed=seed))
    if reference:  # the reference side: plain decoding, the prompt in one forward
        decode = replace(decode, rule=AcceptRule.EXACT, prefill_chunk=0)
    return RunRequest(prompt=prompt.text, model=cfg.model, raw=prompt.raw, decode=decode,
                      drafter=cfg.options.spec(method))


def _output(cfg: GateConfig, prompt: Prompt, method: str, seed: int,
            reference: bool = False) -> tuple[list[int], list[int]]:
    trace = run(_request(cfg, prompt, method, seed, reference))
    return list(trace.info.prompt_token_ids), trace.output_token_ids


@torch.inference_mode()
def divergence(target: LoadedModel, prompt_ids: list[int], base: list[int], other: list[int]) -> Divergence | None:
    """The first position where two outputs differ, with the target's logits there."""
    position = next((i for i, (a, b) in enumerate(zip(base, other)) if a != b), min(len(base), len(other)))
    if position == len(base) == len(other):
        return None
    ids = torch.tensor([prompt_ids + base[:position]], device=target.device)  # (1, T)
    logits = target.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()  # (V,)
    top2 = torch.topk(logits, 2).values
    ref = {i: TokenRef(i, target.token_text(i)) for i in (base[position:position + 1] + other[position:position + 1])}
    b = ref.get(base[position]) if position < len(base) else None
    m = ref.get(other[position]) if position < len(other) else None
    gap = float(logits[b.token_id] - logits[m.token_id]) if b and m else None
    return Divergence(position, b, m, gap, float(top2[0] - top2[1]))


def _greedy_verdict(cfg: GateConfig, target: LoadedModel, prompt: Prompt) -> PromptVerdict:
    prompt_ids, base = _output(cfg, prompt, BASELINE, cfg.decode.sampling.seed, reference=True)
    _, other = _output(cfg, prompt, cfg.method, cfg.decode.sampling.seed)
    div = divergence(target, prompt_ids, base, other)
    return PromptVerdict(prompt.key, len(prompt_ids), div is None, min(len(base), len(other)), divergence=div)


def _codes(pooled: np.ndarray) -> tuple[np.ndarray, int]:
    """Tokens (n, P) -> flat bin indices (n, P) = position * U + the token's rank among that
    position's observed tokens, and U (bins per position)."""
    ranks = np.stack([np.unique(col, return_inverse=True)[1] for col in pooled.T], axis=1)  # (n, P)
    width = int(ranks.max()) + 1
    return ranks + np.arange(pooled.shape[1]) * width, width


def tv_per_position(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """TV distance between the token distributions of samples a (N, P) and b (M, P), per position.

    >>> tv_per_position(np.array([[1, 5], [2, 5]]), np.array([[1, 5], [1, 6]])).tolist()
    [0.5, 0.5]
    """
    flat, width = _codes(np.concatenate([a, b]))
    size = a.shape[1] * width
    fa = np.bincount(flat[: len(a)].ravel(), minlength=size) / len(a)
    fb = np.bincount(flat[len(a):].ravel(), minlength=size) / len(b)
    return 0.5 * np.abs(fa - fb).reshape(a.shape[1], width).sum(axis=1)


def _null_max_tv(a: np.ndarray, b: np.ndarray, permutations: int, rng: np.random.Generator) -> np.ndarray:
    """(permutations,) max over positions of the TV distance after relabelling a and b at random."""
    flat, width = _codes(np.concatenate([a, b]))
    n, total, positions = len(a), len(a) + len(b), a.shape[1]
    size = positions * width
    pooled_counts = np.bincount(flat.ravel(), minlength=size)
    out = []
    for start in range(0, permutations, PERMUTATION_BATCH):
        batch = min(PERMUTATION_BATCH, permutations - start)
        first = np.argsort(rng.random((batch, total)), axis=1)[:, :n]  # (batch, n) rows labelled "a"
        picked = flat[first] + (np.arange(batch) * size)[:, None, None]  # (batch, n, P)
        counts_a = np.bincount(picked.ravel(), minlength=batch * size).reshape(batch, size)
        diff = np.abs(counts_a / n - (pooled_counts - counts_a) / (total - n))
        out.append(0.5 * diff.reshape(batch, positions, width).sum(axis=2).max(axis=1))
    return np.concatenate(out)


def permutation_test(pairs: list[tuple[np.ndarray, np.ndarray]], alpha: float, permutations: int,
                     seed: int = 0) -> tuple[float, float, float]:
    """(observed max TV, threshold, p-value) over prompts' (baseline, method) samples; see the
    module docstring. Fails (at false-alarm rate alpha) iff observed > threshold."""
    rng = np.random.default_rng(seed)
    observed = max(float(tv_per_position(a, b).max()) for a, b in pairs)
    null = np.max([_null_max_tv(a, b, permutations, rng) for a, b in pairs], axis=0)  # (permutations,)
    rank = math.ceil((1 - alpha) * (permutations + 1))
    threshold = float(np.sort(null)[rank - 1])
    p_value = (1 + int((null >= observed).sum())) / (permutations + 1)
    return observed, threshold, p_value


def _differences(target: LoadedModel, a: np.ndarray, b: np.ndarray) -> tuple[Difference, ...]:
    tokens, count_a = np.unique(a, return_counts=True)
    freq_a = dict(zip(tokens.tolist(), (count_a / len(a)).tolist()))
    tokens, count_b = np.unique(b, return_counts=True)
    freq_b = dict(zip(tokens.tolist(), (count_b / len(b)).tolist()))
    keys = sorted(set(freq_a) | set(freq_b), key=lambda t: -abs(freq_a.get(t, 0) - freq_b.get(t, 0)))
    return tuple(Difference(TokenRef(t, target.token_text(t)), freq_a.get(t, 0.0), freq_b.get(t, 0.0))
                 for t in keys[:TOP_DIFFERENCES])


def _samples(cfg: GateConfig, prompt: Prompt, method: str, first_seed: int, tick: Callable[[], None],
             reference: bool = False):
    rows = []
    for i in range(cfg.samples):
        prompt_ids, out = _output(cfg, prompt, method, first_seed + i, reference)
        rows.append(out)
        tick()
    return prompt_ids, np.array(rows)  # (samples, max_new_tokens)


def total_runs(cfg: GateConfig) -> int:
    return len(cfg.prompts) * (2 if cfg.greedy else 2 * cfg.samples)


def run_gate(cfg: GateConfig, tick: Callable[[], None] = lambda: None) -> GateResult:
    """Run the gate; tick() is called after each run (a progress bar)."""
    target = load_model(cfg.model)
    check_buildable(target, cfg.method, cfg.options)
    s = cfg.decode.sampling
    verdicts: list[PromptVerdict] = []
    stats: dict = dict(samples=None, alpha=None, permutations=None, threshold=None, max_tv=None, p_value=None)
    if cfg.greedy:
        for prompt in cfg.prompts:
            verdicts.append(_greedy_verdict(cfg, target, prompt))
            tick()
        passed = all(v.passed for v in verdicts)
    else:
        pairs, lengths = [], []
        for prompt in cfg.prompts:
            prompt_ids, a = _samples(cfg, prompt, BASELINE, s.seed, tick, reference=True)
            _, b = _samples(cfg, prompt, cfg.method, s.seed + cfg.samples, tick)
            pairs.append((a, b))
            lengths.append(len(prompt_ids))
        observed, threshold, p_value = permutation_test(pairs, cfg.alpha, cfg.permutations, s.seed)
        passed = observed <= threshold
        for prompt, n_tokens, (a, b) in zip(cfg.prompts, lengths, pairs):
            tv = tv_per_position(a, b)
            worst = int(tv.argmax())
            verdicts.append(PromptVerdict(
                prompt.key, n_tokens, bool(tv.max() <= threshold), a.size, tv=tuple(tv.tolist()),
                worst_position=worst, differences=_differences(target, a[:, worst], b[:, worst]),
            ))
        stats = dict(samples=cfg.samples, alpha=cfg.alpha, permutations=cfg.permutations, threshold=threshold,
                     max_tv=observed, p_value=p_value)
    return GateResult(
        passed=passed, mode="greedy" if cfg.greedy else "sampling", method=cfg.method, accept=cfg.decode.rule.value,
        lossy=cfg.decode.rule is not AcceptRule.EXACT, model=cfg.model, device=target.device,
        dtype=str(target.dtype).removeprefix("torch."), k=cfg.decode.k, temperature=s.temperature, top_k=s.top_k,
        top_p=s.top_p, seed=s.seed, max_new_tokens=cfg.decode.max_new_tokens, prefill_chunk=cfg.decode.prefill_chunk,
        prompts=tuple(verdicts), **stats,
    )
