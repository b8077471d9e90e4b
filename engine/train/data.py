"""Self-distillation data: the target answers the prompt set, and we keep what the drafters learn
from, once, in a cache file (training reruns never regenerate).

Per answered prompt: the token ids (prompt + response), and at every response position j the
target's final hidden state (H,) that chose response token j, plus the target's top-K logits
there (the draft model's KL target). Generation is batched with left padding because plain
decoding is slow on a small CPU.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.models import LoadedModel, cache_root
from engine.train.prompts import PROMPTS_FILE, read_prompts


@dataclass(frozen=True)
class DataConfig:
    max_new_tokens: int = 96  # response length cap per prompt
    batch_size: int = 32  # prompts answered together (left padded)
    top_logits: int = 32  # target logits kept per position for the draft model's KL
    limit: int = 0  # use only the first N prompts (0: all); smoke tests use a few


@dataclass
class Example:
    prompt_id: int
    category: str
    split: str  # "train" or "heldout"
    ids: torch.Tensor  # (T,) prompt + response token ids
    prompt_len: int
    hidden: torch.Tensor  # (R, H) fp16: row j is the final hidden state that chose response token j
    top_ids: torch.Tensor  # (R, K) the target's top-K tokens there
    top_logits: torch.Tensor  # (R, K) fp16 and their logits


ANSWER_FIELDS = ("ids", "prompt_len", "hidden", "top_ids", "top_logits")


@dataclass
class Dataset:
    examples: list[Example]
    info: dict  # how it was made: model, prompts file, settings, timings

    def split(self, name: str) -> list[Example]:
        return [e for e in self.examples if e.split == name]

    def tokens(self, name: str) -> int:
        return sum(e.hidden.shape[0] for e in self.split(name))


def _cache_file(target: LoadedModel, cfg: DataConfig) -> Path:
    """Answers are cached per prompt text, under what changes them: the target and the
    answer settings (not the batch size, which only moves float rounding)."""
    key = json.dumps([target.spec, str(target.dtype), cfg.max_new_tokens, cfg.top_logits])
    return cache_root() / "train" / f"answers-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"


def _pad_left(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # (B, T)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])  # (B, T)
    return ids, mask


@torch.inference_mode()
def _answer_batch(target: LoadedModel, batch: list[str], cfg: DataConfig) -> list[dict]:
    model = target.model
    prompts = [target.encode(text) for text in batch]
    eos = sorted(target.eos_token_ids)
    ids, mask = _pad_left(prompts, eos[0])
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, do_sample=False,
        eos_token_id=eos, pad_token_id=eos[0], output_hidden_states=True, return_dict_in_generate=True,
    )
    responses = out.sequences[:, ids.shape[1]:]  # (B, R_max)
    # step 0 is the prefill (last position chose response token 0); step s > 0 chose token s
    last = [step[-1][:, -1] for step in out.hidden_states]  # R_max x (B, H)
    hidden = torch.stack(last, dim=1)  # (B, R_max, H)
    answers = []
    for b in range(len(batch)):
        resp = responses[b].tolist()
        length = next((i + 1 for i, t in enumerate(resp) if t in target.eos_token_ids), len(resp))
        h = hidden[b, :length].float()  # (R, H)
        logits = model.get_output_embeddings()(h)  # (R, V): the target's next-token logits
        top = torch.topk(logits, cfg.top_logits, dim=-1)
        answers.append({
            "ids": torch.tensor(prompts[b] + resp[:length]), "prompt_len": len(prompts[b]), "hidden": h.half(),
            "top_ids": top.indices.to(torch.int32), "top_logits": top.values.half(),
        })
    return answers


def _save(store: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(store, tmp)
    tmp.replace(path)  # atomic: an interrupted run keeps every batch saved before it


def build_dataset(target: LoadedModel, cfg: DataConfig = DataConfig(), prompts_file: Path = PROMPTS_FILE) -> Dataset:
    """The target's greedy answer to every prompt, with hidden states and top logits. Answers
    are cached per prompt (saved after each batch), so reruns, interrupted runs and a grown
    prompt set only answer what is missing."""
    path = _cache_file(target, cfg)
    store = torch.load(path, weights_only=False) if path.is_file() else {"answers": {}, "seconds": 0.0}
    prompts = read_prompts(prompts_file)
    if cfg.limit:
        prompts = prompts[: cfg.limit]
    todo = sorted({p["prompt"] for p in prompts} - set(store["answers"]), key=lambda text: len(target.encode(text)))
    batches = [todo[i : i + cfg.batch_size] for i in range(0, len(todo), cfg.batch_size)]  # similar lengths together
    for batch in tqdm(batches, desc="self-distillation (target answers)", unit="batch"):
        begin = time.perf_counter()
        store["answers"].update(zip(batch, _answer_batch(target, batch, cfg)))
        store["seconds"] += time.perf_counter() - begin
        _save(store, path)
    examples = [Example(p["id"], p["category"], p["split"], **store["answers"][p["prompt"]]) for p in prompts]
    info = {
        "model": target.spec, "prompts_file": prompts_file.name, "prompts": len(examples),
        "settings": asdict(cfg), "generation_s": round(store["seconds"], 1),
    }
    return Dataset(examples, info)
