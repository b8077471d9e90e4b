"""Lessons: the shipped lessons validate, the validator catches broken ones, concepts (no
question before its lesson), the per-session order of options, grading, progress, and
certificates (issue, verify, tampering, hostile names)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime as dt
import json
import os
import shutil
import stat
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

from engine import metrics
from engine.errors import InputError
from lessons import (
    COURSE_SEED,
    Choice,
    ChoiceQuestion,
    LessonError,
    NumericQuestion,
    PlaygroundPreset,
    Score,
    certificate_html,
    choice_index,
    completion_certificate,
    concept_problems,
    course_score,
    from_code,
    grade,
    issue,
    lesson_problems,
    lesson_score,
    load_lessons,
    new_progress,
    option_order,
    reset_lesson,
    shown_choices,
    submit,
    to_code,
    validate,
    verify,
)
from lessons.loader import CONTENT_DIR
from lessons.shuffle import MAX_POSITION_SHARE, correct_position, shuffle_problems
from lessons.validate import main as validate_main

TOPICS = (
    "prefill-vs-decode",
    "chunked-prefill",
    "greedy-speculation",
    "exact-sampling",
    "acceptance-and-speedup",
    "drafting-without-a-second-model",
    "measuring-honestly",
    "quality-gates",
    "which-technique-when",
)


@pytest.fixture(scope="module")
def lessons():
    return load_lessons()


# -- the shipped lessons --------------------------------------------------------------------


def test_shipped_lessons_validate(lessons):
    assert validate() == []
    assert tuple(lesson.id for lesson in lessons) == TOPICS
    assert [lesson.order for lesson in lessons] == list(range(1, len(TOPICS) + 1))
    for lesson in lessons:
        assert len(lesson.questions) >= 5, lesson.id
        assert lesson.try_it, lesson.id
        assert lesson.sources, lesson.id
        assert {type(q) for q in lesson.questions} == {ChoiceQuestion, NumericQuestion}, lesson.id


def test_every_question_has_one_correct_answer_and_explanations(lessons):
    for lesson in lessons:
        for q in lesson.questions:
            if isinstance(q, ChoiceQuestion):
                assert sum(c.correct for c in q.choices) == 1, (lesson.id, q.id)
                assert all(c.explanation for c in q.choices), (lesson.id, q.id)
            else:
                assert q.explanation and q.tolerance > 0, (lesson.id, q.id)


def test_numeric_answers_equal_the_engine_formulas(lessons):
    numeric = [q for lesson in lessons for q in lesson.questions if isinstance(q, NumericQuestion)]
    assert len(numeric) >= 10
    for q in numeric:
        args = {k: list(v) if isinstance(v, tuple) else v for k, v in q.args}
        assert q.answer == getattr(metrics, q.formula)(**args), q.id
        assert "{" not in q.prompt and "{" not in q.explanation, q.id
    by_id = {q.id: q for q in numeric}
    assert by_id["expected-tokens"].answer == metrics.expected_tokens_per_step(0.8, 4)
    assert by_id["speedup-good-drafter"].answer == metrics.predicted_speedup(0.8, 4, 0.05)
    assert by_id["speedup-poor-drafter"].answer < 1  # the lesson's point: speculation can hurt
    assert "a = 0.8" in by_id["expected-tokens"].prompt and "k = 4" in by_id["expected-tokens"].prompt


def test_playground_presets_build_engine_requests(lessons):
    presets = [p for lesson in lessons for p in lesson.try_it if isinstance(p, PlaygroundPreset)]
    assert {p.method for p in presets} >= {"baseline", "prompt-lookup", "early-exit"}
    for p in presets:
        request = p.run_request("embedded")
        assert request.drafter.method == p.method
        assert request.decode.k == p.k and request.decode.sampling.temperature == p.temperature


def test_validate_entry_point(capsys, tmp_path):
    assert validate_main() == 0
    assert f"{len(TOPICS)} lessons" in capsys.readouterr().out
    (tmp_path / "broken.yaml").write_text("id: broken\nquestions: []\n", encoding="utf-8")
    assert validate_main(tmp_path) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) > 1 and all(line.startswith(f"{tmp_path.name}/broken.yaml: ") for line in lines)


# -- the validator on broken lessons ----------------------------------------------------------


def choice(text, correct=False, explanation="Because."):
    return {"text": text, "correct": correct, "explanation": explanation}


def valid_lesson() -> dict:
    mc = {
        "kind": "choice",
        "uses": ["prefill"],
        "prompt": "Which phase produces the first output token?",
        "choices": [choice("Prefill", correct=True), choice("Decode")],
    }
    numeric = {
        "id": "tokens",
        "kind": "numeric",
        "uses": ["expected-tokens"],
        "prompt": "a = {a}, k = {k}: expected tokens per step?",
        "formula": "expected_tokens_per_step",
        "args": {"a": 0.8, "k": 4},
        "tolerance": 0.01,
        "explanation": "(1 - a^(k+1)) / (1 - a).",
    }
    return {
        "id": "test-lesson",
        "title": "A test lesson",
        "order": 1,
        "summary": "For the validator tests.",
        "teaches": ["prefill", "expected-tokens"],
        "body": "Speculative decoding (Leviathan et al. 2023).",
        "sources": ["leviathan2023"],
        "questions": [{**mc, "id": f"q{i}"} for i in range(4)] + [numeric],
        "try_it": [
            {
                "label": "Try it",
                "look_for": "Identical output.",
                "target": "playground",
                "settings": {"method": "prompt-lookup", "k": 4, "temperature": 0, "prompt": "Copy: a b c", "max_new_tokens": 64},
            },
            {
                "label": "Chunks",
                "look_for": "No spike.",
                "target": "chunked-prefill",
                "settings": {"scenario": "doc-arrives", "policy": "decode-first", "chunk_size": 256},
            },
        ],
    }


def test_the_valid_lesson_is_valid():
    assert lesson_problems(valid_lesson()) == []


def _mutate(change):
    data = copy.deepcopy(valid_lesson())
    change(data)
    return data


def _set_choices(data, choices):
    data["questions"][0]["choices"] = choices


def _set_setting(data, key, value, preset=0):
    data["try_it"][preset]["settings"][key] = value


BROKEN = {
    "two correct answers": (
        lambda d: _set_choices(d, [choice("A", True), choice("B", True)]),
        "2 choices are marked correct",
    ),
    "no correct answer": (lambda d: _set_choices(d, [choice("A"), choice("B")]), "0 choices are marked correct"),
    "a single choice, nothing to shuffle": (
        lambda d: _set_choices(d, [choice("A", True)]),
        "needs 2..6 choices (has 1)",
    ),
    "question without concepts": (lambda d: d["questions"][0].pop("uses"), "questions[0]: uses must be a non-empty list"),
    "numeric question without concepts": (
        lambda d: d["questions"][4].update(uses=[]),
        "questions[4]: uses must be a non-empty list",
    ),
    "lesson without concepts": (lambda d: d.pop("teaches"), "teaches must be a non-empty list"),
    "concept id not a slug": (lambda d: d["teaches"].append("KV Cache"), "teaches: concept ids must be lower-case words"),
    "concept listed twice": (
        lambda d: d["questions"][0].update(uses=["prefill", "prefill"]),
        "uses: 'prefill' listed twice",
    ),
    "missing explanation": (
        lambda d: _set_choices(d, [choice("A", True), {"text": "B", "correct": False}]),
        "choices[1]: explanation must be non-empty text",
    ),
    "bad method": (lambda d: _set_setting(d, "method", "telepathy"), "method 'telepathy' is not one of"),
    "k out of range": (lambda d: _set_setting(d, "k", 17), "k must be an integer in 1..16"),
    "negative temperature": (lambda d: _set_setting(d, "temperature", -1), "temperature must be >= 0"),
    "unknown setting": (lambda d: _set_setting(d, "temprature", 0.5), "unknown field(s) temprature"),
    "bad scenario": (lambda d: _set_setting(d, "scenario", "rush-hour", preset=1), "scenario 'rush-hour' is not one of"),
    "bad policy": (lambda d: _set_setting(d, "policy", "random", preset=1), "policy 'random' is not one of"),
    "numeric answer typed wrong": (
        lambda d: d["questions"][4].update(answer=4.0),
        "typed answer 4.0: numeric answers are computed from the formula (the formula gives 3.3616)",
    ),
    "formula not allowed": (
        lambda d: d["questions"][4].update(formula="__import__"),
        "formula must be one of expected_tokens_per_step, predicted_speedup, percentile, verify_cost",
    ),
    "acceptance rate above 1": (lambda d: d["questions"][4]["args"].update(a=1.5), "argument a = 1.5 is outside 0.0..1.0"),
    "argument of the wrong type": (lambda d: d["questions"][4]["args"].update(k=2.5), "argument k must be an integer"),
    "unknown argument": (lambda d: d["questions"][4]["args"].update(gamma=4), "args do not fit expected_tokens_per_step"),
    "given missing from the prompt": (
        lambda d: d["questions"][4].update(prompt="a = {a}: expected tokens per step?"),
        "prompt must state every given; add {k}",
    ),
    "tolerance too loose": (lambda d: d["questions"][4].update(tolerance=1.0), "tolerance 1.0 is too loose"),
    "too few questions": (lambda d: d["questions"].pop(), "needs at least 5 questions (has 4)"),
    "duplicate question id": (lambda d: d["questions"][1].update(id="q0"), "question id 'q0' is used twice"),
    "unknown source": (lambda d: d["sources"].append("nobody2099"), "unknown source 'nobody2099'"),
    "source never cited": (lambda d: d["sources"].append("kwon2023"), "never cites it as 'Kwon et al. 2023'"),
    "unknown question kind": (lambda d: d["questions"][0].update(kind="essay"), "kind must be choice or numeric"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_validator_catches(case):
    change, expected = BROKEN[case]
    problems = lesson_problems(_mutate(change), where="broken.yaml")
    assert any(expected in p for p in problems), problems
    assert all(p.startswith("broken.yaml: ") for p in problems)


def test_validator_reports_every_problem_not_just_the_first():
    def break_twice(d):
        _set_choices(d, [choice("A", True), choice("B", True)])
        _set_setting(d, "method", "telepathy")

    assert len(lesson_problems(_mutate(break_twice))) == 2


def test_policy_none_takes_no_chunk_size():
    data = _mutate(lambda d: _set_setting(d, "policy", "none", preset=1))
    assert any("remove chunk_size" in p for p in lesson_problems(data))
    del data["try_it"][1]["settings"]["chunk_size"]
    assert lesson_problems(data) == []


# -- concepts: no question before its lesson ---------------------------------------------------


def test_every_lesson_teaches_and_every_question_uses_concepts(lessons):
    assert concept_problems(lessons) == []
    taught = [c for lesson in lessons for c in lesson.teaches]
    assert len(taught) == len(set(taught))  # each concept introduced once
    for lesson in lessons:
        assert lesson.teaches, lesson.id
        for q in lesson.questions:
            assert q.uses, (lesson.id, q.id)
    by_id = {lesson.id: lesson for lesson in lessons}
    assert {"kv-cache", "ttft", "itl", "memory-bound", "verify-cost"} <= set(by_id["prefill-vs-decode"].teaches)
    assert {"expected-tokens", "speedup-formula", "verify-curve"} <= set(by_id["acceptance-and-speedup"].teaches)


def test_the_first_lesson_asks_no_formula_of_later_lessons(lessons):
    """Issue 15: lesson 1 asked for the tokens-per-step formula of lesson 5 (and lesson 3 asked it too)."""
    first, greedy = lessons[0], lessons[2]
    assert all(q.formula not in ("expected_tokens_per_step", "predicted_speedup")
               for q in first.questions if isinstance(q, NumericQuestion))
    assert not any("expected-tokens" in q.uses or "speedup-formula" in q.uses
                   for lesson in (first, greedy) for q in lesson.questions)
    assert "typical-step" not in {q.id for q in greedy.questions}


def _replace_question(lessons, lesson_index, question_index, **changes):
    lesson = lessons[lesson_index]
    questions = list(lesson.questions)
    questions[question_index] = dataclasses.replace(questions[question_index], **changes)
    changed = dataclasses.replace(lesson, questions=tuple(questions))
    return (*lessons[:lesson_index], changed, *lessons[lesson_index + 1:])


def test_a_question_using_a_later_or_untaught_concept_is_refused(lessons):
    q = lessons[0].questions[0]
    early = _replace_question(lessons, 0, 0, uses=("prefill", "speedup-formula"))
    assert concept_problems(early) == [
        f"lesson 1 (prefill-vs-decode), question {q.id!r}: uses concept 'speedup-formula', which only "
        "lesson 5 (acceptance-and-speedup) teaches, later; move the question there or teach the concept "
        "in lesson 1 or before"]
    untaught = _replace_question(lessons, 2, 0, uses=("telepathy",))
    assert concept_problems(untaught) == [
        f"lesson 3 (greedy-speculation), question {lessons[2].questions[0].id!r}: uses concept 'telepathy', "
        "which no lesson teaches"]
    same_lesson = _replace_question(lessons, 4, 0, uses=("verify-curve",))  # taught by its own lesson: fine
    assert concept_problems(same_lesson) == []


def test_a_concept_is_taught_once(lessons):
    twice = (*lessons[:4], dataclasses.replace(lessons[4], teaches=(*lessons[4].teaches, "kv-cache")), *lessons[5:])
    assert concept_problems(twice) == [
        "lesson 5 (acceptance-and-speedup): teaches 'kv-cache', which lesson 1 (prefill-vs-decode) already "
        "teaches; a concept is taught once, by the lesson that introduces it"]


@pytest.fixture
def course_copy(tmp_path):
    """The shipped lesson files in a folder of their own, to break."""
    folder = tmp_path / "content"
    shutil.copytree(CONTENT_DIR, folder)
    return folder


def _edit_lesson(folder: Path, name: str, change) -> None:
    path = next(folder.glob(f"*-{name}.yaml"))
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    change(data)
    path.write_text(yaml.safe_dump(data, sort_keys=False, allow_unicode=True), encoding="utf-8")


def test_the_loader_refuses_the_old_lesson_one_question(course_copy, capsys):
    """The question lesson 1 used to ask (the expected-tokens formula at k = 0) is refused, naming
    the lesson, the question and the concept; the same for a concept no lesson teaches."""
    old = {"id": "plain-is-k-zero", "kind": "numeric", "uses": ["expected-tokens", "acceptance-rate"],
           "prompt": "Draft length k = {k}, acceptance rate a = {a}: tokens per target step?",
           "formula": "expected_tokens_per_step", "args": {"a": 0.7, "k": 0}, "tolerance": 0.01,
           "explanation": "1 whatever a is."}
    assert validate(course_copy) == []
    _edit_lesson(course_copy, "prefill-vs-decode", lambda d: d["questions"].append(old))
    problems = validate(course_copy)
    assert problems == [
        "content: lesson 1 (prefill-vs-decode), question 'plain-is-k-zero': uses concept 'expected-tokens', "
        "which only lesson 5 (acceptance-and-speedup) teaches, later; move the question there or teach the "
        "concept in lesson 1 or before",
        "content: lesson 1 (prefill-vs-decode), question 'plain-is-k-zero': uses concept 'acceptance-rate', "
        "which only lesson 3 (greedy-speculation) teaches, later; move the question there or teach the "
        "concept in lesson 1 or before"]
    with pytest.raises(LessonError):
        load_lessons(course_copy)
    assert validate_main(course_copy) == 1
    assert "plain-is-k-zero" in capsys.readouterr().out
    _edit_lesson(course_copy, "prefill-vs-decode", lambda d: d["questions"].pop())
    _edit_lesson(course_copy, "quality-gates", lambda d: d["questions"][0]["uses"].append("mind-reading"))
    assert validate(course_copy) == ["content: lesson 8 (quality-gates), question 'greedy-gate': uses concept "
                                     "'mind-reading', which no lesson teaches"]


# -- the order of options: shuffled per session, graded by text ---------------------------------


def _choice_questions(lessons):
    return [q for lesson in lessons for q in lesson.questions if isinstance(q, ChoiceQuestion)]


SESSIONS = ("session-a", "session-b", "8x2kq9xk1", COURSE_SEED, 1, 2)


def test_option_order_is_a_permutation_fixed_by_the_seed(lessons):
    for q in _choice_questions(lessons):
        for seed in SESSIONS:
            order = option_order(q, seed)
            assert sorted(order) == list(range(len(q.choices))), q.id
            assert option_order(q, seed) == order
            assert shown_choices(q, seed) == [q.choices[i].text for i in order]


def test_option_order_is_the_same_in_another_process(lessons):
    """The seed is a session id (a string): its shuffle must not depend on Python's hash seed."""
    q = _choice_questions(lessons)[0]
    code = ("from lessons import load_lessons, option_order, ChoiceQuestion;"
            f"q = next(q for l in load_lessons() for q in l.questions if q.id == {q.id!r});"
            "print(option_order(q, 'session-a'))")
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"  # not this process's
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": hash_seed}, cwd=CONTENT_DIR.parents[1]).stdout
    assert out.strip() == str(option_order(q, "session-a"))


