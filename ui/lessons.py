"""Lessons tab: a short course whose claims open live in the playground or the chunked-prefill tab.

One page per lesson (body, "try it" presets, quiz with instant feedback, score, retry), a
certificate page and a verify page, chosen from a list on the left. Progress lives in gr.State on
the server and every answer is graded there: the browser sends answers, never scores. A choice
question's options are shown in an order of the browser session's own (seeded by its session id,
set when the page loads), and the answer sent is the picked option's text, so its position on
screen tells nothing.

API names (for gradio_client): lesson<order>_q<i> (answer question i, 1-based: a choice question
takes the option's text, a numeric one the number), lesson<order>_retry, lesson<order>_try<j>
(apply preset j), quiz_order (this session's option order), certificate, verify_certificate.
"""

from __future__ import annotations

import functools
import html
import secrets
from dataclasses import dataclass

import gradio as gr

from engine.errors import InputError
from lessons import (
    COURSE_SEED,
    ChoiceQuestion,
    ChunkedPrefillPreset,
    Feedback,
    Lesson,
    PlaygroundPreset,
    Preset,
    Question,
    Target,
    certificate_html,
    choice_index,
    completion_certificate,
    course_score,
    from_code,
    is_answered,
    lesson_score,
    load_lessons,
    new_progress,
    reset_lesson,
    shown_choices,
    submit,
    to_code,
    verify,
)
from ui.common import user_errors
from ui.playground import CHAIN
from ui.playground import reset as reset_playground

TAB_IDS = {Target.PLAYGROUND: "playground", Target.CHUNKED_PREFILL: "prefill"}  # app.py's tab ids
TRY_LABELS = {Target.PLAYGROUND: "▶ Try it in the playground",
              Target.CHUNKED_PREFILL: "▶ Try it in chunked prefill"}
# The playground's settings a preset sets; the ones a preset has no field for go back to their defaults.
PLAYGROUND_FIELDS = ("prompt", "method", "k", "adaptive", "temperature", "top_k", "top_p", "seed", "max_new_tokens",
                     "raw", "rule", "tree", "dtype", "lookup_first", "draft_stop", "fit_k")
PREFILL_FIELDS = ("scenario", "policy", "chunk_size", "max_new_tokens", "prefix_cache")
CERTIFICATE_PAGE, VERIFY_PAGE = "certificate", "verify"
REJECTED = "this certificate was not issued by this server, or something in it was changed"
CERTIFICATE_CSS = """
.speclab-certificate { border: 4px double #4338ca; border-radius: 14px; padding: 20px 32px; margin: 8px auto;
  max-width: 720px; text-align: center; background: linear-gradient(180deg, #ffffff, #eef2ff); color: #1e1b4b; }
.speclab-certificate h2 { margin: 0 0 8px; letter-spacing: 0.04em; color: #312e81; }
.speclab-certificate-name { font-size: 1.8em; margin: 6px 0; }
.speclab-certificate code { word-break: break-all; font-size: 0.85em; color: #1e1b4b; background: none; }
.speclab-verdict { font-size: 1.15em; font-weight: 600; padding: 10px 14px; border-radius: 8px; }
.speclab-verdict.genuine { background: #dcfce7; color: #14532d; border: 1px solid #16a34a; }
.speclab-verdict.rejected { background: #fee2e2; color: #7f1d1d; border: 1px solid #dc2626; }
"""


def endpoint(lesson: Lesson, what: str) -> str:
    """The API name of one of a lesson's events, e.g. lesson3_q2, lesson3_retry, lesson3_try1."""
    return f"lesson{lesson.order}_{what}"


def feedback_text(feedback: Feedback) -> str:
    if feedback.correct:
        return f"✓ **Correct**\n\n{feedback.explanation}"
    return f"✗ **Not quite.** The answer: **{feedback.answer}**\n\n{feedback.explanation}"


def score_text(progress: dict, lesson: Lesson) -> str:
    score = lesson_score(progress, lesson)
    left = score.total - score.answered
    status = "lesson complete" if score.complete else f"{left} question{'s' * (left != 1)} to go"
    return f"**Score: {score.correct} / {score.total}** · {status}"


