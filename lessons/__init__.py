"""Lessons as data: one YAML file per lesson under lessons/content/, their loader and validator,
grading, progress and completion certificates. No gradio here; the lessons tab builds on this.

Typical use by the app:

    lessons = load_lessons()                       # tuple[Lesson, ...], in course order
    progress = new_progress()                      # a plain dict for gr.State / the browser session
    shown = shown_choices(question, seed)          # a choice question's options, in this session's order
    given = choice_index(question, picked_text)    # a choice by its text; a numeric answer goes as typed
    feedback, progress = submit(progress, lesson, question.id, given)
    is_answered(progress, lesson, question.id); lesson_score(progress, lesson)
    progress = reset_lesson(progress, lesson)
    cert = completion_certificate(progress, lessons, name)
    certificate_html(cert); verify(from_code(pasted_code))
"""

from lessons.certificates import (
    Certificate,
    certificate_html,
    completion_certificate,
    from_code,
    issue,
    to_code,
    verify,
)
from lessons.concepts import concept_problems
from lessons.grading import (
    Feedback,
    Score,
    choice_index,
    course_score,
    grade,
    is_answered,
    lesson_score,
    new_progress,
    reset_lesson,
    submit,
)
from lessons.loader import LessonError, lesson_problems, load_lessons, validate
from lessons.model import (
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
from lessons.shuffle import COURSE_SEED, option_order, shown_choices

__all__ = [
    "COURSE_SEED",
    "Certificate",
    "Choice",
    "ChoiceQuestion",
    "ChunkedPrefillPreset",
    "Feedback",
    "Lesson",
    "LessonError",
    "NumericQuestion",
    "PlaygroundPreset",
    "Preset",
    "Question",
    "Score",
    "Source",
    "Target",
    "certificate_html",
    "choice_index",
    "concept_problems",
    "completion_certificate",
    "course_score",
    "from_code",
    "grade",
    "is_answered",
    "issue",
    "lesson_problems",
    "lesson_score",
    "load_lessons",
    "new_progress",
    "option_order",
    "reset_lesson",
    "shown_choices",
    "submit",
    "to_code",
    "validate",
    "verify",
]
