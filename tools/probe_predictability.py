"""A probe, not part of the engine: where does the MTP module's first draft match the target, and
how much of each prompt category's text is predictable at all? For every answer position of the
held-out training prompts and the Spec-Bench dev answers (the corpus the module's card evaluates
on; the target's own greedy answers, teacher forced), it records the target's confidence in its
own next token (top-1 probability, renormalised over the top-8 logits the corpus keeps) and
whether the shipped module's depth-1 draft (argmax over the full vocabulary) is that token; then
per category: the share of positions where the target is confident, the module's accuracy in
each confidence band, and the teacher-forced k = 4 chain's mean acceptance length.

usage: .venv/bin/python tools/probe_predictability.py   (writes /tmp/probe/predictability.json)
Reads the training corpus cache that
`python -m engine.train mtp-module --prompts 3000 --self-prompts 2800 --task-prompts 800` builds.
"""
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
Path("/tmp/probe").mkdir(exist_ok=True)
os.environ.setdefault("SPECLAB_ALLOW_ANY_MODEL", "1")
from engine.mtp.weights import load_weights
from engine.train.module import _batch, _groups, build_module, depth_rows, unroll
from tools.probe_data import probe_data

BANDS = ((0.0, 0.5), (0.5, 0.8), (0.8, 0.95), (0.95, 1.01))
DEPTHS = 4

target, _, evals, _ = probe_data(1)
module = build_module(target, 1)
module.layers.load_state_dict({k.removeprefix("layers."): v for k, v in
                               load_weights(ROOT / "engine/weights/mtp-module", "cpu", torch.float32).items()})
module.eval()
weight = target.model.get_output_embeddings().weight.detach().float()  # (V, H): the full vocabulary
pad = min(target.eos_token_ids, default=0)

# per category: [positions, hits] per band; chain lengths
stats = defaultdict(lambda: {"bands": [[0, 0] for _ in BANDS], "chain": [0.0, 0]})
with torch.no_grad():
    for split, seqs in evals.items():
        for group in _groups(seqs, list(range(len(seqs))), 2048):
            ids, hidden, top_ids, top_logits, prompt_len, length, _ = _batch(seqs, group, pad)
            t = ids.shape[1]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                outs = dict(unroll(module, ids, hidden.float(), DEPTHS))
            right = torch.zeros(DEPTHS, *ids.shape, dtype=torch.bool)
            valid = torch.zeros(DEPTHS, *ids.shape, dtype=torch.bool)
            for d, out in outs.items():
                rows = depth_rows(d, t, prompt_len, length)
                draft = (out[:, : t - d - 1].float() @ weight.T).argmax(-1)
                truth = top_ids[:, d: t - 1, 0]
                right[d - 1, :, : t - d - 1] = (draft == truth) & rows
                valid[d - 1, :, : t - d - 1] = rows
                if d == 1:
                    p1 = torch.softmax(top_logits[:, 1: t - 1].float(), -1)[..., 0]  # (B, t-2)
                    for b, i in enumerate(group):
                        cat = f"{split}/{seqs[i].source}"
                        for lo_hi, slot in zip(BANDS, stats[cat]["bands"]):
                            inband = rows[b] & (p1[b] >= lo_hi[0]) & (p1[b] < lo_hi[1])
                            slot[0] += int(inband.sum())
                            slot[1] += int((inband & right[0, b, : t - 2]).sum())
            run = torch.ones_like(valid[0])
            lengths = torch.zeros(ids.shape)
            for d in range(DEPTHS):
                run = run & right[d] & valid[d]
                lengths += (run & valid[0]).float()
            for b, i in enumerate(group):
                cat = f"{split}/{seqs[i].source}"
                stats[cat]["chain"][0] += float(lengths[b][valid[0, b]].sum())
                stats[cat]["chain"][1] += int(valid[0, b].sum())

out = {}
print(f"{'category':34} {'pos':>6} {'tau_k4':>6} {'acc1':>5} | " + " ".join(f"p1 in [{lo:.2f},{min(hi, 1):.2f}): share/acc" for lo, hi in BANDS))
for cat in sorted(stats):
    s = stats[cat]
    n = sum(b[0] for b in s["bands"])
    hits = sum(b[1] for b in s["bands"])
    tau = 1 + s["chain"][0] / max(s["chain"][1], 1)
    row = {"positions": n, "tau_k4": round(tau, 3), "depth1_accuracy": round(hits / max(n, 1), 3),
           "bands": [{"p1": [lo, min(hi, 1.0)], "share": round(b[0] / max(n, 1), 3), "accuracy": round(b[1] / max(b[0], 1), 3)}
                     for (lo, hi), b in zip(BANDS, s["bands"])]}
    out[cat] = row
    print(f"{cat:34} {n:6d} {tau:6.2f} {row['depth1_accuracy']:5.2f} | " +
          " ".join(f"{b['share']:>18.2f}/{b['accuracy']:.2f}" for b in row["bands"]), flush=True)
Path("/tmp/probe/predictability.json").write_text(json.dumps(out, indent=1))
