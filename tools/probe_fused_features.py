"""A probe, not part of the engine: does feeding the MTP module EAGLE-3-style fused features (low, mid and final hidden
states of the target) raise acceptance over the final hidden state alone? Warm start from the
shipped module, same data, same batches, same time; evaluate teacher-forced k=4 acceptance.

usage: .venv/bin/python tools/probe_fused_features.py N_TRAIN MINUTES LOW MID
(2026-12-03: 1000 9 4 16, BENCHMARKS.md 1l). Reads the training corpus cache that
`python -m engine.train mtp-module --prompts 3000 --self-prompts 2800 --task-prompts 800` builds; writes
/tmp/probe/ (the extra layers' hidden states and result JSON). The fusion: RMS-normalised hidden states
after decoder layers LOW and MID beside the final one, projected 3H -> H (initialised to pass the
final one through), as the module's depth-1 input.
"""
import json, os, sys, time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
Path("/tmp/probe").mkdir(exist_ok=True)
os.environ.setdefault("SPECLAB_ALLOW_ANY_MODEL", "1")
from engine.mtp.weights import load_weights
from engine.train.common import cosine_lr, seed_everything
from engine.train.corpus import Sequence
from tools.probe_data import draw, optimise, probe_data
from engine.train.module import build_module, evaluate, module_loss, training_vocabulary, _batch, _groups

n_train, minutes, low, mid = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
target, train, evals, g = probe_data(n_train)
print(len(train), {k: len(v) for k, v in evals.items()}, flush=True)

cache = Path(f"/tmp/probe/extra-{n_train}-{low}-{mid}.pt")
@torch.inference_mode()
def extra_layers(seqs):
    out = {}
    pad = min(target.eos_token_ids)
    for group in _groups(seqs, list(range(len(seqs))), 4096):
        longest = max(int(seqs[i].ids.shape[0]) for i in group)
        ids = torch.stack([F.pad(seqs[i].ids.long(), (0, longest - int(seqs[i].ids.shape[0])), value=pad) for i in group])
        attn = torch.stack([(torch.arange(longest) < int(seqs[i].ids.shape[0])).long() for i in group])
        hs = target.model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1).hidden_states
        for b, i in enumerate(group):
            t = int(seqs[i].ids.shape[0])
            out[seqs[i].key] = torch.cat([hs[low][b, :t], hs[mid][b, :t]], -1).to(torch.bfloat16).clone()
            if b == 0:
                err = (hs[-1][b, :t].float() - seqs[i].hidden.float()).abs().max().item()
        print("  batch", len(out), "final-hidden max diff vs stored", round(err, 3), flush=True)
    return out
if cache.exists():
    extra = torch.load(cache)
else:
    t0 = time.time()
    extra = extra_layers(train + evals["heldout"] + evals["spec_bench"])
    torch.save(extra, cache)
    print("extra layers", round(time.time() - t0), "s", flush=True)

H = 576
def rms(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

class Fuse(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(3 * H, H, bias=False)
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[:, 2 * H:].copy_(torch.eye(H))
    def forward(self, extra, final):  # (..., 2H), (..., H)
        a, b = extra[..., :H].float(), extra[..., H:].float()
        return self.proj(torch.cat([rms(a), rms(b), final.float()], -1))

def with_fused(seqs, fuse):
    out = []
    with torch.no_grad():
        for s in seqs:
            h = fuse(extra[s.key], s.hidden).to(torch.bfloat16) if fuse is not None else s.hidden
            out.append(Sequence(s.key, s.source, s.ids, s.prompt_len, h, s.top_ids, s.top_logits))
    return out

def run(fused: bool):
    gen = seed_everything(0)
    module = build_module(target, 1)
    state = {k.removeprefix("layers."): v for k, v in load_weights(ROOT / "engine/weights/mtp-module", "cpu", torch.float32).items()}
    module.layers.load_state_dict(state, strict=True)
    module.train()
    fuse = Fuse() if fused else None
    vocab = training_vocabulary(train, target.vocab_size)
    to_vocab = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    weight = target.model.get_output_embeddings().weight.detach()[vocab].float()
    params = list(module.layers.parameters()) + (list(fuse.parameters()) if fused else [])
    groups = [{"params": list(module.layers.parameters()), "scale": 1.0}] + (
        [{"params": list(fuse.parameters()), "scale": 2.5}] if fused else [])
    opt = torch.optim.AdamW(groups, lr=4e-4, weight_decay=0.0)
    pad = min(target.eos_token_ids)
    before = {k: evaluate(module, weight, vocab, with_fused(v, fuse), 4, pad) for k, v in evals.items()}
    begin, step, steps = time.perf_counter(), 0, None
    while steps is None or step < steps:
        if step == 5:
            steps = int(5 + (minutes * 60 - (time.perf_counter() - begin)) / ((time.perf_counter() - begin) / 5))
        for group in opt.param_groups:
            group["lr"] = group["scale"] * cosine_lr(step, steps or 10**6, 4e-4, 20)
        order = draw(train, gen)
        batch = list(_batch(train, order, pad))
        h = batch[1].float()
        if fused:
            longest = batch[0].shape[1]
            ex = torch.stack([F.pad(extra[train[i].key], (0, 0, 0, longest - int(train[i].ids.shape[0]))) for i in order])
            h = fuse(ex, h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module_loss(module, weight, to_vocab, (batch[0], h, *batch[2:]), 4)
        optimise(opt, params, loss)
        step += 1
        if step % 50 == 0:
            print(f"  {'fused' if fused else 'final'} step {step}/{steps} loss {loss.item():.3f}", flush=True)
    after = {k: evaluate(module, weight, vocab, with_fused(v, fuse), 4, pad) for k, v in evals.items()}
    return {"fused": fused, "steps": steps, "before": before, "after": after}

results = []
for fused in (False, True):
    r = run(fused)
    results.append(r)
    print(json.dumps({"fused": fused, "steps": r["steps"],
                      **{f"{k}_{w}": (r[w][k]["mean_acceptance_length_k4"], r[w][k]["top1"][0]) for k in evals for w in ("before", "after")}}), flush=True)
json.dump(results, open(f"/tmp/probe/result-{n_train}-{low}-{mid}.json", "w"), indent=1)
