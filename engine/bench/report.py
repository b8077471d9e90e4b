"""The benchmark's JSON object and markdown tables, derived from the run records only.

Definitions (the formulas live in engine.metrics; nothing is redefined here):
- tokens/s of a run = output tokens / its wall time (request start to last token, prefill
  included). A method's figure is the median over all its runs (every prompt x repeat); every
  method runs the same prompts to the same length (ignore_eos; with bench --stop-at-eos each run
  ends at the model's EOS, as Spec-Bench's protocol does, and exact methods still emit the same
  tokens per prompt), so medians compare.
- speedup = the method's median tokens/s / the baseline's, measured in the same run; per prompt
  the same with that prompt's medians.
- per prompt set (Spec-Bench's per-category table): the set's median tokens/s over its runs /
  the baseline's over the same runs' prompts, and tau (mean acceptance length) and the draft
  acceptance rate over the set's steps.
- baseline_step_ms: the median gap between consecutive plain decode steps of the baseline's runs
  (engine.metrics.itl_per_step_s), the "time of one plain target step" of the cost ratio c.
- acceptance rate, mean acceptance length, per-position acceptance, c and the predicted speedup
  (Leviathan et al. Thm 3.8) come from engine.metrics.summary over all the method's steps.
- identical_to_baseline (greedy only): every repeat's output equals the engine's plain run of the
  same arithmetic (the baseline; "baseline:dtype=..." / "baseline:kernels=stock" for methods of
  that variant and, with batch-invariant kernels, for transformers' generate(), which uses its own)
  output on that prompt; None when sampling (the quality gate compares distributions).
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
from collections.abc import Sequence

import torch
import transformers

from engine.bench.hf import hf_methods_for
from engine.bench.methods import BASELINE, base_name, target_settings
from engine.bench.runner import BenchConfig, BenchRun, RunRecord
from engine.metrics import itl_per_step_s, summary
from engine.models import LoadedModel

SCHEMA = "speclab.bench/1"
EVIDENCE = "controlled benchmark"
SET_PREFIX = "set:"  # base_tps keys of whole prompt sets (prompt keys hold a "/")
ACCEPTANCE_KEYS = ("drafted_tokens", "accepted_tokens", "draft_acceptance_rate", "per_token_acceptance",
                   "mean_acceptance_length", "per_position_acceptance", "cost_ratio", "predicted_speedup",
                   "verify_cost", "predicted_speedup_measured_verify")


def machine_state(target: LoadedModel) -> dict:
    """What the numbers were measured on, including how busy the machine was."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if target.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def _median(values: Sequence[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _identical(records: list[RunRecord], baseline: dict[str, tuple[int, ...]] | None, greedy: bool) -> bool | None:
    """None when sampling or when there is no plain run of the same arithmetic to compare with."""
    if not greedy or baseline is None:
        return None
    return all(r.output_token_ids == baseline[r.prompt] for r in records)


def _reference(method: str, outputs: dict[str, dict]) -> dict | None:
    """The outputs a method's must equal: the plain engine run with the same target variant
    ("mtp:kernels=stock" -> "baseline:kernels=stock"; a plain run's repeats must equal its first);
    None if that run is not in the benchmark.

    >>> _reference("mtp", {"baseline": {"p": (1,)}}), _reference("mtp:dtype=float32", {"baseline": {}})
    ({'p': (1,)}, None)
    """
    settings = target_settings(method)
    return outputs.get(BASELINE + "".join(f":{k}={v}" for k, v in settings.items()))


def _acceptance(records: list[RunRecord], baseline_step_s: float | None) -> dict:
    steps = [s for r in records if r.trace for s in r.trace.steps]
    curve = next((r.trace.info.verify_ms for r in records if r.trace), ())  # measured once per loaded model
    metrics = summary(steps, (), baseline_step_s, curve)
    return {k: metrics[k] for k in ACCEPTANCE_KEYS}


