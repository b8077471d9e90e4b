"""Where a decoding step's time goes, and what bounds speculation on this machine.

`python -m engine profile` times the real loop (engine.decoding.generate) and splits a step
with cProfile into the calls the loop makes: for a plain step the model forward, sampling, record
keeping (top-5 alternatives, token text) and the rest (the loop's own Python); for a speculative
step (prompt lookup by default) draft, verify forward, acceptance, KV rollback, records and loop,
so the engine's own share of a step is visible. It then measures this machine's memory read
bandwidth and compares the step with the time needed just to read the weights once (a decode
step reads every weight: the floor), and the things that explain the distance and bound
speculative decoding here:
- the verify curves (engine.verify_curve): one cached forward over T tokens (T = 1 is a plain
  step, T = k + 1 verifies k drafts) as a multiple of T = 1, per dtype. Speculation pays only
  where verifying k + 1 tokens costs little more than one.
- one attention layer of the model's shapes over 1K-8K cached keys: the batch-invariant
  attention (engine.invariant) against transformers' SDPA, in 16-bit.
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
from engine.drafters import DrafterSpec, build_drafter
from engine.models import LoadedModel, load_model
from engine.verify_curve import measure

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


PARTS = {  # what generate() calls directly -> the part of a step it is
    "propose": "draft", "within": "draft", "observe": "draft",
    "verify": "verify forward",
    "probs_from_logits": "acceptance", "one_hot_probs": "acceptance", "accept": "acceptance",
    "greedy_accept_tree": "acceptance", "residual_distribution": "acceptance",
    "rollback": "KV rollback",
    "_emitted": "records", "_top": "records", "_head_top": "records", "_truncate": "records",
}
STEP_PARTS = ("draft", "verify forward", "acceptance", "KV rollback", "records", "loop python")
ENGINE_PARTS = ("acceptance", "KV rollback", "records", "loop python")  # the engine's own work


def _callee_seconds(stats: dict) -> tuple[dict[str, float], float]:
    """Seconds generate() spent in each part (its direct callees, by PARTS), and its total
    minus the prefill."""
    gen = next(key for key in stats if key[0] == decoding.__file__ and key[2] == "generate")
    # torch.inference_mode() wraps verify and drafters' propose in decorate_context, and the prefill
    # generator in generator_context: look through them
    wrappers = {key for key, (*_, callers) in stats.items()
                if key[2] in ("decorate_context", "generator_context") and gen in callers}
    totals: dict[str, float] = defaultdict(float)
    for (filename, _, name), (_, _, _, _, callers) in stats.items():
        via = [c for c in callers if c == gen or c in wrappers]
        part = PARTS.get(name, "records" if filename.endswith("trace.py") else "prefill" if name == "prefill" else None)
        if via and part:
            totals[part] += sum(callers[c][3] for c in via)  # cumulative time of the calls made from generate
    return totals, stats[gen][3] - totals.pop("prefill", 0.0)


def profile_steps(target: LoadedModel, prompt: str, cfg: DecodeConfig, repeats: int,
                  spec: DrafterSpec | None = None) -> dict[str, float]:
    """Median seconds per decoding step and its parts (STEP_PARTS), anchored in the loop's own
    timings of an unprofiled run: a step is the gap between consecutive step records, draft its
    draft_s, and verify_s (the forward, acceptance and KV rollback) and the rest (records and the
    loop) are split between their parts in the proportions cProfile measures on a profiled run of
    the same decode (cProfile slows Python calls, so its absolute times are not used)."""
    ids = target.encode(prompt)

    def run():
        drafter = build_drafter(target, spec) if spec else None
        return [e for e in decoding.generate(target, ids, cfg, drafter) if isinstance(e, decoding.Step)]

    def split(total: float, names: tuple[str, ...], weights: dict[str, float]) -> dict[str, float]:
        weight = sum(weights.get(n, 0.0) for n in names)
        return {n: total * weights.get(n, 0.0) / weight if weight else total / len(names) for n in names}

    run()  # warm-up
    per_run = []
    for _ in range(repeats):
        steps = run()
        body = steps[1:]  # step 0 is the prefill's first token
        n = len(body)
        step = (steps[-1].end_s - steps[0].end_s) / n
        draft = sum(s.draft_s for s in body) / n
        verify = sum(s.verify_s for s in body) / n
        profiler = cProfile.Profile()
        profiler.runcall(run)
        parts, decode_total = _callee_seconds(pstats.Stats(profiler).stats)
        parts["loop python"] = max(0.0, decode_total - sum(parts.values()))
        out = {"step": step, "tokens_per_step": sum(len(s.emitted) for s in body) / n, "draft": draft}
        out |= split(verify, ("verify forward", "acceptance", "KV rollback"), parts)
        out |= split(step - draft - verify, ("records", "loop python"), parts)
        per_run.append(out)
    return {key: statistics.median(r[key] for r in per_run) for key in per_run[0]}


def profile_plain(target: LoadedModel, tokens: int, repeats: int) -> dict:
    """A plain step's parts, named as the plain loop knows them."""
    parts = profile_steps(target, PROMPT, DecodeConfig(max_new_tokens=tokens, ignore_eos=True), repeats)
    return {"step": parts["step"], "forward": parts["verify forward"], "sampling": parts["acceptance"],
            "record keeping": parts["records"], "loop python": parts["loop python"] + parts["KV rollback"] + parts["draft"]}


