"""The records a lesson is made of: frozen dataclasses the loader builds from the YAML files.

A lesson is a markdown body citing its sources, quiz questions (multiple choice, or numeric
with the answer computed by an engine formula) and "try it" presets that open the playground
or the chunked-prefill tab with given settings. Concepts are data too: a lesson names the
concepts it teaches and a question the concepts it uses, so the course can be checked never to
ask about an idea before teaching it (lessons.concepts).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

from engine.acceptance import AcceptRule
from engine.decoding import DecodeConfig
from engine.drafters import DrafterSpec
from engine.run import RunRequest
from engine.sampling import SamplingConfig

# Workload scenarios and scheduling policies of the chunked-prefill tab (issue 5 uses these names).
SCENARIOS = ("doc-arrives", "poisson-mixed", "doc-questions", "shared-system-prompt")
POLICIES = ("none", "decode-first", "prefill-first")


@dataclass(frozen=True)
class Source:
    key: str
    cite: str  # the short form a lesson body uses, e.g. "Leviathan et al. 2023"
    reference: str  # authors, title, venue
    url: str


@dataclass(frozen=True)
class Choice:
    text: str
    correct: bool
    explanation: str  # shown when this choice is picked: why it is right or wrong


@dataclass(frozen=True)
class ChoiceQuestion:
    id: str
    prompt: str
    choices: tuple[Choice, ...]  # exactly one is correct; the learner sees them shuffled (lessons.shuffle)
    uses: tuple[str, ...]  # the concepts a learner needs to answer; each taught by this or an earlier lesson

    @property
    def correct_index(self) -> int:
        return next(i for i, c in enumerate(self.choices) if c.correct)


@dataclass(frozen=True)
class NumericQuestion:
    id: str
    prompt: str  # the givens filled in from args
    formula: str  # name of an engine.metrics function
    args: tuple[tuple[str, float | int | tuple[float, ...]], ...]
    answer: float  # engine.metrics.<formula>(**args), computed by the loader, never typed
    tolerance: float  # absolute
    explanation: str
    uses: tuple[str, ...]  # as ChoiceQuestion.uses


Question = ChoiceQuestion | NumericQuestion


class Target(str, Enum):
    PLAYGROUND = "playground"
    CHUNKED_PREFILL = "chunked-prefill"


@dataclass(frozen=True)
class PlaygroundPreset:
    """Opens the playground on the current model with these settings."""

    label: str
    look_for: str  # what the learner should see: the lesson's claim, shown live
    method: str  # "baseline" or a registered drafter
    prompt: str
    k: int = 4
    adaptive: bool = False
    temperature: float = 0.0
    seed: int = 0
    max_new_tokens: int = 64
    rule: AcceptRule = AcceptRule.EXACT
    dtype: str = "auto"  # the target's dtype (engine.models.choose_dtype); "float32" shows a climbing verify curve
    fit_k: bool = False  # each step's draft length fitted to this machine's verify curve (engine.draft_length)
    target: ClassVar[Target] = Target.PLAYGROUND

    def decode_config(self) -> DecodeConfig:
        """The engine's config for these settings; raises InputError where they are out of range."""
        return DecodeConfig(
            max_new_tokens=self.max_new_tokens,
            k=self.k,
            adaptive=self.adaptive,
            fit_k=self.fit_k,
            sampling=SamplingConfig(temperature=self.temperature, seed=self.seed),
            rule=self.rule,
        )

    def run_request(self, model: str) -> RunRequest:
        return RunRequest(self.prompt, model=model, decode=self.decode_config(), drafter=DrafterSpec(self.method),
                          dtype=self.dtype)


@dataclass(frozen=True)
class ChunkedPrefillPreset:
    """Opens the chunked-prefill tab on a built-in scenario with a policy and chunk size."""

    label: str
    look_for: str
    scenario: str  # one of SCENARIOS
    policy: str  # one of POLICIES
    chunk_size: int | None  # None for policy "none" (a prompt's prefill runs in one step)
    prefix_cache: bool = False  # setting A reuses cached prompt prefixes
    target: ClassVar[Target] = Target.CHUNKED_PREFILL


Preset = PlaygroundPreset | ChunkedPrefillPreset


@dataclass(frozen=True)
class Lesson:
    id: str
    title: str
    order: int  # position in the course, from 1
    summary: str  # one line for the lesson list
    teaches: tuple[str, ...]  # the concepts this lesson introduces (ids such as "kv-cache"); each is taught once
    body: str  # markdown
    sources: tuple[Source, ...]
    questions: tuple[Question, ...]
    try_it: tuple[Preset, ...]

    def question(self, question_id: str) -> Question:
        for q in self.questions:
            if q.id == question_id:
                return q
        raise KeyError(f"lesson {self.id!r} has no question {question_id!r}")

    def markdown(self) -> str:
        """The body followed by its list of sources."""
        refs = "\n".join(f"- {s.reference} <{s.url}>" for s in self.sources)
        return f"{self.body.rstrip()}\n\n### Sources\n\n{refs}\n"
