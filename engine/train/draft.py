"""`python -m engine.train draft-model`: distil the target into its first L layers.

The draft (engine/mtp/distilled.py) starts as the target's first L decoder layers under a copy
of the target's final norm and its LM head (shared, frozen); the layers and the norm train. At every
response position it learns the target's next-token distribution: cross-entropy against the
target's top-K probabilities, renormalised (the KL to them up to a constant).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.models import LoadedModel
from engine.mtp.distilled import KIND, build_draft, trained_modules
from engine.mtp.weights import save_weights
from engine.train.common import (answered, budget_steps, card_base, cosine_lr, fast_bfloat16, seed_everything,
                                 write_vocabulary)
from engine.train.data import Dataset, Example


@dataclass(frozen=True)
class DraftConfig:
    layers: int = 4
    steps: int = 500
    batch: int = 4  # answers per step
    lr: float = 1e-3
    warmup: int = 10
    seed: int = 0
    minutes: float = 0.0  # > 0: a time budget; the first steps are timed and `steps` set to fit it


def _forward(draft: torch.nn.Module, batch: list[Example], pad: int) -> list[torch.Tensor]:
    """The draft's logits (R, V) at each answer's response positions (where the target's top-K
    were kept): inputs are prompt + response minus its last token, right padded."""
    inputs = [e.ids[:-1].long() for e in batch]
    width = max(len(x) for x in inputs)
    ids = torch.stack([torch.nn.functional.pad(x, (0, width - len(x)), value=pad) for x in inputs])  # (B, T)
    mask = torch.stack([(torch.arange(width) < len(x)).long() for x in inputs])  # (B, T)
    hidden = draft.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, H)
    rows = [hidden[b, e.prompt_len - 1 : len(e.ids) - 1] for b, e in enumerate(batch)]  # (R, H) each
    return [draft.lm_head(h) for h in rows]


def _soft_targets(e: Example) -> tuple[torch.Tensor, torch.Tensor]:
    return e.top_ids.long(), torch.softmax(e.top_logits.float(), dim=-1)  # (R, K), (R, K)


@torch.inference_mode()
def evaluate(draft: torch.nn.Module, examples: list[Example], pad: int) -> dict:
    """How often the draft's top-1 / top-5 hold the target's choice (its greedy token)."""
    top1 = top5 = total = 0
    for start in range(0, len(examples), 4):
        batch = examples[start : start + 4]
        for logits, e in zip(_forward(draft, batch, pad), batch):
            want = e.ids[e.prompt_len:].long()  # the target's greedy tokens
            top = torch.topk(logits, 5, dim=-1).indices  # (R, 5)
            top1 += int((top[:, 0] == want).sum())
            top5 += int((top == want[:, None]).any(-1).sum())
            total += len(want)
    return {"top1": round(top1 / total, 4), "top5": round(top5 / total, 4), "positions": total}


def train_draft(target: LoadedModel, data: Dataset, cfg: DraftConfig, out: Path, command: str) -> dict:
    gen = seed_everything(cfg.seed)
    pad = min(target.eos_token_ids)
    draft = build_draft(target, cfg.layers)
    trained = trained_modules(draft).requires_grad_(True)
    train, heldout = data.split("train"), data.split("heldout")
    before = evaluate(draft, heldout, pad)
    opt = torch.optim.AdamW(trained.parameters(), lr=cfg.lr, weight_decay=0.0)
    begin = time.perf_counter()
    draft.train()
    steps, step = cfg.steps, 0
    bar = tqdm(total=steps, desc="draft-model", unit="step")
    while step < steps:
        steps = budget_steps(steps, cfg.minutes, step, time.perf_counter() - begin)
        bar.total = steps
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, cfg.lr, cfg.warmup)
        batch = [train[int(i)] for i in torch.randint(0, len(train), (cfg.batch,), generator=gen)]
        losses = []
        with torch.autocast(torch.device(target.device).type, dtype=torch.bfloat16, enabled=fast_bfloat16(target.device)):
            forward = _forward(draft, batch, pad)
        for logits, e in zip(forward, batch):
            ids, probs = _soft_targets(e)
            log_q = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids)  # (R, K)
            losses.append(-(probs * log_q).sum(-1))
        loss = torch.cat(losses).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update()
        step += 1
    bar.close()
    train_s = time.perf_counter() - begin
    draft.eval()
    after = evaluate(draft, heldout, pad)
    card = card_base(KIND, target, data, command)
    card.update({
        "layers": cfg.layers,
        "predicts": "the next token: the target's first `layers` decoder layers (trained) + a final norm (trained) + its LM head",
        "training": {**asdict(cfg), "steps_run": steps, "final_loss": round(loss.item(), 4), "train_s": round(train_s, 1)},
        "heldout": after,
        "heldout_untrained": before,
    })
    save_weights(out, trained.state_dict(), card)
    card["draft_vocabulary"] = write_vocabulary(out, answered(data.split("train")), answered(data.split("heldout")), target.vocab_size)
    return card
