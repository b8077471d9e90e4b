"""`python -m engine.train mtp-module`: train the DeepSeek-style MTP module (engine/mtp/module.py)
on the target's answers to real prompts (engine/train/corpus.py).

Teacher forcing over whole sequences, recursively over depths as DeepSeek-V3 trains its MTP
modules: with h^0 the target's final hidden states and x the sequence,

    h^d_i = Module(h^{d-1}_i, x_{i+d})   at position id i + d, causal attention over rows <= i,

and the logits of h^d_i (the target's LM head over the training vocabulary) learn the target's
own next-token distribution for x_{i+d+1}: a cross-entropy against the target's top-K logits
there, renormalised (self-distillation). Only rows whose x_{i+d+1} is in the answer count.

Evaluation is the acceptance a k-token chain would see with greedy verification: from anchor row
i, depth d drafts x_{i+d+1}; drafts are accepted while they equal the target's own choice, and
teacher forcing feeds exactly the tokens an accepted chain would have fed, so the mean number of
leading correct depths + 1 is the mean acceptance length (tokens per target step). It is reported
per depth (top-1, top-5 and conditional on the depths before being right) on held-out train
prompts and on the Spec-Bench dev questions (answered by the target; never trained on).

Checkpoints every `checkpoint_every` steps (module, optimizer, step, RNG) so an interrupted run
resumes where it stopped. `init` starts from a trained module's weights (a warm start: a later
session trains further on the same or more data; the card lists the runs before it).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.bench.prompts import MT_BENCH
from engine.models import LoadedModel, cache_root
from engine.mtp.module import KIND, build_module, load_trained, trained_state
from engine.errors import InputError
from engine.mtp.weights import load_weights, read_card_for, save_weights
from engine.train.common import (answered, budget_steps, cosine_lr, fast_bfloat16, seed_everything, train_vocabulary,
                                 write_vocabulary)
from engine.train.corpus import Sequence, corpus_stats


@dataclass(frozen=True)
class ModuleConfig:
    layers: int = 1
    depths: int = 4  # depths trained (k of the chain it is meant for)
    steps: int = 2000
    batch_positions: int = 2048  # sequence positions per step (whole sequences, right padded)
    lr: float = 1e-3
    warmup: int = 50
    seed: int = 0
    checkpoint_every: int = 100
    minutes: float = 0.0  # > 0: a time budget; the first steps are timed and `steps` set to fit it
    init: str = ""  # a trained module's folder to start from (warm start), "" for the target's last layer
    feature_layers: tuple[int, ...] = ()  # the target's earlier layers fused into depth 1's input (EAGLE-3)


FIRST_IDS = 8192  # the tokenizer's first ids join the training vocabulary (BPE merge order ~ frequency)


def training_vocabulary(seqs: list[Sequence], vocab_size: int, top: int = 4, first_ids: int = FIRST_IDS) -> torch.Tensor:
    """The tokens the module's training softmax runs over (the full vocabulary costs too much on a
    small CPU): every token of the training sequences, the target's top-`top` at every position,
    and the tokenizer's first ids. It drafts with a smaller set (engine.train.common.drafting_vocabulary)."""
    ids = torch.unique(torch.cat([train_vocabulary(seqs, top), torch.arange(first_ids)]))
    return ids[ids < vocab_size]


