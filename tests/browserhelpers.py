"""What the browser tests and tools/screenshots.py both do to the page (needs selenium)."""

from __future__ import annotations

from selenium.webdriver.common.keys import Keys


def pick(box, option: str) -> None:
    """Pick an option of a gradio dropdown by typing it into the dropdown's input `box`."""
    box.click()
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(option)
    box.send_keys(Keys.ENTER)
