"""The order a learner sees a choice question's options in: shuffled per session.

The YAML lists every question's correct option first (it reads best that way), so showing the
options as written would let "always pick the first" pass the course. Each session gets its own
seed (the app uses the browser session's id) and each question its own shuffle from that seed.
Positions never reach grading: the app sends the text of the picked option, and
grading.choice_index maps it back to the option's index in the YAML.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

from lessons.model import ChoiceQuestion, Lesson

COURSE_SEED = 0  # the order a page shows before its session's own, and the one validate checks
MAX_POSITION_SHARE = 0.5  # at COURSE_SEED, no position may hold the correct option this often


def option_order(question: ChoiceQuestion, seed: int | str) -> tuple[int, ...]:
    """The YAML indices of the question's choices in the order the session `seed` sees them.
    Deterministic: the same seed and question give the same order in any process.

    >>> from lessons.model import Choice
    >>> q = ChoiceQuestion("q", "Which?", tuple(Choice(t, t == "a", "") for t in "abcd"), ())
    >>> option_order(q, "session-1") == option_order(q, "session-1")
    True
    >>> sorted(option_order(q, "session-1"))
    [0, 1, 2, 3]
    """
    order = list(range(len(question.choices)))
    random.Random(f"{seed}/{question.id}").shuffle(order)  # a str seed hashes the same in every process
    return tuple(order)


def shown_choices(question: ChoiceQuestion, seed: int | str) -> list[str]:
    """The choices' texts in the order the session `seed` sees them."""
    return [question.choices[i].text for i in option_order(question, seed)]


def correct_position(question: ChoiceQuestion, seed: int | str) -> int:
    """Where the session `seed` sees the correct option (0 = first)."""
    return option_order(question, seed).index(question.correct_index)


def shuffle_problems(lessons: Sequence[Lesson], seed: int | str = COURSE_SEED) -> list[str]:
    """Course-level check of the shuffle at one seed: a learner who always picks the same
    position must not pass the quiz. Empty when no position holds the correct option in more
    than MAX_POSITION_SHARE of the choice questions."""
    positions = Counter(correct_position(q, seed) for lesson in lessons for q in lesson.questions
                        if isinstance(q, ChoiceQuestion))
    total = sum(positions.values())
    if not total:
        return []
    position, count = positions.most_common(1)[0]
    if count / total <= MAX_POSITION_SHARE:
        return []
    return [f"with seed {seed!r} the correct option shows at position {position + 1} in {count} of {total} "
            f"choice questions (at most {MAX_POSITION_SHARE:.0%}): always picking that position would pass"]
