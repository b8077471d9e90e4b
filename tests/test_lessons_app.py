"""The Lessons tab as learners reach it: the real app, driven through its API client.

Answers are graded on the server with instant feedback, a score and a retry; each session sees
the options of a choice question in its own order and answers by the option's text, never by its
position; the certificate is issued only after every question and verified (a tampered or foreign
one is rejected); every "try it" preset fills its tab with settings that tab accepts, and one runs
live on the model.
"""

import dataclasses
import re

import pytest
from gradio_client import Client

from apphelpers import running_app
from lessons import (
    COURSE_SEED,
    ChoiceQuestion,
    NumericQuestion,
    PlaygroundPreset,
    from_code,
    issue,
    load_lessons,
    shown_choices,
    to_code,
)
from ui.lessons import PLAYGROUND_FIELDS, PREFILL_FIELDS
from ui.playground import CHAIN, build_request
from ui.prefill import serve_config

pytestmark = pytest.mark.app

APP_SECRET = "lessons-app-test-secret-0123456789"
LESSONS = load_lessons()
GREEDY = next(lesson for lesson in LESSONS if lesson.id == "greedy-speculation")


@pytest.fixture(scope="module")
def url():
    with running_app({"SPECLAB_CERT_SECRET": APP_SECRET}) as url:
        yield url


def fresh(url) -> Client:
    """A new browser session: its own progress."""
    return Client(url, verbose=False)


def ask(client, lesson, i, given):
    """Answer question i (1-based): (feedback, lesson score, course overview, input update)."""
    return client.predict(given, api_name=f"/lesson{lesson.order}_q{i}")


def right(question) -> str:
    if isinstance(question, ChoiceQuestion):
        return question.choices[question.correct_index].text
    return f"{question.answer:.6f}"


def wrong(question) -> str:
    if isinstance(question, ChoiceQuestion):
        return question.choices[(question.correct_index + 1) % len(question.choices)].text
    return f"{question.answer + 10 * question.tolerance + 1:.6f}"


def numbered(lesson, kind):
    return [(i, q) for i, q in enumerate(lesson.questions, start=1) if isinstance(q, kind)]


def test_answers_get_instant_feedback_with_the_explanation_and_a_score(url):
    client = fresh(url)
    total = len(GREEDY.questions)
    (i, choice), *_ = numbered(GREEDY, ChoiceQuestion)
    picked = choice.choices[(choice.correct_index + 1) % len(choice.choices)]
    feedback, score, overview, locked = ask(client, GREEDY, i, picked.text)
    assert "Not quite" in feedback and picked.explanation in feedback
    assert choice.choices[choice.correct_index].text in feedback
    assert f"Score: 0 / {total}" in score and f"| {GREEDY.order}. {GREEDY.title} | 1 / {total} | 0 |" in overview
    assert locked["interactive"] is False
    with pytest.raises(Exception, match="answered already"):  # one answer per question until a retry
        ask(client, GREEDY, i, right(choice))

    (n1, first), (n2, second), *_ = numbered(GREEDY, NumericQuestion)
    with pytest.raises(Exception, match="enter a number"):  # not an answer: not counted
        ask(client, GREEDY, n1, "three")
    feedback, score, _, _ = ask(client, GREEDY, n1, right(first))
    assert "Correct" in feedback and first.explanation in feedback and f"Score: 1 / {total}" in score
    feedback, score, _, _ = ask(client, GREEDY, n2, wrong(second))
    assert "Not quite" in feedback and second.explanation in feedback
    assert f"Score: 1 / {total}" in score and f"{total - 3} questions to go" in score

    (n3, unanswered), *_ = [(n, q) for n, q in numbered(GREEDY, ChoiceQuestion) if n != i]
    with pytest.raises(Exception, match="pick one of the choices"):
        ask(client, GREEDY, n3, None)


def choice_questions() -> list[tuple[object, int, ChoiceQuestion]]:
    """(lesson, 1-based number, question) of every choice question, in page order."""
    return [(lesson, i, q) for lesson in LESSONS for i, q in numbered(lesson, ChoiceQuestion)]


def test_the_page_shows_options_shuffled_and_sends_their_text():
    """No server needed: the page's Radios as built, and the page-load event that reorders them."""
    import app

    config = app.build_app().config
    by_elem = {c["props"].get("elem_id"): c for c in config["components"] if "props" in c}
    radio_ids = []
    for lesson, i, question in choice_questions():
        radio = by_elem[f"lesson{lesson.order}-q{i}-answer"]
        shown = shown_choices(question, COURSE_SEED)
        assert radio["props"]["choices"] == [(text, text) for text in shown]  # the value is the text, not a position
        assert radio["props"]["type"] == "value"
        radio_ids.append(radio["id"])
    assert any(shown_choices(q, COURSE_SEED)[0] != q.choices[q.correct_index].text for _, _, q in choice_questions())
    (load,) = [d for d in config["dependencies"] if d.get("api_name") == "quiz_order"]
    assert [event for _, event in load["targets"]] == ["load"] and load["outputs"] == radio_ids


def session_order(client) -> list[list[str]]:
    """This session's options of every choice question, in its order on screen."""
    updates = client.predict(api_name="/quiz_order")
    return [[label for label, _ in update["choices"]] for update in updates]


