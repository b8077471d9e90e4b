"""The training corpus from real prompts: the target answers them (self-distillation) and a
teacher-forced pass keeps, at every position of prompt + answer, the target's final hidden state
and its top-K next-token logits.

Prompts: engine/train/train_prompts.jsonl (14,106 prompts under MIT or Apache-2.0: GSM8K train
questions, GPTeacher code and roleplay instructions, Self-Instruct seed tasks; sources and
licences in engine/train/DATA.md). Every 20th row is held out (never trained on; the cards' accuracies read it).
The Spec-Bench dev questions (engine/bench/prompts/spec-bench.jsonl) can be answered the same
way, as an evaluation set only (`split="spec-bench"`): no trainer reads that split. Split "self"
holds the requests the target wrote itself (engine/train/self_prompts.py, Magpie), split "tasks" the
requests about a text made from its answers (engine/train/task_prompts.py); both all trained on.

Why a teacher-forced pass after generating: a drafter is fed the hidden states the engine's
verification and prefill forwards produce (all positions, prompt included: an MTP module keeps a
KV cache over the whole context), so it is trained on the same kind of pass, not on the
step-by-step generation's.

Cost on a small CPU: answers are generated in batches of similar-length prompts (left padded)
in bfloat16 with transformers' own kernels; the batch's sequences then go through one
right-padded forward (the teacher-forced pass), in bfloat16 too where the CPU has bfloat16
instructions, in float32 over the same answers where it emulates bfloat16 (`answerer` below). Each batch is saved as its own shard the
moment it exists, so an interrupted build resumes where it stopped; a shard's name fixes which
prompts it holds (a seeded draw), so reruns and larger builds reuse every shard made before.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from engine.errors import InputError
from engine.models import LoadedModel, cache_root, load_model
from engine.mtp.module import check_feature_layers
from engine.train.common import fast_bfloat16

TRAIN_PROMPTS = Path(__file__).with_name("train_prompts.jsonl")
HELDOUT_EVERY = 20  # row i is held out when i % 20 == 0
SPLITS = ("train", "heldout", "spec-bench", "self", "tasks")
BLOCK = 256  # prompts drawn together; sorted by length inside a block, then batched


@dataclass(frozen=True)
class CorpusConfig:
    split: str = "train"
    prompts: int = 2000  # how many prompts of the split to answer (a seeded draw; 0: all)
    max_new_tokens: int = 128  # answer length cap
    max_prompt_tokens: int = 512  # longer prompts are skipped
    batch_size: int = 16
    top_logits: int = 8  # target logits kept per position (the distillation target)
    seed: int = 0
    feature_layers: tuple[int, ...] = ()  # also keep these layers' hidden states (EAGLE-3's fused features)


@dataclass
class Sequence:
    """One answered prompt: ids (T,) = prompt + answer; row i of hidden / top_* is position i
    (its final hidden state and the target's top-K logits for the token after it)."""

    key: str  # "<split>/<row>"
    source: str  # the prompt's origin (gsm8k-train, gpteacher-codegen, ... or a Spec-Bench category)
    ids: torch.Tensor  # (T,) int32
    prompt_len: int
    hidden: torch.Tensor  # (T, H) bfloat16
    top_ids: torch.Tensor  # (T, K) int32
    top_logits: torch.Tensor  # (T, K) bfloat16
    features: torch.Tensor | None = None  # (T, F * H) bfloat16: the feature layers' hidden states, side by side

    @property
    def answer_len(self) -> int:
        return int(self.ids.shape[0]) - self.prompt_len


def read_split(split: str) -> list[tuple[str, str, str]]:
    """(key, source, text) of every prompt of a split, in file order."""
    if split not in SPLITS:
        raise InputError(f"unknown corpus split {split!r} (one of {', '.join(SPLITS)})")
    if split == "spec-bench":
        from engine.bench.prompts import SPEC_BENCH_FILE

        rows = [json.loads(line) for line in SPEC_BENCH_FILE.read_text(encoding="utf-8").split("\n") if line.strip()]
        return [(f"spec-bench/{r['question_id']}", r["category"], r["turns"][0]) for r in rows]
    if split == "self":
        from engine.train.self_prompts import read_self_prompts

        return [(f"self/{i}", r["source"], r["text"]) for i, r in enumerate(read_self_prompts())]
    if split == "tasks":
        from engine.train.task_prompts import read_task_prompts

        return [(f"tasks/{i}", r["source"], r["text"]) for i, r in enumerate(read_task_prompts())]
    rows = [json.loads(line) for line in TRAIN_PROMPTS.read_text(encoding="utf-8").split("\n") if line.strip()]
    held = split == "heldout"
    return [(f"{split}/{i}", r["source"], r["text"]) for i, r in enumerate(rows) if (i % HELDOUT_EVERY == 0) == held]


GROWN_SPLITS = ("self", "tasks")  # files that are extended by appending, their rows already in random order


def drawn(split: str, n: int, seed: int) -> list[tuple[str, str, str]]:
    """The first n prompts of the split's seeded order (a larger n extends a smaller one). The
    self-written and task requests are drawn in file order: their rows are sampled or made in
    random order already, and the files grow by appending, so a longer file still extends the
    same draw (and its committed answers still serve)."""
    rows = read_split(split)
    if split not in GROWN_SPLITS:
        random.Random(f"{split}:{seed}").shuffle(rows)
    return rows[:n] if n else rows


TEACHER_DTYPES = ("auto", "float32", "bfloat16")


def corpus_models(model: str, answer_dtype: str, teacher_dtype: str = "auto") -> tuple[LoadedModel, LoadedModel]:
    """(teacher, answerer): the target for the teacher-forced pass (and training), and the same
    target in the dtype its answers are written in (the committed answers: bfloat16). teacher
    "auto": the answers' dtype, or float32 where this CPU emulates bfloat16. Both on
    transformers' own kernels: the corpus runs batched forwards."""
    if teacher_dtype not in TEACHER_DTYPES:
        raise InputError(f"teacher dtype must be one of {', '.join(TEACHER_DTYPES)} (got {teacher_dtype!r})")
    answerer = load_model(model, device="cpu", dtype=answer_dtype, kernels="stock")
    if teacher_dtype == "auto":
        slow = answerer.dtype in (torch.bfloat16, torch.float16) and not fast_bfloat16(answerer.device)
        teacher_dtype = "float32" if slow else answer_dtype
    return load_model(model, device="cpu", dtype=teacher_dtype, kernels="stock"), answerer


def corpus_dir(target: LoadedModel, cfg: CorpusConfig, answerer: LoadedModel | None = None) -> Path:
    """Shards live under what changes their content: the target, its dtype, the answer cap, K and
    the draw's seed (not the number of prompts: more prompts only add shards), and the answering
    model's dtype where it is not the teacher's."""
    key = [target.spec, str(target.dtype), cfg.max_new_tokens, cfg.max_prompt_tokens, cfg.top_logits, cfg.batch_size,
           cfg.seed]
    if answerer is not None and answerer.dtype != target.dtype:
        key.append(f"answered in {answerer.dtype}")
    if cfg.feature_layers:
        key.append(f"features {list(cfg.feature_layers)}")
    return cache_root() / "train" / f"corpus-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}"


def _batches(target: LoadedModel, cfg: CorpusConfig) -> list[tuple[str, list[tuple[str, str, list[int]]]]]:
    """(shard name, [(key, source, prompt ids)]) for every batch of the draw."""
    rows = drawn(cfg.split, cfg.prompts, cfg.seed)
    out = []
    for block in range(0, len(rows), BLOCK):
        encoded = [(key, source, target.encode(text)) for key, source, text in rows[block:block + BLOCK]]
        encoded = sorted((e for e in encoded if len(e[2]) <= cfg.max_prompt_tokens), key=lambda e: len(e[2]))
        for b in range(0, len(encoded), cfg.batch_size):
            out.append((f"{cfg.split}-{block // BLOCK:04d}-{b // cfg.batch_size:02d}", encoded[b:b + cfg.batch_size]))
    return out


@torch.inference_mode()
def generate_answers(target: LoadedModel, batch: list[tuple[str, str, list[int]]], cfg: CorpusConfig) -> list[list[int]]:
    """The target's greedy answers to a batch of prompts (left padded, batched), EOS kept."""
    model = target.model
    eos = sorted(target.eos_token_ids)
    pad = eos[0]
    prompts = [ids for _, _, ids in batch]
    width = max(len(p) for p in prompts)
    left = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # (B, T) left padded
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=left, attention_mask=mask, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                         eos_token_id=eos, pad_token_id=pad)
    answers = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))  # EOS kept
        answers.append(row[:cut])
    return answers


