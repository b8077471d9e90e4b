"""Screenshots of every view, taken from the running app in headless Chromium (docs/*.png).

    python tools/screenshots.py                      # launches the app on a free port
    python tools/screenshots.py --url http://127.0.0.1:7860/ --out docs

Drives the page as a user would: first as a new visitor at 1440 x 900 (the first view, the first
scenario button then Compare: the verdict card; a losing scenario's verdict), then (type a prompt,
Step a sampled run a few times, run it to the
end, Compare greedy decoding with the baseline, open the charts, switch to the Chunked prefill
tab and compare two settings) and saves one PNG per view (the verify curve view too). The MTP tree is
shot only when the mtp drafter can run on the preset (it needs trained heads). Needs chromium
and chromedriver (apt: chromium chromium-driver) and selenium.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

from selenium import webdriver
from selenium.common.exceptions import TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from apphelpers import running_app  # noqa: E402
from browserhelpers import pick  # noqa: E402

from engine.drafters import DrafterSpec, build_drafter, drafter_names  # noqa: E402
from engine.errors import InputError  # noqa: E402
from engine.models import load_model  # noqa: E402

CHROME_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", "--force-device-scale-factor=1")
PROMPT = "Repeat this list twice, exactly, one item per line: apples, pears, plums, cherries, grapes, lemons."
SAMPLED_TEMPERATURE = 0.8  # sampling shows every token kind, the uniform draws and the residual
VERIFY_SHOT_STEP = 4  # the verify table is shot after this many Step clicks (a mid-run step)
MODEL_WAIT_S = 600  # a generation or a serving run on a busy CPU


class Page:
    """The app in one browser tab, addressed by the elem_ids the ui/ modules set."""

    def __init__(self, driver: webdriver.Chrome, out: Path):
        self.driver, self.out = driver, out

    def el(self, elem_id: str) -> WebElement:
        return self.driver.find_element(By.ID, elem_id)

    def text(self, elem_id: str) -> str:
        return self.el(elem_id).text

    def wait(self, condition, timeout: float = 60, what: str = "the page"):
        try:
            return WebDriverWait(self.driver, timeout, poll_frequency=0.5).until(lambda d: condition())
        except TimeoutException:
            raise TimeoutException(f"waited {timeout:.0f} s for {what}") from None

    def wait_text(self, elem_id: str, *needles: str, timeout: float = MODEL_WAIT_S) -> str:
        self.wait(lambda: any(n in self.text(elem_id) for n in needles), timeout, f"{needles} in #{elem_id}")
        return self.text(elem_id)

    def click(self, elem_id: str) -> None:
        self.el(elem_id).click()

    def type_into(self, elem_id: str, value: str) -> None:
        box = self.el(elem_id).find_element(By.CSS_SELECTOR, "textarea, input")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(Keys.DELETE)
        box.send_keys(value)
        box.send_keys(Keys.TAB)  # commit the value (change event)

    def set_number(self, elem_id: str, value: float) -> None:
        box = self.el(elem_id).find_element(By.CSS_SELECTOR, "input[type=number]")
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(str(value))
        box.send_keys(Keys.TAB)

    def choose(self, elem_id: str, option: str) -> None:
        box = self.el(elem_id).find_element(By.CSS_SELECTOR, "input")
        pick(box, option)
        self.wait(lambda: box.get_attribute("value") == option, 10, f"{option} in #{elem_id}")

    def open_accordion(self, elem_id: str) -> None:
        header = self.el(elem_id).find_element(By.CSS_SELECTOR, "button.label-wrap")
        if "open" not in header.get_attribute("class").split():
            header.click()
        time.sleep(0.5)

    def open_tab(self, label: str) -> None:
        tab = next(b for b in self.driver.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text == label)
        tab.click()
        time.sleep(1)

    def plots_drawn(self, elem_id: str, count: int = 1) -> None:
        self.wait(lambda: len(self.el(elem_id).find_elements(By.CSS_SELECTOR, ".js-plotly-plot")) >= count, 60,
                  f"plots in #{elem_id}")

    def shot(self, element: WebElement | str, name: str) -> Path:
        element = self.el(element) if isinstance(element, str) else element
        self.driver.execute_script("arguments[0].scrollIntoView({block: 'start'});", element)
        time.sleep(1.0)  # plotly transitions and fonts settle
        path = self.out / f"{name}.png"
        element.screenshot(str(path))
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        return path

    def tab_panel(self) -> WebElement:
        return next(p for p in self.driver.find_elements(By.CSS_SELECTOR, "[role=tabpanel]") if p.is_displayed())


def set_viewport(page: Page, width: int, height: int) -> None:
    """The page's viewport (not the window with its frame) at width x height."""
    page.driver.set_window_size(width, height)
    inner = page.driver.execute_script("return [window.innerWidth, window.innerHeight]")
    page.driver.set_window_size(2 * width - inner[0], 2 * height - inner[1])
    time.sleep(0.5)


