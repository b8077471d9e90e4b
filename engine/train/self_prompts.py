"""Prompts the target writes itself (Magpie: Xu et al. 2024, "Magpie: Alignment Data Synthesis
from Scratch by Prompting Aligned LLMs with Nothing"): fed only its chat template up to where a
user's message begins, an instruct model samples a user request from what it was aligned on.
The embedded SmolLM2-Instruct writes open questions, essays, explanations and advice requests,
the kinds of request MT-bench asks and the real prompt sources (GSM8K, code, roleplay) barely
hold; its greedy answers to them then join the MTP module's training corpus (split "self").

`python -m engine.train self-prompts --count N` appends to engine/train/self_prompts.jsonl,
one batch at a time (resumable: batch b is sampled with its own seed, so a rerun or a larger N
continues the same sequence of batches). Kept: requests the model closed with its end-of-turn
token, 6 to 120 words, not a duplicate (case-insensitive) of a kept or a train prompt, and
sharing no 13-word sequence with a Spec-Bench question (the benchmark's decontamination: those
questions are never trained on). The file is the model's output (SmolLM2, Apache-2.0).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.errors import InputError
from engine.models import LoadedModel

SELF_PROMPTS = Path(__file__).with_name("self_prompts.jsonl")
SOURCE = "magpie-self"
NGRAM = 13  # words: a request sharing a 13-word run with a Spec-Bench question is dropped
PLACEHOLDER = "\x00PLACEHOLDER\x00"


@dataclass(frozen=True)
class SelfPromptConfig:
    count: int = 1000  # requests kept in the file (the file is extended up to this)
    batch_size: int = 16
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 0.95
    min_words: int = 6
    max_words: int = 120
    seed: int = 0
    max_batches: int = 0  # per run; 0: ten times the batches the count would need if all were kept


def pre_query(target: LoadedModel) -> list[int]:
    """The chat template's ids up to where a user message's text begins (Magpie's input)."""
    ids = target.encode(PLACEHOLDER)
    text = target.tokenizer.decode(ids)
    if PLACEHOLDER not in text or not getattr(target.tokenizer, "chat_template", None):
        raise InputError("self-prompts needs an instruct model whose chat template shows the user's text verbatim")
    head = text[: text.index(PLACEHOLDER)]
    return [int(i) for i in target.tokenizer(head, add_special_tokens=False)["input_ids"]]


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    """Word n-grams of a text (all of its words when it has fewer than n).

    >>> sorted(ngrams("A b c", 2))
    [('a', 'b'), ('b', 'c')]
    """
    w = _words(text)
    return {tuple(w)} if len(w) < n else {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def read_self_prompts(path: Path = SELF_PROMPTS) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def _banned() -> tuple[set[tuple[str, ...]], set[str]]:
    """Spec-Bench's 13-grams and the train prompts' texts (lowercased)."""
    from engine.bench.prompts import SPEC_BENCH_FILE
    from engine.train.corpus import TRAIN_PROMPTS

    grams: set[tuple[str, ...]] = set()
    for line in SPEC_BENCH_FILE.read_text(encoding="utf-8").split("\n"):
        if line.strip():
            for turn in json.loads(line)["turns"]:
                grams |= ngrams(turn)
    texts = {json.loads(line)["text"].strip().lower()
             for line in TRAIN_PROMPTS.read_text(encoding="utf-8").split("\n") if line.strip()}
    return grams, texts


def drop_reason(text: str, eos: bool, cfg: SelfPromptConfig, seen: set[str], spec_grams: set[tuple[str, ...]]) -> str | None:
    """Why a sampled request is dropped, or None when it is kept."""
    if not eos:
        return "unfinished"
    n = len(_words(text))
    if n < cfg.min_words or n > cfg.max_words:
        return "length"
    if text.strip().lower() in seen:
        return "duplicate"
    if ngrams(text) & spec_grams:
        return "spec-bench overlap"
    return None


@torch.inference_mode()
def sample_batch(target: LoadedModel, head: list[int], cfg: SelfPromptConfig, batch: int) -> list[tuple[str, bool]]:
    """(text, closed with the end-of-turn token) for one batch of sampled requests."""
    torch.manual_seed(cfg.seed * 1_000_003 + batch)
    ids = torch.tensor([head] * cfg.batch_size)
    eos = sorted(target.eos_token_ids)
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                temperature=cfg.temperature, top_p=cfg.top_p, top_k=0,
                                max_new_tokens=cfg.max_new_tokens, eos_token_id=eos, pad_token_id=eos[0])
    rows = []
    for row in out[:, len(head):].tolist():
        cut = next((i for i, t in enumerate(row) if t in target.eos_token_ids), None)
        rows.append((target.tokenizer.decode(row[:cut], skip_special_tokens=True).strip(), cut is not None))
    return rows


def build_self_prompts(target: LoadedModel, cfg: SelfPromptConfig, path: Path = SELF_PROMPTS,
                       progress: bool = True) -> dict:
    """Extend the file to cfg.count kept requests; returns counts of kept and dropped."""
    rows = read_self_prompts(path)
    spec_grams, seen = _banned()
    seen |= {r["text"].strip().lower() for r in rows}
    batch = 1 + max((r["batch"] for r in rows), default=-1)
    head = pre_query(target)
    dropped: dict[str, int] = {}
    bar = tqdm(total=cfg.count, initial=min(len(rows), cfg.count), desc="self-prompts", unit="prompt",
               disable=not progress)
    limit = cfg.max_batches or 10 * -(-max(cfg.count - len(rows), 0) // cfg.batch_size)
    for _ in range(limit):
        if len(rows) >= cfg.count:
            break
        new = []
        for text, eos in sample_batch(target, head, cfg, batch):
            why = drop_reason(text, eos, cfg, seen, spec_grams)
            if why:
                dropped[why] = dropped.get(why, 0) + 1
                continue
            seen.add(text.strip().lower())
            new.append({"source": SOURCE, "text": text, "seed": cfg.seed, "batch": batch})
        with path.open("a", encoding="utf-8") as f:  # a batch lands whole: reruns continue after it
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in new))
        rows += new
        bar.update(len(new))
        batch += 1
    bar.close()
    if len(rows) < cfg.count:
        raise InputError(f"only {len(rows)} of {cfg.count} requests kept after {limit} batches "
                         f"(dropped: {dropped}); run again to continue")
    return {"kept": len(rows), "batches": batch, "dropped_this_run": dropped}