def overview_text(progress: dict, lessons: tuple[Lesson, ...]) -> str:
    rows = []
    for lesson in lessons:
        score = lesson_score(progress, lesson)
        rows.append(f"| {lesson.order}. {lesson.title} | {score.answered} / {score.total} | {score.correct} |")
    course = course_score(progress, lessons)
    status = ("every question is answered: enter your name and issue your certificate" if course.complete
              else f"{course.total - course.answered} of {course.total} questions left before the certificate")
    return ("| lesson | answered | correct |\n| --- | --- | --- |\n" + "\n".join(rows)
            + f"\n\n**Course score: {course.correct} / {course.total}** · {status}")


def verdict_html(ok: bool, message: str) -> str:
    kind, mark = ("genuine", "✓ Genuine") if ok else ("rejected", "✗ Rejected")
    return f'<p class="speclab-verdict {kind}">{mark}: {html.escape(message)}</p>'


@user_errors
def answer(lessons: tuple[Lesson, ...], lesson: Lesson, question: Question, progress: dict, given):
    """Grade one answer (a choice by its text, a number as typed) and lock the question until
    the lesson is retried."""
    if is_answered(progress, lesson, question.id):
        raise InputError("this question is answered already: press Retry lesson to answer the lesson again")
    if isinstance(question, ChoiceQuestion):
        given = choice_index(question, given)
    feedback, progress = submit(progress, lesson, question.id, given)
    locked = gr.update(interactive=False)
    return (progress, feedback_text(feedback), score_text(progress, lesson), overview_text(progress, lessons),
            locked, locked)


def retry(lessons: tuple[Lesson, ...], lesson: Lesson, progress: dict):
    """Clear the lesson's answers, its feedback and its inputs."""
    progress = reset_lesson(progress, lesson)
    cleared = [gr.update(value=None if isinstance(q, ChoiceQuestion) else "", interactive=True)
               for q in lesson.questions]
    n = len(lesson.questions)
    return (progress, score_text(progress, lesson), overview_text(progress, lessons), *cleared,
            *[gr.update(interactive=True)] * n, *[""] * n)


def quiz_order(questions: tuple[ChoiceQuestion, ...], seed: str) -> list:
    """Updates of the questions' Radios: each shows its options in the order of the session `seed`."""
    return [gr.update(choices=shown_choices(q, seed)) for q in questions]


def _quiz_order_on_load(questions: tuple[ChoiceQuestion, ...]):
    """The page-load handler: this browser session's order, seeded by its session id. A closure,
    not functools.partial: gradio passes gr.Request by the handler's type hints, which a partial hides."""

    def order_for_session(request: gr.Request) -> list:
        return quiz_order(questions, request.session_hash or secrets.token_hex(8))

    return order_for_session


def playground_values(preset: PlaygroundPreset) -> dict:
    return {"prompt": preset.prompt, "method": preset.method, "k": preset.k, "adaptive": preset.adaptive,
            "temperature": preset.temperature, "top_k": 0, "top_p": 1.0, "seed": preset.seed,
            "max_new_tokens": preset.max_new_tokens, "raw": False, "rule": preset.rule.value, "tree": CHAIN,
            "dtype": preset.dtype, "lookup_first": 0, "draft_stop": 0.0, "fit_k": preset.fit_k}


def prefill_values(preset: ChunkedPrefillPreset) -> dict:
    """Setting A of the chunked-prefill tab. Policy none has no chunk size: the field keeps what it
    shows. Max new tokens 0 runs each request to the scenario's own limit."""
    chunk_size = gr.skip() if preset.chunk_size is None else preset.chunk_size
    return {"scenario": preset.scenario, "policy": preset.policy, "chunk_size": chunk_size, "max_new_tokens": 0,
            "prefix_cache": preset.prefix_cache}


def _announce(preset: Preset, action: str) -> None:
    gr.Info(f"{preset.label}. {action} Look for: {preset.look_for}", title="Try it", duration=20)


def try_playground(preset: PlaygroundPreset, state):
    """Fill the playground with the preset (a fresh session, so the next run uses it) and open it."""
    fresh_state = reset_playground(state)[0]
    values = playground_values(preset)
    _announce(preset, "Press Generate, Step or Compare with baseline.")
    return (gr.Tabs(selected=TAB_IDS[Target.PLAYGROUND]), fresh_state, *(values[f] for f in PLAYGROUND_FIELDS))