def test_two_sessions_see_different_orders(lessons):
    questions = _choice_questions(lessons)
    for a, b in (("session-a", "session-b"), (0, 1), ("8x2kq9xk1", COURSE_SEED)):
        differing = [q.id for q in questions if option_order(q, a) != option_order(q, b)]
        assert len(differing) >= len(questions) // 2, (a, b, differing)


def test_the_correct_option_is_not_always_first(lessons):
    """The files list the correct option first; on screen it must not always be."""
    questions = _choice_questions(lessons)
    assert shuffle_problems(lessons) == []
    for seed in SESSIONS:
        positions = Counter(correct_position(q, seed) for q in questions)
        assert positions[0] < len(questions), seed
        assert len(positions) >= 2, seed
    at_course_seed = Counter(correct_position(q, COURSE_SEED) for q in questions)
    assert max(at_course_seed.values()) <= MAX_POSITION_SHARE * len(questions)


def test_always_picking_the_first_shown_option_does_not_pass(lessons):
    """Issue 15: picking the first option everywhere scored 7/7. Now a learner who always picks the
    first option on screen gets only some choice questions right."""
    questions = _choice_questions(lessons)
    for seed in SESSIONS:
        progress = new_progress()
        for lesson in lessons:
            for q in lesson.questions:
                if isinstance(q, ChoiceQuestion):
                    _, progress = submit(progress, lesson, q.id, choice_index(q, shown_choices(q, seed)[0]))
        score = course_score(progress, lessons)
        assert score.answered == len(questions)
        assert score.correct <= 0.6 * len(questions), (seed, score)


