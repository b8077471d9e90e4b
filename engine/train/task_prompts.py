"""Requests about a text, made from the target's own answers: the task formats that Spec-Bench's
summarization and retrieval (RAG) categories use - a long text, then a request about it - which
none of the real prompt sources (GSM8K, code, roleplay, seed tasks) nor the self-written
requests hold. Answers to such requests copy and condense the text they read, and a drafter
that has never seen one cannot have learned to copy from its context.

Built from the committed answers (engine/train/answers/) to the self-written requests (prose:
explanations, advice, essays; never the held-out rows, never Spec-Bench; the answers to GSM8K
and code prompts are worked sums and programs, not texts one summarizes), with Spec-Bench's own
request formats:

- "summarize": `Summarize: <text>`, the text one of the target's answers;
- "passages": three of the target's answers, one after another, then on a new line the request
  that one of them answered (a question: it ends with "?"), as Spec-Bench's RAG questions
  follow their retrieved passages.

`python -m engine.train task-prompts --count N [--from-self M]` writes engine/train/task_prompts.jsonl
(seeded, deterministic given the answers to the first M self-written requests; the shipped file:
`--count 800 --from-self 1205`); `mtp-module --task-prompts N` trains on the target's answers
to N of them (split "tasks"). A request sharing a 13-word run with a Spec-Bench question is
dropped (the benchmark stays unseen). The texts are the embedded SmolLM2's output (Apache-2.0)
on prompts under the licences in DATA.md.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from engine.errors import InputError
from engine.models import LoadedModel
from engine.train.self_prompts import _banned, _words, ngrams

TASK_PROMPTS = Path(__file__).with_name("task_prompts.jsonl")
MIN_WORDS = 40  # an answer shorter than this is too short to summarize or to retrieve from
PASSAGES = 3


def read_task_prompts(path: Path = TASK_PROMPTS) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


SHIPPED_FROM_SELF = 1205  # task_prompts.jsonl was made from the first 1,205 self-written requests (all there were then)


def answered_texts(target: LoadedModel, answers_dir: Path, from_self: int = 0) -> list[tuple[str, str, str]]:
    """(key, request, answer text) of every committed answer to a self-written request (of the
    first `from_self` of them; 0: all), in key order; answers under MIN_WORDS words are left out."""
    from engine.train.corpus import AnswerStore, CorpusConfig, read_split

    store = AnswerStore(answers_dir, target, CorpusConfig())
    rows = read_split("self")
    requests = {key: text for key, _, text in (rows[:from_self] if from_self else rows)}
    out = []
    for key in sorted(store.rows):
        if key not in requests:
            continue  # only the self-written requests' answers: never held-out rows, never Spec-Bench
        text = target.tokenizer.decode(store.rows[key]["answer"], skip_special_tokens=True).strip()
        if len(_words(text)) >= MIN_WORDS:
            out.append((key, requests[key].strip(), text))
    return out


def make_task_prompts(texts: list[tuple[str, str, str]], count: int, seed: int = 0) -> list[dict]:
    """count requests, half "summarize" and half "passages" (seeded draws from texts)."""
    questions = [i for i, (_, request, _) in enumerate(texts) if request.endswith("?") and "\n" not in request]
    if len(texts) < PASSAGES or not questions:
        raise InputError(f"task prompts need at least {PASSAGES} answers and one question among them; "
                         f"found {len(texts)} answers")
    rng = random.Random(f"tasks:{seed}")
    spec_grams, _ = _banned()
    rows: list[dict] = []
    seen: set[str] = set()
    for n in range(20 * count):
        if len(rows) >= count:
            break
        if n % 2 == 0:
            key, _, text = texts[rng.randrange(len(texts))]
            row = {"source": "task-summarize", "text": f"Summarize: {text}", "from": [key]}
        else:
            answer = rng.choice(questions)
            others = rng.sample([i for i in range(len(texts)) if i != answer], PASSAGES - 1)
            order = others + [answer]
            rng.shuffle(order)
            passages = " ".join(texts[i][2] for i in order)
            row = {"source": "task-passages", "text": f"{passages}\n{texts[answer][1]}",
                   "from": [texts[i][0] for i in order]}
        if row["text"] in seen or ngrams(row["text"]) & spec_grams:
            continue
        seen.add(row["text"])
        rows.append(row)
    return rows


def build_task_prompts(target: LoadedModel, count: int, answers_dir: Path, seed: int = 0,
                       path: Path = TASK_PROMPTS, from_self: int = 0) -> dict:
    texts = answered_texts(target, answers_dir, from_self)
    rows = make_task_prompts(texts, count, seed)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    kinds: dict[str, int] = {}
    for r in rows:
        kinds[r["source"]] = kinds.get(r["source"], 0) + 1
    return {"written": len(rows), "answers_read": len(texts), "sources": kinds}