def test_each_session_gets_its_own_order_and_answers_by_text(url):
    first, second = fresh(url), fresh(url)
    order, other = session_order(first), session_order(second)
    questions = choice_questions()
    assert len(order) == len(other) == len(questions)
    for shown, (_, _, q) in zip(order, questions, strict=True):
        assert sorted(shown) == sorted(c.text for c in q.choices)
    assert session_order(first) == order  # fixed for the session
    differing = sum(a != b for a, b in zip(order, other, strict=True))
    assert differing >= len(questions) // 2
    first_is_right = [shown[0] == right(q) for shown, (_, _, q) in zip(order, questions, strict=True)]
    assert not all(first_is_right)

    (lesson, i, question), shown = questions[0], order[0]
    with pytest.raises(Exception, match="not in the list of choices"):  # a position is not an answer
        ask(first, lesson, i, 0)
    assert right(question) in shown
    feedback, score, _, _ = ask(first, lesson, i, right(question))
    assert "Correct" in feedback and "Score: 1 /" in score
    (lesson, i, question) = questions[1]
    feedback, score, _, _ = ask(second, lesson, i, wrong(question))
    assert "Not quite" in feedback and "Score: 0 /" in score


def test_retry_clears_the_lesson_and_takes_answers_again(url):
    client = fresh(url)
    first = GREEDY.questions[0]
    ask(client, GREEDY, 1, right(first))
    n = len(GREEDY.questions)
    score, overview, *rest = client.predict(api_name=f"/lesson{GREEDY.order}_retry")
    inputs, feedback = rest[:n], rest[n:]
    assert f"Score: 0 / {n}" in score and f"| {GREEDY.order}. {GREEDY.title} | 0 / {n} | 0 |" in overview
    assert all(update["interactive"] is True for update in inputs) and feedback == [""] * n
    feedback, score, _, _ = ask(client, GREEDY, 1, right(first))
    assert "Correct" in feedback and f"Score: 1 / {n}" in score


def test_certificate_after_every_question_verified_and_tampering_rejected(url, monkeypatch):
    client = fresh(url)
    with pytest.raises(Exception, match="answer every question first"):
        client.predict("Ada", api_name="/certificate")
    total = sum(len(lesson.questions) for lesson in LESSONS)
    for lesson in LESSONS:
        for i, question in enumerate(lesson.questions, start=1):
            ask(client, lesson, i, wrong(question) if (lesson, i) == (GREEDY, 1) else right(question))
    name = "<script>alert(1)</script> Ada"
    html, code = client.predict(name, api_name="/certificate")
    assert "&lt;script&gt;alert(1)&lt;/script&gt; Ada" in html and "<script>" not in html
    assert f"{total - 1} / {total}" in html and code in html
    cert = from_code(code)
    assert (cert.name, cert.score, cert.total) == (name, total - 1, total)

    verdict = client.predict(code, api_name="/verify_certificate")
    assert "Genuine" in verdict and "&lt;script&gt;" in verdict and "<script>" not in verdict
    for change in ({"score": total}, {"name": "Ada"}, {"date": "2020-01-01"}, {"id": "0" * 32}):
        tampered = to_code(dataclasses.replace(cert, **change))
        verdict = client.predict(tampered, api_name="/verify_certificate")
        assert "Rejected" in verdict and "Genuine" not in verdict
    monkeypatch.setenv("SPECLAB_CERT_SECRET", "another-server-secret-0123456789")
    foreign = to_code(issue("Ada", total, total))  # well formed, signed with another key
    assert "Rejected" in client.predict(foreign, api_name="/verify_certificate")
    verdict = client.predict("SDL1.<b>not a code</b>", api_name="/verify_certificate")
    assert "Rejected" in verdict and "not a certificate code" in verdict and "<b>" not in verdict


def test_every_try_it_preset_fills_its_tab_with_settings_the_tab_accepts(url):
    client = fresh(url)
    for lesson in LESSONS:
        for j, preset in enumerate(lesson.try_it, start=1):
            returned = client.predict(api_name=f"/lesson{lesson.order}_try{j}")
            if isinstance(preset, PlaygroundPreset):
                got = dict(zip(PLAYGROUND_FIELDS, returned, strict=True))
                assert got == {"prompt": preset.prompt, "method": preset.method, "k": preset.k,
                               "adaptive": preset.adaptive, "temperature": preset.temperature, "top_k": 0,
                               "top_p": 1.0, "seed": preset.seed, "max_new_tokens": preset.max_new_tokens,
                               "raw": False, "rule": preset.rule.value, "tree": CHAIN,
                               "dtype": preset.dtype, "lookup_first": 0, "draft_stop": 0.0,
                               "fit_k": preset.fit_k}
                build_request(**got, preset="embedded")  # the playground's own checks pass
            else:
                got = dict(zip(PREFILL_FIELDS, returned, strict=True))
                assert (got["scenario"], got["policy"], got["max_new_tokens"]) == (preset.scenario, preset.policy, 0)
                if preset.chunk_size is None:  # policy none: the chunk-size field is left as it is
                    assert got["chunk_size"] == {"__type__": "update"}
                else:
                    assert got["chunk_size"] == preset.chunk_size
                    assert got["prefix_cache"] is preset.prefix_cache
                    serve_config(got["policy"], got["chunk_size"], got["max_new_tokens"], got["prefix_cache"])


@pytest.mark.embedded
def test_the_greedy_lessons_preset_runs_live_and_shows_identical_output(url):
    """Lesson 3's claim on the real model: greedy speculative output is the baseline's, token for token."""
    client = fresh(url)
    preset_index = next(j for j, p in enumerate(GREEDY.try_it, start=1) if p.method == "prompt-lookup")
    settings = dict(zip(PLAYGROUND_FIELDS, client.predict(api_name=f"/lesson{GREEDY.order}_try{preset_index}")))
    settings.update(preset="embedded", max_new_tokens=12)  # a short run keeps CI fast
    *_, readout = client.predict(api_name="/compare", **settings)
    assert "outputs identical" in readout and re.search(r"12 tokens", readout)
