"""A microbenchmark, not part of the engine: what the MTP module's training costs on this CPU in
each dtype. (1) The corpus's teacher-forced pass: tokens/s of the embedded target's batched
forward over 16 committed prompt + answer sequences (stock kernels, as engine/train/corpus.py
runs it), bfloat16 vs float32. (2) One training step of the module (engine/train/module.py:
2,048 positions, 4 depths, the softmax over a 32,646-token training vocabulary, as the shipped
card's runs), with bfloat16 autocast vs in float32; the autocast step only with --emulated on a
CPU without bfloat16 instructions (on an AVX2-only Zen 3 one such step ran over 5 minutes, against
seconds in float32). Interleaved repeats, medians.

usage: .venv/bin/python tools/train_speed.py [REPEATS] [--emulated]   (prints one JSON object)
"""
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from engine.models import cpu_bf16_flags, load_model
from engine.train.corpus import ANSWERS_DIR
from engine.train.module import build_module, module_loss

args = [a for a in sys.argv[1:] if a != "--emulated"]
repeats = int(args[0]) if args else 3
rows = []
with gzip.open(next(ANSWERS_DIR.glob("answers-*.jsonl.gz")), "rt") as f:
    for line in list(f)[1:17]:
        row = json.loads(line)
        rows.append(row["prompt"] + row["answer"])
models = {name: load_model("embedded", device="cpu", dtype=name, kernels="stock") for name in ("bfloat16", "float32")}
pad = min(models["float32"].eos_token_ids)
longest = max(len(r) for r in rows)
ids = torch.tensor([r + [pad] * (longest - len(r)) for r in rows])
mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
tokens = sum(len(r) for r in rows)


@torch.inference_mode()
def teacher_pass(model) -> float:
    begin = time.perf_counter()
    model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1)
    return time.perf_counter() - begin


target = models["float32"]
module = build_module(target, 1)
opt = torch.optim.AdamW(module.layers.parameters(), lr=1e-4)
vocab = torch.arange(32646)
to_vocab = torch.full((target.vocab_size,), -1, dtype=torch.long)
to_vocab[vocab] = vocab
weight = target.model.get_output_embeddings().weight.detach()[vocab].float()
g = torch.Generator().manual_seed(0)
t, b = 256, 8  # 2,048 positions
batch = (torch.randint(0, 32646, (b, t), generator=g), torch.randn(b, t, 576, generator=g),
         torch.randint(0, 32646, (b, t, 8), generator=g), torch.randn(b, t, 8, generator=g),
         torch.full((b,), 96), torch.full((b,), t), None)  # (no fused features)


def train_step(autocast: bool) -> float:
    begin = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = module_loss(module, weight, to_vocab, batch, 4)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return time.perf_counter() - begin


runs = {"teacher bfloat16": lambda: teacher_pass(models["bfloat16"]), "teacher float32": lambda: teacher_pass(target),
        "step autocast bfloat16": lambda: train_step(True), "step float32": lambda: train_step(False)}
if not cpu_bf16_flags() and "--emulated" not in sys.argv:
    del runs["step autocast bfloat16"]
timings = {name: [] for name in runs}
for name, run in runs.items():
    print(f"warm-up {name}: {run():.1f} s", file=sys.stderr, flush=True)
for r in range(repeats):
    order = list(runs.items())
    for name, run in order[r % 2:] + order[:r % 2]:
        timings[name].append(run())
median = {name: statistics.median(v) for name, v in timings.items()}
print(json.dumps({
    "bf16_flags": list(cpu_bf16_flags()), "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
    "teacher_tokens": tokens, "repeats": repeats,
    "teacher_tokens_per_s": {k.split()[1]: round(tokens / v) for k, v in median.items() if k.startswith("teacher")},
    "train_step_s": {k.removeprefix("step "): round(v, 2) for k, v in median.items() if k.startswith("step")},
}))
