"""Load and validate the lessons: YAML files -> frozen records, or a list of problems.

The validator is the loader run to the end: every field of every file is checked and every
problem is reported as one line naming the file and the place, instead of stopping at the first.
Numeric answers are never typed: a numeric question names an engine.metrics formula and its
arguments, and the answer is computed here. Once every file is valid, the course as a whole is
checked: no question uses a concept before a lesson teaches it (lessons.concepts), and the
options' shuffle hides where the correct one is (lessons.shuffle).
"""

from __future__ import annotations

import collections.abc
import inspect
import math
import re
import string
import typing
from pathlib import Path

import yaml

from engine import metrics
from engine.acceptance import AcceptRule
from engine.decoding import MAX_K, MAX_NEW_TOKENS
from engine.drafters import drafter_names
from engine.errors import InputError
from engine.models import DTYPE_CHOICES
from engine.run import MAX_PROMPT_CHARS
from lessons.concepts import concept_problems
from lessons.model import (
    POLICIES,
    SCENARIOS,
    Choice,
    ChoiceQuestion,
    ChunkedPrefillPreset,
    Lesson,
    NumericQuestion,
    PlaygroundPreset,
    Preset,
    Question,
    Source,
    Target,
)
from lessons.shuffle import shuffle_problems

LESSONS_DIR = Path(__file__).parent
CONTENT_DIR = LESSONS_DIR / "content"
SOURCES_FILE = LESSONS_DIR / "sources.yaml"

FORMULAS = ("expected_tokens_per_step", "predicted_speedup", "percentile", "verify_cost", "reusable_prefix_tokens",
            "prefill_cost", "prefill_chunks")  # engine.metrics, by name
ARG_RANGES = {"a": (0.0, 1.0), "k": (0, MAX_K), "c": (0.0, math.inf), "q": (0.0, 100.0), "verify_cost": (0.5, 50.0),
              "tokens": (1, MAX_K + 1), "prompt_tokens": (1, 10**6), "shared_tokens": (0, 10**6),
              "block_size": (1, 1024), "requested_tokens": (1, 10**7), "reused_tokens": (0, 10**7),
              "chunk_size": (1, 10**5)}
MIN_QUESTIONS = 5
MAX_CHOICES = 6
MAX_CHUNK_SIZE = 8192  # the embedded model's context
SLUG = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")
FORMAT_FIELD = string.Formatter()


class LessonError(ValueError):
    """Lessons that do not validate; .problems holds one line per problem."""

    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


class _Fields:
    """One mapping of a lesson file, read field by field; problems are noted, not raised."""

    def __init__(self, data: object, where: str, problems: list[str], allowed: tuple[str, ...]):
        self.where = where
        self.problems = problems
        if not isinstance(data, dict):
            self.problem(f"expected a mapping, got {type(data).__name__}")
            data = {}
        unknown = sorted(str(key) for key in data if key not in allowed)
        if unknown:
            self.problem(f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(allowed)})")
        self.data = data

    def problem(self, message: str) -> None:
        self.problems.append(f"{self.where}: {message}")

    def text(self, key: str) -> str:
        value = self.data.get(key)
        if not isinstance(value, str) or not value.strip():
            self.problem(f"{key} must be non-empty text")
            return ""
        return value.strip()

    def integer(self, key: str, lo: int, hi: int | float, default: int | None = None) -> int:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            self.problem(f"{key} must be an integer in {lo}..{hi} (got {value!r})")
            return lo
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.problem(f"{key} must be a number (got {value!r})")
            return 0.0
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            self.problem(f"{key} must be true or false (got {value!r})")
            return default
        return value

    def items(self, key: str) -> list:
        value = self.data.get(key)
        if not isinstance(value, list) or not value:
            self.problem(f"{key} must be a non-empty list")
            return []
        return value

    def concepts(self, key: str) -> tuple[str, ...]:
        """A non-empty list of distinct concept ids, e.g. [kv-cache, ttft]."""
        items = self.items(key)
        bad = [c for c in items if not isinstance(c, str) or not SLUG.fullmatch(c)]
        if bad:
            self.problem(f"{key}: concept ids must be lower-case words joined by '-' (got {', '.join(map(repr, bad))})")
        dups = sorted({c for c in items if isinstance(c, str) and items.count(c) > 1})
        if dups:
            self.problem(f"{key}: {', '.join(map(repr, dups))} listed twice")
        return tuple(c for c in items if isinstance(c, str))