def try_prefill(preset: ChunkedPrefillPreset):
    values = prefill_values(preset)
    _announce(preset, "Press Run A.")
    return (gr.Tabs(selected=TAB_IDS[Target.CHUNKED_PREFILL]), *(values[f] for f in PREFILL_FIELDS))


@user_errors
def issue_certificate(lessons: tuple[Lesson, ...], progress: dict, name: str):
    cert = completion_certificate(progress, lessons, name)
    return certificate_html(cert), to_code(cert)


def check_certificate(code: str) -> str:
    """The verify page's verdict for a pasted code: genuine (and the certificate), or rejected."""
    try:
        cert = from_code(code)
    except InputError as err:
        return verdict_html(False, str(err))
    if not verify(cert):
        return verdict_html(False, REJECTED)
    return verdict_html(True, "issued by this server and unchanged") + certificate_html(cert)


@dataclass
class LessonPage:
    lesson: Lesson
    column: gr.Column
    inputs: list  # one per question: Radio (choice index) or Textbox (a number)
    checks: list[gr.Button]
    feedback: list[gr.Markdown]
    score: gr.Markdown
    retry: gr.Button
    tries: list[tuple[int, Preset, gr.Button]]  # (1-based number, preset, its button)


def _question(lesson: Lesson, i: int, question: Question):
    with gr.Column(variant="panel"):
        gr.Markdown(f"**Question {i}.** {question.prompt}")
        if isinstance(question, ChoiceQuestion):  # shuffled at build time, then per session on load
            given = gr.Radio(shown_choices(question, COURSE_SEED), type="value", show_label=False,
                             elem_id=f"lesson{lesson.order}-q{i}-answer")
        else:
            given = gr.Textbox(label="Your answer (a number)", placeholder="e.g. 3.36", max_length=40,
                               elem_id=f"lesson{lesson.order}-q{i}-answer")
        check = gr.Button("Check", size="sm", elem_id=f"lesson{lesson.order}-q{i}-check")
        feedback = gr.Markdown(elem_id=f"lesson{lesson.order}-q{i}-feedback")
    return given, check, feedback


def _lesson_page(lesson: Lesson, progress: dict, visible: bool, prefill: dict | None) -> LessonPage:
    with gr.Column(visible=visible, elem_id=f"lesson-{lesson.id}") as column:
        gr.Markdown(f"# {lesson.order}. {lesson.title}\n_{lesson.summary}_")
        gr.Markdown(lesson.markdown())
        gr.Markdown("## Try it live")
        tries = []
        for j, preset in enumerate(lesson.try_it, start=1):
            with gr.Row(equal_height=True):
                gr.Markdown(f"**{preset.label}**: {preset.look_for}")
                if preset.target is Target.CHUNKED_PREFILL and prefill is None:
                    gr.Markdown("_(the chunked-prefill tab is not part of this app)_")
                else:
                    button = gr.Button(TRY_LABELS[preset.target], size="sm", scale=0, min_width=240,
                                       elem_id=f"lesson{lesson.order}-try{j}")
                    tries.append((j, preset, button))
        gr.Markdown("## Quiz")
        inputs, checks, feedback = [], [], []
        for i, question in enumerate(lesson.questions, start=1):
            given, check, shown = _question(lesson, i, question)
            inputs.append(given)
            checks.append(check)
            feedback.append(shown)
        with gr.Row(equal_height=True):
            score = gr.Markdown(score_text(progress, lesson), elem_id=f"lesson{lesson.order}-score")
            retry_btn = gr.Button("Retry lesson", size="sm", scale=0, min_width=160,
                                  elem_id=f"lesson{lesson.order}-retry")
    return LessonPage(lesson, column, inputs, checks, feedback, score, retry_btn, tries)


