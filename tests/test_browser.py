"""The page in a real browser: Debian's headless Chromium driven by Selenium (no browser
downloads). Steps a speculative decode and checks the token colours as the browser computes them,
shows model output that is HTML as text, answers a quiz question, and saves screenshots
(SPECLAB_SCREENSHOTS=<folder> keeps them; otherwise they go to the test's temp folder).

Skipped when chromium or chromedriver is missing, unless SPECLAB_REQUIRE_BROWSER=1 (CI).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from engine.acceptance import TokenKind
from engine.trace import EmittedToken, RunInfo, Step, Trace, trace_to_json
from lessons import ChoiceQuestion, load_lessons
from visualizations.style import KIND_COLORS, tint

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--window-size=1400,2000")
HOSTILE = "<img src=x onerror=alert(1)>"
UPLOAD = ("//*[contains(text(), 'upload a trace JSON')]/ancestor::*[contains(@class, 'block')][1]"
          "//input[@type='file']")
MODEL_WAIT_S = 300  # the first generation converts and loads the embedded model on a busy CPU
VISITOR_WINDOW = (1440, 900)  # a laptop screen: the first viewport a new visitor sees

pytestmark = [pytest.mark.browser, pytest.mark.app, pytest.mark.embedded]

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    if os.environ.get("SPECLAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"SPECLAB_REQUIRE_BROWSER=1 but {CHROMIUM} or {CHROMEDRIVER} is missing (make browser-deps)",
                    pytrace=False)
    pytest.skip("chromium and chromedriver are not installed (make browser-deps)", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from browserhelpers import pick  # noqa: E402


def rgb(color: str) -> str:
    """'#009E73' -> 'rgb(0, 158, 115)', as getComputedStyle reports colours."""
    r, g, b = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


class Page:
    def __init__(self, driver, shots: Path):
        self.driver, self.shots = driver, shots

    def el(self, elem_id: str):
        return self.driver.find_element(By.ID, elem_id)

    def wait(self, condition, what: str, timeout: float = MODEL_WAIT_S):
        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.25).until(lambda d: condition())
        except TimeoutException:
            raise AssertionError(f"waited {timeout:.0f} s for {what}") from None

    def wait_text(self, elem_id: str, *needles: str, timeout: float = MODEL_WAIT_S) -> str:
        self.wait(lambda: any(n in self.el(elem_id).text for n in needles), f"{needles} in #{elem_id}", timeout)
        return self.el(elem_id).text

    def type_into(self, elem_id: str, text: str) -> None:
        box = self.el(elem_id).find_element(By.CSS_SELECTOR, "textarea, input")
        box.send_keys(Keys.CONTROL, "a", Keys.DELETE)
        box.send_keys(text, Keys.TAB)  # TAB commits the value

    def set_number(self, elem_id: str, value: float) -> None:
        box = self.el(elem_id).find_element(By.CSS_SELECTOR, "input[type=number]")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(str(value), Keys.TAB)

    def choose(self, elem_id: str, option: str) -> None:
        box = self.el(elem_id).find_element(By.CSS_SELECTOR, "input")
        pick(box, option)
        self.wait(lambda: box.get_attribute("value") == option, f"{option} in #{elem_id}", 10)

    def open_tab(self, label: str) -> None:
        tab = next(b for b in self.driver.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text == label)
        tab.click()

    def shot(self, name: str) -> Path:
        path = self.shots / f"browser-{name}.png"
        self.driver.save_screenshot(str(path))
        return path

    def spans(self, kind: str) -> list:
        return self.driver.find_elements(By.CSS_SELECTOR, f"#token-stream span.sdl-{kind}")


@pytest.fixture(scope="module")
def app_url():
    from apphelpers import running_app

    with running_app() as url:
        yield url


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("SPECLAB_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def browser(url: str, shots: Path, profile: Path, size: tuple[int, int] | None = None) -> Iterator[Page]:
    """A fresh browser session (its own profile, so its own gradio session) on the app."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        if size:  # the viewport (what the page gets), not the window with its frame
            driver.set_window_size(*size)
            inner = driver.execute_script("return [window.innerWidth, window.innerHeight]")
            driver.set_window_size(2 * size[0] - inner[0], 2 * size[1] - inner[1])
        driver.get(url)
        page = Page(driver, shots)
        page.wait(lambda: driver.find_elements(By.ID, "step-btn"), "the playground")
        yield page
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture(scope="module")
def page(app_url, shots, tmp_path_factory):
    with browser(app_url, shots, tmp_path_factory.mktemp("chromium-profile")) as page:
        yield page