SPEC_PROMPT = ("Repeat this paragraph exactly: The lighthouse keeper climbed the stairs every evening, "
               "trimmed the wick, polished the lens and wrote the weather in a small blue book.")


def profile_speculative(target: LoadedModel, method: str, k: int, tokens: int, repeats: int) -> dict:
    """A speculative step's parts (greedy, k drafts), and the engine's own share of it."""
    cfg = DecodeConfig(max_new_tokens=tokens, k=k, ignore_eos=True)
    parts = profile_steps(target, SPEC_PROMPT, cfg, repeats, DrafterSpec(method=method))
    parts["engine share"] = sum(parts[p] for p in ENGINE_PARTS) / parts["step"]
    return parts


VERIFY_TOKENS = (1, 2, 3, 5, 9, 17)  # T = k + 1 for k = 0, 1, 2, 4, 8, 16
CURVE_DTYPES = ("float32", "bfloat16", "bfloat16:stock", "float16")  # "dtype[:stock]": transformers' own kernels


def verify_curves(model: str, dtypes: tuple[str, ...], repeats: int = 5) -> dict[str, dict]:
    """The verify curve of the model loaded in each dtype (engine.verify_curve.measure); an entry
    "bfloat16:stock" loads transformers' own kernels instead of the batch-invariant ones."""
    out = {}
    for entry in dtypes:
        dtype, _, kernels = entry.partition(":")
        target = load_model(model, dtype=dtype, kernels=kernels or "auto")
        curve = measure(target, VERIFY_TOKENS, repeats=repeats)
        out[entry] = {"forward_ms": dict(zip(map(str, curve.tokens), curve.ms)),
                      "over_single": dict(zip(map(str, curve.tokens), curve.ratios)),
                      "batch_invariant": target.batch_invariant}
    return out


@torch.inference_mode()
def matvec_kernels(target: LoadedModel, repeats: int = 20) -> dict[str, dict]:
    """The LM head's (V, H) weights times one hidden state: seconds and effective GB/s, in the
    model's dtype and in float16 / bfloat16 copies (what a 16-bit model would read)."""
    weight = target.model.get_output_embeddings().weight.detach()
    out = {}
    for dtype in dict.fromkeys([weight.dtype, torch.float32, torch.float16, torch.bfloat16]):
        w = weight.to(dtype)
        x = torch.randn(1, w.shape[1], dtype=dtype, device=w.device)
        torch.nn.functional.linear(x, w)
        best = min(_timed(lambda: torch.nn.functional.linear(x, w)) for _ in range(repeats))
        out[str(dtype).removeprefix("torch.")] = {"ms": best * 1000, "gb_s": w.numel() * w.element_size() / best / 1e9}
    return out


ATTENTION_KEYS = (1024, 4096, 8192)
ATTENTION_QUERIES = (1, 5)  # a plain step, and k + 1 for k = 4


