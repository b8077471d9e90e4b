"""Where a plain decoding step's time goes, and how far it is from the memory-bandwidth floor.

`python -m engine profile` times the real loop (engine.decoding.generate) and splits a step
with cProfile into the model forward, sampling (the shared transform and the acceptance rule),
record keeping (top-5 alternatives, token text) and the rest (the loop's own Python).
It then measures this machine's memory read bandwidth and compares the step with the time
needed just to read the weights once (a decode step reads every weight: the floor), and two
things that explain the distance and bound speculative decoding here:
- the verify curve: one cached forward over T tokens (T = 1 is a plain step, T = k + 1 verifies
  k drafts) as a multiple of T = 1. Speculation pays only where verifying k + 1 tokens costs
  little more than one; on a small CPU it does not come free.
- the matrix-vector kernel: the LM head's weights times one hidden state, in the model's dtype
  and in 16-bit copies, as effective read bandwidth (what the kernel reaches of the floor's).
Evidence class: microbenchmark.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time
from collections import defaultdict

import torch

from engine import decoding
from engine.decoding import DecodeConfig
from engine.models import LoadedModel, load_model

PROMPT = "Write a short story about a robot who learns to paint."


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def read_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second this machine reads from memory (a sum over a buffer far larger than the
    caches, best of a few repeats), with torch's threads as used for decoding."""
    buf = torch.ones(megabytes * (1 << 20) // 4, dtype=torch.float32)
    buf.sum()
    best = min(_timed(buf.sum) for _ in range(repeats))
    return buf.numel() * 4 / best


def _timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


PARTS = {  # engine.decoding functions -> the part of a step they are
    "verify": "forward",
    "probs_from_logits": "sampling",
    "accept": "sampling",
    "_emitted": "record keeping",
}


def profile_plain(target: LoadedModel, tokens: int, repeats: int) -> dict:
    """Median per-decode-step seconds: the whole step timed plainly, and its parts from
    cProfile's cumulative times of the loop's own functions."""
    ids = target.encode(PROMPT)
    cfg = DecodeConfig(max_new_tokens=tokens, ignore_eos=True)
    list(decoding.generate(target, ids, cfg))  # warm-up
    per_run = []
    for _ in range(repeats):
        steps = [e for e in decoding.generate(target, ids, cfg) if isinstance(e, decoding.Step)]
        n = len(steps) - 1
        run = {"step": (steps[-1].end_s - steps[0].end_s) / n}
        profiler = cProfile.Profile()
        profiler.runcall(lambda: list(decoding.generate(target, ids, cfg)))
        stats = pstats.Stats(profiler).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        totals: dict[str, float] = defaultdict(float)
        for (filename, _, name), (_, _, _, cumulative, _) in stats.items():
            if filename == decoding.__file__:
                totals[PARTS.get(name, name)] += cumulative
        profiled_total = totals.pop("generate") - totals.pop("prefill")  # the decode steps only
        # parts as shares of the profiled decode, applied to the plainly timed step
        for part, t in totals.items():
            run[part] = run["step"] * t / profiled_total
        per_run.append(run)
    return {part: statistics.median(r[part] for r in per_run) for part in ("step", *set(PARTS.values()))}


VERIFY_TOKENS = (1, 2, 3, 5, 9, 17)  # T = k + 1 for k = 0, 1, 2, 4, 8, 16


@torch.inference_mode()
def verify_curve(target: LoadedModel, repeats: int = 5) -> dict[int, float]:
    """Median seconds of one cached forward over T new tokens (all T positions' logits, as a
    verification needs) after the profiling prompt, for each T in VERIFY_TOKENS."""
    from transformers import DynamicCache

    model = target.model
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([target.encode(PROMPT)], device=target.device), cache=cache, use_cache=True,
          logits_to_keep=1)
    gen = torch.Generator().manual_seed(0)
    out = {}
    for n in VERIFY_TOKENS:
        ids = torch.randint(0, target.vocab_size, (1, n), generator=gen).to(target.device)
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            begin = time.perf_counter()
            model(input_ids=ids, cache=cache, use_cache=True)
            times.append(time.perf_counter() - begin)
            cache.crop(-n)
        out[n] = statistics.median(times[1:])
    return out


@torch.inference_mode()
def matvec_kernels(target: LoadedModel, repeats: int = 20) -> dict[str, dict]:
    """The LM head's (V, H) weights times one hidden state: seconds and effective GB/s, in the
    model's dtype and in float16 / bfloat16 copies (what a 16-bit model would read)."""
    weight = target.model.get_output_embeddings().weight.detach()
    out = {}
    for dtype in dict.fromkeys([weight.dtype, torch.float16, torch.bfloat16]):
        w = weight.to(dtype)
        x = torch.randn(1, w.shape[1], dtype=dtype, device=w.device)
        torch.nn.functional.linear(x, w)
        best = min(_timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(repeats))
        out[str(dtype).removeprefix("torch.")] = {"ms": best * 1000, "gb_s": w.numel() * w.element_size() / best / 1e9}
    return out


def report(model: str, tokens: int, repeats: int, dtype: str = "auto") -> dict:
    target = load_model(model, dtype=dtype)
    parts = profile_plain(target, tokens, repeats)
    parts["loop python"] = parts["step"] - parts["forward"] - parts["sampling"] - parts["record keeping"]
    nbytes = weight_bytes(target.model)
    bandwidth = read_bandwidth()
    floor = nbytes / bandwidth
    curve = verify_curve(target)
    return {
        "evidence": "microbenchmark",
        "model": model,
        "device": target.device,
        "dtype": str(target.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "decode_tokens": tokens,
        "repeats": repeats,
        "per_step_ms": {k: v * 1000 for k, v in parts.items()},
        "weight_bytes": nbytes,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor * 1000,
        "step_over_floor": parts["step"] / floor,
        "verify_forward_ms": {str(n): t * 1000 for n, t in curve.items()},
        "verify_over_single": {str(n): t / curve[1] for n, t in curve.items()},
        "lm_head_matvec": matvec_kernels(target),
    }


def cmd_profile(args: argparse.Namespace) -> int:
    result = report(args.model, args.tokens, args.repeats, args.dtype)
    if args.json:
        print(json.dumps(result))
        return 0
    ms = result["per_step_ms"]
    print(f"plain decoding step on {result['model']} ({result['device']}, {result['dtype']}, "
          f"{result['threads']} threads), median of {result['repeats']} runs x {result['decode_tokens']} tokens:")
    for part in ("step", "forward", "sampling", "record keeping", "loop python"):
        print(f"  {part:15s} {ms[part]:8.2f} ms  ({ms[part] / ms['step']:.1%})")
    print(f"weights {result['weight_bytes'] / 1e6:.0f} MB, read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s "
          f"-> floor {result['floor_ms']:.1f} ms/step; the step is {result['step_over_floor']:.2f}x the floor")
    curve = ", ".join(f"{n}: {r:.2f}x" for n, r in result["verify_over_single"].items())
    print(f"one forward over T tokens / over 1 token (T = k + 1 verifies k drafts): {curve}")
    kernels = ", ".join(f"{d} {k['ms']:.2f} ms ({k['gb_s']:.1f} GB/s)" for d, k in result["lm_head_matvec"].items())
    print(f"LM head matrix x one hidden state: {kernels}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="where a plain decoding step's time goes (microbenchmark)")
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the preset's)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)
