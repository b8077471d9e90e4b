"""Lessons as data: one YAML file per lesson under lessons/content/, their loader and validator,
grading, progress and completion certificates. No gradio here; the lessons tab builds on this.

Typical use by the app:

    lessons = load_lessons()                       # tuple[Lesson, ...], in course order
    progress = new_progress()                      # a plain dict for gr.State / the browser session
    feedback, progress = submit(progress, lesson, question.id, answer)
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
from lessons.grading import (
    Feedback,
    Score,
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

__all__ = [
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
    "reset_lesson",
    "submit",
    "to_code",
    "validate",
    "verify",
]
