"""python -m engine.train {prompts, data, mtp-heads, draft-model, vocabulary, self-prompts, task-prompts, corpus, mtp-module} [options]

Every trainer first self-distils (the target answers a prompt set; cached under
$SPECLAB_CACHE/train, so reruns skip it), then trains, then writes weights + card.json to --out.
mtp-heads and draft-model read the templated prompts.jsonl; corpus and mtp-module read the real
prompts of train_prompts.jsonl (engine/train/corpus.py, DATA.md), answered in bfloat16 (the
teacher-forced pass and training in float32 on a CPU that emulates bfloat16), and with
--self-prompts the requests self-prompts had the target write (engine/train/self_prompts.py), with
--task-prompts the requests about a text that task-prompts made from its answers (task_prompts.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

import torch


from engine.errors import InputError
from engine.models import load_model
from engine.mtp.module import KIND as MODULE_KIND
from engine.mtp.weights import WEIGHTS_DIR, read_card, resolve_weights
from engine.train.common import answered, write_vocabulary
from engine.train.corpus import (ANSWERS_DIR, SPLITS, TEACHER_DTYPES, CorpusConfig, answer_examples, build_corpus,
                                 corpus_dir, corpus_models, corpus_stats, load_corpus)
from engine.train.module import ModuleConfig, train_module
from engine.train.data import DataConfig, Dataset, build_dataset
from engine.train.draft import DraftConfig, train_draft
from engine.train.heads import HeadsConfig, train_heads
from engine.train.prompts import PROMPTS_FILE, write_prompts
from engine.train.self_prompts import SELF_PROMPTS, SelfPromptConfig, build_self_prompts
from engine.train.task_prompts import TASK_PROMPTS, build_task_prompts


def _data_args(p: argparse.ArgumentParser, out: str) -> None:
    p.add_argument("--model", default="embedded", help="preset name or local folder of the target")
    p.add_argument("--out", default=str(WEIGHTS_DIR / out), help="folder for weights + card.json")
    p.add_argument("--prompts", default=str(PROMPTS_FILE))
    p.add_argument("--limit", type=int, default=0, help="answer only the first N prompts (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=DataConfig.max_new_tokens, help="answer length cap")
    p.add_argument("--data-batch", type=int, default=DataConfig.batch_size, help="prompts answered together")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default; 1 is faster on a busy CPU)")
    if out in ("mtp-heads", "draft-model"):
        p.add_argument("--corpus", type=int, default=0, metavar="N",
                       help="train on the MTP module's data instead of --prompts: the target's bfloat16 answers to N "
                            "real train prompts (with --self-prompts, --task-prompts; held out: --heldout)")
        p.add_argument("--self-prompts", type=int, default=0, help="with --corpus: self-written requests too")
        p.add_argument("--task-prompts", type=int, default=0, help="with --corpus: requests about a text too")
        p.add_argument("--heldout", type=int, default=160, help="with --corpus: held-out train prompts for the card")
        p.add_argument("--minutes", type=float, default=0.0,
                       help="a training time budget: the first steps are timed and --steps set to fit it")
        p.add_argument("--answers-dir", default=str(ANSWERS_DIR), help="with --corpus: the committed answers")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine.train", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prompts", help=f"rewrite {PROMPTS_FILE.name} from its templates")
    _data_args(sub.add_parser("data", help="only self-distil: the target answers the prompts (cached)"), "unused")
    heads = sub.add_parser("mtp-heads", help="train Medusa-style MTP heads")
    _data_args(heads, "mtp-heads")
    heads.add_argument("--heads", type=int, default=HeadsConfig.heads)
    heads.add_argument("--steps", type=int, default=HeadsConfig.steps)
    heads.add_argument("--batch", type=int, default=HeadsConfig.batch, help="positions per step")
    heads.add_argument("--lr", type=float, default=HeadsConfig.lr)
    draft = sub.add_parser("draft-model", help="distil the target's first layers into a draft model")
    _data_args(draft, "draft-model")
    draft.add_argument("--layers", type=int, default=DraftConfig.layers)
    draft.add_argument("--steps", type=int, default=DraftConfig.steps)
    draft.add_argument("--batch", type=int, default=DraftConfig.batch, help="answers per step")
    draft.add_argument("--lr", type=float, default=DraftConfig.lr)
    vocab = sub.add_parser("vocabulary", help="(re)write the drafting vocabulary beside trained weights in --out")
    _data_args(vocab, "mtp-heads")
    corpus = sub.add_parser("corpus", help="only self-distil the real prompts (resumable shards)")
    _corpus_args(corpus)
    corpus.add_argument("--split", default="train", choices=SPLITS)
    corpus.add_argument("--answers-only", action="store_true",
                        help="only generate the answers into --answers-dir (the slow part; commit them), no shards")
    selfp = sub.add_parser("self-prompts", help="the target writes requests itself (Magpie) into self_prompts.jsonl")
    selfp.add_argument("--model", default="embedded", help="preset name or local folder of the target")
    selfp.add_argument("--count", type=int, default=SelfPromptConfig.count, help="requests the file is extended to")
    selfp.add_argument("--data-batch", type=int, default=SelfPromptConfig.batch_size, help="requests sampled together")
    selfp.add_argument("--seed", type=int, default=0)
    selfp.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    selfp.add_argument("--quiet", action="store_true", help="no progress bars")
    tasks = sub.add_parser("task-prompts", help="requests about a text (summarize, passages + question), made from "
                           "the committed answers, into task_prompts.jsonl")
    tasks.add_argument("--model", default="embedded", help="preset name or local folder of the target")
    tasks.add_argument("--count", type=int, default=800, help="requests written (half of each kind)")
    tasks.add_argument("--seed", type=int, default=0)
    tasks.add_argument("--from-self", type=int, default=0,
                       help="texts from the answers to the first N self-written requests only (0: all)")
    tasks.add_argument("--answers-dir", default=str(ANSWERS_DIR), help="the answers read")
    tasks.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    module = sub.add_parser("mtp-module", help="train the DeepSeek-style MTP module")
    _corpus_args(module)
    module.add_argument("--out", default=str(WEIGHTS_DIR / "mtp-module"), help="folder for weights + card.json")
    module.add_argument("--heldout", type=int, default=160, help="held-out train prompts answered for the card")
    module.add_argument("--spec-bench", type=int, default=120, help="Spec-Bench dev questions answered for the card")
    module.add_argument("--self-prompts", type=int, default=0,
                        help="also train on this many requests the target wrote itself (self_prompts.jsonl)")
    module.add_argument("--task-prompts", type=int, default=0,
                        help="also train on this many requests about a text (task_prompts.jsonl)")
    module.add_argument("--layers", type=int, default=ModuleConfig.layers)
    module.add_argument("--depths", type=int, default=ModuleConfig.depths)
    module.add_argument("--steps", type=int, default=ModuleConfig.steps)
    module.add_argument("--batch-positions", type=int, default=ModuleConfig.batch_positions)
    module.add_argument("--lr", type=float, default=ModuleConfig.lr)
    module.add_argument("--minutes", type=float, default=0.0,
                        help="a training time budget: the first steps are timed and --steps set to fit it")
    module.add_argument("--init", default="",
                        help="start from this trained module's weights (a folder or a shipped name, e.g. mtp-module)")
    return parser


def _corpus_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="embedded", help="preset name or local folder of the target")
    p.add_argument("--prompts", type=int, default=CorpusConfig.prompts, help="train prompts answered (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=CorpusConfig.max_new_tokens, help="answer length cap")
    p.add_argument("--data-batch", type=int, default=CorpusConfig.batch_size, help="prompts answered together")
    p.add_argument("--dtype", default="bfloat16", help="the target's dtype while answering")
    p.add_argument("--teacher-dtype", default="auto", choices=TEACHER_DTYPES,
                   help="the target's dtype in the teacher-forced pass whose hidden states and logits the module "
                        "learns from (auto: the answers' dtype, float32 where this CPU emulates bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-layers", type=_layers, default=None, metavar="I,J,...",
                   help="also keep the target's hidden states after this many decoder layers (EAGLE-3's fused features; "
                        "the module then fuses them into depth 1's input). Default: those of the --init module, else none")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--answers-dir", default=str(ANSWERS_DIR),
                   help="where the target's answers are kept and reused (committed; 'none': only in the shards)")


def _layers(text: str) -> tuple[int, ...]:
    """--feature-layers: comma-separated layer numbers, ascending, no repeats.

    >>> _layers("2,15,27"), _layers("")
    ((2, 15, 27), ())
    """
    try:
        layers = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"feature layers are comma-separated numbers (got {text!r})") from None
    if list(layers) != sorted(set(layers)) or any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"feature layers are ascending, distinct and >= 0 (got {text!r})")
    return layers


def _answers_dir(args: argparse.Namespace) -> Path | None:
    return None if args.answers_dir == "none" else Path(args.answers_dir)


def _splits(target, answerer, base: CorpusConfig, counts: dict[str, int], args: argparse.Namespace) -> dict[str, list]:
    """The corpus's sequences of each split asked for (built, or read from the cache)."""
    data = {}
    for split, n in counts.items():
        if split in ("self", "tasks") and not n:
            data[split] = []
            continue
        cfg = CorpusConfig(**{**base.__dict__, "split": split, "prompts": n})
        data[split] = load_corpus(build_corpus(target, cfg, not getattr(args, "quiet", False), _answers_dir(args),
                                               answerer=answerer))
    return data


