"""Prompt sets as data: the built-in sets in prompts/ (chat, code, rewrite, long-qa), Spec-Bench
(`spec-bench`, or one category: `spec-bench:qa`), or a file.

A prompt set is YAML (or JSON, which YAML reads too):

    name: chat
    description: what the set stresses
    raw: false            # optional: skip the chat template
    prompts:
      - id: colors
        text: Name three colors.

`--prompts` takes set names and/or file paths, comma separated; "all" is every built-in YAML set.
Every field is checked; a bad one is refused with a one-line InputError naming it.

Spec-Bench (Xia et al. 2024, the field's standard speculative-decoding benchmark; its dev half,
240 questions, Apache-2.0, shipped in prompts/spec-bench.jsonl, see prompts/README.md) loads as
one set per category, named as in Spec-Bench's table: `spec-bench:mt_bench` (the first turn of
its 40 MT-bench questions, eight kinds interleaved so `--limit 8` takes one of each),
`spec-bench:translation`, `:summarization`, `:qa`, `:math_reasoning`, `:rag` (40 each).
`spec-bench` is all six; `--limit N` cuts each category to its first N. These prompts are for
benchmarking only: no trainer reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.errors import InputError

PROMPTS_DIR = Path(__file__).with_name("prompts")
SPEC_BENCH = "spec-bench"
SPEC_BENCH_FILE = PROMPTS_DIR / "spec-bench.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_CATEGORIES = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
MAX_FILE_BYTES = 2_000_000
MAX_PROMPTS = 200


@dataclass(frozen=True)
class Prompt:
    set: str
    id: str
    text: str
    raw: bool = False

    @property
    def key(self) -> str:
        """Unique across sets: "set/id"."""
        return f"{self.set}/{self.id}"


def builtin_sets() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in PROMPTS_DIR.glob("*.yaml")))


def spec_bench_sets() -> tuple[str, ...]:
    return tuple(f"{SPEC_BENCH}:{c}" for c in SPEC_BENCH_CATEGORIES)


def spec_bench(category: str) -> tuple[Prompt, ...]:
    """One Spec-Bench category as a prompt set named spec-bench:<category>; ids are Spec-Bench's
    question ids (MT-bench ones prefixed with their kind)."""
    if category not in SPEC_BENCH_CATEGORIES:
        raise InputError(f"unknown Spec-Bench category {category!r} (one of {', '.join(SPEC_BENCH_CATEGORIES)})")
    rows = [json.loads(line) for line in SPEC_BENCH_FILE.read_text(encoding="utf-8").split("\n") if line.strip()]
    name = f"{SPEC_BENCH}:{category}"
    if category != "mt_bench":
        return tuple(Prompt(name, str(r["question_id"]), r["turns"][0]) for r in rows if r["category"] == category)
    kinds = [[r for r in rows if r["category"] == kind] for kind in MT_BENCH]
    interleaved = [r for group in zip(*kinds) for r in group]  # one of each kind, then the next round
    return tuple(Prompt(name, f"{r['category']}-{r['question_id']}", r["turns"][0]) for r in interleaved)


def _load_file(path: Path) -> tuple[Prompt, ...]:
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise InputError(f"prompt set {str(path)!r} is larger than {MAX_FILE_BYTES} bytes")
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        raise InputError(f"cannot read prompt set {str(path)!r}: {err.__class__.__name__}") from None
    where = f"prompt set {str(path)!r}"
    if not isinstance(data, dict) or not isinstance(data.get("prompts"), list) or not data["prompts"]:
        raise InputError(f"{where} needs a non-empty list 'prompts'")
    name = data.get("name", path.stem)
    raw = data.get("raw", False)
    if not isinstance(name, str) or not name or not isinstance(raw, bool):
        raise InputError(f"{where}: 'name' must be a string and 'raw' true or false")
    if len(data["prompts"]) > MAX_PROMPTS:
        raise InputError(f"{where} has {len(data['prompts'])} prompts (limit {MAX_PROMPTS})")
    prompts = []
    for i, item in enumerate(data["prompts"]):
        if not isinstance(item, dict) or not isinstance(item.get("text"), str) or not item["text"].strip():
            raise InputError(f"{where}: prompts[{i}] needs a non-empty string 'text'")
        pid = item.get("id", str(i))
        if not isinstance(pid, (str, int)):
            raise InputError(f"{where}: prompts[{i}].id must be a string")
        prompts.append(Prompt(name, str(pid), item["text"], raw))
    if len({p.id for p in prompts}) != len(prompts):
        raise InputError(f"{where}: prompt ids must be unique")
    return tuple(prompts)


def load_prompts(spec: str, limit: int = 0) -> tuple[Prompt, ...]:
    """Prompts of the comma-separated sets or files in spec, each set cut to its first `limit`
    prompts (0: all)."""
    if not isinstance(limit, int) or limit < 0:
        raise InputError(f"limit must be >= 0 prompts per set (got {limit})")
    names = [s.strip() for s in spec.split(",") if s.strip()]
    if not names:
        raise InputError("no prompt set given")
    if names == ["all"]:
        names = list(builtin_sets())
    names = [n for name in names for n in (spec_bench_sets() if name == SPEC_BENCH else [name])]
    prompts: list[Prompt] = []
    for name in names:
        if name.startswith(SPEC_BENCH + ":"):
            loaded = spec_bench(name.removeprefix(SPEC_BENCH + ":"))
        else:
            path = PROMPTS_DIR / f"{name}.yaml" if name in builtin_sets() else Path(name)
            if not path.is_file():
                raise InputError(f"unknown prompt set {name!r} (built in: {', '.join(builtin_sets())}, "
                                 f"{SPEC_BENCH} or {SPEC_BENCH}:<category>, or a file)")
            loaded = _load_file(path)
        prompts.extend(loaded[:limit] if limit else loaded)
    if len({p.key for p in prompts}) != len(prompts):
        raise InputError("a prompt set is named twice")
    return tuple(prompts)
