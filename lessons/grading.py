"""Grading answers and keeping progress across lessons.

Progress is a plain JSON-serialisable dict, {"version": 1, "answers": {lesson_id: {question_id:
correct}}}, that the app keeps per browser session. Functions here return a new dict and never
change the one passed in; they read it defensively (a session may hand back anything) and count
only answers to questions that exist. The latest answer to a question is the one that counts, so a
retry replaces it; reset_lesson clears a lesson to start it again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engine.errors import InputError
from lessons.model import ChoiceQuestion, Lesson, NumericQuestion, Question

PROGRESS_VERSION = 1


@dataclass(frozen=True)
class Feedback:
    correct: bool
    explanation: str  # of the picked choice, or of the numeric question
    answer: str  # the correct answer as shown to the learner


@dataclass(frozen=True)
class Score:
    correct: int
    answered: int
    total: int

    @property
    def complete(self) -> bool:
        return self.answered == self.total


def parse_number(text: str | int | float) -> float:
    """A learner's numeric answer; a trailing "x" (as in "2.8x") is allowed.

    >>> parse_number(" 3.36 "), parse_number("2.8x"), parse_number(5)
    (3.36, 2.8, 5.0)
    """
    if isinstance(text, bool):
        raise InputError("enter a number")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        cleaned = str(text).strip().removesuffix("x").removesuffix("×").strip()
        try:
            value = float(cleaned)
        except ValueError:
            raise InputError(f"enter a number, e.g. 3.36 (got {str(text)[:40]!r})") from None
    if not math.isfinite(value):
        raise InputError("enter a finite number")
    return value


def format_number(value: float, tolerance: float) -> str:
    """The answer to as many decimals as the tolerance asks for.

    >>> format_number(3.3616, 0.01), format_number(434.2, 0.1), format_number(5.0, 1)
    ('3.36', '434.2', '5')
    """
    decimals = max(0, math.ceil(-math.log10(tolerance)))
    return f"{value:.{decimals}f}"


def choice_index(question: ChoiceQuestion, picked: object) -> int:
    """The index (in the lesson file) of the choice a learner picked, given by its text. The app
    shows each session the choices in its own order (lessons.shuffle), so it sends what was
    picked, never a position. Raises InputError when nothing, or no choice's text, was sent.

    >>> from lessons.model import Choice
    >>> q = ChoiceQuestion("q", "Which phase?", (Choice("Prefill", True, ""), Choice("Decode", False, "")), ())
    >>> choice_index(q, "Decode")
    1
    """
    for i, choice in enumerate(question.choices):
        if isinstance(picked, str) and picked == choice.text:
            return i
    raise InputError("pick one of the choices")


def grade(question: Question, given: int | float | str | None) -> Feedback:
    """Grade one answer: a choice index for a multiple-choice question, a number (or its text)
    for a numeric one. Raises InputError for an answer that is not one (nothing picked, not a
    number), so the app can ask again without counting it."""
    if isinstance(question, ChoiceQuestion):
        right = question.choices[question.correct_index]
        if isinstance(given, bool) or not isinstance(given, int) or not 0 <= given < len(question.choices):
            raise InputError("pick one of the choices")
        picked = question.choices[given]
        return Feedback(picked.correct, picked.explanation, right.text)
    assert isinstance(question, NumericQuestion)
    if given is None:
        raise InputError("enter a number")
    value = parse_number(given)
    correct = abs(value - question.answer) <= question.tolerance + 1e-12
    return Feedback(correct, question.explanation, format_number(question.answer, question.tolerance))


def new_progress() -> dict:
    return {"version": PROGRESS_VERSION, "answers": {}}


def _answers(progress: object) -> dict[str, dict[str, bool]]:
    """The well-formed part of a progress dict."""
    answers = progress.get("answers") if isinstance(progress, dict) else None
    if not isinstance(answers, dict):
        return {}
    return {
        lesson_id: {qid: ok for qid, ok in per_lesson.items() if isinstance(qid, str) and isinstance(ok, bool)}
        for lesson_id, per_lesson in answers.items()
        if isinstance(lesson_id, str) and isinstance(per_lesson, dict)
    }


def submit(progress: object, lesson: Lesson, question_id: str, given: int | float | str | None) -> tuple[Feedback, dict]:
    """Grade an answer and record it: (feedback, the new progress). Raises KeyError for an
    unknown question and InputError for an answer that is not one (nothing is recorded)."""
    feedback = grade(lesson.question(question_id), given)
    answers = _answers(progress)
    answers[lesson.id] = {**answers.get(lesson.id, {}), question_id: feedback.correct}
    return feedback, {"version": PROGRESS_VERSION, "answers": answers}


def is_answered(progress: object, lesson: Lesson, question_id: str) -> bool:
    """Whether this question already has an answer in the progress (the app then asks for a
    retry of the lesson instead of taking a second answer)."""
    return question_id in _answers(progress).get(lesson.id, {})


def reset_lesson(progress: object, lesson: Lesson) -> dict:
    """Progress with this lesson's answers cleared (retry the lesson)."""
    answers = _answers(progress)
    answers.pop(lesson.id, None)
    return {"version": PROGRESS_VERSION, "answers": answers}


def lesson_score(progress: object, lesson: Lesson) -> Score:
    mine = _answers(progress).get(lesson.id, {})
    results = [mine[q.id] for q in lesson.questions if q.id in mine]
    return Score(sum(results), len(results), len(lesson.questions))


def course_score(progress: object, lessons: Iterable[Lesson]) -> Score:
    scores = [lesson_score(progress, lesson) for lesson in lessons]
    return Score(sum(s.correct for s in scores), sum(s.answered for s in scores), sum(s.total for s in scores))