def _dtypes(teacher, answerer) -> dict:
    return {"answer_dtype": str(answerer.dtype).removeprefix("torch."), "teacher_dtype": str(teacher.dtype).removeprefix("torch.")}


def _prompt_files(args: argparse.Namespace) -> str:
    return " + ".join(["engine/train/train_prompts.jsonl"] + (["engine/train/self_prompts.jsonl"] if args.self_prompts else [])
                      + (["engine/train/task_prompts.jsonl"] if args.task_prompts else []))


def _corpus_dataset(args: argparse.Namespace) -> Dataset:
    """The heads' and the draft model's data from the MTP module's corpus (answer rows only)."""
    teacher, answerer = corpus_models(args.model, "bfloat16")
    base = CorpusConfig(prompts=args.corpus, seed=args.seed)
    data = _splits(teacher, answerer, base, {"train": args.corpus, "self": args.self_prompts, "tasks": args.task_prompts,
                                             "heldout": args.heldout}, args)
    train = data["train"] + data["self"] + data["tasks"]
    info = {"model": teacher.spec, "prompts_file": _prompt_files(args), "corpus": corpus_dir(teacher, base, answerer).name,
            **_dtypes(teacher, answerer), "settings": {**base.__dict__, "split": None},
            "sources": corpus_stats(train)["sources"]}
    return Dataset(answer_examples(train, "train") + answer_examples(data["heldout"], "heldout"), info)


