"""The playground's scenario buttons and example prompts, as data (ui/scenarios.yaml, and the
Spec-Bench dev prompts the benchmarks use, grouped by category)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.bench.prompts import SPEC_BENCH_CATEGORIES, spec_bench
from engine.decoding import MAX_K
from engine.drafters import DrafterSpec, drafter_names
from engine.drafters.base import LOOKUP_DRAFTERS
from engine.errors import InputError

SCENARIOS_FILE = Path(__file__).with_name("scenarios.yaml")
EXAMPLES_PER_CATEGORY = 3
EXAMPLE_LABEL_CHARS = 70


@dataclass(frozen=True)
class Scenario:
    id: str
    label: str  # the button's text
    method: str
    k: int
    max_new_tokens: int
    temperature: float
    expect: str  # what the learner should see, shown when the button is pressed
    prompt: str
    # optional: the model drafters' confidence stop and prompt lookup first (0: off), and each
    # step's draft length fitted to this machine's verify curve (chains)
    draft_stop: float = 0.0
    lookup_first: int = 0
    fit_k: bool = False


OPTIONAL = ("draft_stop", "lookup_first", "fit_k")


def parse_scenarios(data: object, where: str = "scenarios") -> tuple[Scenario, ...]:
    """Scenarios from YAML data, every field checked (a bad one is refused, naming it)."""
    if not isinstance(data, dict) or not isinstance(data.get("scenarios"), list) or not data["scenarios"]:
        raise InputError(f"{where}: needs a non-empty list 'scenarios'")
    out = []
    for i, item in enumerate(data["scenarios"]):
        name = f"{where}[{i}]"
        required = [f for f in Scenario.__dataclass_fields__ if f not in OPTIONAL]
        if not isinstance(item, dict) or not set(required) <= set(item) <= set(Scenario.__dataclass_fields__):
            raise InputError(f"{name}: needs exactly the fields {', '.join(required)} (optional: {', '.join(OPTIONAL)})")
        if any(not isinstance(item[f], str) or not item[f].strip() for f in ("id", "label", "expect", "prompt")):
            raise InputError(f"{name}: id, label, expect and prompt must be non-empty strings")
        if item["method"] not in ("baseline", *drafter_names()):
            raise InputError(f"{name}: unknown method {item['method']!r}")
        if not isinstance(item["k"], int) or not 1 <= item["k"] <= MAX_K:
            raise InputError(f"{name}: k must be in 1..{MAX_K}")
        if not isinstance(item["max_new_tokens"], int) or item["max_new_tokens"] < 1:
            raise InputError(f"{name}: max_new_tokens must be a positive whole number")
        if not isinstance(item["temperature"], (int, float)) or item["temperature"] < 0:
            raise InputError(f"{name}: temperature must be >= 0")
        try:
            DrafterSpec(item["method"], draft_stop=item.get("draft_stop", 0.0), lookup_first=item.get("lookup_first", 0))
        except InputError as err:
            raise InputError(f"{name}: {err}") from None
        if not isinstance(item.get("fit_k", False), bool):
            raise InputError(f"{name}: fit_k must be true or false")
        if item.get("lookup_first") and item["method"] not in LOOKUP_DRAFTERS:
            raise InputError(f"{name}: lookup_first is for {', '.join(LOOKUP_DRAFTERS)}")
        out.append(Scenario(**{**item, "temperature": float(item["temperature"])}))
    if len({s.id for s in out}) != len(out):
        raise InputError(f"{where}: scenario ids must be unique")
    return tuple(out)


@functools.cache
def load_scenarios() -> tuple[Scenario, ...]:
    return parse_scenarios(yaml.safe_load(SCENARIOS_FILE.read_text(encoding="utf-8")), SCENARIOS_FILE.name)


@functools.cache
def spec_bench_examples() -> dict[str, str]:
    """Dropdown label -> prompt: the first few Spec-Bench dev questions of each category."""
    examples = {}
    for category in SPEC_BENCH_CATEGORIES:
        for prompt in spec_bench(category)[:EXAMPLES_PER_CATEGORY]:
            text = " ".join(prompt.text.split())
            short = text if len(text) <= EXAMPLE_LABEL_CHARS else text[:EXAMPLE_LABEL_CHARS - 1] + "…"
            examples[f"{category} · {short}"] = prompt.text
    return examples