def test_grading_by_text_is_grading_by_the_original_index(lessons):
    for q in _choice_questions(lessons):
        for seed in SESSIONS:
            shown = shown_choices(q, seed)
            for position, text in enumerate(shown):
                index = choice_index(q, text)
                assert index == option_order(q, seed)[position]
                assert grade(q, index) == grade(q, q.choices.index(next(c for c in q.choices if c.text == text)))
                assert grade(q, index).correct == (index == q.correct_index)
            assert grade(q, choice_index(q, shown[correct_position(q, seed)])).correct
    q = lessons[0].question("first-token")
    for not_a_choice in (None, 0, 1, "0", "", "prefill", q.choices[0].text + " "):  # positions say nothing
        with pytest.raises(InputError, match="pick one of the choices"):
            choice_index(q, not_a_choice)


def _choice_on_top(qid: str, n: int, seed) -> dict:
    """A choice question whose correct option the session `seed` sees first."""
    probe = ChoiceQuestion(qid, "?", tuple(Choice(str(i), i == 0, "") for i in range(n)), ())
    first = option_order(probe, seed)[0]
    return {"id": qid, "kind": "choice", "uses": ["prefill"], "prompt": "Which one?",
            "choices": [choice(f"option {i}", correct=i == first) for i in range(n)]}