def _feature_layers(args: argparse.Namespace) -> tuple[int, ...]:
    """--feature-layers as given, else the warm start's own (a fused module trains on as one)."""
    if args.feature_layers is not None:
        return args.feature_layers
    if getattr(args, "init", ""):
        return tuple(read_card(resolve_weights(args.init), MODULE_KIND).get("feature_layers", ()))
    return ()


def _corpus_main(args: argparse.Namespace, argv: list[str]) -> int:
    feature_layers = _feature_layers(args)
    base = CorpusConfig(prompts=args.prompts, max_new_tokens=args.max_new_tokens, batch_size=args.data_batch,
                        seed=args.seed, feature_layers=feature_layers)
    progress = not args.quiet
    if args.command == "corpus" and args.answers_only:
        answerer = load_model(args.model, device="cpu", dtype=args.dtype, kernels="stock")  # batched: stock kernels
        cfg = CorpusConfig(**{**base.__dict__, "split": args.split})
        build_corpus(answerer, cfg, progress, _answers_dir(args), answers_only=True)
        print(f"answers of {cfg.prompts or 'all'} {args.split} prompts in {_answers_dir(args)}")
        return 0
    target, answerer = corpus_models(args.model, args.dtype, args.teacher_dtype)
    if args.command == "corpus":
        cfg = CorpusConfig(**{**base.__dict__, "split": args.split})
        seqs = load_corpus(build_corpus(target, cfg, progress, _answers_dir(args), answerer=answerer))
        print(f"{corpus_dir(target, cfg, answerer)}: {len(seqs)} {args.split} sequences, "
              f"{sum(s.answer_len for s in seqs)} answer positions")
        return 0
    data = _splits(target, answerer, base, {"train": base.prompts, "self": args.self_prompts, "tasks": args.task_prompts,
                                            "heldout": args.heldout, "spec-bench": args.spec_bench}, args)
    info = {"prompts_file": _prompt_files(args), "corpus": corpus_dir(target, base, answerer).name,
            **_dtypes(target, answerer), "settings": {**base.__dict__, "split": None}}
    cfg = ModuleConfig(layers=args.layers, depths=args.depths, steps=args.steps, batch_positions=args.batch_positions,
                       lr=args.lr, seed=args.seed, minutes=args.minutes, feature_layers=feature_layers,
                       init=str(resolve_weights(args.init)) if args.init else "")
    evals = {name: data[split] for name, split in (("heldout", "heldout"), ("spec_bench", "spec-bench")) if data[split]}
    card = train_module(target, data["train"] + data["self"] + data["tasks"], evals, cfg, Path(args.out), "python -m engine.train " + " ".join(argv),
                        info, progress)
    print(f"wrote {args.out}: " + json.dumps(card["evaluation"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.command == "prompts":
        print(f"wrote {write_prompts()} prompts to {PROMPTS_FILE}")
        return 0
    os.environ.setdefault("SPECLAB_ALLOW_ANY_MODEL", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.command == "self-prompts":
        try:
            target = load_model(args.model, device="cpu", dtype="bfloat16", kernels="stock")  # batched: stock kernels
            cfg = SelfPromptConfig(count=args.count, batch_size=args.data_batch, seed=args.seed)
            print(f"{SELF_PROMPTS}: " + json.dumps(build_self_prompts(target, cfg, progress=not args.quiet)))
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "task-prompts":
        try:
            target = load_model(args.model, device="cpu", dtype="bfloat16", kernels="stock")
            print(f"{TASK_PROMPTS}: " + json.dumps(build_task_prompts(target, args.count, Path(args.answers_dir), args.seed,
                                                                             from_self=args.from_self)))
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command in ("corpus", "mtp-module"):
        try:
            return _corpus_main(args, argv)
        except InputError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    try:
        begin = time.perf_counter()
        if getattr(args, "corpus", 0):
            data = _corpus_dataset(args)
            target = load_model(args.model, device="cpu", dtype="float32")  # training copies float32 layers, LM head
        else:
            target = load_model(args.model, device="cpu", dtype="float32")
            data = build_dataset(target, DataConfig(args.max_new_tokens, args.data_batch, limit=args.limit), Path(args.prompts))
        data.info["load_s"] = round(time.perf_counter() - begin, 1)
        command = "python -m engine.train " + " ".join(argv)
        if args.command == "data":
            print(f"{data.info['prompts']} answers, {data.tokens('train')} train and {data.tokens('heldout')} "
                  f"held-out positions")
            return 0
        if args.command == "vocabulary":
            entry = write_vocabulary(Path(args.out), answered(data.split("train")), answered(data.split("heldout")), target.vocab_size,
                                     command)
            print(f"wrote {Path(args.out) / entry['file']}: {entry['tokens']} tokens, held-out coverage "
                  f"{entry['heldout_coverage']} ({entry['heldout_coverage_with_context']} with the request's own tokens)")
            return 0
        if args.command == "mtp-heads":
            cfg = HeadsConfig(heads=args.heads, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                              minutes=args.minutes)
            card = train_heads(target, data, cfg, Path(args.out), command)
        else:
            cfg = DraftConfig(layers=args.layers, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                              minutes=args.minutes)
            card = train_draft(target, data, cfg, Path(args.out), command)
    except InputError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}: held-out {card['heldout']}")
    return 0


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    sys.exit(main())