def viewport_shot(page: Page, name: str) -> Path:
    page.driver.execute_script("window.scrollTo(0, 0)")
    time.sleep(1.0)
    path = page.out / f"{name}.png"
    page.driver.save_screenshot(str(path))
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path


def first_view(page: Page, size: tuple[int, int]) -> None:
    """What a new visitor sees at 1440 x 900: the page as it opens, then after the first scenario
    button and Compare (the verdict card in the first viewport); then a scenario that loses."""
    set_viewport(page, 1440, 900)
    viewport_shot(page, "playground-first-view")
    page.click("scenario-fix-typos")
    page.click("compare-btn")
    page.wait(lambda: "Medians of 3 runs" in page.text("verdict"), MODEL_WAIT_S, "the verdict card")
    viewport_shot(page, "playground-first-view-verdict")
    page.shot("verdict", "playground-verdict")
    print(f"verdict, first scenario: {page.text('verdict')}")
    page.click("scenario-open-question")
    page.wait_text("readout", "Nothing generated yet", timeout=30)
    page.click("compare-btn")
    page.wait(lambda: "Medians of 3 runs" in page.text("verdict"), MODEL_WAIT_S, "the verdict card")
    page.shot("verdict", "playground-verdict-mtp")
    print(f"verdict, open question: {page.text('verdict')}")
    set_viewport(page, *size)


def playground(page: Page) -> None:
    page.type_into("prompt", PROMPT)
    page.set_number("max-new-tokens", 64)
    page.set_number("temperature", SAMPLED_TEMPERATURE)
    for n in range(1, VERIFY_SHOT_STEP + 1):
        page.click("step-btn")
        page.wait_text("readout", f"in {n} target steps", "finished")
        # the drafts show first, then the verdict, then the charts follow: a click before that is ignored
        page.wait(lambda: not page.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-pending"), 60,
                  "the step's verdict")
        time.sleep(1.5)
    time.sleep(2)  # the verdict follows the drafts
    page.shot("verify-accordion", "playground-verify-table")
    page.click("run-btn")  # the same run, on to its end
    page.wait_text("readout", "finished")
    page.shot("token-stream", "playground-token-stream")
    page.shot(page.tab_panel(), "playground")

    page.set_number("temperature", 0)  # greedy: the comparison checks the outputs are identical
    page.open_accordion("compare-accordion")
    page.click("compare-btn")
    page.wait_text("compare-readout", "measured speedup", "stopped", "differ")
    page.shot("compare-accordion", "playground-compare")

    page.open_accordion("charts-accordion")  # the comparison's charts are drawn when it ends
    page.plots_drawn("charts-accordion", 5)
    page.shot("charts-accordion", "playground-acceptance-charts")
    page.shot("run-timeline", "playground-run-timeline")
    page.open_accordion("machine-accordion")  # this machine's verify curve, drawn with the charts
    page.plots_drawn("machine-accordion", 1)
    page.wait_text("machine-note", "with the measured verify cost", timeout=30)
    page.shot("machine-accordion", "playground-verify-curve")


