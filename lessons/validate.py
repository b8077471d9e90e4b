"""`python -m lessons.validate`: check every lesson; one line per problem, exit 1 if any."""

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
    print(f"{len(lessons)} lessons, {n_questions} questions: all valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
