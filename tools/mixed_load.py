"""Speculation under mixed load: what verifying k + 1 tokens per request costs when a step
already carries several requests.

    python tools/mixed_load.py --batch 1 4 8 --k 4

For each batch size B: B requests, each with `--context` cached tokens, go through the serving
loop's packed forward (engine.serving.packed) once with one new token each (a plain decode step
of B requests) and once with k + 1 each (a speculative verification for all of them). The ratio
of the two is the verify cost at that load: about 1 for one request on a memory-bound step, and
growing with B as the step stops being memory-bound, so the tokens per step a drafter must reach
to break even grow with load. Evidence class: microbenchmark (median of --repeats interleaved
pairs, one process).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.models import load_model  # noqa: E402
from engine.serving.packed import Segment, forward_packed  # noqa: E402
from engine.serving.prefix_cache import RequestKV  # noqa: E402


def packed_step(target, caches: list[RequestKV], tokens: int, context: int, gen: torch.Generator) -> float:
    """Seconds of one packed forward with `tokens` new tokens per request (appended, then the
    caches are cut back so the next call sees the same context)."""
    ids, positions, segments = [], [], []
    for kv in caches:
        lo = len(ids)
        ids += torch.randint(0, target.vocab_size, (tokens,), generator=gen).tolist()
        positions += range(context, context + tokens)
        segments.append(Segment(lo, len(ids), kv))
    keep = [s.hi - 1 for s in segments]
    begin = time.perf_counter()
    forward_packed(target, ids, positions, tuple(segments), keep)
    took = time.perf_counter() - begin
    for kv in caches:
        kv.truncate(context)
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    target = load_model(args.model)
    gen = torch.Generator().manual_seed(0)
    print(f"{target.name} on {target.device} {str(target.dtype).removeprefix('torch.')}, {args.context} cached tokens "
          f"per request, k = {args.k}, median of {args.repeats} interleaved pairs")
    print(f"{'requests':>9}{'plain step ms':>15}{'verify step ms':>16}{'verify / plain':>16}")
    for batch in args.batch:
        caches = []
        for _ in range(batch):
            kv = RequestKV()
            ids = torch.randint(0, target.vocab_size, (args.context,), generator=gen).tolist()
            forward_packed(target, ids, list(range(args.context)), (Segment(0, args.context, kv),), [args.context - 1])
            caches.append(kv)
        packed_step(target, caches, 1, args.context, gen)  # warm-up
        plain, verify = [], []
        for r in range(args.repeats):
            for tokens in ((1, args.k + 1) if r % 2 == 0 else (args.k + 1, 1)):
                (plain if tokens == 1 else verify).append(packed_step(target, caches, tokens, args.context, gen))
        p, v = statistics.median(plain) * 1000, statistics.median(verify) * 1000
        print(f"{batch:>9}{p:>15.1f}{v:>16.1f}{v / p:>15.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
