"""The shipped MTP module's data, as the probes in tools/ read it: the embedded target (stock
kernels, in the dtype training runs in: bfloat16, or float32 where this CPU emulates bfloat16)
and the corpus cache that
`python -m engine.train mtp-module --prompts 3000 --self-prompts 2800 --task-prompts 800` builds
(3,000 real prompts, 2,800 self-written requests, 800 task requests; held-out 160; Spec-Bench 120)."""
from pathlib import Path

import torch

from engine.train.corpus import corpus_models
from engine.train.corpus import CorpusConfig, build_corpus, load_corpus

ROOT = Path(__file__).resolve().parents[1]


def probe_data(n_train: int, seed: int = 1):
    """(target, train, evals, generator): a seeded draw of n_train training sequences (0: all),
    the held-out and Spec-Bench evaluation sets, and the generator after the draw."""
    torch.manual_seed(0)
    target, answerer = corpus_models("embedded", "bfloat16")  # the trainer's teacher: float32 where bfloat16 is emulated
    base = CorpusConfig(prompts=3000, seed=0)

    def split(name, n):
        cfg = CorpusConfig(**{**base.__dict__, "split": name, "prompts": n})
        return load_corpus(build_corpus(target, cfg, False, ROOT / "engine/train/answers", answerer=answerer))

    train_all = split("train", 3000) + split("self", 2800) + split("tasks", 800)
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(train_all), generator=g)[:n_train].tolist() if n_train else list(range(len(train_all)))
    train = [train_all[i] for i in pick]
    return target, train, {"heldout": split("heldout", 160), "spec_bench": split("spec-bench", 120)}, g


def draw(train, gen: torch.Generator, positions: int = 2048) -> list[int]:
    """Random training sequences (with replacement) until they hold `positions` positions."""
    order, total = [], 0
    while total < positions:
        i = int(torch.randint(0, len(train), (1,), generator=gen))
        order.append(i)
        total += int(train[i].ids.shape[0])
    return order


def optimise(opt: torch.optim.Optimizer, params: list, loss: torch.Tensor) -> None:
    """One optimiser step, gradients clipped to norm 1 as the trainer does."""
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
