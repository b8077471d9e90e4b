"""A microbenchmark, not part of the engine: what the shipped MTP module's drafting and the
target's verification cost per step, by Spec-Bench category. For each category named, the first 3
questions are decoded greedily (64 new tokens, EOS ignored, k = 4) with the module's chain and its
dynamic-8 tree; it prints the mean drafting and verification time per step (the loop's own
draft_s and verify_s, every step: the first draft, which catches each depth up with the prompt,
included), the slowest step's drafting and the prompts' token counts. Long prompts (rag,
summarization) show what grows with the context. Run it in two checkouts alternately to compare
drafting code (BENCHMARKS.md, "drafting bookkeeping"), or with --paths to compare, in one
process and alternately, the module's depths computed by engine/mtp/fast.py ("fast") and by
transformers' MtpModel.forward_layer ("forward_layer"); the emitted tokens must be the same.

usage: .venv/bin/python tools/draft_speed.py [CATEGORIES] [--paths]   (comma-separated; default rag,mt_bench)
"""
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from engine import decoding
from engine.bench.prompts import spec_bench
from engine.decoding import DecodeConfig
from engine.drafters import DrafterSpec, build_drafter
from engine.models import load_model

args = [a for a in sys.argv[1:] if not a.startswith("--")]
paths = ("forward_layer", "fast", "forward_layer", "fast") if "--paths" in sys.argv else ("as is",)
target = load_model("embedded", dtype="auto")
cfg = DecodeConfig(max_new_tokens=64, k=4, ignore_eos=True)


def run(prompts, tree, path):
    draft, slowest, verify, tokens, emitted = [], [], [], [], []
    for prompt in prompts:
        ids = target.encode(prompt.text)
        drafter = build_drafter(target, DrafterSpec("mtp", mtp_kind="module", tree=tree))
        if path == "forward_layer":
            drafter.layers.fast = None
        elif path == "fast" and drafter.layers.fast is None:
            sys.exit("engine.mtp.fast does not take this module")
        steps = [e for e in decoding.generate(target, ids, cfg, drafter) if isinstance(e, decoding.Step)]
        drafted = [s for s in steps if s.draft_s > 0]
        draft.append(statistics.mean(s.draft_s for s in drafted))
        slowest.append(max(s.draft_s for s in drafted))
        verify.append(statistics.mean(s.verify_s for s in drafted))
        tokens.append(len(ids))
        emitted.append([t.token_id for s in steps for t in s.emitted])
    return {"draft_ms": round(1000 * statistics.mean(draft), 2), "slowest_draft_ms": round(1000 * max(slowest), 1),
            "verify_ms": round(1000 * statistics.mean(verify), 2), "prompt_tokens": tokens}, emitted


for category in (args[0] if args else "rag,mt_bench").split(","):
    prompts = spec_bench(category)[:3]
    for tree in (None, "dynamic-8"):
        outputs = []
        for path in paths:
            row, emitted = run(prompts, tree, path)
            outputs.append(emitted)
            print(json.dumps({"category": category, "tree": tree or "chain", "path": path, **row,
                              "load": round(os.getloadavg()[0], 2)}), flush=True)
        if any(out != outputs[0] for out in outputs):
            sys.exit(f"{category}, {tree or 'chain'}: the paths emitted other tokens")