@torch.inference_mode()
def attention_microbench(target: LoadedModel, keys: tuple[int, ...] = ATTENTION_KEYS,
                         queries: tuple[int, ...] = ATTENTION_QUERIES, repeats: int = 10) -> list[dict]:
    """One attention layer of the model's shapes: T queries over N cached keys (causal, the
    queries last), the batch-invariant attention vs transformers' SDPA, median ms each."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from engine.invariant import invariant_attention

    module = next(m for m in target.model.modules() if hasattr(m, "num_key_value_groups"))
    config = target.model.config
    hq, hkv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // hq
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in keys:
        k, v = (torch.randn(1, hkv, n, d, generator=gen).to(target.device, target.dtype) for _ in range(2))
        for t in queries:
            q = torch.randn(1, hq, t, d, generator=gen).to(target.device, target.dtype)
            mask = None if t == 1 else torch.ones(t, n, dtype=torch.bool, device=target.device).tril(n - t)[None, None]
            row = {"keys": n, "queries": t}
            for name, fn in (("invariant_ms", invariant_attention), ("sdpa_ms", sdpa_attention_forward)):
                fn(module, q, k, v, mask, scaling=d ** -0.5)
                row[name] = 1000 * statistics.median(
                    _timed(lambda: fn(module, q, k, v, mask, scaling=d ** -0.5)) for _ in range(repeats))
            rows.append(row)
    return rows


def report(model: str, tokens: int, repeats: int, dtype: str = "auto", method: str = "prompt-lookup",
           k: int = 4, curve_dtypes: tuple[str, ...] = CURVE_DTYPES) -> dict:
    target = load_model(model, dtype=dtype)
    parts = profile_plain(target, tokens, repeats)
    speculative = profile_speculative(target, method, k, tokens, repeats)
    nbytes = weight_bytes(target.model)
    bandwidth = read_bandwidth()
    floor = nbytes / bandwidth
    name = str(target.dtype).removeprefix("torch.")
    curves = verify_curves(model, curve_dtypes)
    own = curves.get(name)  # the profiled target's curve, unless its dtype was not among curve_dtypes
    if own is None or own["batch_invariant"] != target.batch_invariant:
        curve = measure(target, VERIFY_TOKENS, repeats=5)
        own = {"forward_ms": dict(zip(map(str, curve.tokens), curve.ms)),
               "over_single": dict(zip(map(str, curve.tokens), curve.ratios))}
    return {
        "evidence": "microbenchmark",
        "model": model,
        "device": target.device,
        "dtype": name,
        "dtype_reason": target.dtype_reason,
        "batch_invariant": target.batch_invariant,
        "threads": torch.get_num_threads(),
        "decode_tokens": tokens,
        "repeats": repeats,
        "per_step_ms": {k: v * 1000 for k, v in parts.items()},
        "speculative_step": {"method": method, "k": k, "tokens_per_step": speculative.pop("tokens_per_step"),
                             "engine_share": speculative.pop("engine share"),
                             "ms": {k: v * 1000 for k, v in speculative.items()}},
        "weight_bytes": nbytes,
        "read_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms": floor * 1000,
        "step_over_floor": parts["step"] / floor,
        "verify_forward_ms": own["forward_ms"],
        "verify_over_single": own["over_single"],
        "verify_curves": curves,
        "attention": attention_microbench(target) if target.dtype != torch.float32 else [],
        "lm_head_matvec": matvec_kernels(target),
    }


def cmd_profile(args: argparse.Namespace) -> int:
    dtypes = tuple(d.strip() for d in args.curve_dtypes.split(",") if d.strip())
    result = report(args.model, args.tokens, args.repeats, args.dtype, args.method, args.k, dtypes)
    if args.json:
        print(json.dumps(result))
        return 0
    ms = result["per_step_ms"]
    print(f"plain decoding step on {result['model']} ({result['device']}, {result['dtype']}, "
          f"{result['threads']} threads), median of {result['repeats']} runs x {result['decode_tokens']} tokens:")
    print(f"  dtype: {result['dtype_reason']}; batch-invariant: {'yes' if result['batch_invariant'] else 'no'}")
    for part in ("step", "forward", "sampling", "record keeping", "loop python"):
        print(f"  {part:15s} {ms[part]:8.2f} ms  ({ms[part] / ms['step']:.1%})")
    spec = result["speculative_step"]
    print(f"speculative step ({spec['method']}, k = {spec['k']}, {spec['tokens_per_step']:.2f} tokens/step):")
    for part in ("step", *STEP_PARTS):
        print(f"  {part:15s} {spec['ms'][part]:8.2f} ms  ({spec['ms'][part] / spec['ms']['step']:.1%})")
    print(f"  the engine's own work (acceptance, KV rollback, records, loop): {spec['engine_share']:.1%} of the step")
    print(f"weights {result['weight_bytes'] / 1e6:.0f} MB, read bandwidth {result['read_bandwidth_gb_s']:.1f} GB/s "
          f"-> floor {result['floor_ms']:.1f} ms/step; the step is {result['step_over_floor']:.2f}x the floor")
    print("one forward over T tokens / over 1 token (T = k + 1 verifies k drafts):")
    for dtype, c in result["verify_curves"].items():
        curve = ", ".join(f"{n}: {r:.2f}x" for n, r in c["over_single"].items())
        invariant = " (batch-invariant)" if c["batch_invariant"] else ""
        print(f"  {dtype:14s} T = 1 {c['forward_ms']['1']:.1f} ms; {curve}{invariant}")
    if result["attention"]:
        print(f"one attention layer, T queries over N keys ({result['dtype']}): batch-invariant vs SDPA")
        for row in result["attention"]:
            print(f"  T = {row['queries']:2d}, N = {row['keys']:5d}: {row['invariant_ms']:.3f} ms vs {row['sdpa_ms']:.3f} ms")
    kernels = ", ".join(f"{d} {k['ms']:.2f} ms ({k['gb_s']:.1f} GB/s)" for d, k in result["lm_head_matvec"].items())
    print(f"LM head matrix x one hidden state: {kernels}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("profile", help="where a decoding step's time goes, the verify curves (microbenchmark)")
    p.add_argument("--model", default="embedded")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the preset's)")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--method", default="prompt-lookup", help="drafter of the speculative step's breakdown")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--curve-dtypes", default=",".join(CURVE_DTYPES), help="dtypes whose verify curve is measured")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)