def _batch(seqs: list[Sequence], order: list[int], pad: int) -> tuple[torch.Tensor, ...]:
    """ids (B, T), hidden (B, T, H), top_ids / top_logits (B, T, K), prompt_len (B,), length (B,),
    features (B, T, F * H) or None (sequences without the feature layers' states)."""
    longest = max(int(seqs[i].ids.shape[0]) for i in order)
    ids, hidden, top_ids, top_logits, features = [], [], [], [], []
    for i in order:
        s = seqs[i]
        extra = longest - int(s.ids.shape[0])
        ids.append(F.pad(s.ids.long(), (0, extra), value=pad))
        hidden.append(F.pad(s.hidden, (0, 0, 0, extra)))
        top_ids.append(F.pad(s.top_ids.long(), (0, 0, 0, extra)))
        top_logits.append(F.pad(s.top_logits.float(), (0, 0, 0, extra), value=float("-inf")))
        if s.features is not None:
            features.append(F.pad(s.features, (0, 0, 0, extra)))
    return (torch.stack(ids), torch.stack(hidden), torch.stack(top_ids), torch.stack(top_logits),
            torch.tensor([seqs[i].prompt_len for i in order]), torch.tensor([int(seqs[i].ids.shape[0]) for i in order]),
            torch.stack(features) if len(features) == len(order) else None)


