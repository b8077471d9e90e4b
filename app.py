"""Speculative Decoding Lab: the Gradio app. Composition only: tabs come from ui/.

Importing this module loads no model; models load on first use, once per process.
"""

from __future__ import annotations

import os

import gradio as gr

from ui.gate import build_gate
from ui.lessons import build_lessons
from ui.playground import build_playground
from ui.prefill import build_prefill
from ui.status import build_status

TITLE = "Speculative Decoding Lab"
# A failed event shows its message in place (the playground's card) and as a toast; gradio would
# also lay a red "Error" badge over every output of the event until the next good run.
CSS = '[data-testid="status-tracker"]:has(> .error) { display: none !important; }'
INTRO = (
    "Watch a **drafter** propose tokens and the **target model** verify them, step by step, on a real model. "
    "Greedy speculative output is token-for-token the plain output; sampled output keeps the target's distribution."
)


def build_app() -> gr.Blocks:
    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\n{INTRO}")
        build_status(demo)
        with gr.Tabs() as tabs:  # the lessons tab switches tabs: gr.Tabs(selected=...) as an output
            with gr.Tab("Playground", id="playground"):
                playground = build_playground()
            with gr.Tab("Chunked prefill", id="prefill"):
                prefill = build_prefill()
            with gr.Tab("Lessons", id="lessons"):
                build_lessons(playground, prefill, tabs)
            with gr.Tab("Gate", id="gate"):
                build_gate()
    demo.queue(default_concurrency_limit=int(os.environ.get("SPECLAB_CONCURRENCY", "2")), max_size=64)
    return demo


def main() -> None:
    demo = build_app()
    demo.launch(
        server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
        max_file_size="25mb",
        footer_links=["api"],
        css=CSS,
    )


if __name__ == "__main__":
    main()
