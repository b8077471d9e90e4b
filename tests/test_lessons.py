"""Lessons: the shipped lessons validate, the validator catches broken ones, grading, progress,
and certificates (issue, verify, tampering, hostile names)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import datetime as dt
import json
import stat

import pytest

from engine import metrics
from engine.errors import InputError
from lessons import (
    ChoiceQuestion,
    NumericQuestion,
    PlaygroundPreset,
    Score,
    certificate_html,
    completion_certificate,
    course_score,
    from_code,
    grade,
    issue,
    lesson_problems,
    lesson_score,
    load_lessons,
    new_progress,
    reset_lesson,
    submit,
    to_code,
    validate,
    verify,
)
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
)


@pytest.fixture(scope="module")
def lessons():
    return load_lessons()


# -- the shipped lessons --------------------------------------------------------------------


def test_shipped_lessons_validate(lessons):
    assert validate() == []
    assert tuple(lesson.id for lesson in lessons) == TOPICS
    assert [lesson.order for lesson in lessons] == list(range(1, 9))
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
    assert "8 lessons" in capsys.readouterr().out
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
        "prompt": "Which phase produces the first output token?",
        "choices": [choice("Prefill", correct=True), choice("Decode")],
    }
    numeric = {
        "id": "tokens",
        "kind": "numeric",
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
        "formula must be one of expected_tokens_per_step, predicted_speedup, percentile",
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
