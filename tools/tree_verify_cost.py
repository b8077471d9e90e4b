"""What one verification forward costs on this machine, by shape and context length: a plain step
(1 token), a chain (5), trees of 17 and 65 tokens (random shapes, at most 6 deep), on the
embedded model in the engine's dtype, after a random context of each length.

    python tools/tree_verify_cost.py [--contexts 256,512,768,1024] [--repeats 17]
        [--against OLD_INVARIANT.py]

--against takes another version of engine/invariant.py (for instance
`git show REV:engine/invariant.py > /tmp/old_invariant.py`) and times its attention beside the
current one, interleaved forward by forward on the same model and cache (the linear layers stay
the current ones), so that the two columns share the machine's state. Prints the median ms of
each shape (the first two repeats dropped). Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AttentionInterface  # noqa: E402

import engine.invariant as current  # noqa: E402
from engine.kv import growing_cache  # noqa: E402
from engine.models import load_model  # noqa: E402
from engine.mtp.tree import tree_inputs  # noqa: E402


def random_tree(nodes: int, depth: int = 6, seed: int = 0) -> tuple[int, ...]:
    rnd = random.Random(seed)
    parents, depths = [], []
    for i in range(nodes):
        p = rnd.choice([-1] + [j for j in range(i) if depths[j] < depth])
        parents.append(p)
        depths.append(1 if p < 0 else depths[p] + 1)
    return tuple(parents)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="256,512,768,1024")
    parser.add_argument("--repeats", type=int, default=17)
    parser.add_argument("--against", type=Path, help="another engine/invariant.py to time beside this one")
    args = parser.parse_args(argv)
    target = load_model("embedded", dtype="auto")
    versions = {"now": current}
    if args.against:
        spec = importlib.util.spec_from_file_location("invariant_against", args.against)
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # registers its attention under the same name: chosen per forward below
        versions = {"against": module, "now": current}
    shapes = {"plain": 0, "chain 5": 4, "tree 17": random_tree(16), "tree 65": random_tree(64)}
    gen = torch.Generator().manual_seed(0)
    print(f"{target.dtype}, {torch.get_num_threads()} threads; median ms of {args.repeats - 2}")
    with torch.inference_mode():
        for ctx in (int(c) for c in args.contexts.split(",")):
            ids = torch.randint(0, target.vocab_size, (1, ctx + 70), generator=gen)
            cache = growing_cache()
            target.model(input_ids=ids[:, :ctx], cache=cache, use_cache=True, logits_to_keep=1)
            cells = []
            for name, shape in shapes.items():
                drafts = len(shape) if isinstance(shape, tuple) else shape
                extra = tree_inputs(shape, ctx, target.device, target.dtype) if isinstance(shape, tuple) else {}
                times: dict[str, list[float]] = {label: [] for label in versions}
                for _ in range(args.repeats):
                    for label, module in versions.items():
                        AttentionInterface.register(current.ATTENTION_NAME, module.invariant_attention)
                        start = time.perf_counter()
                        target.model(input_ids=ids[:, ctx:ctx + drafts + 1], cache=cache, use_cache=True, **extra)
                        times[label].append(time.perf_counter() - start)
                        cache.crop(ctx - cache.get_seq_length())
                cells.append(f"{name} " + " -> ".join(f"{1000 * statistics.median(t[2:]):.1f}" for t in times.values()))
            print(f"context {ctx}: " + " | ".join(cells), flush=True)
    AttentionInterface.register(current.ATTENTION_NAME, current.invariant_attention)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