def load_sources(path: Path = SOURCES_FILE) -> dict[str, Source]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    return {key: Source(key, **fields) for key, fields in data.items()}


def _choice(data: object, where: str, problems: list[str]) -> Choice:
    f = _Fields(data, where, problems, ("text", "correct", "explanation"))
    return Choice(f.text("text"), f.flag("correct", False), f.text("explanation"))


def _choice_question(f: _Fields, qid: str) -> ChoiceQuestion:
    items = f.items("choices")
    choices = tuple(_choice(c, f"{f.where}: choices[{i}]", f.problems) for i, c in enumerate(items))
    if items and not 2 <= len(choices) <= MAX_CHOICES:
        f.problem(f"needs 2..{MAX_CHOICES} choices (has {len(choices)})")
    n_correct = sum(c.correct for c in choices)
    if items and n_correct != 1:
        f.problem(f"{n_correct} choices are marked correct; exactly one must be")
    texts = [c.text for c in choices]
    if len(set(texts)) != len(texts):
        f.problem("two choices have the same text")
    return ChoiceQuestion(qid, f.text("prompt"), choices, f.concepts("uses"))


def _check_arg(fn_name: str, name: str, value: object, hint: object, f: _Fields) -> float | int | tuple[float, ...]:
    """An argument of a formula, checked against the function's annotation and a sane range."""

    def is_number(v: object) -> bool:
        return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)

    if hint is int:
        ok, wanted = is_number(value) and isinstance(value, int), "an integer"
    elif hint is float:
        ok, wanted = is_number(value), "a number"
    elif typing.get_origin(hint) is collections.abc.Sequence:
        ok = isinstance(value, list) and bool(value) and all(is_number(v) for v in value)
        wanted = "a non-empty list of numbers"
    else:
        f.problem(f"{fn_name}: argument {name} has a type the loader cannot check ({hint})")
        return 0
    if not ok:
        f.problem(f"{fn_name}: argument {name} must be {wanted} (got {value!r})")
        return 0
    if isinstance(value, list):
        return tuple(float(v) for v in value)
    lo, hi = ARG_RANGES.get(name, (-math.inf, math.inf))
    if not lo <= value <= hi:
        f.problem(f"{fn_name}: argument {name} = {value} is outside {lo}..{hi}")
    return value


def _compute(f: _Fields) -> tuple[str, tuple, float | None]:
    """formula name, checked args, and the answer computed by engine.metrics (None if unusable)."""
    name = f.data.get("formula")
    if name not in FORMULAS:
        f.problem(f"formula must be one of {', '.join(FORMULAS)} (got {name!r})")
        return str(name), (), None
    fn = getattr(metrics, name)
    raw = f.data.get("args")
    if not isinstance(raw, dict):
        f.problem(f"args must be a mapping of {name}'s arguments")
        return name, (), None
    try:
        inspect.signature(fn).bind(**raw)
    except TypeError as err:
        f.problem(f"args do not fit {name}{inspect.signature(fn)}: {err}")
        return name, (), None
    hints = typing.get_type_hints(fn)
    n_before = len(f.problems)
    args = tuple((key, _check_arg(name, key, value, hints[key], f)) for key, value in raw.items())
    if len(f.problems) > n_before:
        return name, args, None
    answer = fn(**{key: list(v) if isinstance(v, tuple) else v for key, v in args})
    if not isinstance(answer, (int, float)) or not math.isfinite(answer):
        f.problem(f"{name} gives no finite number for these args (got {answer!r})")
        return name, args, None
    return name, args, float(answer)


def _given(value: float | int | tuple[float, ...]) -> str:
    """A given as the prompt shows it.

    >>> _given(0.8), _given(4), _given((20.0, 480.0))
    ('0.8', '4', '20, 480')
    """
    if isinstance(value, tuple):
        return ", ".join(f"{v:g}" for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def _fill(key: str, args: tuple, f: _Fields, every_given: bool) -> str:
    """Text with {name} replaced by each given, so the words and the computed answer never
    disagree; the prompt must state every given."""
    template = f.text(key)
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in FORMAT_FIELD.parse(template) if name is not None]
    except ValueError as err:
        f.problem(f"{key} is not a valid template: {err}")
        return template
    given = {name: _given(value) for name, value in args}
    for name, spec, conv in fields:
        if name not in given or spec or conv:
            f.problem(f"{key} placeholder {{{name}}} must be a bare name of an arg ({', '.join(given)})")
            return template
    missing = set(given) - {name for name, _, _ in fields}
    if every_given and missing:
        f.problem(f"{key} must state every given; add {', '.join('{' + m + '}' for m in sorted(missing))}")
    return template.format_map(given)


