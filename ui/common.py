"""Small helpers every tab shares: bad input as a UI error, settings from components."""

from __future__ import annotations

import functools
import inspect
import os
import re
import tempfile
from pathlib import Path

import gradio as gr

from engine.errors import InputError
from engine.models import preset_unavailable, presets


def default_preset() -> str:
    return os.environ.get("SPECLAB_PRESET", "embedded")


def preset_choices() -> list[str]:
    """The presets this machine can run: hub presets show only where their models are cached
    or the hub is reachable (engine.models.preset_unavailable)."""
    return [name for name in presets() if name == default_preset() or preset_unavailable(name) is None]


def check_preset(preset) -> None:
    """A preset from a request: known and runnable here, else a one-line reason."""
    if preset not in presets():
        raise InputError(f"unknown preset {preset!r} (choose one of {', '.join(preset_choices())})")
    reason = preset_unavailable(preset)
    if reason:
        raise InputError(reason)


# what HTML reads as the start of a tag or a character reference; any other < or & is plain text
_MARKUP = re.compile(r"<(?=[A-Za-z/!?])|&(?=[#A-Za-z0-9])")


def user_error(err: InputError) -> gr.Error:
    """The message as the page shows it. Gradio renders a message as HTML and messages quote what
    was sent (a trace file's values), so every < that could open a tag and every & that could
    open a character reference is escaped: markup shows as text, "k <= 16" stays as it is.

    >>> user_error(InputError("unknown value '<img src=x>' & k <= 16; a &amp; b")).message
    "unknown value '&lt;img src=x>' & k <= 16; a &amp;amp; b"
    """
    text = _MARKUP.sub(lambda m: "&lt;" if m.group() == "<" else "&amp;", str(err))
    return gr.Error(text, print_exception=False)


def user_errors(fn):
    """Turn bad input into a visible message (and an error for API clients), never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except InputError as err:
            raise user_error(err) from None

    @functools.wraps(fn)
    def gen_wrapper(*args, **kwargs):
        try:
            yield from fn(*args, **kwargs)
        except InputError as err:
            raise user_error(err) from None

    return gen_wrapper if inspect.isgeneratorfunction(fn) else wrapper


def as_int(value, name: str) -> int:
    """Numbers from UI components arrive as floats or None; refuse what is not an integer."""
    if value is None or (isinstance(value, float) and not value.is_integer()):
        raise InputError(f"{name} must be a whole number (got {value})")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a whole number (got {value!r})") from None


def as_float(value, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number (got {value!r})") from None


def temp_file(name: str, text: str) -> str:
    """Write a download into a fresh temp folder (one per call: sessions never share files)."""
    folder = Path(tempfile.mkdtemp(prefix="speclab-"))
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return str(path)
