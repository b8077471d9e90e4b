"""The verify curve: what one target forward over T new tokens costs, as a multiple of one token.

Speculative decoding rests on it. A step that verifies k drafts is one forward over T = k + 1
tokens; if that costs about as much as a plain step (a flat curve: memory-bound, as on a GPU, or
bfloat16 on a CPU with bfloat16 matrix instructions), every accepted draft is nearly free. Where
the curve climbs (float32 on a small CPU: 5 tokens cost ~1.6x one), a drafter must emit that many
more tokens per step just to break even. The predicted speedup uses the measured cost
(engine.metrics.predicted_speedup's verify_cost) instead of assuming verification is free.

Measured once per loaded model and process (about 4 s on the embedded model in bfloat16 here), after a
fixed context; recorded in every trace (RunInfo.verify_ms). Evidence class: microbenchmark.
"""

from __future__ import annotations

import statistics
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from engine.models import LoadedModel

CURVE_TOKENS = tuple(range(1, 18))  # T = k + 1 for k = 0..16
CONTEXT_TOKENS = 200  # cached tokens before each timed forward


@dataclass(frozen=True)
class VerifyCurve:
    tokens: tuple[int, ...]  # T values, starting at 1
    ms: tuple[float, ...]  # median milliseconds of one cached forward over T tokens

    def ratio(self, t: int) -> float | None:
        """Cost of a forward over t tokens / over one (None when t was not measured).

        >>> VerifyCurve((1, 2, 5), (20.0, 21.0, 22.0)).ratio(5)
        1.1
        """
        if t not in self.tokens:
            return None
        return self.ms[self.tokens.index(t)] / self.ms[0]

    @property
    def ratios(self) -> tuple[float, ...]:
        return tuple(m / self.ms[0] for m in self.ms)


@torch.inference_mode()
def measure(target: LoadedModel, tokens: tuple[int, ...] = CURVE_TOKENS, repeats: int = 3,
            context: int = CONTEXT_TOKENS, seed: int = 0) -> VerifyCurve:
    """Median milliseconds of one cached forward over T random tokens after `context` random
    tokens, all T positions' logits computed (as a verification needs). Each T runs as a block of
    consecutive forwards (as decoding repeats one shape), one untimed; two passes, T ascending then
    descending, and each T keeps the lower of its two medians, so a slow spell of the machine
    during one pass does not bend the curve."""
    from engine.kv import growing_cache

    model = target.model
    gen = torch.Generator().manual_seed(seed)
    cache = growing_cache()  # DynamicCache that grows in place (engine/kv.py)
    prompt = torch.randint(0, target.vocab_size, (1, context), generator=gen).to(target.device)
    model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    inputs = {t: torch.randint(0, target.vocab_size, (1, t), generator=gen).to(target.device) for t in tokens}
    best: dict[int, float] = {}
    for order in (tokens, tokens[::-1]):
        for t in order:
            times = []
            for _ in range(repeats + 1):
                begin = time.perf_counter()
                model(input_ids=inputs[t], cache=cache, use_cache=True)
                if target.device.startswith("cuda"):
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - begin)
                cache.crop(-t)
            best[t] = min(best.get(t, float("inf")), statistics.median(times[1:]))
    return VerifyCurve(tuple(tokens), tuple(best[t] * 1000 for t in tokens))


_curves: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def curve_for(target: LoadedModel) -> VerifyCurve:
    """This process's measured curve for the loaded model (measured on first use)."""
    with _lock:
        curve = _curves.get(target.model)
        if curve is None:
            curve = _curves[target.model] = measure(target)
        return curve
