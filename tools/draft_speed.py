"""A microbenchmark, not part of the engine: what the shipped MTP module's drafting and the
target's verification cost per step, by Spec-Bench category. For each category named, the first 3
questions are decoded greedily (64 new tokens, EOS ignored, k = 4) with the module's chain and its
dynamic-8 tree; it prints the mean drafting and verification time per step (the loop's own
draft_s and verify_s) and the prompts' token counts. Long prompts (rag, summarization) show what
grows with the context. Run it in two checkouts alternately to compare drafting code
(BENCHMARKS.md, "drafting bookkeeping").

usage: .venv/bin/python tools/draft_speed.py [CATEGORIES]   (comma-separated; default rag,mt_bench)
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

target = load_model("embedded", dtype="auto")
cfg = DecodeConfig(max_new_tokens=64, k=4, ignore_eos=True)
for category in (sys.argv[1] if len(sys.argv) > 1 else "rag,mt_bench").split(","):
    prompts = spec_bench(category)[:3]
    for tree in (None, "dynamic-8"):
        draft, verify, tokens = [], [], []
        for prompt in prompts:
            ids = target.encode(prompt.text)
            drafter = build_drafter(target, DrafterSpec("mtp", mtp_kind="module", tree=tree))
            steps = [e for e in decoding.generate(target, ids, cfg, drafter) if isinstance(e, decoding.Step)][1:]
            draft.append(statistics.mean(s.draft_s for s in steps))
            verify.append(statistics.mean(s.verify_s for s in steps))
            tokens.append(len(ids))
        print(json.dumps({"category": category, "tree": tree or "chain", "prompt_tokens": tokens,
                          "draft_ms": round(1000 * statistics.mean(draft), 2),
                          "verify_ms": round(1000 * statistics.mean(verify), 2),
                          "load": round(os.getloadavg()[0], 2)}), flush=True)