def _numeric_question(f: _Fields, qid: str) -> NumericQuestion:
    name, args, answer = _compute(f)
    if "answer" in f.data:
        computed = "" if answer is None else f" (the formula gives {answer:.6g})"
        f.problem(f"typed answer {f.data['answer']!r}: numeric answers are computed from the formula{computed}; remove it")
    tolerance = f.number("tolerance")
    if tolerance <= 0:
        f.problem("tolerance must be > 0")
    elif answer is not None and tolerance > max(0.05 * abs(answer), 0.05):
        f.problem(f"tolerance {tolerance} is too loose for the answer {answer:.6g} (at most 5%)")
    prompt = _fill("prompt", args, f, every_given=True)
    explanation = _fill("explanation", args, f, every_given=False)
    return NumericQuestion(qid, prompt, name, args, answer if answer is not None else math.nan, tolerance, explanation,
                           f.concepts("uses"))


def _question(data: object, where: str, problems: list[str]) -> Question | None:
    kind = data.get("kind") if isinstance(data, dict) else None
    if kind == "choice":
        f = _Fields(data, where, problems, ("id", "kind", "prompt", "choices", "uses"))
    elif kind == "numeric":
        f = _Fields(data, where, problems,
                    ("id", "kind", "prompt", "formula", "args", "tolerance", "explanation", "answer", "uses"))
    else:
        problems.append(f"{where}: kind must be choice or numeric (got {kind!r})")
        return None
    qid = f.text("id")
    if qid and not SLUG.fullmatch(qid):
        f.problem(f"id {qid!r} must be lower-case words joined by '-'")
    return _choice_question(f, qid) if kind == "choice" else _numeric_question(f, qid)