@torch.inference_mode()
def teacher_forced(target: LoadedModel, batch: list[tuple[str, str, list[int]]], answers: list[list[int]],
                   cfg: CorpusConfig) -> list[Sequence]:
    """One right-padded forward over each prompt + answer: every position's final hidden state
    and the target's top-K logits (and the feature layers' hidden states where asked for:
    i is the state after i decoder layers, transformers' hidden_states[i])."""
    model = target.model
    pad = sorted(target.eos_token_ids)[0]
    seqs = [prompt + answer for (_, _, prompt), answer in zip(batch, answers)]
    longest = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad] * (longest - len(s)) for s in seqs])
    attn = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in seqs])
    states = model(input_ids=ids, attention_mask=attn, output_hidden_states=True, logits_to_keep=1).hidden_states
    hidden = states[-1]
    features = torch.cat([states[i] for i in cfg.feature_layers], -1) if cfg.feature_layers else None
    lm_head = model.get_output_embeddings()
    result = []
    for b, ((key, source, prompt), seq, h) in enumerate(zip(batch, seqs, hidden)):
        h = h[: len(seq)]
        top = torch.topk(lm_head(h).float(), cfg.top_logits, dim=-1)  # (T, K)
        f = None if features is None else features[b, : len(seq)].to(torch.bfloat16).clone()
        result.append(Sequence(key, source, torch.tensor(seq, dtype=torch.int32), len(prompt), h.to(torch.bfloat16).clone(),
                               top.indices.to(torch.int32), top.values.to(torch.bfloat16), f))
    return result