def test_shuffle_problems_catch_a_shuffle_that_leaves_the_answers_first(lessons, tmp_path):
    assert shuffle_problems(lessons, seed=COURSE_SEED) == []
    data = valid_lesson()
    data["questions"] = [_choice_on_top(f"q{i}", 3, COURSE_SEED) for i in range(4)] + [data["questions"][4]]
    (tmp_path / "01-on-top.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    assert validate(tmp_path) == [f"{tmp_path.name}: with seed 0 the correct option shows at position 1 in 4 of "
                                  "4 choice questions (at most 50%): always picking that position would pass"]


# -- the lessons' text: when verifying costs about one step ---------------------------------------


def _texts(lesson) -> list[str]:
    texts = [lesson.body]
    for q in lesson.questions:
        texts.append(q.prompt)
        texts += [t for c in q.choices for t in (c.text, c.explanation)] if isinstance(q, ChoiceQuestion) \
            else [q.explanation]
    return [" ".join(t.split()) for t in texts]


def test_no_lesson_calls_verification_free(lessons):
    """"Verifying costs about one step" holds only where a step is memory-bound; the lessons once
    called verification free without that condition."""
    for lesson in lessons:
        for text in _texts(lesson):
            for phrase in ("free verification", "verification is free", "verification not being quite free"):
                assert phrase not in text, (lesson.id, phrase)


