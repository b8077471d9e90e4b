"""Playground tab: step through speculative decoding on a real model, or replay a saved trace."""

from __future__ import annotations

import time
from dataclasses import dataclass

import gradio as gr

from engine.acceptance import AcceptRule
from engine.decoding import MAX_K, DecodeConfig
from engine.drafters import DrafterSpec, drafter_names
from engine.errors import InputError
from engine.metrics import summary
from engine.models import load_model
from engine.run import RunRequest
from engine.sampling import SamplingConfig
from engine.session import RunSession
from engine.trace import trace_from_json, trace_to_json
from ui.common import as_float, as_int, default_preset, preset_choices, temp_file, user_errors
from visualizations import (
    accepted_histogram,
    per_position_chart,
    theory_chart_for,
    token_stream_html,
    tokens_vs_steps_chart,
    verify_view,
)

UI_MAX_NEW_TOKENS = 512  # the cap shown on the slider; the engine's own limit is higher
DEFAULT_PROMPT = "Rewrite this sentence in plain words: The quick brown fox jumps over the lazy dog."
PENDING_PAUSE_S = 0.35  # how long a step's drafts show before the verdict


def methods() -> list[str]:
    return ["baseline", *drafter_names()]


@dataclass
class PlaygroundState:
    """Per-browser-session state (kept in gr.State)."""

    session: RunSession | None = None
    settings: tuple | None = None  # the settings the session was started with
    render_ms: float = 0.0  # time to build the views of the last step


def build_request(prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw,
                  rule) -> RunRequest:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("the prompt is empty: type something to continue")
    if preset not in preset_choices():
        raise InputError(f"unknown preset {preset!r} (choose one of {', '.join(preset_choices())})")
    if method not in methods():
        raise InputError(f"unknown method {method!r}")
    max_new = as_int(max_new_tokens, "max new tokens")
    if max_new > UI_MAX_NEW_TOKENS:
        raise InputError(f"max new tokens is capped at {UI_MAX_NEW_TOKENS} here (got {max_new})")
    sampling = SamplingConfig(
        temperature=as_float(temperature, "temperature"), top_k=as_int(top_k, "top-k"),
        top_p=as_float(top_p, "top-p"), seed=as_int(seed, "seed"),
    )
    decode = DecodeConfig(max_new_tokens=max_new, k=as_int(k, "k"), adaptive=bool(adaptive), sampling=sampling,
                          rule=AcceptRule(rule))
    return RunRequest(prompt=prompt, model=preset, raw=bool(raw), decode=decode, drafter=DrafterSpec(method))


def readout(session: RunSession, render_ms: float) -> str:
    if not session.steps:
        if session.replay:
            return "Replaying a saved trace (no model): press Step or Play. Reset to go back to live runs."
        return "Nothing generated yet."
    m = summary(session.steps, session.prefill)
    last = session.steps[-1]
    parts = [
        f"**{m['output_tokens']} tokens** in {m['target_steps']} target steps",
        f"**{m['tokens_per_s']:.1f} tokens/s**" if m["tokens_per_s"] else "",
        f"TTFT **{m['ttft_ms']:.0f} ms**",
    ]
    if m["draft_acceptance_rate"] is not None:
        parts.append(f"acceptance **{m['draft_acceptance_rate']:.0%}**, "
                     f"**{m['mean_acceptance_length']:.2f}** tokens per step")
    parts.append(f"last step: model {1000 * (last.draft_s + last.verify_s):.0f} ms, render {render_ms:.1f} ms")
    if session.info.lossy:
        parts.append("**LOSSY acceptance: the output distribution is not the target's**")
    if session.replay:
        parts.append("replaying a saved trace (no model)")
    if session.finished:
        parts.append(f"finished ({session.stop_reason})")
    return " · ".join(p for p in parts if p)


def views(state: PlaygroundState, pending: bool = False):
    """Everything the tab shows for the current session: stream, readout, verify detail.
    pending: show the last step's drafts only, before its verdict."""
    session = state.session
    begin = time.perf_counter()
    steps = session.steps if session else []
    last = steps[-1] if steps else None
    if pending and last is not None:
        stream = token_stream_html(steps[:-1], pending=last)
    else:
        stream = token_stream_html(steps)
    detail = verify_view(last) if last is not None and last.k > 0 and not pending else None
    state.render_ms = (time.perf_counter() - begin) * 1000
    text = readout(session, state.render_ms) if session else "Nothing generated yet."
    if detail is None:
        return stream, text, None, None, None
    return stream, text, detail.table, detail.target_top, detail.residual


def charts(state: PlaygroundState):
    steps = state.session.steps if state.session else []
    return (per_position_chart(steps), accepted_histogram(steps), tokens_vs_steps_chart(steps),
            theory_chart_for(steps))


def _session_for(state: PlaygroundState | None, settings: tuple) -> PlaygroundState:
    """Continue the session if its settings are unchanged and it is not finished; else start anew."""
    state = state or PlaygroundState()
    session = state.session
    if session is None or session.finished or (not session.replay and state.settings != settings):
        if session is not None:
            session.close()
        request = build_request(*settings)
        load_model(request.model)
        state.session = RunSession.live(request)
        state.settings = settings
    return state