def method_row(method: str, implementation: str, records: list[RunRecord], prompts: list[str],
               base_tps: dict[str, float | None], base_outputs: dict[str, tuple[int, ...]] | None,
               baseline_step_s: float | None, greedy: bool, sets: dict[str, list[str]] | None = None) -> dict:
    """greedy: outputs are compared with base_outputs, the plain run of the same arithmetic
    (None: no such run, or this row is it). sets: prompt set -> its prompt keys (a row per set,
    as Spec-Bench reports per category); base_tps holds each set's baseline median too."""
    mine = [r for r in records if r.method == method]
    tps = _median([r.tokens_per_s for r in mine])
    per_prompt = []
    for key in prompts:
        runs = [r for r in mine if r.prompt == key]
        p_tps = _median([r.tokens_per_s for r in runs])
        per_prompt.append({
            "prompt": key,
            "tokens_per_s_median": p_tps,
            "speedup": _ratio(p_tps, base_tps[key]),
            "identical_to_baseline": _identical(runs, base_outputs, greedy),
            "output_tokens": len(runs[0].output_token_ids),
            "mean_acceptance_length": _acceptance(runs, baseline_step_s)["mean_acceptance_length"]
            if implementation == "engine" else None,
        })
    per_set = []
    for name, keys in (sets or {}).items():
        runs = [r for r in mine if r.prompt in keys]
        set_tps = _median([r.tokens_per_s for r in runs])
        acc = _acceptance(runs, baseline_step_s) if implementation == "engine" else {}
        per_set.append({
            "set": name, "prompts": len(keys), "tokens_per_s_median": set_tps,
            "speedup": _ratio(set_tps, base_tps[SET_PREFIX + name]),
            "mean_acceptance_length": acc.get("mean_acceptance_length"),
            "draft_acceptance_rate": acc.get("draft_acceptance_rate"),
            "identical_to_baseline": _identical(runs, base_outputs, greedy),
        })
    row = {
        "method": method,
        "implementation": implementation,
        "runs": len(mine),
        "tokens_per_s_median": tps,
        "speedup": _ratio(tps, base_tps["all"]),
        "identical_to_baseline": _identical(mine, base_outputs, greedy),
        "per_prompt": per_prompt,
        "per_set": per_set,
    }
    if implementation == "engine":
        acc = _acceptance(mine, baseline_step_s)
        row |= acc
        row["measured_over_predicted"] = _ratio(row["speedup"], acc["predicted_speedup"])
        row["lossy"] = any(r.trace.info.lossy for r in mine)
    return row