def test_lessons_state_when_verifying_costs_one_step_and_the_float32_counterexample(lessons):
    by_id = {lesson.id: lesson for lesson in lessons}
    first = " ".join(by_id["prefill-vs-decode"].body.split())
    assert "holds only where the step is memory-bound" in first
    assert "bfloat16 on this lab's CPU" in first and "1.0-1.1x" in first
    assert "float32 on the same CPU" in first and "1.2-1.8x" in first
    greedy = " ".join(by_id["greedy-speculation"].body.split())
    assert "While the target is memory-bound (a GPU, or bfloat16 on this lab's CPU)" in greedy
    assert "float32 on the same CPU it measured 1.2-1.8x" in greedy
    speedup = " ".join(by_id["acceptance-and-speedup"].body.split())
    assert "1.0-1.1x" in speedup and "1.2-1.8x" in speedup
    counterexample = by_id["prefill-vs-decode"].question("float32-verify-cost")
    args = {k: list(v) if isinstance(v, tuple) else v for k, v in counterexample.args}
    assert counterexample.answer == metrics.verify_cost(**args)
    assert 1.2 <= counterexample.answer <= 1.8 and "float32" in counterexample.prompt


# -- grading and progress ---------------------------------------------------------------------


def test_grade_choice(lessons):
    q = lessons[0].question("first-token")
    right = grade(q, q.correct_index)
    assert right.correct and right.explanation == q.choices[q.correct_index].explanation
    wrong_index = (q.correct_index + 1) % len(q.choices)
    wrong = grade(q, wrong_index)
    assert not wrong.correct
    assert wrong.explanation == q.choices[wrong_index].explanation
    assert wrong.answer == q.choices[q.correct_index].text
    for bad in (None, -1, len(q.choices), True, "0"):
        with pytest.raises(InputError):
            grade(q, bad)


