"""Screenshots of the Lessons tab, taken from the running app in headless Chromium (docs/*.png).

    python tools/lesson_screenshots.py                      # launches the app on a free port
    python tools/lesson_screenshots.py --url http://127.0.0.1:7860/ --out docs

Works through the course as a learner would: answers lesson 3's first question wrongly and the
next ones rightly (feedback), presses a "try it" button (the playground opens with the preset),
answers every other question, issues a certificate (a name with HTML in it, shown escaped),
and verifies its code, then a tampered copy. Reuses the page driver of tools/screenshots.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tools")]

from screenshots import Page, add_common_args, open_app  # noqa: E402

from lessons import ChoiceQuestion, Lesson, Question, from_code, load_lessons, to_code  # noqa: E402

NAME = "Ada <b>Lovelace</b>"  # HTML in a name must come out as text
FEEDBACK_WAIT_S = 120


def pick(page: Page, elem_id: str, label: str) -> None:
    """Click the option of a Radio by its text."""
    options = page.el(elem_id).find_elements(By.CSS_SELECTOR, "label")
    next(option for option in options if option.text.strip() == label).click()


def window_shot(page: Page, name: str, top: WebElement | None = None) -> None:
    """The browser window, scrolled to `top` (else to the top of the page)."""
    if top is None:
        page.driver.execute_script("window.scrollTo(0, 0);")
    else:
        page.driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", top)
    time.sleep(1.0)
    path = page.out / f"{name}.png"
    page.driver.save_screenshot(str(path))
    print(f"wrote {path}")


def open_page(page: Page, label: str, elem_id: str) -> None:
    """Choose a page in the course list and wait until it shows."""
    pick(page, "lesson-picker", label)
    page.wait(lambda: any(el.is_displayed() for el in page.driver.find_elements(By.ID, elem_id)), 30,
              f"#{elem_id}")


def open_lesson(page: Page, lesson: Lesson) -> None:
    open_page(page, f"{lesson.order}. {lesson.title}", f"lesson-{lesson.id}")


def answer(page: Page, lesson: Lesson, i: int, question: Question, right: bool) -> str:
    prefix = f"lesson{lesson.order}-q{i}"
    if isinstance(question, ChoiceQuestion):
        index = question.correct_index if right else (question.correct_index + 1) % len(question.choices)
        pick(page, f"{prefix}-answer", question.choices[index].text)
    else:
        given = question.answer if right else question.answer + 10 * question.tolerance + 1
        page.type_into(f"{prefix}-answer", f"{given:.6f}")
    page.click(f"{prefix}-check")
    return page.wait_text(f"{prefix}-feedback", "Correct", "Not quite", timeout=FEEDBACK_WAIT_S)


def feedback_and_try_it(page: Page, lessons: tuple[Lesson, ...]) -> Lesson:
    lesson = next(lesson for lesson in lessons if lesson.id == "greedy-speculation")
    page.open_tab("Lessons")
    open_lesson(page, lesson)
    for i, question in enumerate(lesson.questions[:3], start=1):
        answer(page, lesson, i, question, right=i > 1)
    window_shot(page, "lesson-feedback", page.el(f"lesson{lesson.order}-try1"))

    page.click(f"lesson{lesson.order}-try1")
    preset = lesson.try_it[0]
    page.wait(lambda: page.el("prompt").find_element(By.CSS_SELECTOR, "textarea").get_attribute("value")
              == preset.prompt, 30, "the preset's prompt in the playground")
    window_shot(page, "lesson-try-it-playground")  # the whole window: the tab switch and the notice
    page.open_tab("Lessons")
    return lesson


def finish_course(page: Page, lessons: tuple[Lesson, ...], done: Lesson) -> None:
    for lesson in lessons:
        open_lesson(page, lesson)
        start = 4 if lesson is done else 1
        for i, question in enumerate(lesson.questions[start - 1:], start=start):
            answer(page, lesson, i, question, right=True)


def certificate(page: Page) -> str:
    open_page(page, "Certificate", "certificate-page")
    page.type_into("certificate-name", NAME)
    page.click("certificate-issue")
    page.wait_text("certificate", "This certifies", timeout=60)
    page.shot("certificate-page", "certificate")
    return page.el("certificate-code").find_element(By.CSS_SELECTOR, "textarea, input").get_attribute("value")


def verify(page: Page, code: str) -> None:
    open_page(page, "Verify a certificate", "verify-page")
    page.type_into("verify-code", code)
    page.click("verify-btn")
    page.wait_text("certificate-verdict", "Genuine", timeout=60)
    page.shot("verify-page", "certificate-verify")
    cert = from_code(code)
    page.type_into("verify-code", to_code(dataclasses.replace(cert, score=cert.total)))
    page.click("verify-btn")
    page.wait_text("certificate-verdict", "Rejected", timeout=60)
    page.shot("verify-page", "certificate-rejected")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, height=2000)
    args = parser.parse_args()
    lessons = load_lessons()
    with open_app(args) as page:
        page.wait(lambda: page.driver.find_elements(By.CSS_SELECTOR, "button[role=tab]"), 120, "the app")
        done = feedback_and_try_it(page, lessons)
        finish_course(page, lessons, done)
        verify(page, certificate(page))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
