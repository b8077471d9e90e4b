"""No question before its lesson: concepts as data, checked across the course.

Each lesson lists the concepts it `teaches` (short ids such as "kv-cache" or "speedup-formula")
and each question the concepts it `uses`. A question may use a concept taught by its own lesson
or an earlier one; a concept taught only later, or never, is a problem. Each concept is taught by
one lesson, the one that introduces it, so a later lesson that deepens it does not hide a too-early
question.
"""

from __future__ import annotations

from collections.abc import Sequence

from lessons.model import Lesson


def _name(lesson: Lesson) -> str:
    return f"lesson {lesson.order} ({lesson.id})"


def teachers(lessons: Sequence[Lesson]) -> dict[str, Lesson]:
    """Each concept -> the first lesson in course order that teaches it."""
    first: dict[str, Lesson] = {}
    for lesson in sorted(lessons, key=lambda lesson: lesson.order):
        for concept in lesson.teaches:
            first.setdefault(concept, lesson)
    return first


def concept_problems(lessons: Sequence[Lesson]) -> list[str]:
    """One line per question that uses a concept before (or without) a lesson teaching it, and
    per concept taught twice; empty when the course teaches before it asks."""
    taught = teachers(lessons)
    problems = []
    for lesson in sorted(lessons, key=lambda lesson: lesson.order):
        for concept in lesson.teaches:
            first = taught[concept]
            if first is not lesson:
                problems.append(f"{_name(lesson)}: teaches {concept!r}, which {_name(first)} already teaches; "
                                f"a concept is taught once, by the lesson that introduces it")
        for question in lesson.questions:
            for concept in question.uses:
                teacher = taught.get(concept)
                if teacher is None:
                    problems.append(f"{_name(lesson)}, question {question.id!r}: uses concept {concept!r}, "
                                    f"which no lesson teaches")
                elif teacher.order > lesson.order:
                    problems.append(f"{_name(lesson)}, question {question.id!r}: uses concept {concept!r}, "
                                    f"which only {_name(teacher)} teaches, later; move the question there "
                                    f"or teach the concept in lesson {lesson.order} or before")
    return problems