def test_grade_numeric(lessons):
    q = lessons[4].question("expected-tokens")  # 3.3616 with tolerance 0.01
    assert grade(q, "3.36").correct
    assert grade(q, 3.37).correct
    assert grade(q, " 3.355 ").correct
    assert not grade(q, "3.5").correct
    assert grade(q, "3.5").answer == "3.36"
    for bad in ("", "three", "nan", "inf", None):
        with pytest.raises(InputError):
            grade(q, bad)


def test_progress_scores_retry_and_reset(lessons):
    lesson = lessons[0]
    mc = lesson.questions[0]
    progress = new_progress()
    feedback, after_wrong = submit(progress, lesson, mc.id, (mc.correct_index + 1) % len(mc.choices))
    assert not feedback.correct
    assert progress == new_progress()  # the input is never changed
    assert lesson_score(after_wrong, lesson) == Score(0, 1, len(lesson.questions))
    _, after_retry = submit(after_wrong, lesson, mc.id, mc.correct_index)
    score = lesson_score(after_retry, lesson)
    assert (score.correct, score.answered) == (1, 1) and not score.complete
    assert json.loads(json.dumps(after_retry)) == after_retry  # plain, serialisable
    assert lesson_score(reset_lesson(after_retry, lesson), lesson).answered == 0
    with pytest.raises(KeyError):
        submit(after_retry, lesson, "no-such-question", 0)


def test_progress_from_a_session_is_read_defensively(lessons):
    lesson = lessons[0]
    junk = {"answers": {lesson.id: {lesson.questions[0].id: "yes", "ghost": True}, 7: [], "x": None}}
    assert lesson_score(junk, lesson).answered == 0
    assert lesson_score("not a dict", lesson).answered == 0
    _, cleaned = submit(junk, lesson, lesson.questions[0].id, lesson.questions[0].correct_index)
    assert cleaned["answers"] == {lesson.id: {"ghost": True, lesson.questions[0].id: True}}
    assert lesson_score(cleaned, lesson) == Score(1, 1, len(lesson.questions))


def _answer_all(lessons, wrong: int = 0):
    """Progress with every question answered, the first `wrong` of them wrongly."""
    progress = new_progress()
    n = 0
    for lesson in lessons:
        for q in lesson.questions:
            if isinstance(q, ChoiceQuestion):
                given = q.correct_index if n >= wrong else (q.correct_index + 1) % len(q.choices)
            else:
                given = q.answer if n >= wrong else q.answer + 10 * q.tolerance + 1
            _, progress = submit(progress, lesson, q.id, given)
            n += 1
    return progress, n


