"""The model status line: visible while the model loads, then what was loaded and how fast."""

from __future__ import annotations

import time

import gradio as gr

from engine.errors import InputError
from engine.models import load_model
from ui.common import default_preset


def warm_up():
    yield f"⏳ Loading model `{default_preset()}` (the first start converts the embedded model, about 20 s)…"
    begin = time.perf_counter()
    try:
        loaded = load_model(default_preset())
    except InputError as err:
        yield f"⚠️ Could not load `{default_preset()}`: {err}"
        return
    dtype = str(loaded.dtype).removeprefix("torch.")
    yield (f"✅ Model ready: `{default_preset()}` on {loaded.device} ({dtype}), "
           f"{loaded.model.config.num_hidden_layers} layers · loaded in {time.perf_counter() - begin:.1f} s")


def build_status(demo: gr.Blocks) -> gr.Markdown:
    status = gr.Markdown("⏳ Starting…", elem_id="model-status")
    demo.load(warm_up, None, status, api_name=False)
    return status
