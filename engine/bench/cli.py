"""`python -m engine bench` (methods side by side on prompt sets, optionally against transformers'
generate()) and `python -m engine gate` (does a method change the target's output?).

Exit status: 0 done (bench) or gate passed, 1 gate failed, 2 bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from tqdm import tqdm

from engine.acceptance import AcceptRule
from engine.bench.gate import GateConfig, GateResult, run_gate, total_runs as gate_runs
from engine.bench.methods import DrafterOptions, parse_methods
from engine.bench.output import write_bench
from engine.bench.prompts import builtin_sets, load_prompts
from engine.bench.report import bench_report, machine_state, markdown
from engine.bench.runner import BenchConfig, run_bench, total_runs as bench_runs
from engine.cli import add_sampling_args, sampling_from_args
from engine.decoding import DecodeConfig
from engine.trace import to_jsonable

EXIT_GATE_FAILED = 1
DEFAULT_METHODS = "baseline,prompt-lookup,early-exit"  # need no extra model on any target


def register(subparsers) -> None:
    b = subparsers.add_parser("bench", help="benchmark methods side by side (interleaved repeats, medians)")
    b.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated: baseline, prompt-lookup, draft-model, early-exit, mtp "
                        f"(default {DEFAULT_METHODS}); baseline is always run")
    _add_common(b, max_new_tokens=64)
    b.add_argument("--stop-at-eos", action="store_true",
                   help="end each run at the model's EOS, as Spec-Bench's protocol does (outputs are still "
                        "identical across exact methods, so every method runs the same tokens per prompt); "
                        "default: run to --max-new-tokens")
    b.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    b.add_argument("--prefill-chunk", type=int, default=0, help="prefill in chunks of N tokens (0 = one forward)")
    b.add_argument("--vs-transformers", action="store_true",
                   help="also time transformers' generate(): plain, assistant_model=, prompt_lookup_num_tokens=, "
                        "assistant_early_exit= (those whose engine method is benchmarked)")
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument("--out", default=None, help="write bench.json, bench.md and charts.html to this folder")
    b.set_defaults(func=cmd_bench)

    g = subparsers.add_parser("gate", help="quality gate: does a method change the target's output?")
    g.add_argument("--method", required=True, help="the drafting method to check against the baseline")
    g.add_argument("--accept", choices=[r.value for r in AcceptRule], default=AcceptRule.EXACT.value,
                   help="acceptance rule: exact (default) or typical (LOSSY: the gate must fail it)")
    _add_common(g, max_new_tokens=16)
    g.add_argument("--prefill-chunk", type=int, default=0,
                   help="the method prefills in chunks of N tokens (the baseline in one forward); "
                        "with --method baseline this checks chunked prefill alone")
    g.add_argument("--samples", type=int, default=200, help="sampling: runs per side and prompt")
    g.add_argument("--alpha", type=float, default=0.01, help="sampling: false-alarm rate of the test")
    g.add_argument("--permutations", type=int, default=1000, help="sampling: relabellings for the threshold")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_gate)


def _add_common(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--prompts", default="all",
                   help=f"comma-separated prompt sets ({', '.join(builtin_sets())}, spec-bench or "
                        "spec-bench:<category>, or a YAML/JSON file); all = every built-in YAML set")
    p.add_argument("--limit", type=int, default=0, help="use the first N prompts of each set (0 = all)")
    p.add_argument("--k", type=int, default=4, help="draft length 1..16")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help="tokens per run (EOS is ignored, unless bench --stop-at-eos)")
    p.add_argument("--model", default="embedded", help="preset name, local folder or hub id")
    p.add_argument("--draft", default=None, help="draft-model: the draft model (default: the preset's)")
    p.add_argument("--mtp-heads", default=None, help="mtp: a folder of trained heads (default: the shipped ones)")
    p.add_argument("--ngram-max", type=int, default=3)
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--exit-layer", type=int, default=0, help="early-exit layers (0 = a quarter)")
    p.add_argument("--tree", default=None, help="mtp tree shape (default: chain)")
    add_sampling_args(p)


def _options(args: argparse.Namespace) -> DrafterOptions:
    return DrafterOptions(draft=args.draft, mtp_heads=args.mtp_heads, ngram_max=args.ngram_max,
                          ngram_min=args.ngram_min, exit_layer=args.exit_layer, tree=args.tree)


def _progress(total: int, desc: str) -> tqdm:
    """A progress bar on stderr when it is a terminal (none in pipes and logs)."""
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr, disable=None, leave=False)


def _command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, every setting spelled out."""
    words = ["python", "-m", "engine", args.command]
    for name, value in vars(args).items():
        if name in ("command", "func", "json", "out") or value is None or value is False:
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(str(value))
    return shlex.join(words)