def _wire_lesson(page: LessonPage, lessons, progress: gr.State, overview: gr.Markdown, playground: dict,
                 prefill: dict | None, tabs: gr.Tabs) -> None:
    lesson = page.lesson
    for i, (question, given, check, shown) in enumerate(
            zip(lesson.questions, page.inputs, page.checks, page.feedback, strict=True), start=1):
        check.click(functools.partial(answer, lessons, lesson, question), [progress, given],
                    [progress, shown, page.score, overview, given, check],
                    api_name=endpoint(lesson, f"q{i}"), api_visibility="undocumented")
    page.retry.click(functools.partial(retry, lessons, lesson), [progress],
                     [progress, page.score, overview, *page.inputs, *page.checks, *page.feedback],
                     api_name=endpoint(lesson, "retry"), api_visibility="undocumented")
    for j, preset, button in page.tries:
        if isinstance(preset, PlaygroundPreset):
            fields = [playground[f] for f in PLAYGROUND_FIELDS]
            clear, clear_inputs, clear_outputs = playground["clear"]  # the old run goes, even if no field changed
            button.click(functools.partial(try_playground, preset), [playground["state"]],
                         [tabs, playground["state"], *fields],
                         api_name=endpoint(lesson, f"try{j}"), api_visibility="undocumented"
                         ).then(clear, clear_inputs, clear_outputs, api_name=False, show_progress="hidden")
        else:
            fields = [prefill[f] for f in PREFILL_FIELDS]
            button.click(functools.partial(try_prefill, preset), None, [tabs, *fields],
                         api_name=endpoint(lesson, f"try{j}"), api_visibility="undocumented")


def build_lessons(playground: dict, prefill: dict | None, tabs: gr.Tabs) -> None:
    """Lay out the Lessons tab and wire it. playground / prefill: the components those tabs expose
    (build_playground(), build_prefill()); tabs: the app's gr.Tabs, to switch to them."""
    lessons = load_lessons()
    start = new_progress()
    progress = gr.State(start)
    pages_keys = [lesson.id for lesson in lessons] + [CERTIFICATE_PAGE, VERIFY_PAGE]
    with gr.Row():
        with gr.Column(scale=1, min_width=240):
            picker = gr.Radio([(f"{lesson.order}. {lesson.title}", lesson.id) for lesson in lessons]
                              + [("Certificate", CERTIFICATE_PAGE), ("Verify a certificate", VERIFY_PAGE)],
                              value=lessons[0].id, label="Course", elem_id="lesson-picker")
        with gr.Column(scale=4):
            pages = [_lesson_page(lesson, start, lesson is lessons[0], prefill) for lesson in lessons]
            with gr.Column(visible=False, elem_id="certificate-page") as certificate_page:
                gr.Markdown("# Certificate\nAnswer every question of every lesson, then issue a certificate "
                            "with your name, today's date and your score. Its code can be checked on the "
                            "verify page by anyone; a changed name, score or date is rejected.")
                overview = gr.Markdown(overview_text(start, lessons), elem_id="course-overview")
                with gr.Row(equal_height=True):
                    name = gr.Textbox(label="Name on the certificate", max_length=80, elem_id="certificate-name")
                    issue_btn = gr.Button("Issue certificate", variant="primary", scale=0, min_width=200,
                                          elem_id="certificate-issue")
                certificate = gr.HTML(css_template=CERTIFICATE_CSS, elem_id="certificate")
                code = gr.Textbox(label="Verification code (paste it on the verify page)", interactive=False,
                                  buttons=["copy"], elem_id="certificate-code")
            with gr.Column(visible=False, elem_id="verify-page") as verify_page:
                gr.Markdown("# Verify a certificate\nPaste a certificate's verification code. Only certificates "
                            "issued by this server, unchanged, are accepted.")
                pasted = gr.Textbox(label="Verification code", lines=2, max_length=2000, elem_id="verify-code")
                verify_btn = gr.Button("Verify", variant="primary", elem_id="verify-btn")
                verdict = gr.HTML(css_template=CERTIFICATE_CSS, elem_id="certificate-verdict")

    radios = [(q, given) for page in pages for q, given in zip(page.lesson.questions, page.inputs, strict=True)
              if isinstance(q, ChoiceQuestion)]
    gr.on(None, _quiz_order_on_load(tuple(q for q, _ in radios)), None, [given for _, given in radios],
          api_name="quiz_order", api_visibility="undocumented", queue=False, show_progress="hidden")
    columns = [page.column for page in pages] + [certificate_page, verify_page]
    picker.change(lambda key: [gr.Column(visible=key == k) for k in pages_keys], [picker], columns,
                  api_visibility="private", queue=False)
    for page in pages:
        _wire_lesson(page, lessons, progress, overview, playground, prefill, tabs)
    issue_btn.click(functools.partial(issue_certificate, lessons), [progress, name], [certificate, code],
                    api_name="certificate")
    verify_btn.click(check_certificate, [pasted], [verdict], api_name="verify_certificate")
