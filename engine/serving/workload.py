"""Workloads as data: which requests arrive when, with which prompt.

A workload file is JSON (the built-in scenarios in workloads/ are examples to copy):

    {"name": "doc-arrives", "description": "...", "raw": false, "ignore_eos": true,
     "max_new_tokens": 64,
     "requests": [{"request_id": "chat-0", "cls": "short", "arrival_s": 0.0,
                   "prompt": "Tell me a story.", "max_new_tokens": 64}, ...]}

- "prompt" is a string, or {"words": N, "start": S, "then": "..."}: N words of the shipped text
  (workloads/lighthouses.txt) from word S on, wrapping around, then the instruction "then" as
  its own paragraph. Prompts are built from shipped text only, so a workload means the same
  everywhere, offline.
- Instead of "requests" a file may give "poisson": seeded Poisson arrivals of mixed classes
  (see workloads/poisson-mixed.json); they expand to requests deterministically. A class may
  list "starts" (the text's first word is one of these: a few shared documents) and give "then"
  as a list (each request asks one of these).
- "system" (top level, or per request): the chat's system message, a string or {"words", ...}
  like a prompt; a long one every request shares is what prefix caching reuses.
- "raw": skip the chat template. "ignore_eos": every request runs to its max_new_tokens (as
  serving benchmarks do), so decode traffic lasts as long as the scenario says.
- A `serve --json` output is a workload too: its "workload" object lists every request with its
  arrival and literal prompt, so loading that file replays the recorded run's arrivals.

Every field is checked; a bad one is refused with a one-line InputError naming it.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from dataclasses import dataclass, replace
from pathlib import Path

from engine.decoding import MAX_NEW_TOKENS
from engine.errors import InputError
from engine.serving.records import RequestClass

WORKLOADS_DIR = Path(__file__).with_name("workloads")
SHIPPED_TEXT = WORKLOADS_DIR / "lighthouses.txt"
MAX_FILE_BYTES = 20_000_000
MAX_REQUESTS = 1000
MAX_WORDS = 20_000
MAX_ARRIVAL_S = 3600.0
DEFAULT_MAX_NEW_TOKENS = 32
CONTROLLED = "controlled benchmark"
REPLAY = "replay"


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    cls: RequestClass
    arrival_s: float  # seconds after the run starts
    prompt: str
    max_new_tokens: int
    system: str = ""  # the chat's system message (a prompt every request may share)


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: tuple[WorkloadRequest, ...]  # in arrival order
    raw: bool = False  # prompts skip the chat template
    ignore_eos: bool = False  # every request runs to its max_new_tokens
    evidence: str = CONTROLLED  # DESIGN.md's evidence class: "replay" for a recorded run's arrivals

    def to_jsonable(self) -> dict:
        """The workload file form (literal prompts), so a recorded run can be replayed."""
        return {
            "name": self.name,
            "description": self.description,
            "raw": self.raw,
            "ignore_eos": self.ignore_eos,
            "requests": [
                {"request_id": r.request_id, "cls": r.cls.value, "arrival_s": r.arrival_s, "prompt": r.prompt,
                 "max_new_tokens": r.max_new_tokens} | ({"system": r.system} if r.system else {})
                for r in self.requests
            ],
        }


def builtin_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOADS_DIR.glob("*.json"))


def load_workload(spec: str) -> Workload:
    """A built-in scenario by name, a workload file, or a recorded `serve --json` output."""
    if spec in builtin_workloads():
        path, label = WORKLOADS_DIR / f"{spec}.json", spec
    elif Path(spec).is_file():
        path, label = Path(spec), Path(spec).name
    else:
        raise InputError(f"unknown workload {spec!r}: use {', '.join(builtin_workloads())} or a JSON file")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise InputError(f"workload {label}: the file is larger than {MAX_FILE_BYTES // 1_000_000} MB")
    try:
        data = json.loads(path.read_bytes(), parse_constant=lambda name: _no_constant(label, name))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"workload {label}: not valid JSON ({str(err).splitlines()[0][:120]})") from None
    return parse_workload(data, label)


def parse_workload(data, label: str = "workload") -> Workload:
    """Validate a workload object (or a recorded run holding one) and expand its prompts."""
    if isinstance(data, dict) and "steps" in data and "workload" in data:
        return replace(_parse(data["workload"], f"workload {label}: workload."), evidence=REPLAY)
    return _parse(data, f"workload {label}: ")


def _parse(data, where: str) -> Workload:
    fields = _Fields(data, where, ("name", "description", "raw", "ignore_eos", "max_new_tokens", "system", "requests",
                                   "poisson"))
    default_max = fields.integer("max_new_tokens", 1, MAX_NEW_TOKENS, DEFAULT_MAX_NEW_TOKENS)
    system = _prompt(data["system"], f"{where}system") if "system" in data else ""
    if ("requests" in data) == ("poisson" in data):
        raise InputError(f"{where}give exactly one of requests or poisson")
    if "requests" in data:
        items = data["requests"]
        if not isinstance(items, list):
            raise InputError(f"{where}requests must be a list (got {type(items).__name__})")
        if not 1 <= len(items) <= MAX_REQUESTS:
            raise InputError(f"{where}requests must hold 1..{MAX_REQUESTS} requests (got {len(items)})")
        requests = [_request(item, i, f"{where}requests[{i}].", default_max, system) for i, item in enumerate(items)]
    else:
        requests = [replace(r, system=system) for r in _poisson(data["poisson"], f"{where}poisson.", default_max)]
    seen: set[str] = set()
    for i, r in enumerate(requests):
        if r.request_id in seen:
            raise InputError(f"{where}requests[{i}].request_id {r.request_id!r} is used twice")
        seen.add(r.request_id)
    return Workload(
        name=fields.string("name", "workload"),
        description=fields.string("description", ""),
        requests=tuple(sorted(requests, key=lambda r: r.arrival_s)),
        raw=fields.boolean("raw", False),
        ignore_eos=fields.boolean("ignore_eos", False),
    )


def _request(item, index: int, where: str, default_max: int, system: str = "") -> WorkloadRequest:
    fields = _Fields(item, where, ("request_id", "cls", "arrival_s", "prompt", "max_new_tokens", "system"))
    return WorkloadRequest(
        request_id=fields.string("request_id", f"r{index}", nonempty=True),
        cls=fields.cls("cls"),
        arrival_s=fields.number("arrival_s", 0.0, MAX_ARRIVAL_S),
        prompt=_prompt(fields.required("prompt"), where + "prompt"),
        max_new_tokens=fields.integer("max_new_tokens", 1, MAX_NEW_TOKENS, default_max),
        system=_prompt(item["system"], where + "system") if "system" in item else system,
    )


def _prompt(value, where: str) -> str:
    if isinstance(value, str):
        if not value.strip():
            raise InputError(f"{where} is empty")
        return value
    if not isinstance(value, dict):
        raise InputError(f"{where} must be a string or an object {{words, start, then}} (got {type(value).__name__})")
    fields = _Fields(value, where + ".", ("words", "start", "then"))
    return shipped_text(fields.integer("words", 1, MAX_WORDS), fields.integer("start", 0, 10**9, 0),
                        fields.string("then", ""))


def _poisson(value, where: str, default_max: int) -> list[WorkloadRequest]:
    fields = _Fields(value, where, ("seed", "rate_per_s", "count", "start_s", "classes"))
    seed = fields.integer("seed", 0, 2**63 - 1, 0)
    rate = fields.number("rate_per_s", 1e-3, 1e4)
    count = fields.integer("count", 1, MAX_REQUESTS)
    t = fields.number("start_s", 0.0, MAX_ARRIVAL_S, 0.0)
    specs = fields.required("classes")
    if not isinstance(specs, list) or not specs:
        raise InputError(f"{where}classes must be a non-empty list")
    classes = [_ClassSpec.parse(spec, f"{where}classes[{i}].", default_max) for i, spec in enumerate(specs)]
    rng = random.Random(seed)
    n_words = len(_words())
    requests = []
    for i in range(count):
        t += rng.expovariate(rate)
        spec = rng.choices(classes, weights=[c.weight for c in classes])[0]
        words = rng.randint(*spec.words)  # (draws in this order: recorded workloads keep their prompts)
        start = rng.choice(spec.starts) if spec.starts else rng.randrange(n_words)
        then = (rng.choice(spec.then) if len(spec.then) > 1 else spec.then[0]) if spec.then else ""
        prompt = shipped_text(words, start, then)
        arrival = min(round(t, 3), MAX_ARRIVAL_S)
        requests.append(WorkloadRequest(f"{spec.cls.value}-{i}", spec.cls, arrival, prompt, spec.max_new_tokens))
    return requests


@dataclass(frozen=True)
class _ClassSpec:
    cls: RequestClass
    weight: float
    words: tuple[int, int]  # prompt length range in words, inclusive
    then: tuple[str, ...]  # the instruction after the text: one of these (none: no instruction)
    max_new_tokens: int
    starts: tuple[int, ...] = ()  # where the text starts, one of these words (none: anywhere)

    @classmethod
    def parse(cls, value, where: str, default_max: int) -> _ClassSpec:
        fields = _Fields(value, where, ("cls", "weight", "words", "then", "max_new_tokens", "starts"))
        words = fields.required("words")
        if not (isinstance(words, list) and len(words) == 2 and all(_is_int(w) for w in words)
                and 1 <= words[0] <= words[1] <= MAX_WORDS):
            raise InputError(f"{where}words must be [min, max] with 1 <= min <= max <= {MAX_WORDS} (got {words!r})")
        then = value.get("then", "")
        if isinstance(then, list):  # several instructions: each request draws one (questions about a text)
            if not then or not all(isinstance(t, str) and t.strip() for t in then):
                raise InputError(f"{where}then must be a string or a non-empty list of non-empty strings")
            then = tuple(then)
        else:
            then = (fields.string("then", ""),) if then else ()
        starts = value.get("starts", [])
        if not (isinstance(starts, list) and all(_is_int(s) and 0 <= s < 10**9 for s in starts)):
            raise InputError(f"{where}starts must be a list of word offsets (got {starts!r:.60})")
        return cls(fields.cls("cls"), fields.number("weight", 1e-9, 1e9, 1.0), (words[0], words[1]), then,
                   fields.integer("max_new_tokens", 1, MAX_NEW_TOKENS, default_max), tuple(starts))


@functools.cache
def _words() -> tuple[str, ...]:
    """The shipped text as words, each with the whitespace after it (paragraph breaks survive)."""
    return tuple(re.findall(r"\S+\s*", SHIPPED_TEXT.read_text(encoding="utf-8")))


def shipped_text(words: int, start: int = 0, then: str = "") -> str:
    """`words` words of the shipped text from word `start`, wrapping around, then `then`.

    >>> shipped_text(3)
    'A lighthouse is'
    >>> shipped_text(2, start=1, then="Go on.")
    'lighthouse is\\n\\nGo on.'
    """
    corpus = _words()
    text = "".join(corpus[(start + i) % len(corpus)] for i in range(words)).strip()
    return f"{text}\n\n{then}" if then else text


class _Fields:
    """Typed reads from one JSON object; any problem names the field."""

    _REQUIRED = object()

    def __init__(self, obj, where: str, allowed: tuple[str, ...]):
        if not isinstance(obj, dict):
            raise InputError(f"{where.rstrip('.: ') or 'workload'} must be an object (got {type(obj).__name__})")
        for key in obj:
            if key not in allowed:
                raise InputError(f"{where}{key} is not a field here (fields: {', '.join(allowed)})")
        self.obj, self.where = obj, where

    def required(self, key: str):
        if key not in self.obj:
            raise InputError(f"{self.where}{key} is missing")
        return self.obj[key]

    def _get(self, key: str, default):
        return self.required(key) if default is self._REQUIRED else self.obj.get(key, default)

    def _bad(self, key: str, rule: str):
        return InputError(f"{self.where}{key} must be {rule} (got {self.obj[key]!r:.60})")

    def integer(self, key: str, lo: int, hi: int, default=_REQUIRED) -> int:
        value = self._get(key, default)
        if not _is_int(value) or not lo <= value <= hi:
            raise self._bad(key, f"an integer in {lo}..{hi}")
        return value

    def number(self, key: str, lo: float, hi: float, default=_REQUIRED) -> float:
        value = self._get(key, default)
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or not lo <= value <= hi:
            raise self._bad(key, f"a number in {lo:g}..{hi:g}")
        return float(value)

    def string(self, key: str, default=_REQUIRED, nonempty: bool = False) -> str:
        value = self._get(key, default)
        if not isinstance(value, str) or (nonempty and not value.strip()):
            raise self._bad(key, "a non-empty string" if nonempty else "a string")
        return value

    def boolean(self, key: str, default=_REQUIRED) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false")
        return value

    def cls(self, key: str) -> RequestClass:
        value = self.required(key)
        try:
            return RequestClass(value)
        except ValueError:
            raise self._bad(key, " or ".join(repr(c.value) for c in RequestClass)) from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_constant(label: str, name: str):
    raise InputError(f"workload {label}: {name} is not a JSON number")