def cmd_bench(args: argparse.Namespace) -> int:
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, k=args.k, prefill_chunk=args.prefill_chunk,
                          sampling=sampling_from_args(args), ignore_eos=not args.stop_at_eos)
    cfg = BenchConfig(model=args.model, methods=parse_methods(args.methods),
                      prompts=load_prompts(args.prompts, args.limit), decode=decode, options=_options(args),
                      repeats=args.repeats, vs_transformers=args.vs_transformers)
    with _progress(bench_runs(cfg), "bench") as bar:
        def on_run(record) -> None:
            bar.set_postfix_str(f"{record.method} {record.prompt}", refresh=False)
            bar.update()

        result = run_bench(cfg, on_run)
    report = bench_report(cfg, result, _command(args), machine_state(result.target))
    text = markdown(report)
    if args.out:
        written = write_bench(report, text, args.out)
        print("wrote " + ", ".join(str(p) for p in written) + f"; charts: python tools/bench_charts.py {args.out}",
              file=sys.stderr)
    print(json.dumps(report, ensure_ascii=False, allow_nan=False) if args.json else text)
    return 0


def cmd_gate(args: argparse.Namespace) -> int:
    decode = DecodeConfig(max_new_tokens=args.max_new_tokens, k=args.k, sampling=sampling_from_args(args),
                          rule=AcceptRule(args.accept), ignore_eos=True, prefill_chunk=args.prefill_chunk)
    cfg = GateConfig(model=args.model, method=args.method, prompts=load_prompts(args.prompts, args.limit),
                     decode=decode, options=_options(args), samples=args.samples, alpha=args.alpha,
                     permutations=args.permutations)
    with _progress(gate_runs(cfg), "gate") as bar:
        result = run_gate(cfg, bar.update)
    if args.json:
        print(json.dumps(to_jsonable(result), ensure_ascii=False, allow_nan=False))
    else:
        print(gate_text(result))
    return 0 if result.passed else EXIT_GATE_FAILED


def gate_text(result: GateResult) -> str:
    lossy = " [LOSSY acceptance rule]" if result.lossy else ""
    chunk = f", prefill chunk {result.prefill_chunk} (baseline: one forward)" if result.prefill_chunk else ""
    lines = [f"gate: {result.method} vs baseline, {result.mode}, accept {result.accept}{lossy}, k {result.k}, "
             f"temperature {result.temperature}, {result.max_new_tokens} tokens{chunk}, {result.model} on "
             f"{result.device} {result.dtype}"]
    for p in result.prompts:
        verdict = "pass" if p.passed else "FAIL"
        if result.mode == "greedy":
            d = p.divergence
            detail = f"identical ({p.compared_tokens} tokens)" if d is None else (
                f"diverges at output token {d.position}: baseline {_tok(d.baseline)}, method {_tok(d.method)}; "
                f"target logit gap {_num(d.target_logit_gap)}, top-2 margin {d.target_top2_margin:.3f}")
        else:
            diffs = ", ".join(f"{x.token.text!r} {x.baseline_freq:.2f} vs {x.method_freq:.2f}" for x in p.differences)
            detail = f"max TV {max(p.tv):.3f} at position {p.worst_position} ({diffs})"
        lines.append(f"  {verdict:<4} {p.prompt}: {detail}")
    if result.mode == "sampling":
        lines.append(f"max TV {result.max_tv:.4f} vs threshold {result.threshold:.4f} (permutation test, "
                     f"{result.samples} samples per side, {result.permutations} permutations, false-alarm rate "
                     f"{result.alpha:g}), p = {result.p_value:.4f}")
    lines.append("PASS" if result.passed else "FAIL")
    return "\n".join(lines)


def _tok(ref) -> str:
    return "(ended)" if ref is None else f"{ref.text!r} (id {ref.token_id})"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
