"""Time the playground's rendering of a step against the model's time for that step.

    python tools/render_timing.py --preset embedded --method prompt-lookup --max-new-tokens 64

Runs one live session (ui.playground's own request and views) and, after every step, times
(a) the views the playground builds for it (token stream, readout, verify table, target top-5,
residual chart, MTP tree) and (b) the same plus gradio's postprocessing of those outputs into
what is sent to the browser. Model time is the step's draft + verify time from its record.
A microbenchmark: one process, one run; the browser's own drawing is not included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradio as gr  # noqa: E402

from engine.metrics import percentile  # noqa: E402
from engine.models import load_model  # noqa: E402
from engine.session import RunSession  # noqa: E402
from ui.playground import CHAIN, PlaygroundState, build_request, views  # noqa: E402
from ui.scenarios import load_scenarios  # noqa: E402

# the components the playground sends a step's views to, in views()' order
OUTPUTS = (gr.HTML(), gr.HTML(), gr.HTML(), gr.Markdown(), gr.Dataframe(), gr.Dataframe(), gr.Plot(), gr.Plot())


def postprocess(values) -> None:
    for component, value in zip(OUTPUTS, values):
        if isinstance(value, dict):  # a gr.update(): its value is what gets sent
            value = value.get("value")
        component.postprocess(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="embedded")
    parser.add_argument("--method", default="prompt-lookup")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree", default=CHAIN)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default=load_scenarios()[0].prompt)
    args = parser.parse_args()

    request = build_request(args.prompt, args.preset, args.method, args.k, False, 0, 0, 1.0, 0, args.max_new_tokens,
                            False, "exact", args.tree)
    target = load_model(request.model)
    state = PlaygroundState(session=RunSession.live(request))
    model_ms, view_ms, sent_ms = [], [], []
    while (step := state.session.advance()) is not None:
        begin = time.perf_counter()
        values = views(state)
        middle = time.perf_counter()
        postprocess(values)
        end = time.perf_counter()
        model_ms.append(1000 * (step.draft_s + step.verify_s))
        view_ms.append(1000 * (middle - begin))
        sent_ms.append(1000 * (end - begin))

    print(f"{args.method} k={args.k} on {args.preset} ({target.device}, {str(target.dtype).removeprefix('torch.')}): "
          f"{len(model_ms)} steps, {sum(len(s.emitted) for s in state.session.steps)} tokens")
    print(f"{'per step (ms)':<34}{'median':>9}{'p90':>9}{'max':>9}")
    for name, values in (("model (draft + verify)", model_ms), ("render: views", view_ms),
                         ("render: views + gradio postprocess", sent_ms)):
        print(f"{name:<34}{statistics.median(values):>9.2f}{percentile(values, 90):>9.2f}{max(values):>9.2f}")
    print(f"render / model (medians): {statistics.median(sent_ms) / statistics.median(model_ms):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
