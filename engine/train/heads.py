"""`python -m engine.train mtp-heads`: train Medusa-style MTP heads on the target's own answers.

The target's final hidden states are computed once (engine/train/data.py), so training touches
only the heads: head i at response row j (hidden state that chose response token j) learns
response token j + 1 + i with cross-entropy, through the target's frozen LM head.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.models import LoadedModel
from engine.mtp.heads import KIND, MTPHeads
from engine.mtp.tree import best_tree
from engine.mtp.weights import save_weights
from engine.train.common import (answered, budget_steps, card_base, cosine_lr, fast_bfloat16, seed_everything,
                                 train_vocabulary, write_vocabulary)
from engine.train.data import Dataset, Example

IGNORE = -100
RANKS = 10  # per-rank accuracies kept in the card (tree shapes are built from them)
TREE_SIZES = (4, 8, 16, 32, 64)  # node counts of the trees the card suggests


@dataclass(frozen=True)
class HeadsConfig:
    heads: int = 4
    steps: int = 1500
    batch: int = 256  # hidden states (positions) per step
    lr: float = 3e-3
    warmup: int = 20
    seed: int = 0
    minutes: float = 0.0  # > 0: a time budget; the first steps are timed and `steps` set to fit it


def head_labels(examples: list[Example], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states (N, H) and labels (N, heads): row j of an answer gets response tokens
    j+1 .. j+heads (IGNORE past the end); rows with no label at all are dropped.

    >>> ex = Example(0, "chat", "train", torch.tensor([7, 1, 2, 3]), 1, torch.zeros(3, 2), torch.zeros(3, 1), torch.zeros(3, 1))
    >>> head_labels([ex], 2)[1].tolist()
    [[2, 3], [3, -100]]
    """
    hidden, labels = [], []
    for e in examples:
        response = e.ids[e.prompt_len:].long()
        rows = len(response) - 1
        if rows <= 0:
            continue
        padded = torch.cat([response, torch.full((heads,), IGNORE)])
        labels.append(torch.stack([padded[1 + i : 1 + i + rows] for i in range(heads)], dim=1))  # (rows, heads)
        hidden.append(e.hidden[:rows])
    return torch.cat(hidden), torch.cat(labels)


@torch.inference_mode()
def evaluate(heads: MTPHeads, lm_weight: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> dict:
    """Per-head top-1 / top-5 accuracy over the full vocabulary, and the share of labels at
    each rank below RANKS (a tree shape's expected acceptance is built from these)."""
    n_heads = labels.shape[1]
    at_rank = torch.zeros(n_heads, RANKS)
    counted = torch.zeros(n_heads)
    for start in range(0, hidden.shape[0], 128):
        logits = heads(hidden[start : start + 128].float()) @ lm_weight.T  # (b, heads, V)
        y = labels[start : start + 128]  # (b, heads)
        valid = y != IGNORE
        label_logit = logits.gather(-1, y.clamp_min(0)[..., None])  # (b, heads, 1)
        rank = (logits > label_logit).sum(-1)  # (b, heads)
        for r in range(RANKS):
            at_rank[:, r] += ((rank == r) & valid).sum(0)
        counted += valid.sum(0)
    share = at_rank / counted.clamp_min(1)[:, None]
    return {
        "top1": [round(float(v), 4) for v in share[:, 0]],
        "top5": [round(float(v), 4) for v in share[:, :5].sum(1)],
        "rank_accuracy": [[round(float(v), 4) for v in row] for row in share],
        "positions": [int(c) for c in counted],
    }


def train_heads(target: LoadedModel, data: Dataset, cfg: HeadsConfig, out: Path, command: str) -> dict:
    gen = seed_everything(cfg.seed)
    hidden, labels = head_labels(data.split("train"), cfg.heads)
    held_hidden, held_labels = head_labels(data.split("heldout"), cfg.heads)
    lm_weight = target.model.get_output_embeddings().weight.detach().float()  # (V, H), frozen
    vocab = train_vocabulary(data.split("train"))  # (S,)
    to_vocab = torch.full((lm_weight.shape[0],), IGNORE, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    train_weight = lm_weight[vocab]  # (S, H)
    heads = MTPHeads(lm_weight.shape[1], cfg.heads)
    before = evaluate(heads, lm_weight, held_hidden, held_labels)  # identity heads: the target's next token
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=0.0)
    begin = time.perf_counter()
    steps, step = cfg.steps, 0
    bar = tqdm(total=steps, desc="mtp-heads", unit="step")
    while step < steps:
        steps = budget_steps(steps, cfg.minutes, step, time.perf_counter() - begin)
        bar.total = steps
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, cfg.lr, cfg.warmup)
        idx = torch.randint(0, hidden.shape[0], (cfg.batch,), generator=gen)
        y = labels[idx]  # (b, heads)
        y = torch.where(y == IGNORE, y, to_vocab[y.clamp_min(0)])
        with torch.autocast(lm_weight.device.type, dtype=torch.bfloat16, enabled=fast_bfloat16(lm_weight.device)):
            logits = heads(hidden[idx].float()) @ train_weight.T  # (b, heads, S)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        opt.zero_grad()
        loss.backward()
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update()
        step += 1
    bar.close()
    train_s = time.perf_counter() - begin
    heads.eval()
    after = evaluate(heads, lm_weight, held_hidden, held_labels)
    card = card_base(KIND, target, data, command)
    card.update({
        "heads": cfg.heads,
        "predicts": "head i (0-based) reads the hidden state that chose token t+1 and predicts token t+2+i",
        "training": {**asdict(cfg), "steps_run": steps, "train_positions": int(hidden.shape[0]), "train_vocabulary": int(len(vocab)),
                     "final_loss": round(loss.item(), 4), "train_s": round(train_s, 1)},
        "heldout": after,
        "heldout_untrained_top1": before["top1"],
        # trees.yaml's shapes come from here: the best trees by expected tokens per step
        "trees": {str(n): dict(zip(("paths", "expected_tokens_per_step"), best_tree(after["rank_accuracy"], n)))
                  for n in TREE_SIZES},
    })
    save_weights(out, heads.state_dict(), card)
    card["draft_vocabulary"] = write_vocabulary(out, answered(data.split("train")), answered(data.split("heldout")), target.vocab_size)
    return card
