"""`python -m lessons.validate`: check every lesson; one line per problem, exit 1 if any.

Besides each file's fields, the course as a whole: no question uses a concept before its lesson
teaches it, and the per-session shuffle of options hides where the correct one is."""

from __future__ import annotations

import sys
from pathlib import Path

from lessons.loader import CONTENT_DIR, LessonError, load_lessons


def main(folder: Path = CONTENT_DIR) -> int:
    try:
        lessons = load_lessons(folder)
    except LessonError as err:
        print("\n".join(err.problems))
        return 1
    n_questions = sum(len(lesson.questions) for lesson in lessons)
    n_concepts = sum(len(lesson.teaches) for lesson in lessons)
    print(f"{len(lessons)} lessons, {n_questions} questions, {n_concepts} concepts: all valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