@user_errors
def step(state, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule):
    """One draft/verify round: the drafts appear, then the verdict."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule)
    state = _session_for(state, settings)
    record = state.session.advance()
    if record is not None and record.k > 0:
        yield (state, *views(state, pending=True))
        time.sleep(PENDING_PAUSE_S)
    yield (state, *views(state))


@user_errors
def play(state, speed_s, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw,
         rule):
    """Stream rounds live; speed_s is the pause between rounds (0: as fast as the model goes)."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule)
    state = _session_for(state, settings)
    pause = max(0.0, min(2.0, as_float(speed_s, "speed")))
    while state.session.advance() is not None:
        yield (state, *views(state))
        if pause:
            time.sleep(pause)
    yield (state, *views(state))


def reset(state):
    if state and state.session:
        state.session.close()
    return (PlaygroundState(), *views(PlaygroundState()), None)


def stop(state):
    if state and state.session:
        state.session.stop()
    return state


@user_errors
def download_trace(state):
    if not state or not state.session or not state.session.steps:
        raise InputError("nothing to download yet: run or step first")
    return temp_file("speclab-trace.json", trace_to_json(state.session.trace()))


@user_errors
def upload_trace(state, file):
    if file is None:
        raise InputError("no trace file was given")
    with open(file if isinstance(file, str) else file.name, "rb") as fh:
        data = fh.read(25_000_000)
    trace = trace_from_json(data)
    if state and state.session:
        state.session.close()
    state = PlaygroundState(session=RunSession.from_trace(trace))
    return (state, *views(state))


def build_playground():
    """Lay out the tab and wire it; returns the components other tabs (lessons) may preset."""
    state = gr.State(None)
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", lines=4, max_lines=12)
            with gr.Row():
                preset = gr.Dropdown(preset_choices(), value=default_preset(), label="Model preset")
                method = gr.Dropdown(methods(), value="prompt-lookup", label="Method (drafter)")
            with gr.Row():
                k = gr.Slider(1, MAX_K, value=4, step=1, label="k (draft length)")
                adaptive = gr.Checkbox(False, label="adaptive k")
            with gr.Row():
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature (0 = greedy)")
                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p")
            with gr.Row():
                top_k = gr.Number(0, label="top-k (0 = off)", precision=0)
                seed = gr.Number(0, label="seed", precision=0)
            max_new = gr.Slider(1, UI_MAX_NEW_TOKENS, value=64, step=1, label=f"max new tokens (cap {UI_MAX_NEW_TOKENS})")
            with gr.Row():
                raw = gr.Checkbox(False, label="raw text (no chat template)")
                rule = gr.Radio([r.value for r in AcceptRule], value="exact", label="acceptance (typical is LOSSY)")
            speed = gr.Slider(0, 2, value=0.3, step=0.05, label="play speed (pause between rounds, s)")
        with gr.Column(scale=2):
            with gr.Row():
                step_btn = gr.Button("Step", variant="primary", elem_id="step-btn")
                play_btn = gr.Button("Play", elem_id="play-btn")
                run_btn = gr.Button("Generate (run to end)", elem_id="run-btn")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
                reset_btn = gr.Button("Reset", elem_id="reset-btn")
            info = gr.Markdown("Nothing generated yet.", elem_id="readout", label="readout")
            stream = gr.HTML(token_stream_html([]), elem_id="token-stream", label="token stream")
            with gr.Accordion("Verify table of the last step", open=True):
                table = gr.Dataframe(label="drafted positions", interactive=False)
                top = gr.Dataframe(label="target's top-5 where it emitted its own token", interactive=False)
                residual = gr.Plot(label="residual distribution at the rejection")
            with gr.Accordion("Acceptance charts", open=False):
                charts_btn = gr.Button("Update charts")
                with gr.Row():
                    per_pos = gr.Plot()
                    hist = gr.Plot()
                with gr.Row():
                    tokens_steps = gr.Plot()
                    theory = gr.Plot()
            with gr.Accordion("Trace: download, or upload one to replay without a model", open=False):
                with gr.Row():
                    download_btn = gr.Button("Prepare download")
                    trace_file = gr.File(label="trace JSON", interactive=False)
                upload = gr.File(label="upload a trace JSON to replay", file_types=[".json"], type="filepath")

    settings = [prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new, raw, rule]
    shown = [state, stream, info, table, top, residual]
    step_btn.click(step, [state, *settings], shown, api_name="step", concurrency_id="model")
    play_btn.click(play, [state, speed, *settings], shown, api_name="play", concurrency_id="model")
    run_btn.click(play, [state, gr.Number(0.0, visible=False), *settings], shown, api_name="run", concurrency_id="model")
    stop_btn.click(stop, [state], [state], api_name="stop", queue=False)
    reset_btn.click(reset, [state], [*shown, trace_file], api_name="reset")
    charts_btn.click(charts, [state], [per_pos, hist, tokens_steps, theory], api_name="charts")
    download_btn.click(download_trace, [state], [trace_file], api_name="download_trace")
    upload.upload(upload_trace, [state, upload], shown, api_name="upload_trace")
    return {"prompt": prompt, "preset": preset, "method": method, "k": k, "temperature": temperature,
            "max_new_tokens": max_new, "state": state}