def bench_report(cfg: BenchConfig, result: BenchRun, command: str, machine: dict) -> dict:
    """The `bench --json` object (a stable contract: later features add keys, never rename)."""
    target, records = result.target, result.records
    greedy = cfg.decode.sampling.greedy
    prompts = [p.key for p in cfg.prompts]
    base = [r for r in records if r.method == BASELINE and r.implementation == "engine"]
    base_tps = {key: _median([r.tokens_per_s for r in base if r.prompt == key]) for key in prompts}
    base_tps["all"] = _median([r.tokens_per_s for r in base])
    sets: dict[str, list[str]] = {}
    for p in cfg.prompts:
        sets.setdefault(p.set, []).append(p.key)
    for name, keys in sets.items():
        base_tps[SET_PREFIX + name] = _median([r.tokens_per_s for r in base if r.prompt in keys])
    outputs = {}  # plain engine method -> its outputs per prompt (first repeat)
    for r in records:
        if r.implementation == "engine" and base_name(r.method) == BASELINE and r.repeat == 0:
            outputs.setdefault(r.method, {})[r.prompt] = r.output_token_ids
    step_gaps = [gap for r in base for gap in itl_per_step_s(r.trace.steps)]
    baseline_step_s = statistics.median(step_gaps) if step_gaps else None
    dtype = str(target.dtype).removeprefix("torch.")
    engine_rows = [method_row(m, "engine", records, prompts, base_tps, _reference(m, outputs), baseline_step_s,
                              greedy, sets)
                   for m in cfg.methods]
    hf_rows = []
    if cfg.vs_transformers:
        by_method = {row["method"]: row for row in engine_rows}
        for hf in hf_methods_for(cfg.methods):
            if hf.name in result.skipped:
                continue
            same = (f"{BASELINE}:dtype={hf.dtype}" if hf.dtype != "auto" else
                    f"{BASELINE}:kernels=stock" if target.batch_invariant else BASELINE)  # transformers' own kernels
            row = method_row(hf.name, "transformers", records, prompts, base_tps, outputs.get(same), baseline_step_s,
                             greedy, sets)
            row["compared_with"] = same if same in outputs else None
            row["engine_method"] = hf.engine_method
            row["engine_over_transformers"] = _ratio(by_method[hf.engine_method]["tokens_per_s_median"],
                                                     row["tokens_per_s_median"])
            hf_rows.append(row)
    s = cfg.decode.sampling
    prompt_tokens = {}
    for r in records:
        prompt_tokens.setdefault(r.prompt, r.prompt_tokens)
    return {
        "schema": SCHEMA,
        "evidence_class": EVIDENCE,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        # DESIGN.md's report fields
        "model": cfg.model,
        "target": target.spec,
        "device": target.device,
        "dtype": dtype,
        "dtype_reason": target.dtype_reason,
        "batch_invariant": target.batch_invariant,
        "prompt_tokens": prompt_tokens,
        "k": cfg.decode.k,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "seed": s.seed,
        "chunk_size": cfg.decode.prefill_chunk,  # prefill chunk; 0: the prompt in one forward
        "concurrency": 1,  # one request at a time
        "decode_traffic_active": False,
        "max_new_tokens": cfg.decode.max_new_tokens,
        "ignore_eos": cfg.decode.ignore_eos,
        "repeats": cfg.repeats,
        "methods": list(cfg.methods),
        "prompts": prompts,
        "prompt_sets": {name: len(keys) for name, keys in sets.items()},
        "machine": machine,
        "baseline_step_ms": baseline_step_s * 1000 if baseline_step_s is not None else None,
        "results": engine_rows,
        "transformers": hf_rows,
        "transformers_skipped": result.skipped,
        "runs": [
            {"method": r.method, "implementation": r.implementation, "prompt": r.prompt, "repeat": r.repeat,
             "order": r.order, "output_tokens": len(r.output_token_ids), "wall_s": r.wall_s,
             "tokens_per_s": r.tokens_per_s}
            for r in records
        ],
    }


