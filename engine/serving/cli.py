"""`python -m engine serve` (one run of a workload) and `python -m engine serve-compare`
(several policies / chunk sizes on the same workload, interleaved repeats, medians)."""

from __future__ import annotations

import argparse
import json
import statistics

from engine.cli import add_sampling_args, sampling_from_args
from engine.errors import InputError
from engine.metrics import percentile
from engine.models import load_model
from engine.serving.loop import ServeConfig, run_serve
from engine.serving.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_BUDGET_TOKENS
from engine.serving.routing import SIMULATION, Costs, RoutePolicy, measure_costs, simulate_workload
from engine.serving.records import RequestClass
from engine.serving.report import report, summary
from engine.serving.scheduler import Policy
from engine.serving.workload import Workload, WorkloadRequest, builtin_workloads, load_workload

POLICIES = [p.value for p in Policy]


def register(subparsers) -> None:
    s = subparsers.add_parser("serve", help="serve a workload of arriving requests (chunked prefill)")
    _add_common(s)
    s.add_argument("--policy", choices=POLICIES, default=Policy.DECODE_FIRST.value)
    s.add_argument("--chunk-size", type=int, default=256, help="most prompt tokens of a request per step")
    s.add_argument("--prefix-cache", choices=["on", "off"], default="off",
                   help="reuse the KV blocks of prompt prefixes already prefilled (default off)")
    s.add_argument("--json", action="store_true", help="print one JSON object: steps, requests, summary")
    s.set_defaults(func=cmd_serve)

    c = subparsers.add_parser("serve-compare", help="compare policies/chunk sizes on one workload, side by side")
    _add_common(c)
    c.add_argument("--runs", nargs="+", default=["none", "decode-first:256", "decode-first:64"],
                   help="POLICY[:CHUNK][+cache] each, e.g. none decode-first:256 decode-first:64+cache "
                        "(+cache: with the prefix cache)")
    c.add_argument("--repeats", type=int, default=3, help="interleaved repeats; medians are reported")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_compare)

    r = subparsers.add_parser("route-sim", help="SIMULATION: route a workload over replicas with prefix caches "
                              "(round-robin vs cache-aware), fed by the model's measured costs")
    r.add_argument("--workload", required=True, help=f"{', '.join(builtin_workloads())} or a workload JSON file")
    r.add_argument("--replicas", type=int, default=4)
    r.add_argument("--policies", default=",".join(p.value for p in RoutePolicy),
                   help=f"comma-separated: {', '.join(p.value for p in RoutePolicy)}")
    r.add_argument("--model", default="embedded", help="its tokenizer and its measured costs")
    r.add_argument("--prefill-ms-per-token", type=float, default=None, help="give the costs instead of measuring them")
    r.add_argument("--decode-ms-per-step", type=float, default=None)
    r.add_argument("--prefix-block", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per cached block")
    r.add_argument("--prefix-budget", type=int, default=DEFAULT_BUDGET_TOKENS, help="most tokens each replica caches")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_route)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", required=True, help=f"{', '.join(builtin_workloads())}, a workload JSON file, "
                   "or a serve --json output (replays its arrivals)")
    p.add_argument("--token-budget", type=int, default=None, help="most tokens per step (default: chunk + requests)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="replaces every request's own limit")
    p.add_argument("--model", default="embedded", help="preset name, local folder or hub id")
    p.add_argument("--prefix-block", type=int, default=DEFAULT_BLOCK_SIZE, help="prefix cache: tokens per block")
    p.add_argument("--prefix-budget", type=int, default=DEFAULT_BUDGET_TOKENS,
                   help="prefix cache: most tokens it holds (least recently used blocks are evicted)")
    add_sampling_args(p)


def _config(args, policy: str, chunk_size: int, prefix_cache: bool = False) -> ServeConfig:
    return ServeConfig(policy=Policy(policy), chunk_size=chunk_size, token_budget=args.token_budget,
                       max_new_tokens=args.max_new_tokens, sampling=sampling_from_args(args),
                       prefix_cache=prefix_cache, prefix_block=args.prefix_block, prefix_budget=args.prefix_budget)


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _config(args, args.policy, args.chunk_size, args.prefix_cache == "on")
    workload = load_workload(args.workload)
    result = run_serve(load_model(args.model), workload, cfg)
    out = report(result)
    if args.json:
        print(json.dumps(out, ensure_ascii=False, allow_nan=False))
        return 0
    print(f"{'request':<14}{'class':<7}{'prompt':>7}{'reused':>7}{'output':>7}{'TTFT ms':>10}{'ITL p50':>9}"
          f"{'ITL p99':>9}  stop")
    for r in out["requests"]:
        itl = r["itl_ms"]
        print(f"{r['request_id']:<14}{r['cls']:<7}{r['prompt_tokens']:>7}{r['reused_tokens']:>7}"
              f"{len(r['output_token_ids']):>7}{r['ttft_ms']:>10.0f}{_fmt(percentile(itl, 50)):>9}"
              f"{_fmt(percentile(itl, 99)):>9}  {r['stop_reason']}")
    _print_summary(out["summary"])
    return 0


def _print_summary(s: dict) -> None:
    print(f"-- {s['workload']} ({s['evidence_class']}), policy {s['policy']}, chunk {s['chunk_size']}"
          f"{'' if s['chunking'] else ' (not used)'}, budget {s['token_budget']} tokens/step, "
          f"{s['model']} on {s['device']} {s['dtype']}")
    print(f"   {s['steps']} steps, {s['output_tokens']} output tokens in {s['wall_s']:.2f} s "
          f"({_fmt(s['output_tokens_per_s'])} tokens/s), concurrency {s['concurrency']}, "
          f"decode traffic during prefill: {'yes' if s['decode_traffic_active'] else 'no'}")
    for cls, c in s["by_class"].items():
        if c["requests"]:
            ttft = "/".join(_fmt(c[f"ttft_ms_p{q}"]) for q in (50, 90, 99))
            itl = "/".join(_fmt(c[f"itl_ms_p{q}"]) for q in (50, 90, 99))
            print(f"   {cls:<5}: TTFT ms p50/p90/p99 {ttft}, ITL ms p50/p90/p99 {itl}")
    pc = s["prefix_cache"]
    if pc["on"]:
        print(f"   prefix cache ({pc['block_size']}-token blocks, budget {pc['budget_tokens']} tokens): "
              f"{pc['reused_tokens']} of {pc['requested_tokens']} prompt tokens reused "
              f"({100 * pc['reused_share']:.0f} %), prefill cost {pc['prefill_cost']:.2f} "
              f"(computed / requested), {pc['evicted_blocks']} blocks evicted")


def _parse_run(spec: str) -> tuple[str, int, bool]:
    """POLICY[:CHUNK][+cache] -> (policy, chunk size, prefix cache on)."""
    body, plus, suffix = spec.partition("+")
    if plus and suffix != "cache":
        raise InputError(f"run {spec!r}: the only suffix is '+cache' (the prefix cache)")
    policy, _, chunk = body.partition(":")
    if policy not in POLICIES:
        raise InputError(f"run {spec!r}: policy must be one of {', '.join(POLICIES)}")
    try:
        return policy, int(chunk) if chunk else 256, bool(plus)
    except ValueError:
        raise InputError(f"run {spec!r}: the chunk size after ':' must be an integer") from None


WATCHED = ("short.itl_ms_p50", "short.itl_ms_p99", "short.itl_ms_max", "long.ttft_ms_p50", "long.ttft_ms_p99",
           "ttft_ms_p50_later", "prefix_cache.prefill_cost", "prefix_cache.reused_share")


def cmd_compare(args: argparse.Namespace) -> int:
    if not 1 <= args.repeats <= 100:
        raise InputError(f"repeats must be in 1..100 (got {args.repeats})")
    configs = [_config(args, *_parse_run(spec)) for spec in args.runs]
    workload = load_workload(args.workload)
    target = load_model(args.model)
    warm = Workload("warm-up", "", (WorkloadRequest("warm-up", RequestClass.SHORT, 0.0, "Hello.", 2),))
    run_serve(target, warm, configs[0])  # one-time costs (the packed view, lazy kernels) outside the timings
    runs: list[list[dict]] = [[] for _ in configs]
    outputs = set()  # every run must produce the same tokens: greedy output does not depend on the policy
    for rep in range(args.repeats):
        order = list(range(len(configs)))
        order = order[rep % len(order):] + order[:rep % len(order)]  # rotate, so no config is always first
        for i in order:
            result = run_serve(target, workload, configs[i])
            runs[i].append(summary(result))
            outputs.add(tuple(r.output_token_ids for r in result.requests))
    rows = []
    for spec, summaries in zip(args.runs, runs):
        row = {"run": spec, "policy": summaries[0]["policy"], "chunk_size": summaries[0]["chunk_size"],
               "token_budget": summaries[0]["token_budget"], "repeats": len(summaries)}
        for key in WATCHED:
            values = [v for v in (_dig(s, key) for s in summaries) if v is not None]
            row[f"{key}_median"] = statistics.median(values) if values else None
        row["output_tokens_per_s_median"] = statistics.median(s["output_tokens_per_s"] or 0 for s in summaries)
        row["by_request"] = {rid: {"ttft_ms_median": statistics.median(s["by_request"][rid]["ttft_ms"] for s in summaries),
                                   "prompt_tokens": req["prompt_tokens"], "reused_tokens": req["reused_tokens"]}
                             for rid, req in summaries[0]["by_request"].items()}
        row["runs"] = summaries
        rows.append(row)
    first = runs[0][0]
    fields = ("model", "device", "dtype", "evidence_class", "workload", "k", "temperature", "prompt_tokens", "requests",
              "concurrency", "decode_traffic_active")
    out = {**{f: first[f] for f in fields},
           "same_outputs_in_every_run": len(outputs) == 1, "results": rows}
    if args.json:
        print(json.dumps(out, ensure_ascii=False, allow_nan=False))
        return 0
    print(f"{workload.name}: {first['model']} on {first['device']} {first['dtype']}, "
          f"{args.repeats} interleaved repeats, medians")
    print(f"{'run':<26}{'budget':>7}{'short ITL p50':>15}{'short ITL p99':>15}{'short ITL max':>15}"
          f"{'long TTFT':>12}{'later TTFT':>12}{'reused':>8}{'cost':>6}{'tok/s':>8}")
    for row in rows:
        print(f"{row['run']:<26}{row['token_budget']:>7}{_fmt(row['short.itl_ms_p50_median']):>15}"
              f"{_fmt(row['short.itl_ms_p99_median']):>15}{_fmt(row['short.itl_ms_max_median']):>15}"
              f"{_fmt(row['long.ttft_ms_p50_median']):>12}{_fmt(row['ttft_ms_p50_later_median']):>12}"
              f"{_pct(row['prefix_cache.reused_share_median']):>8}{_fmt(row['prefix_cache.prefill_cost_median'], 2):>6}"
              f"{_fmt(row['output_tokens_per_s_median']):>8}")
    print("\nTTFT ms by request (median of the repeats) / reused prompt tokens")
    print(f"{'request':<14}{'prompt':>7}" + "".join(f"{row['run']:>26}" for row in rows))
    for rid, req in rows[0]["by_request"].items():
        print(f"{rid:<14}{req['prompt_tokens']:>7}" + "".join(
            f"{_fmt(row['by_request'][rid]['ttft_ms_median']) + ' / ' + str(row['by_request'][rid]['reused_tokens']):>26}"
            for row in rows))
    print("(ms; ITL per token; TTFT from arrival; decode traffic active: "
          f"{'yes' if first['decode_traffic_active'] else 'no'}; same outputs in every run: "
          f"{'yes' if out['same_outputs_in_every_run'] else 'NO'})")
    return 0


def _dig(summary_: dict, key: str):
    group, dot, stat = key.partition(".")
    if not dot:
        return summary_[key]
    return (summary_["by_class"][group] if group in summary_["by_class"] else summary_[group])[stat]


def _fmt(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def cmd_route(args: argparse.Namespace) -> int:
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    known = {p.value: p for p in RoutePolicy}
    if not names or any(n not in known for n in names):
        raise InputError(f"policies must be a comma-separated list of {', '.join(known)} (got {args.policies!r})")
    given = (args.prefill_ms_per_token, args.decode_ms_per_step)
    if (given[0] is None) != (given[1] is None):
        raise InputError("give both --prefill-ms-per-token and --decode-ms-per-step, or neither (then they are measured)")
    workload = load_workload(args.workload)
    target = load_model(args.model)
    if given[0] is None:
        costs = measure_costs(target)
    else:
        costs = Costs(given[0] / 1000, given[1] / 1000, "given on the command line")
    out = simulate_workload(target, workload, args.replicas, [known[n] for n in names], costs,
                            args.prefix_block, args.prefix_budget)
    if args.json:
        print(json.dumps(out, ensure_ascii=False, allow_nan=False))
        return 0
    c = out["costs"]
    print(f"{SIMULATION.upper()}: {out['workload']}, {out['requests']} requests, {out['replicas']} replicas, "
          f"{out['block_size']}-token blocks, {out['budget_tokens_per_replica']} tokens cached per replica")
    print(f"costs: prefill {c['prefill_ms_per_token']:.2f} ms/token, decode {c['decode_ms_per_step']:.1f} ms/step "
          f"({c['source']}); {out['simplified']}")
    print(f"{'policy':<14}{'hit rate':>9}{'prefill cost':>13}{'TTFT p50':>10}{'p90':>9}{'p99':>9}{'makespan s':>11}"
          f"  requests per replica")
    for row in out["results"]:
        print(f"{row['policy']:<14}{_pct(row['hit_rate']):>9}{_fmt(row['prefill_cost'], 2):>13}"
              f"{_fmt(row['ttft_ms_p50']):>10}{_fmt(row['ttft_ms_p90']):>9}{_fmt(row['ttft_ms_p99']):>9}"
              f"{_fmt(row['makespan_s']):>11}  {row['requests_per_replica']}")
    print("(hit rate: prompt tokens served from a replica's cache; prefill cost: computed / requested; TTFT ms)")
    return 0
