"""A probe, not part of the engine: is the MTP module limited by its capacity? Its block is one
decoder layer of the target's kind (MLP 576 -> 1536 -> 576); DeepSeek-V3's and EAGLE's one-layer
drafters for 7B+ targets hold more parameters than this whole 135M target. Warm start from the
shipped module twice, on the same sequences, batches and time budget: once as it is, once with the
MLP widened (function-preserving: the shipped rows/columns copied, the new down-projection
columns zero); evaluate teacher-forced k=4 acceptance on held-out train prompts, Spec-Bench dev,
and training sequences (how far training fits what it sees: the gap to held-out is overfitting,
no gap means capacity or time limits it).

usage: .venv/bin/python tools/probe_module_width.py N_TRAIN MINUTES WIDTH [WIDTH ...]
(WIDTH: the MLP's intermediate size; 1536 is the shipped module; 2026-12-03: 0 9 1536 4608, no
gain, BENCHMARKS.md 1m). Reads the training corpus cache
that `python -m engine.train mtp-module --prompts 3000 --self-prompts 2800 --task-prompts 800`
builds; writes /tmp/probe/width-*.json.
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
Path("/tmp/probe").mkdir(exist_ok=True)
os.environ.setdefault("SPECLAB_ALLOW_ANY_MODEL", "1")
from engine.mtp.weights import load_weights
from engine.train.common import cosine_lr, seed_everything
from tools.probe_data import draw, optimise, probe_data
from engine.train.module import _batch, build_module, evaluate, module_loss, training_vocabulary

n_train, minutes, widths = int(sys.argv[1]), float(sys.argv[2]), [int(w) for w in sys.argv[3:]]
target, train, evals, g = probe_data(n_train)
seen = [train[i] for i in torch.randperm(len(train), generator=g)[:160].tolist()]
evals["trained_on"] = seen
print(len(train), {k: len(v) for k, v in evals.items()}, flush=True)
shipped = {k.removeprefix("layers."): v for k, v in
           load_weights(ROOT / "engine/weights/mtp-module", "cpu", torch.float32).items()}


def widened(width: int) -> torch.nn.Module:
    config = target.model.config
    old = config.intermediate_size
    config.intermediate_size = width  # the module's config is a copy made at build time
    try:
        module = build_module(target, 1) if width == old else _build_wide(target)
    finally:
        config.intermediate_size = old
    state = dict(shipped)
    if width != old:
        own = module.layers.state_dict()
        for name in ("mtp_block.mlp.gate_proj.weight", "mtp_block.mlp.up_proj.weight"):
            w = own[f"0.{name}"].clone()
            torch.nn.init.normal_(w, std=0.02)
            w[:old] = shipped[f"0.{name}"]
            state[f"0.{name}"] = w
        w = torch.zeros_like(own["0.mtp_block.mlp.down_proj.weight"])
        w[:, :old] = shipped["0.mtp_block.mlp.down_proj.weight"]
        state["0.mtp_block.mlp.down_proj.weight"] = w
    module.layers.load_state_dict(state, strict=True)
    return module


def _build_wide(target):
    from transformers.modeling_layers import MtpModel

    from engine.mtp.module import _Main

    main = _Main(target.model, 1)
    module = MtpModel(main, 1)
    module.layers.to(target.device, torch.float32)
    return module


def run(width: int) -> dict:
    gen = seed_everything(0)
    module = widened(width)
    module.train()
    vocab = training_vocabulary(train, target.vocab_size)
    to_vocab = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    weight = target.model.get_output_embeddings().weight.detach()[vocab].float()
    params = list(module.layers.parameters())
    opt = torch.optim.AdamW(params, lr=4e-4, weight_decay=0.0)
    pad = min(target.eos_token_ids)
    t0 = time.time()
    before = {k: evaluate(module, weight, vocab, v, 4, pad) for k, v in evals.items()}
    print(f"  width {width} eval {time.time() - t0:.0f} s", {k: v["mean_acceptance_length_k4"] for k, v in before.items()}, flush=True)
    begin, step, steps = time.perf_counter(), 0, None
    while steps is None or step < steps:
        if step == 5:
            steps = int(5 + (minutes * 60 - (time.perf_counter() - begin)) / ((time.perf_counter() - begin) / 5))
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps or 10**6, 4e-4, 20)
        order = draw(train, gen)
        batch = _batch(train, order, pad)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module_loss(module, weight, to_vocab, (batch[0], batch[1].float(), *batch[2:]), 4)
        optimise(opt, params, loss)
        step += 1
        if step % 50 == 0:
            print(f"  width {width} step {step}/{steps} loss {loss.item():.3f}", flush=True)
    after = {k: evaluate(module, weight, vocab, v, 4, pad) for k, v in evals.items()}
    return {"width": width, "steps": steps, "seconds": round(time.perf_counter() - begin), "before": before, "after": after}


results = []
for width in widths:
    r = run(width)
    results.append(r)
    print(json.dumps({"width": width, "steps": r["steps"],
                      **{f"{k}_{w}": (r[w][k]["mean_acceptance_length_k4"], r[w][k]["top1"][0])
                         for k in evals for w in ("before", "after")}}), flush=True)
    with open(f"/tmp/probe/width-{n_train}-{minutes}-{'-'.join(map(str, widths))}.json", "w") as f:
        json.dump(results, f, indent=1)