@pytest.fixture
def visitor(app_url, shots, tmp_path):
    """A new visitor at 1440 x 900: a fresh session, nothing run yet."""
    with browser(app_url, shots, tmp_path / "profile", size=VISITOR_WINDOW) as page:
        yield page


def test_stepping_a_speculative_decode_shows_coloured_tokens(page):
    page.type_into("prompt", "Repeat exactly: red, green, blue, red, green, blue.")
    page.set_number("max-new-tokens", 24)
    for n in range(1, 5):
        page.el("step-btn").click()
        shown = page.wait_text("readout", f"in {n} target steps", "finished")
        # the drafts show first, the verdict follows; a click before it would be ignored
        page.wait(lambda: not page.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-pending"),
                  "the step's verdict", 30)
        if "finished" in shown:
            break
    page.wait(lambda: page.spans("accepted") or page.spans("recovered") or page.spans("bonus"),
              "a verified draft in the stream", 30)
    first = page.spans("target")[0]  # step 0: the prefill's token
    assert page.driver.execute_script("return getComputedStyle(arguments[0]).borderBottomColor", first) == \
        rgb(KIND_COLORS["target"])
    for kind in ("accepted", "recovered", "bonus"):
        for span in page.spans(kind)[:1]:
            style = page.driver.execute_script(
                "const s = getComputedStyle(arguments[0]); return [s.backgroundColor, s.borderBottomColor]", span)
            assert style == [rgb(tint(KIND_COLORS[kind])), rgb(KIND_COLORS[kind])], kind
    page.el("token-stream").location_once_scrolled_into_view
    page.shot("stepped")


def test_model_output_that_is_html_shows_as_text(page):
    page.el("reset-btn").click()
    page.wait_text("readout", "Nothing generated yet", timeout=60)
    page.type_into("prompt", f"Repeat exactly: {HOSTILE}")
    page.set_number("max-new-tokens", 16)
    page.el("run-btn").click()
    page.wait_text("readout", "finished")
    stream = page.el("token-stream")
    assert "<img␣src=x␣onerror=alert(1)>" in stream.text.replace("\n", "")  # the model echoed it, as text
    assert not page.driver.find_elements(By.CSS_SELECTOR, "img[src='x']")  # no element was made of it
    stream.location_once_scrolled_into_view
    page.shot("hostile-output")


def hostile_trace() -> str:
    """A trace whose one token has a kind that is markup: refused, and the message quotes it."""
    info = RunInfo(model="m", method="baseline", drafter="none", k=0, adaptive=False, temperature=0.0, top_k=0,
                   top_p=1.0, seed=0, max_new_tokens=1, prefill_chunk=0, device="cpu", dtype="float32",
                   prompt_text="hi", prompt_token_ids=(1,))
    token = EmittedToken(7, "x", TokenKind.BONUS, 1.0, ())
    step = Step(index=0, drafter="prefill", k=0, draft_token_ids=(), draft_texts=(), draft_probs=(), target_probs=(),
                accept_probs=(), accept_uniforms=(), sample_uniform=None, accepted=0, emitted=(token,),
                residual_top=(), draft_top=(), kv_len_before=0, kv_len_after=1, draft_s=0.0, verify_s=0.1, end_s=0.1)
    data = json.loads(trace_to_json(Trace(info, (), (step,), "max_new_tokens")))
    data["steps"][0]["emitted"][0]["kind"] = HOSTILE
    return json.dumps(data)


def test_a_hostile_trace_upload_gets_a_message_and_no_markup(page, tmp_path):
    trace = tmp_path / "hostile.json"
    trace.write_text(hostile_trace())
    accordion = next(b for b in page.driver.find_elements(By.CSS_SELECTOR, "button.label-wrap")
                     if b.text.startswith("Trace: download"))
    page.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", accordion)
    accordion.click()  # its contents are drawn when it opens
    upload = page.wait(lambda: page.driver.find_elements(By.XPATH, UPLOAD), "the trace upload", 30)[0]
    upload.send_keys(str(trace))
    message = page.wait_text("verdict", "unknown value", timeout=60)  # in place, where the verdict goes
    page.driver.execute_script("window.scrollTo(0, 0)")
    page.shot("hostile-trace-message")
    assert HOSTILE in message and not error_badges(page)
    assert not page.driver.find_elements(By.CSS_SELECTOR, "img[src='x']")