def depth_rows(d: int, t: int, prompt_len: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
    """(B, t - d - 1) bool: rows i whose depth-d prediction x_{i+d+1} is an answer token.

    >>> depth_rows(1, 6, torch.tensor([3]), torch.tensor([5])).tolist()
    [[False, True, True, False]]
    """
    p = torch.arange(d + 1, t)[None, :]  # predicted position of row i = p - d - 1
    return (p >= prompt_len[:, None]) & (p < length[:, None])


def unroll(module, ids: torch.Tensor, hidden: torch.Tensor, depths: int, features: torch.Tensor | None = None):
    """Yield (d, out (B, T - d, H)) for d = 1..depths: h^d from h^{d-1} and x_{i+d} (h^0: the
    target's final hidden state, with the feature layers' states fused in where the module has a fusion)."""
    t = ids.shape[1]
    if getattr(module, "fusion", None) is not None:
        if features is None:
            raise InputError("this module fuses the target's feature layers; the corpus holds none (--feature-layers)")
        hidden = module.fusion(hidden, features)
    below = hidden
    for d in range(1, depths + 1):
        if t - d < 2:
            return
        positions = torch.arange(d, t)[None].expand(ids.shape[0], -1)
        out = module.forward_layer((d - 1) % len(module.layers), below[:, : t - d], positions, None,
                                   input_ids=ids[:, d:])
        yield d, out
        below = out


def _soft_targets(top_ids: torch.Tensor, top_logits: torch.Tensor, to_vocab: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-K distribution renormalised over the tokens the training vocabulary
    holds: (N, K) indices into the vocabulary (0 where dropped) and (N, K) probabilities."""
    index = to_vocab[top_ids]  # (N, K), -1 outside the vocabulary
    logits = top_logits.masked_fill(index < 0, float("-inf"))
    return index.clamp_min(0), torch.softmax(logits, dim=-1)


def module_loss(module, weight: torch.Tensor, to_vocab: torch.Tensor, batch: tuple, depths: int) -> torch.Tensor:
    ids, hidden, top_ids, top_logits, prompt_len, length, features = batch
    t = ids.shape[1]
    total, count = 0.0, 0
    for d, out in unroll(module, ids, hidden, depths, features):
        rows = depth_rows(d, t, prompt_len, length)  # (B, t - d - 1)
        if not rows.any():
            continue
        h = out[:, : t - d - 1][rows]  # (N, H)
        logp = torch.log_softmax((h @ weight.T).float(), dim=-1)  # (N, S)
        teacher = slice(d, t - 1)  # row i's target: the target's logits at position i + d
        index, probs = _soft_targets(top_ids[:, teacher][rows], top_logits[:, teacher][rows], to_vocab)
        total = total - (probs * logp.gather(-1, index)).sum()
        count += int(rows.sum())
    return total / max(count, 1)


@torch.no_grad()
def evaluate(module, weight: torch.Tensor, vocab: torch.Tensor, seqs: list[Sequence], depths: int, pad: int,
             batch_positions: int = 4096, autocast: bool = True, per_anchor: bool = False) -> dict:
    """Per-depth top-1 / top-5 and the k-chain acceptance length, teacher forced (see the module
    docstring), over all sequences and per category (`category`; Spec-Bench's MT-bench kinds
    count as one, mt_bench, as its table does). A depth's truth is the target's own greedy choice
    (its top-1 logit there). per_anchor: also each sequence's accepted drafts per anchor row
    (None where no chain starts)."""
    module.eval()
    anchors_of: list[list[int | None]] = [[] for _ in seqs]
    by_category: dict[str, list[float]] = {}  # category -> [accepted drafts, anchors]
    hits = torch.zeros(depths, 2)  # top-1, top-5 counts
    conditional = torch.zeros(depths, 2)  # (right, tried) given the depths before were right
    counted = torch.zeros(depths)
    accepted_total, anchors = 0.0, 0
    for group in _groups(seqs, list(range(len(seqs))), batch_positions):
        ids, hidden, top_ids, top_logits, prompt_len, length, features = _batch(seqs, group, pad)
        t = ids.shape[1]
        dtype = next(module.layers.parameters()).dtype
        with torch.autocast(hidden.device.type, dtype=torch.bfloat16, enabled=autocast and fast_bfloat16(hidden.device)):
            outs = dict(unroll(module, ids, hidden.to(dtype), depths, None if features is None else features.to(dtype)))
        # right[d-1]: (B, t) bool at anchor row i: depth d's draft equals the target's choice
        right = torch.zeros(depths, *ids.shape, dtype=torch.bool)
        valid = torch.zeros(depths, *ids.shape, dtype=torch.bool)
        for d, out in outs.items():
            rows = depth_rows(d, t, prompt_len, length)
            logits = (out[:, : t - d - 1].float() @ weight.T)  # (B, t-d-1, S)
            truth = top_ids[:, d : t - 1, 0]  # the target's greedy token for x_{i+d+1}
            top5 = vocab[logits.topk(5, dim=-1).indices]  # (B, t-d-1, 5) token ids
            ok1 = top5[..., 0] == truth
            ok5 = (top5 == truth[..., None]).any(-1)
            hits[d - 1, 0] += (ok1 & rows).sum()
            hits[d - 1, 1] += (ok5 & rows).sum()
            counted[d - 1] += rows.sum()
            right[d - 1, :, : t - d - 1] = ok1 & rows
            valid[d - 1, :, : t - d - 1] = rows
        # chains anchored where depth 1 predicts an answer token
        anchor = valid[0]
        run = torch.ones_like(anchor)
        lengths = torch.zeros(anchor.shape)
        for d in range(depths):
            tried = run & anchor & valid[d]
            conditional[d, 1] += tried.sum()
            run = run & right[d] & valid[d]
            conditional[d, 0] += (run & anchor).sum()
            lengths += (run & anchor).float()
        accepted_total += float(lengths[anchor].sum())
        anchors += int(anchor.sum())
        for b, i in enumerate(group):
            anchors_of[i] = [int(n) if a else None for n, a in zip(lengths[b].tolist(), anchor[b].tolist())]
            counts = by_category.setdefault(category(seqs[i].source), [0.0, 0])
            counts[0] += float(lengths[b][anchor[b]].sum())
            counts[1] += int(anchor[b].sum())
    module.train()
    n = counted.clamp_min(1)
    return ({"per_anchor": [row[: int(s.ids.shape[0])] for row, s in zip(anchors_of, seqs)]} if per_anchor else {}) | {
        "top1": [round(float(v), 4) for v in hits[:, 0] / n],
        "top5": [round(float(v), 4) for v in hits[:, 1] / n],
        "accepted_given_previous": [round(float(r / max(c, 1)), 4) for r, c in conditional],
        f"mean_acceptance_length_k{depths}": round(1 + accepted_total / max(anchors, 1), 4),
        f"mean_acceptance_length_k{depths}_by_category": {c: round(1 + a / max(n, 1), 4) for c, (a, n) in sorted(by_category.items())},
        "positions": [int(c) for c in counted],
    }


def category(source: str) -> str:
    """A sequence's category in the evaluation: its source, with Spec-Bench's eight MT-bench kinds
    as one (mt_bench).

    >>> category("writing"), category("translation"), category("gsm8k-train")
    ('mt_bench', 'translation', 'gsm8k-train')
    """
    return "mt_bench" if source in MT_BENCH else source


def _groups(seqs: list[Sequence], order: list[int], batch_positions: int) -> list[list[int]]:
    """Consecutive indices grouped so each group's padded size stays near batch_positions."""
    groups, group, longest = [], [], 0
    for i in order:
        n = int(seqs[i].ids.shape[0])
        if group and max(longest, n) * (len(group) + 1) > batch_positions:
            groups.append(group)
            group, longest = [], 0
        group.append(i)
        longest = max(longest, n)
    if group:
        groups.append(group)
    return groups


def _checkpoint_path(cfg: ModuleConfig, target: LoadedModel, out: Path) -> Path:
    key = json.dumps([asdict(cfg), target.spec, str(out.resolve())])
    return cache_root() / "train" / f"mtp-module-{hashlib.sha256(key.encode()).hexdigest()[:16]}.ckpt"


def _shown(path: str) -> str:
    """A weights folder as a card shows it: relative to the repository when inside it, never a machine's home."""
    if not path:
        return ""
    root = Path(__file__).resolve().parents[2]
    try:
        return str(Path(path).resolve().relative_to(root))
    except ValueError:
        return Path(path).name


def draw_seed(seed: int, history: list[dict]) -> int:
    """The seed of a run's batch draws. A warm-started run is offset by the steps its history
    already took, so it draws new batches instead of replaying the first ones of the run before it
    (which used the same --seed on the same corpus).

    >>> draw_seed(0, [])
    0
    >>> draw_seed(0, [{"steps_run": 469}, {"steps_run": 213}])
    682000682
    >>> draw_seed(0, [{"steps_run": 469}]) != draw_seed(0, [{"steps_run": 469}, {"steps_run": 213}])
    True
    """
    return seed + 1_000_001 * sum(int(run.get("steps_run") or 0) for run in history)


def train_module(target: LoadedModel, train: list[Sequence], evals: dict[str, list[Sequence]], cfg: ModuleConfig,
                 out: Path, command: str, data_info: dict, progress: bool = True) -> dict:
    gen = seed_everything(cfg.seed)
    pad = min(target.eos_token_ids, default=0)
    module = build_module(target, cfg.layers, cfg.feature_layers)
    history = []  # earlier runs this one continues (warm start), from their cards
    if cfg.init:
        card = read_card_for(Path(cfg.init), KIND, target, "MTP module")
        if card["layers"] != cfg.layers:
            raise InputError(f"{cfg.init} has {card['layers']} layers; --layers is {cfg.layers}")
        before_layers = tuple(card.get("feature_layers", ()))
        if before_layers and before_layers != tuple(cfg.feature_layers):
            raise InputError(f"{cfg.init} fuses feature layers {list(before_layers)}; --feature-layers is "
                             f"{list(cfg.feature_layers)}")
        state = load_weights(Path(cfg.init), "cpu", torch.float32)
        if not before_layers and module.fusion is not None:  # a module without features: its fusion starts at zero
            state = state | {f"fusion.{k}": v for k, v in module.fusion.state_dict().items()}
        load_trained(module, state)
        history = card.get("training_history", []) + [{k: card["training"].get(k) for k in
                                                      ("steps_run", "batch_positions", "lr", "train_s", "final_loss")}
                                                     | {"command": card.get("command")}]
    gen.manual_seed(draw_seed(cfg.seed, history))
    module.train()
    vocab = training_vocabulary(train, target.vocab_size)
    to_vocab = torch.full((target.vocab_size,), -1, dtype=torch.long)
    to_vocab[vocab] = torch.arange(len(vocab))
    weight = target.model.get_output_embeddings().weight.detach()[vocab].float()  # (S, H), frozen
    params = list(module.layers.parameters()) + ([] if module.fusion is None else list(module.fusion.parameters()))
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    start, seconds, steps = 0, 0.0, cfg.steps
    ckpt = _checkpoint_path(cfg, target, out)
    if ckpt.is_file():
        state = torch.load(ckpt, weights_only=False)
        module.layers.load_state_dict(state["layers"])
        if module.fusion is not None:
            module.fusion.load_state_dict(state["fusion"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        start, seconds = state["step"], state["seconds"]
        steps = state["steps"]
    before = {name: evaluate(module, weight, vocab, seqs, cfg.depths, pad) for name, seqs in evals.items()} if start == 0 else None
    bar = tqdm(total=steps, desc="mtp-module", unit="step", disable=not progress, initial=start)
    loss = torch.tensor(float("nan"))
    begin = time.perf_counter()
    step = start
    while step < steps:
        if start == 0:  # a time budget fixes the schedule's length after the first steps
            steps = budget_steps(steps, cfg.minutes, step, time.perf_counter() - begin)
            bar.total = steps
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, steps, cfg.lr, cfg.warmup)
        order, positions = [], 0
        while positions < cfg.batch_positions:
            i = int(torch.randint(0, len(train), (1,), generator=gen))
            order.append(i)
            positions += int(train[i].ids.shape[0])
        batch = _batch(train, order, pad)
        with torch.autocast(weight.device.type, dtype=torch.bfloat16, enabled=fast_bfloat16(weight.device)):
            loss = module_loss(module, weight, to_vocab, (batch[0], batch[1].float(), *batch[2:6],
                                                          None if batch[6] is None else batch[6].float()), cfg.depths)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.update()
        step += 1
        if step % cfg.checkpoint_every == 0 and step < steps:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"layers": module.layers.state_dict(),
                        "fusion": None if module.fusion is None else module.fusion.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "steps": steps, "seconds": seconds + time.perf_counter() - begin},
                       ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)
    bar.close()
    seconds += time.perf_counter() - begin
    after = {name: evaluate(module, weight, vocab, seqs, cfg.depths, pad) for name, seqs in evals.items()}
    card = {
        "kind": KIND,
        "target": target.spec,
        "hidden_size": int(target.model.config.get_text_config().hidden_size),
        "vocab_size": target.vocab_size,
        "layers": cfg.layers,
        "feature_layers": list(cfg.feature_layers),
        "design": "DeepSeek-V3 MTP module (section 2.2): per depth RMSNorm(h^{d-1}) and RMSNorm(embedding of the token "
                  "just chosen), concatenated, projected 2H -> H, one decoder block of the target's kind, a post norm, "
                  "the target's LM head; one layer reused across depths"
                  + ("; h^0 is the target's final hidden state plus EAGLE-3's fused features: the feature layers' "
                     "hidden states, each RMS-normalised, projected F*H -> H" if cfg.feature_layers else ""),
        "predicts": "depth d at position i reads h^{d-1}_i and token x_{i+d}, and predicts x_{i+d+1}",
        "storage": "float16 safetensors: the MTP layers only; embedding, LM head and rotary come from the target",
        "command": command,
        "data": {**data_info, "train": corpus_stats(train), **{f"eval_{k}": corpus_stats(v) for k, v in evals.items()}},
        "training": {**asdict(cfg), "init": _shown(cfg.init), "steps_run": steps, "final_loss": round(float(loss), 4), "train_s": round(seconds, 1),
                     "train_vocabulary": int(len(vocab)), "draw_seed": draw_seed(cfg.seed, history)},
        "training_history": history,  # the runs before this one, when it started from their weights
        "evaluation": after,
        "evaluation_before_training": before,
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads()},
    }
    save_weights(out, trained_state(module), card)
    card["draft_vocabulary"] = write_vocabulary(out, answered(train), answered(evals.get("heldout", [])), target.vocab_size)
    ckpt.unlink(missing_ok=True)
    return card