def test_course_score(lessons):
    progress, n = _answer_all(lessons, wrong=3)
    score = course_score(progress, lessons)
    assert (score.correct, score.answered, score.total) == (n - 3, n, n) and score.complete


# -- certificates -----------------------------------------------------------------------------


@pytest.fixture
def cert_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SPECLAB_CERT_SECRET", raising=False)
    return tmp_path / "cache"


def test_issue_and_verify_round_trip(cert_env):
    cert = issue("Ada Lovelace", 50, 54, dt.date(2026, 3, 1))
    assert (cert.name, cert.score, cert.total, cert.date) == ("Ada Lovelace", 50, 54, "2026-03-01")
    assert verify(cert)
    assert verify(from_code(to_code(cert)))
    assert verify(from_code("  " + to_code(cert)[:20] + "\n" + to_code(cert)[20:] + "  "))  # pasted with whitespace
    secret = cert_env / "certificate-secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert verify(issue("Ada Lovelace", 50, 54, dt.date(2026, 3, 1)))  # the stored secret is reused
    assert [p.name for p in cert_env.iterdir()] == ["certificate-secret"]  # no temp files left


@pytest.mark.parametrize(
    "change",
    [
        {"name": "Ada Lovelace "},
        {"name": "Grace Hopper"},
        {"score": 54},
        {"total": 50},
        {"date": "2026-03-02"},
        {"id": "0" * 32},
        {"score": "50"},
        {"date": "2026-3-1"},
        {"id": None},
    ],
)
def test_tampered_certificate_is_rejected(cert_env, change):
    cert = issue("Ada Lovelace", 50, 54, dt.date(2026, 3, 1))
    assert not verify(dataclasses.replace(cert, **change))


def test_tampered_code_is_rejected(cert_env):
    code = to_code(issue("Ada Lovelace", 50, 54, dt.date(2026, 3, 1)))
    payload = code.removeprefix("SDL1.")
    data = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    data["score"] = 54
    forged = "SDL1." + base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")
    assert not verify(from_code(forged))
    for garbage in ("", "hello", "SDL1.!!!", "SDL1." + "W" * 40, "SDL1.e30", "x" * 5000):
        with pytest.raises(InputError):
            from_code(garbage)


def test_another_secret_rejects_the_certificate(cert_env, monkeypatch):
    monkeypatch.setenv("SPECLAB_CERT_SECRET", "one secret that is long enough")
    cert = issue("Ada Lovelace", 50, 54, dt.date(2026, 3, 1))
    assert verify(cert)
    monkeypatch.setenv("SPECLAB_CERT_SECRET", "another secret, also long enough")
    assert not verify(cert)
    monkeypatch.delenv("SPECLAB_CERT_SECRET")
    assert not verify(cert)  # the per-install file secret is a third key


def test_names_are_limited(cert_env):
    assert issue("  Ada  ", 1, 1).name == "Ada"
    for bad in ("", "   ", "x" * 81, "Ada\nLovelace", "Ada\x00", "Ada\u202eecalevol", None):
        with pytest.raises(InputError):
            issue(bad, 1, 2)
    for score, total in ((3, 2), (-1, 2), (1, 0), (True, 2)):
        with pytest.raises(InputError):
            issue("Ada", score, total)


def test_hostile_name_is_escaped(cert_env):
    name = '<script>alert("x")</script><img src=x onerror=alert(1)>'
    cert = issue(name, 5, 5)
    page = certificate_html(cert)
    assert "<script>" not in page and "<img" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert cert.id in page and to_code(cert) in page
    assert verify(cert)


def test_completion_certificate_needs_every_answer(cert_env, lessons):
    partial, _ = submit(new_progress(), lessons[0], lessons[0].questions[0].id, 0)
    with pytest.raises(InputError, match="answer every question first"):
        completion_certificate(partial, lessons, "Ada")
    progress, n = _answer_all(lessons, wrong=2)
    cert = completion_certificate(progress, lessons, "Ada", dt.date(2026, 3, 1))
    assert (cert.score, cert.total) == (n - 2, n) and verify(cert)