def test_answering_a_quiz_question(page):
    lesson = min(load_lessons(), key=lambda lesson: lesson.order)
    i, question = next((i, q) for i, q in enumerate(lesson.questions, start=1) if isinstance(q, ChoiceQuestion))
    page.open_tab("Lessons")
    answer = page.wait(lambda: page.driver.find_elements(By.ID, f"lesson{lesson.order}-q{i}-answer"), "the quiz", 30)[0]
    page.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", answer)
    correct = question.choices[question.correct_index].text
    option = next(label for label in answer.find_elements(By.CSS_SELECTOR, "label") if label.text.strip() == correct)
    option.click()
    time.sleep(0.5)  # the choice reaches the server with the click below
    page.el(f"lesson{lesson.order}-q{i}-check").click()
    page.wait_text(f"lesson{lesson.order}-q{i}-feedback", "Correct", timeout=60)
    assert "Score: 1 /" in page.el(f"lesson{lesson.order}-score").text
    page.shot("quiz")


def in_first_viewport(page: Page, elem_id: str) -> bool:
    """Is the element wholly visible without scrolling (page at its top)?"""
    return page.driver.execute_script(
        "const r = arguments[0].getBoundingClientRect();"
        "return window.scrollY === 0 && r.height > 0 && r.top >= 0 && r.bottom <= window.innerHeight;",
        page.el(elem_id))


def error_badges(page: Page) -> list:
    """Gradio's red "Error" badges that are visible on the page."""
    return [b for b in page.driver.find_elements(By.CSS_SELECTOR, "[data-testid=status-tracker] .error")
            if b.is_displayed()]


def test_a_new_visitor_presses_the_first_scenario_then_compare_and_sees_the_verdict(visitor):
    first = visitor.driver.find_elements(By.CSS_SELECTOR, "#scenarios button")[0]
    assert first.get_attribute("id") == "scenario-fix-typos" and in_first_viewport(visitor, "compare-btn")
    first.click()
    visitor.wait_text("scenario-expect", "Copy-editing", timeout=30)
    visitor.set_number("compare-rounds", 2)
    visitor.el("compare-btn").click()
    card = visitor.wait(lambda: visitor.driver.find_elements(By.CSS_SELECTOR, "#verdict .speclab-verdict"),
                        "the verdict card")[0]
    visitor.wait(lambda: "Medians of 2 runs" in card.text, "both rounds")
    visitor.driver.execute_script("window.scrollTo(0, 0)")
    time.sleep(0.5)
    visitor.shot("first-view-verdict")
    assert in_first_viewport(visitor, "verdict")
    speedup = float(card.find_element(By.CSS_SELECTOR, "[data-speedup]").get_attribute("data-speedup"))
    assert speedup > 0 and f"{speedup:.2f}" in card.text
    for label in ("plain decoding (baseline)", "tokens/s", "tokens per target step", "identical", "Why it"):
        assert label in card.text, label
    assert visitor.el("output-line").text.strip()  # the clean output, above the annotated stream


def test_compare_is_offered_only_for_a_drafter(visitor):
    visitor.choose("method", "baseline")
    visitor.wait(lambda: not visitor.el("compare-btn").is_enabled(), "Compare disabled", 30)
    visitor.choose("method", "prompt-lookup")
    visitor.wait(lambda: visitor.el("compare-btn").is_enabled(), "Compare enabled", 30)


def test_an_error_shows_in_place_and_no_badge_covers_the_views(visitor):
    visitor.type_into("prompt", " ")
    visitor.el("step-btn").click()
    visitor.wait_text("verdict", "the prompt is empty", timeout=60)
    time.sleep(1)
    visitor.shot("error-in-place")
    assert not error_badges(visitor)
    assert in_first_viewport(visitor, "verdict")
    visitor.type_into("prompt", "Repeat exactly: one, two, three.")
    visitor.set_number("max-new-tokens", 8)
    visitor.driver.execute_script("arguments[0].click()", visitor.el("run-btn"))
    visitor.wait_text("readout", "finished")
    assert "the prompt is empty" not in visitor.el("verdict").text  # a good run replaces the message