ANSWERS_DIR = Path(__file__).with_name("answers")  # the committed answers (`--answers-dir`'s default)


class AnswerStore:
    """The target's answers (token ids), kept apart from the shards: generating them is the slow
    part of a corpus (hours on a 2-core CPU for thousands of prompts), and they are small (about
    2 MB gzipped JSON lines for 3,000 prompts), so they can be committed. A later build on a fresh
    machine then only runs the fast teacher-forced pass. Keyed by what changes an answer: the
    target, its dtype, the answer cap, the prompt cap, the batch size and the draw's seed. An
    answer is used only for exactly the prompt ids it was made for."""

    def __init__(self, folder: Path, target: LoadedModel, cfg: CorpusConfig):
        key = json.dumps([target.spec, str(target.dtype), cfg.max_new_tokens, cfg.max_prompt_tokens, cfg.batch_size,
                          cfg.seed])
        self.path = Path(folder) / f"answers-{hashlib.sha256(key.encode()).hexdigest()[:16]}.jsonl.gz"
        self.header = {"target": target.spec, "dtype": str(target.dtype).removeprefix("torch."),
                       "settings": {k: v for k, v in asdict(cfg).items()
                                    if k not in ("split", "prompts", "top_logits", "feature_layers")}}
        self.rows: dict[str, dict] = {}
        if self.path.is_file():
            with gzip.open(self.path, "rt", encoding="utf-8") as f:
                lines = [json.loads(line) for line in f if line.strip()]
            self.rows = {row["key"]: row for row in lines[1:]}

    def get(self, batch: list[tuple[str, str, list[int]]]) -> list[list[int]] | None:
        rows = [self.rows.get(key) for key, _, _ in batch]
        if any(r is None or r["prompt"] != prompt for r, (_, _, prompt) in zip(rows, batch)):
            return None
        return [r["answer"] for r in rows]

    def put(self, batch: list[tuple[str, str, list[int]]], answers: list[list[int]]) -> None:
        """Adds the batch's answers the store lacks. One it holds for the same prompt is kept: a
        batch is answered again when one of its keys is missing, and on another machine (bfloat16
        emulated, other kernels) its other answers can come out different from the committed ones."""
        for (key, _, prompt), answer in zip(batch, answers):
            if self.rows.get(key, {}).get("prompt") != prompt:
                self.rows[key] = {"key": key, "prompt": prompt, "answer": answer}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
            f.write(json.dumps(self.header) + "\n")
            for key in sorted(self.rows):
                f.write(json.dumps(self.rows[key], separators=(",", ":")) + "\n")
        tmp.replace(self.path)  # atomic