def _playground(f: _Fields, label: str, look_for: str) -> PlaygroundPreset:
    methods = ("baseline", *drafter_names())
    method = f.text("method")
    if method and method not in methods:
        f.problem(f"method {method!r} is not one of {', '.join(methods)}")
    prompt = f.text("prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        f.problem(f"prompt is longer than {MAX_PROMPT_CHARS} characters")
    rule = f.data.get("rule", AcceptRule.EXACT.value)
    if not isinstance(rule, str) or rule not in {r.value for r in AcceptRule}:
        f.problem(f"rule must be one of {', '.join(r.value for r in AcceptRule)} (got {rule!r})")
        rule = AcceptRule.EXACT.value
    dtype = f.data.get("dtype", "auto")
    if dtype not in DTYPE_CHOICES:
        f.problem(f"dtype must be one of {', '.join(DTYPE_CHOICES)} (got {dtype!r})")
        dtype = "auto"
    preset = PlaygroundPreset(
        label=label,
        look_for=look_for,
        method=method,
        prompt=prompt,
        k=f.integer("k", 1, MAX_K, default=4),
        adaptive=f.flag("adaptive", False),
        fit_k=f.flag("fit_k", False),
        temperature=f.number("temperature", default=0.0),
        seed=f.integer("seed", 0, 2**63 - 1, default=0),
        max_new_tokens=f.integer("max_new_tokens", 1, MAX_NEW_TOKENS, default=64),
        rule=AcceptRule(rule),
        dtype=dtype,
    )
    try:
        preset.decode_config()
    except InputError as err:
        f.problem(str(err))
    return preset


def _chunked_prefill(f: _Fields, label: str, look_for: str) -> ChunkedPrefillPreset:
    scenario = f.text("scenario")
    if scenario and scenario not in SCENARIOS:
        f.problem(f"scenario {scenario!r} is not one of {', '.join(SCENARIOS)}")
    policy = f.text("policy")
    if policy and policy not in POLICIES:
        f.problem(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
    chunk_size = None
    if policy == "none":
        if "chunk_size" in f.data:
            f.problem("policy none prefills each prompt in one step; remove chunk_size")
    else:
        chunk_size = f.integer("chunk_size", 1, MAX_CHUNK_SIZE)
    return ChunkedPrefillPreset(label, look_for, scenario, policy, chunk_size, f.flag("prefix_cache", False))


def _preset(data: object, where: str, problems: list[str]) -> Preset | None:
    f = _Fields(data, where, problems, ("label", "look_for", "target", "settings"))
    label, look_for = f.text("label"), f.text("look_for")
    target = f.data.get("target")
    if target == Target.PLAYGROUND.value:
        allowed = ("method", "prompt", "k", "adaptive", "temperature", "seed", "max_new_tokens", "rule", "dtype", "fit_k")
        return _playground(_Fields(f.data.get("settings"), f"{where}: settings", problems, allowed), label, look_for)
    if target == Target.CHUNKED_PREFILL.value:
        allowed = ("scenario", "policy", "chunk_size", "prefix_cache")
        return _chunked_prefill(_Fields(f.data.get("settings"), f"{where}: settings", problems, allowed), label, look_for)
    f.problem(f"target must be {' or '.join(t.value for t in Target)} (got {target!r})")
    return None


def _sources(f: _Fields, body: str, known: dict[str, Source]) -> tuple[Source, ...]:
    body = " ".join(body.split())  # a citation may wrap across lines
    found = []
    for key in f.items("sources"):
        source = known.get(key) if isinstance(key, str) else None
        if source is None:
            f.problem(f"unknown source {key!r} (see {SOURCES_FILE.name})")
        elif source.cite not in body:
            f.problem(f"source {key!r} is listed but the body never cites it as {source.cite!r}")
        else:
            found.append(source)
    return tuple(found)


def _parse_lesson(data: object, where: str, problems: list[str], sources: dict[str, Source]) -> Lesson | None:
    """One lesson from its parsed YAML; appends every problem found to `problems`."""
    n_before = len(problems)
    allowed = ("id", "title", "order", "summary", "teaches", "body", "sources", "questions", "try_it")
    f = _Fields(data, where, problems, allowed)
    lesson_id = f.text("id")
    if lesson_id and not SLUG.fullmatch(lesson_id):
        f.problem(f"id {lesson_id!r} must be lower-case words joined by '-'")
    body = f.text("body")
    raw_questions = f.items("questions")
    questions = tuple(_question(q, f"{where}: questions[{i}]", problems) for i, q in enumerate(raw_questions))
    if len(raw_questions) < MIN_QUESTIONS:
        f.problem(f"needs at least {MIN_QUESTIONS} questions (has {len(raw_questions)})")
    ids = [q.id for q in questions if q is not None]
    for dup in sorted({i for i in ids if ids.count(i) > 1}):
        f.problem(f"question id {dup!r} is used twice")
    presets = tuple(_preset(p, f"{where}: try_it[{i}]", problems) for i, p in enumerate(f.items("try_it")))
    lesson = Lesson(
        id=lesson_id,
        title=f.text("title"),
        order=f.integer("order", 1, 1000),
        summary=f.text("summary"),
        teaches=f.concepts("teaches"),
        body=body,
        sources=_sources(f, body, sources),
        questions=tuple(q for q in questions if q is not None),
        try_it=tuple(p for p in presets if p is not None),
    )
    return lesson if len(problems) == n_before else None


def lesson_problems(data: object, where: str = "lesson") -> list[str]:
    """Every problem of one lesson given as parsed YAML (an empty list: it is valid)."""
    problems: list[str] = []
    _parse_lesson(data, where, problems, load_sources())
    return problems


def _load_all(folder: Path) -> tuple[list[Lesson], list[str]]:
    problems: list[str] = []
    sources = load_sources()
    files = sorted(folder.glob("*.yaml"))
    if not files:
        problems.append(f"{folder}: no lesson files (*.yaml)")
    lessons = []
    for path in files:
        where = f"{folder.name}/{path.name}"
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as err:
            problems.append(f"{where}: not valid YAML: {' '.join(str(err).split())}")
            continue
        lesson = _parse_lesson(data, where, problems, sources)
        if lesson is not None:
            lessons.append(lesson)
    for attr in ("id", "order"):
        values = [getattr(lesson, attr) for lesson in lessons]
        for dup in sorted({v for v in values if values.count(v) > 1}):
            problems.append(f"{folder}: lesson {attr} {dup!r} is used by more than one lesson")
    if not problems:  # the course as a whole; with a file missing, its concepts would look untaught
        problems += [f"{folder.name}: {p}" for p in concept_problems(lessons) + shuffle_problems(lessons)]
    return sorted(lessons, key=lambda lesson: lesson.order), problems


def validate(folder: Path = CONTENT_DIR) -> list[str]:
    """One line per problem in the lessons under `folder`; empty when all are valid."""
    return _load_all(folder)[1]


def load_lessons(folder: Path = CONTENT_DIR) -> tuple[Lesson, ...]:
    """All lessons, in course order; raises LessonError listing every problem."""
    lessons, problems = _load_all(folder)
    if problems:
        raise LessonError(problems)
    return tuple(lessons)