def test_a_settings_change_or_lesson_preset_clears_the_run_shown(visitor):
    visitor.set_number("max-new-tokens", 8)
    visitor.el("run-btn").click()
    visitor.wait_text("readout", "finished")
    visitor.set_number("k", 3)  # any run setting
    visitor.wait_text("readout", "Nothing generated yet", timeout=30)
    assert "Settings changed" in visitor.el("verdict").text
    assert not visitor.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-stream [data-step]")
    visitor.el("run-btn").click()
    visitor.wait_text("readout", "finished")
    visitor.open_tab("Lessons")
    try_it = visitor.wait(lambda: visitor.driver.find_elements(By.ID, "lesson1-try1"), "a try-it button", 30)[0]
    visitor.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", try_it)
    try_it.click()
    visitor.wait(lambda: visitor.el("step-btn").is_displayed(), "the playground", 30)
    visitor.wait_text("readout", "Nothing generated yet", timeout=30)
    assert not visitor.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-stream [data-step]")


def plot_points(page: Page, elem_id: str) -> int:
    """How many data points the plotly chart inside the element draws."""
    return page.driver.execute_script(
        "const p = document.querySelector('#' + arguments[0] + ' .js-plotly-plot');"
        "return p && p.data ? p.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0) : -1;", elem_id)


def test_charts_follow_every_step_and_reset(visitor):
    header = visitor.el("charts-accordion").find_element(By.CSS_SELECTOR, "button.label-wrap")
    visitor.driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", header)
    header.click()
    visitor.set_number("max-new-tokens", 16)
    counts = []
    for n in (1, 2, 3):
        visitor.el("step-btn").click()
        visitor.wait_text("readout", f"in {n} target steps", "finished")
        visitor.wait(lambda: plot_points(visitor, "run-timeline") > (counts[-1] if counts else 0),
                     "the timeline to follow the step", 60)
        counts.append(plot_points(visitor, "run-timeline"))
    visitor.el("reset-btn").click()
    visitor.wait(lambda: plot_points(visitor, "run-timeline") < counts[-1], "the timeline to clear", 60)


def test_rejected_drafts_can_be_hidden(visitor):
    visitor.type_into("prompt", "Explain in two sentences why the sea is salty.")
    visitor.set_number("max-new-tokens", 24)
    visitor.el("run-btn").click()
    visitor.wait_text("readout", "finished")
    shown = len(visitor.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-rejected"))
    visitor.el("show-rejected").find_element(By.CSS_SELECTOR, "input").click()
    visitor.wait(lambda: not visitor.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-rejected"),
                 "rejected drafts hidden", 30)
    assert shown > 0  # prompt lookup drafted and the target rejected some, before the toggle


def quiz_order(page: Page) -> list[str]:
    """The option labels of every choice question of every lesson, in the order shown."""
    page.open_tab("Lessons")
    page.wait(lambda: page.driver.find_elements(By.CSS_SELECTOR, "[id^=lesson][id$=-answer]"), "the quiz", 30)
    order = []
    for answer in page.driver.find_elements(By.CSS_SELECTOR, "[id^=lesson][id$=-answer]"):
        labels = answer.find_elements(By.CSS_SELECTOR, "label")
        order.append("|".join(label.get_attribute("textContent").strip() for label in labels))
    return [o for o in order if o]


def test_quiz_options_are_shuffled_per_learner(app_url, shots, tmp_path):
    orders = []
    for name in ("one", "two"):
        with browser(app_url, shots, tmp_path / name, size=VISITOR_WINDOW) as learner:
            time.sleep(2)  # the session's order arrives with the page's load event
            orders.append(quiz_order(learner))
    options = [[sorted(o.split("|")) for o in order] for order in orders]
    assert len(orders[0]) >= 3 and options[0] == options[1]  # the same questions with the same options
    assert orders[0] != orders[1]  # in another order (two sessions agreeing on every question: ~1e-4)