def _save(shard: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(shard, tmp)
    tmp.replace(path)  # atomic: a shard on disk is always whole


def build_corpus(target: LoadedModel, cfg: CorpusConfig, progress: bool = True,
                 answers_dir: Path | None = None, answers_only: bool = False,
                 answerer: LoadedModel | None = None) -> list[Path]:
    """Answer the draw's prompts that no shard holds yet; returns the draw's shard files. A shard
    is reused only if it holds exactly the prompts its batch asks for (info.json keeps each
    shard's keys): a larger draw changes the last, partial block, which is then answered again.
    With answers_dir, answers come from (and new ones go to) an AnswerStore there, so only the
    teacher-forced pass runs for prompts answered before, on any machine. answers_only: only fill
    the store (no shards; returns []).

    answerer: the same target loaded in the dtype its answers are written in (default: `target`).
    The committed answers are bfloat16 ones; on a CPU without bfloat16 instructions the
    teacher-forced pass (`target`) runs in float32, 7x faster there (tools/train_speed.py), and
    reads the hidden states the float32 target gives the drafter at run time, while the answers
    stay the committed ones."""
    answerer = target if answerer is None else answerer
    if cfg.feature_layers:
        check_feature_layers(cfg.feature_layers, target.model.config.get_text_config().num_hidden_layers)
    if answerer.spec != target.spec:
        raise InputError(f"the answers must be {target.spec}'s own (got {answerer.spec})")
    store = AnswerStore(answers_dir, answerer, cfg) if answers_dir is not None else None
    if answers_only:
        if store is None:
            raise InputError("answers only needs an answers folder")
        todo = [batch for _, batch in _batches(target, cfg) if store.get(batch) is None]
        for batch in tqdm(todo, desc=f"answers {cfg.split}", unit="batch", disable=not progress):
            store.put(batch, generate_answers(answerer, batch, cfg))
        return []
    folder = corpus_dir(target, cfg, answerer)
    folder.mkdir(parents=True, exist_ok=True)
    info_path = folder / "info.json"
    info = json.loads(info_path.read_text()) if info_path.is_file() else {
        "target": target.spec, "dtype": str(target.dtype).removeprefix("torch."),
        "answer_dtype": str(answerer.dtype).removeprefix("torch."), "settings": asdict(cfg), "seconds": {}, "shards": {}}
    batches = _batches(target, cfg)
    todo = [(name, batch) for name, batch in batches
            if not (folder / f"{name}.pt").is_file() or info["shards"].get(name) != [key for key, _, _ in batch]]
    bar = tqdm(todo, desc=f"corpus {cfg.split} (target answers)", unit="batch", disable=not progress)
    for name, batch in bar:
        begin = time.perf_counter()
        answers = store.get(batch) if store is not None else None
        if answers is None:
            answers = generate_answers(answerer, batch, cfg)
            if store is not None:
                store.put(batch, answers)
                answers = store.get(batch)  # the committed answers where the store held them
        seqs = teacher_forced(target, batch, answers, cfg)
        _save({"sequences": [asdict(s) for s in seqs]}, folder / f"{name}.pt")
        seconds = time.perf_counter() - begin
        info["seconds"][cfg.split] = round(info["seconds"].get(cfg.split, 0.0) + seconds, 1)
        info["shards"][name] = [key for key, _, _ in batch]
        _save_json(info, info_path)
        bar.set_postfix(tok_s=f"{sum(len(s.ids) for s in seqs) / seconds:.0f}")
    return [folder / f"{name}.pt" for name, _ in batches]


def _save_json(data: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def load_corpus(paths: list[Path]) -> list[Sequence]:
    """Every sequence of these shards, in order."""
    return [Sequence(**s) for p in paths for s in torch.load(p, weights_only=True)["sequences"]]


def answer_examples(seqs: list[Sequence], split: str) -> list:
    """The corpus's sequences as the heads' and the draft model's training examples
    (engine/train/data.py's Example): only the answer's rows, row j being the hidden state that
    chose answer token j and the target's top-K logits there."""
    from engine.train.data import Example

    out = []
    for n, s in enumerate(seqs):
        rows = slice(s.prompt_len - 1, len(s.ids) - 1)
        out.append(Example(n, s.source, split, s.ids, s.prompt_len, s.hidden[rows], s.top_ids[rows], s.top_logits[rows]))
    return out


def corpus_stats(seqs: list[Sequence]) -> dict:
    sources: dict[str, int] = {}
    for s in seqs:
        sources[s.source] = sources.get(s.source, 0) + 1
    return {
        "sequences": len(seqs),
        "positions": sum(int(s.ids.shape[0]) for s in seqs),
        "answer_positions": sum(s.answer_len for s in seqs),
        "sources": dict(sorted(sources.items())),
    }
