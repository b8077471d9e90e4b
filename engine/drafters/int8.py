"""Weight-only int8 products for drafting on a CPU.

A drafting step is a few rows through a few MB of weights (the embedded model's MTP module: about
8 MB for its block and 9 MB for the drafting vocabulary's LM head rows, in bfloat16), and on a
2-core CPU those products wait on memory, not arithmetic. Kept as int8 with one scale per output
row (absmax / 127), the same weights are half the bytes: torch's weight-only int8 kernel
(`torch._weight_int8pack_mm`, the one torchao's int8 weight-only mode calls) multiplies the 16-bit
rows by them directly. On a Xeon with AMX (bfloat16, weights evicted from the caches first, as a
target forward leaves them), one row: the module's fused gate/up product (3,072 x 576) 0.20 ->
0.16 ms, the drafting vocabulary's head rows (8,192 x 576) 0.34 -> 0.28 ms, against oneDNN's
packed 16-bit kernel; the module's k = 4 chain on Spec-Bench's MT-bench prompts drafted in 7.6
instead of 9.2 ms a step. The int8 kernel's cost grows with the rows (at 3 rows it is no faster,
at 8 twice as slow), so only calls of at most ROWS rows take it.

Only drafts are computed this way, never the target. Each weight rounds to within 0.8 % of its
row's largest entry (products off by about 1 %), so a draft can differ where the drafter's top two
are nearly tied; what is emitted cannot (the target verifies every draft, and the acceptance rule
is exact for any draft distribution). DrafterSpec.draft_int8 (bench: mtp:int8=off) turns it off.
"""

from __future__ import annotations

import torch

ROWS = 2  # calls of at most this many rows take the int8 weights (a chain's drafting step: one)
unavailable = ""  # why the last int8 copy was refused (int8_weight), for a message


class Int8Weight:
    """weight (N, K) as int8 (N, K) and per-row scales (N,) in the weight's dtype."""

    def __init__(self, weight: torch.Tensor):
        w = weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
        self.weight = (w / scales[:, None]).round_().clamp_(-127, 127).to(torch.int8).contiguous()
        self.scales = scales.to(weight.dtype).contiguous()

    def takes(self, x: torch.Tensor) -> bool:
        """A call of few enough rows, in the weight's dtype."""
        return x.dtype == self.scales.dtype and x.numel() <= ROWS * x.shape[-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) = x @ (weight x scales).T, in x's dtype."""
        out = torch._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), self.weight, self.scales)
        return out.view(*x.shape[:-1], out.shape[-1])


def int8_weight(weight: torch.Tensor) -> Int8Weight | None:
    """The int8 copy of a 16-bit CPU weight, or None where this build's kernel does not take it
    (other dtypes and devices keep their products)."""
    global unavailable
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
        return None
    try:
        int8 = Int8Weight(weight)
        int8(torch.ones(1, weight.shape[1], dtype=weight.dtype))
    except (RuntimeError, AttributeError) as err:  # no weight-only int8 kernel in this build
        unavailable = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if str(err) else type(err).__name__
        return None
    return int8
