"""The control for the MTP module's fused features (BENCHMARKS.md, "EAGLE-3's fused features"):
the same warm start, corpus, batch draws, steps and learning-rate schedule as the fused run

    python -m engine.train mtp-module --prompts 3000 --self-prompts 1200 --heldout 160 --spec-bench 120
        --minutes 35 --init BEFORE --lr 3e-4 --threads 2 --feature-layers 2,15,27

but a module without the fusion (it reads the target's final hidden state alone), so the two
cards' teacher-forced evaluations differ only by the fused features.

usage: .venv/bin/python tools/fused_control.py BEFORE STEPS OUT
  BEFORE: the module both runs started from (a folder with card.json); STEPS: the fused run's
  steps_run; OUT: where the control's weights and card go (not engine/weights).
Reads the corpus cache the fused run built (the same shards: the feature layers are stored
beside the final hidden states, which is all the control reads).
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SPECLAB_ALLOW_ANY_MODEL", "1")
from engine.train.__main__ import _splits  # noqa: E402
from engine.train.corpus import ANSWERS_DIR, CorpusConfig, corpus_dir, corpus_models  # noqa: E402
from engine.train.module import ModuleConfig, train_module  # noqa: E402

FEATURES = (2, 15, 27)

before, steps, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
torch.set_num_threads(2)
target, answerer = corpus_models("embedded", "bfloat16")
base = CorpusConfig(prompts=3000, feature_layers=FEATURES)
args = argparse.Namespace(quiet=True, answers_dir=str(ANSWERS_DIR))
data = _splits(target, answerer, base, {"train": 3000, "self": 1200, "tasks": 0, "heldout": 160, "spec-bench": 120}, args)
info = {"corpus": corpus_dir(target, base, answerer).name, "note": "control run: the fused run's corpus, no fusion"}
cfg = ModuleConfig(steps=steps, lr=3e-4, init=before)
card = train_module(target, data["train"] + data["self"] + data["tasks"], {"heldout": data["heldout"], "spec_bench": data["spec-bench"]},
                    cfg, out, "tools/fused_control.py " + " ".join(sys.argv[1:]), info)
print(json.dumps({k: card["evaluation"][k]["mean_acceptance_length_k4"] for k in card["evaluation"]}))