def _fmt(x, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def _verify_note(cost: float | None) -> str:
    """The measured verify cost v (forward over k + 1 tokens / over 1) behind a prediction."""
    return "" if cost is None else f" (v = {cost:.2f})"


def _flag(x: bool | None) -> str:
    return "-" if x is None else ("yes" if x else "**NO**")


def _set_cell(speedup: float | None, tau: float | None, identical: bool | None) -> str:
    cell = _fmt(speedup, ".2f", "x")
    if tau is not None:
        cell += f", tau {tau:.2f}"
    return cell + (" (differs)" if identical is False else "")


def markdown(report: dict) -> str:
    """The benchmark as markdown: a settings line, the methods table, transformers' table and the
    per-prompt speedups."""
    m = report["machine"]
    load = ", ".join(f"{x:.2f}" for x in m["load_average"]) if m.get("load_average") else "n/a"
    lines = [
        f"`{report['command']}`",
        "",
        f"{report['model']} ({report['target']}) on {report['device']} {report['dtype']}"
        f"{' (' + m['gpu'] + ')' if m.get('gpu') else ''}; k = {report['k']}, temperature {report['temperature']}, "
        f"{report['max_new_tokens']} new tokens{' (EOS ignored)' if report['ignore_eos'] else ' at most (each run stops at EOS)'}, "
        f"{len(report['prompts'])} prompts ({min(report['prompt_tokens'].values())}-"
        f"{max(report['prompt_tokens'].values())} tokens), {report['repeats']} interleaved "
        f"repeat{'s' if report['repeats'] != 1 else ''}, medians; "
        f"chunk size {report['chunk_size'] or 'none (one prefill forward)'}, concurrency {report['concurrency']}, "
        f"decode traffic active: {'yes' if report['decode_traffic_active'] else 'no'}; "
        f"{report['evidence_class']}. {m['cpu_count']} CPUs, torch {m['torch']} ({m['torch_threads']} threads), "
        f"transformers {m['transformers']}, load average {load}, {report['created']}.",
        "",
        "| method | tokens/s | speedup | predicted | predicted, measured verify cost | measured / predicted "
        "| acceptance rate | alpha | tokens / step | per-position acceptance | c | identical |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in report["results"]:
        per_pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
        name = r["method"] + (" (LOSSY)" if r.get("lossy") else "")
        lines.append(
            f"| {name} | {_fmt(r['tokens_per_s_median'], '.1f')} | {_fmt(r['speedup'], '.2f', 'x')} "
            f"| {_fmt(r['predicted_speedup'], '.2f', 'x')} "
            f"| {_fmt(r['predicted_speedup_measured_verify'], '.2f', 'x')}{_verify_note(r['verify_cost'])} "
            f"| {_fmt(r['measured_over_predicted'])} "
            f"| {_fmt(r['draft_acceptance_rate'])} | {_fmt(r['per_token_acceptance'])} "
            f"| {_fmt(r['mean_acceptance_length'])} | {per_pos} | {_fmt(r['cost_ratio'], '.3f')} "
            f"| {_flag(r['identical_to_baseline'])} |"
        )
    if report["transformers"]:
        lines += [
            "",
            "| transformers generate() | tokens/s | speedup vs engine baseline | engine method "
            "| engine / transformers | identical to the engine's plain run of the same kernels |",
            "|---|---:|---:|---|---:|---|",
        ]
        for r in report["transformers"]:
            lines.append(
                f"| {r['method']} | {_fmt(r['tokens_per_s_median'], '.1f')} | {_fmt(r['speedup'], '.2f', 'x')} "
                f"| {r['engine_method']} | {_fmt(r['engine_over_transformers'], '.2f', 'x')} "
                f"| {_flag(r['identical_to_baseline'])}"
                f"{' (' + r['compared_with'] + ')' if r.get('compared_with') else ''} |"
            )
    for name, reason in report["transformers_skipped"].items():
        lines.append(f"\n{name}: skipped ({reason})")
    rows = report["results"] + report["transformers"]
    sets = report.get("prompt_sets", {})
    if len(sets) > 1:
        lines += [
            "",
            "Per prompt set (Spec-Bench's table: speedup over the engine baseline on that set, and "
            "tau, the mean acceptance length = tokens per target step):",
            "",
            "| method | " + " | ".join(f"{name} ({n})" for name, n in sets.items()) + " | all |",
            "|---|" + "---:|" * (len(sets) + 1),
        ]
        for r in rows:
            cells = [_set_cell(p["speedup"], p["mean_acceptance_length"], p["identical_to_baseline"]) for p in r["per_set"]]
            cells.append(_set_cell(r["speedup"], r.get("mean_acceptance_length"), r["identical_to_baseline"]))
            lines.append(f"| {r['method']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| prompt | tokens | " + " | ".join(r["method"] for r in rows) + " |",
        "|---|---:|" + "---:|" * len(rows),
    ]
    for i, key in enumerate(report["prompts"]):
        cells = []
        for r in rows:
            p = r["per_prompt"][i]
            mark = "" if p["identical_to_baseline"] is not False else " (differs)"
            cells.append(_fmt(p["speedup"], ".2f", "x") + mark)
        lines.append(f"| {key} | {report['prompt_tokens'][key]} | " + " | ".join(cells) + " |")
    lines += ["", "Speedups per prompt: that prompt's median tokens/s / the engine baseline's on it."]
    return "\n".join(lines) + "\n"