def mtp_tree(page: Page) -> None:
    page.choose("method", "mtp")
    page.choose("tree", "small")
    page.set_number("max-new-tokens", 24)
    page.click("reset-btn")
    time.sleep(1)
    page.click("run-btn")
    page.wait_text("readout", "finished")
    page.plots_drawn("mtp-tree")
    page.shot("mtp-tree", "playground-mtp-tree")
    page.shot("output-line", "playground-output-line-tree")
    page.shot("token-stream", "playground-token-stream-tree")
    page.el("show-rejected").find_element(By.CSS_SELECTOR, "input").click()
    page.wait(lambda: not page.driver.find_elements(By.CSS_SELECTOR, "#token-stream .sdl-rejected"), 30,
              "rejected drafts hidden")
    page.shot("token-stream", "playground-token-stream-tree-kept")
    page.el("show-rejected").find_element(By.CSS_SELECTOR, "input").click()


def chunked_prefill(page: Page) -> None:
    page.open_tab("Chunked prefill")
    page.click("prefill-compare-btn")
    page.wait_text("prefill-progress", "Done.")
    page.plots_drawn("prefill-itl-dist")
    page.shot("prefill-timelines", "prefill-timelines")
    page.shot("prefill-summary", "prefill-summary")
    page.shot("prefill-latency", "prefill-ttft-itl")
    page.shot("prefill-itl-time", "prefill-itl-over-time")
    page.shot(page.tab_panel(), "prefill")


def prefix_cache(page: Page) -> None:
    """The chunked-prefill tab on doc-questions: A with the prefix cache, B without (both
    decode-first): A's timeline shows each later request's reused blocks in their own colour."""
    page.open_tab("Chunked prefill")
    page.choose("prefill-scenario", "doc-questions")
    page.el("prefill-policy-a").find_element(By.CSS_SELECTOR, "input[value='decode-first']").click()
    page.el("prefill-prefix-a").find_element(By.CSS_SELECTOR, "input").click()
    page.set_number("prefill-max-new", 4)
    page.click("prefill-compare-btn")
    page.wait_text("prefill-progress", "Done.")
    page.plots_drawn("prefill-itl-dist")
    page.shot("prefill-timelines", "prefill-prefix-cache-timelines")
    page.shot("prefill-summary", "prefill-prefix-cache-summary")
    page.shot("prefill-latency", "prefill-prefix-cache-ttft")


def mtp_available(preset: str) -> str | None:
    """Why the MTP tree cannot be shot on this preset, or None when it can."""
    if "mtp" not in drafter_names():
        return "the mtp drafter is not registered"
    try:
        build_drafter(load_model(preset), DrafterSpec("mtp", tree="small"))
    except InputError as err:
        return str(err)
    return None


def add_common_args(parser: argparse.ArgumentParser, height: int) -> None:
    """The options every screenshot tool takes."""
    parser.add_argument("--url", help="an app already running (default: launch one)")
    parser.add_argument("--out", default=str(ROOT / "docs"))
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=height)


@contextmanager
def open_app(args: argparse.Namespace) -> Iterator[Page]:
    """Headless Chromium on the app (args.url, or one launched for the duration), as a Page
    writing screenshots to args.out."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    options = webdriver.ChromeOptions()
    for flag in (*CHROME_FLAGS, f"--window-size={args.width},{args.height}",
                 f"--user-data-dir={tempfile.mkdtemp(prefix='speclab-chromium-')}"):
        options.add_argument(flag)
    with (nullcontext(args.url) if args.url else running_app()) as url:
        driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            driver.get(url)
            yield Page(driver, out)
        finally:
            driver.quit()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser, height=2400)
    parser.add_argument("--preset", default="embedded", help="the preset the app runs (for the MTP check)")
    parser.add_argument("--only", choices=["prefix-cache"], help="shoot only these views")
    args = parser.parse_args()
    with open_app(args) as page:
        page.wait_text("model-status", "Model ready", timeout=MODEL_WAIT_S)
        if args.only == "prefix-cache":
            prefix_cache(page)
            return 0
        first_view(page, (args.width, args.height))
        playground(page)
        reason = mtp_available(args.preset)
        if reason:
            print(f"skipped the MTP tree: {reason}")
        else:
            mtp_tree(page)
        chunked_prefill(page)
        prefix_cache(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
