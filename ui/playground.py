"""Playground tab: step through speculative decoding on a real model, or replay a saved trace."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import gradio as gr

from engine.acceptance import AcceptRule
from engine.decoding import MAX_K, DecodeConfig
from engine.drafters import DrafterSpec, drafter_names
from engine.errors import InputError
from engine import metrics
from engine.metrics import summary, verify_steps
from engine.models import DTYPE_CHOICES, load_model
from engine.run import MAX_PROMPT_CHARS, RunRequest
from engine.sampling import SamplingConfig
from engine.session import RunSession
from engine.mtp.tree import tree_shapes
from engine.trace import Step, trace_from_json, trace_to_json
from ui.common import as_float, as_int, default_preset, preset_choices, temp_file, user_errors
from ui.gpu import decode_whole, zero_gpu
from visualizations import (
    accepted_histogram,
    mtp_tree_figure,
    per_position_chart,
    theory_chart_for,
    token_stream_html,
    tokens_vs_steps_chart,
    trace_timeline,
    verify_curve_chart,
    verify_view,
)

UI_MAX_NEW_TOKENS = 512  # the cap shown on the slider; the engine's own limit is higher
DEFAULT_PROMPT = "Rewrite this sentence in plain words: The quick brown fox jumps over the lazy dog."
PENDING_PAUSE_S = 0.35  # how long a step's drafts show before the verdict
IDLE_STATE_S = 30 * 60  # a browser session idle this long loses its run (and the run's KV cache)
PROMPT_POLICY = (f"Up to {MAX_PROMPT_CHARS:,} characters. A prompt longer than the model's context is refused "
                 "with a message; a run stops when the context is full.")
PROB_DECIMALS = 4
CHAIN = "chain"  # the tree-shape choice for drafting a chain (every drafter but mtp drafts one)


def methods() -> list[str]:
    return ["baseline", *drafter_names()]


def tree_choices() -> list[str]:
    return [CHAIN, *tree_shapes()]


@dataclass
class Comparison:
    """Plain decoding (the baseline), then speculative decoding, on the same prompt and settings;
    run one after the other so neither slows the other down."""

    baseline: RunSession
    speculative: RunSession

    def sessions(self) -> list[RunSession]:
        return [self.baseline, self.speculative]


@dataclass
class PlaygroundState:
    """Per-browser-session state (kept in gr.State)."""

    session: RunSession | None = None
    settings: tuple | None = None  # the settings the session was started with
    render_ms: float = 0.0  # time to build the views of the last step
    compare: Comparison | None = None  # the last comparison; its speculative run becomes `session`

    def sessions(self) -> list[RunSession]:
        runs = [self.session, *(self.compare.sessions() if self.compare else ())]
        return [s for s in runs if s is not None]

    def close(self) -> None:
        for session in self.sessions():
            session.close()


def build_request(prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw,
                  rule, tree, dtype="auto") -> RunRequest:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("the prompt is empty: type something to continue")
    if preset not in preset_choices():
        raise InputError(f"unknown preset {preset!r} (choose one of {', '.join(preset_choices())})")
    if method not in methods():
        raise InputError(f"unknown method {method!r}")
    if tree not in tree_choices():
        raise InputError(f"unknown tree shape {tree!r} (choose one of {', '.join(tree_choices())})")
    if dtype not in DTYPE_CHOICES:
        raise InputError(f"unknown dtype {dtype!r} (choose one of {', '.join(DTYPE_CHOICES)})")
    max_new = as_int(max_new_tokens, "max new tokens")
    if max_new > UI_MAX_NEW_TOKENS:
        raise InputError(f"max new tokens is capped at {UI_MAX_NEW_TOKENS} here (got {max_new})")
    sampling = SamplingConfig(
        temperature=as_float(temperature, "temperature"), top_k=as_int(top_k, "top-k"),
        top_p=as_float(top_p, "top-p"), seed=as_int(seed, "seed"),
    )
    decode = DecodeConfig(max_new_tokens=max_new, k=as_int(k, "k"), adaptive=bool(adaptive), sampling=sampling,
                          rule=AcceptRule(rule))
    drafter = DrafterSpec(method, tree=None if tree == CHAIN else tree)
    return RunRequest(prompt=prompt, model=preset, raw=bool(raw), decode=decode, drafter=drafter, dtype=dtype)


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


def tree_view(steps: list[Step]):
    """The last step's MTP proposal tree with its accepted path, or None when the step drafted
    no tree (a chain, or another drafter)."""
    step = steps[-1]
    if not step.head_top or not step.draft_ranks:
        return None
    heads = [[(t.text, t.prob) for t in depth] for depth in step.head_top]
    accepted = step.accepted_nodes or tuple(range(step.accepted))
    path = step.draft_ranks[accepted[-1]] if accepted else ()
    root = steps[-2].emitted[-1].text if len(steps) > 1 else "context"
    return mtp_tree_figure(heads, path, tree=step.draft_ranks, root_text=root)


def views(state: PlaygroundState, pending: bool = False):
    """Everything the tab shows for the current session: stream, readout, verify detail, MTP tree.
    pending: show the last step's drafts only, before its verdict."""
    session = state.session
    begin = time.perf_counter()
    steps = session.steps if session else []
    last = steps[-1] if steps else None
    if pending and last is not None:
        stream = token_stream_html(steps[:-1], pending=last)
    else:
        stream = token_stream_html(steps)
    verdict_shown = last is not None and last.k > 0 and not pending
    detail = verify_view(last) if verdict_shown else None
    tree = tree_view(steps) if verdict_shown else None
    state.render_ms = (time.perf_counter() - begin) * 1000
    text = readout(session, state.render_ms) if session else "Nothing generated yet."
    tree_update = gr.update(value=tree, visible=tree is not None)
    if detail is None:
        return stream, text, None, None, None, tree_update
    return stream, text, rounded(detail.table), rounded(detail.target_top), detail.residual, tree_update


def rounded(table):
    """Probabilities shown to 4 decimals (the values stay exact for API clients)."""
    return table.style.format(precision=PROB_DECIMALS, na_rep="")


def side_readout(label: str, session: RunSession) -> str:
    if not session.steps:
        return f"**{label}**: {'stopped' if session.finished else 'waiting'}"
    m = summary(session.steps, session.prefill)
    rate = f"**{m['tokens_per_s']:.1f} tokens/s**" if m["tokens_per_s"] else "…"
    done = " · finished" if session.finished else ""
    return f"**{label}**: {m['output_tokens']} tokens in {m['target_steps']} target steps · {rate}{done}"


def speedups(c: Comparison) -> tuple[float, float | None] | None:
    """Measured wall-clock speedup of the speculative run over the baseline: end to end
    (tokens/s with the prefill), and decode only (after the first token); None until both ran."""
    base = summary(c.baseline.steps, c.baseline.prefill)
    spec = summary(c.speculative.steps, c.speculative.prefill)
    if not base["tokens_per_s"] or not spec["tokens_per_s"]:
        return None
    decode = None
    if base["decode_tokens_per_s"] and spec["decode_tokens_per_s"]:
        decode = spec["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    return spec["tokens_per_s"] / base["tokens_per_s"], decode


def identity_check(c: Comparison) -> str:
    """Greedy speculative decoding must reproduce plain greedy decoding token for token."""
    base, spec = c.baseline.trace().output_token_ids, c.speculative.trace().output_token_ids
    if not c.speculative.request.decode.sampling.greedy:
        return ("sampled (temperature > 0): the two outputs may differ; speculative sampling keeps the "
                "target's distribution, not its draws")
    if base == spec:
        return f"✓ **outputs identical**: {len(spec)} tokens, token for token"
    diverge = next((i for i, (a, b) in enumerate(zip(base, spec)) if a != b), min(len(base), len(spec)))
    return f"✗ **outputs differ** from output token {diverge}"


def comparison_readout(c: Comparison) -> str:
    lines = [side_readout("baseline", c.baseline), side_readout(f"speculative ({c.speculative.info.method})",
                                                                c.speculative)]
    if c.baseline.stop_reason == "stopped" or c.speculative.stop_reason == "stopped":
        lines.append("stopped before both runs finished")
    elif c.baseline.finished and c.speculative.finished:
        lines.append(identity_check(c))
        ratios = speedups(c)
        if ratios:
            end_to_end, decode = ratios
            decode_text = f" (decode only {decode:.2f}×)" if decode else ""
            lines.append(f"measured speedup **{end_to_end:.2f}×** end to end{decode_text}, one run each")
        if c.speculative.info.lossy:
            lines.append("**LOSSY acceptance: the output distribution is not the target's**")
    return "\n\n".join(lines)


def compare_views(c: Comparison | None):
    if c is None:
        return token_stream_html([], legend=False), token_stream_html([]), "Nothing compared yet."
    return (token_stream_html(c.baseline.steps, legend=False), token_stream_html(c.speculative.steps),
            comparison_readout(c))


def machine_note(session: RunSession | None, baseline_step_s: float | None = None) -> str:
    """What the target runs in on this machine, what verifying k drafts costs here (the run's
    measured verify curve), and the predicted speedup with that cost next to the textbook one."""
    if session is None:
        return "Run something: the verify curve is measured when the model loads (a few seconds, once per model and dtype)."
    info = session.info
    lines = [f"Target **{info.dtype}** on **{info.device}**: {info.dtype_reason or 'no reason recorded'}."]
    if info.batch_invariant:
        lines.append("Batch-invariant kernels: a position's logits are bitwise the same whether it is computed alone, "
                     "in a k + 1-token verification, a tree or a prefill chunk, so greedy speculative output is the "
                     "plain output token for token.")
    elif info.dtype != "float32":
        lines.append("Stock kernels: a position's logits can differ in the last bits with the number of tokens in a "
                     "forward, so a near-tie can make greedy speculative output differ from plain decoding.")
    k = info.k
    cost = metrics.verify_cost(info.verify_ms, k + 1)
    if cost is not None:
        verdict = ("about one step: the premise of speculation holds" if cost <= 1.15 else
                   "well over one step: each step must emit that many more tokens just to break even")
        lines.append(f"Verifying k = {k} drafts (one forward over {k + 1} tokens) costs **{cost:.2f}×** a one-token "
                     f"forward here: {verdict}. (Measured once, when the model loaded: the median of 3 forwards "
                     f"per point, the lower of two passes; on a busy or shared machine the points scatter by "
                     f"10-20 %.)")
    steps = session.steps
    rate, c = metrics.per_token_acceptance(steps), metrics.cost_ratio(steps, baseline_step_s)
    drafted = [s.k for s in verify_steps(steps) if s.k > 0]
    if rate is not None and c is not None and drafted:
        mean_k = round(statistics.mean(drafted))
        free = metrics.predicted_speedup(rate, mean_k, c)
        cost_k = metrics.verify_cost(info.verify_ms, mean_k + 1)
        measured = f"**{metrics.predicted_speedup(rate, mean_k, c, cost_k):.2f}×** with the measured verify cost, " \
            if cost_k is not None else ""
        lines.append(f"Predicted speedup of this run (a = {rate:.2f}, c = {c:.3f}, k = {mean_k}): {measured}"
                     f"{free:.2f}× if verification were free (Leviathan et al. 2023).")
    return "\n\n".join(lines)


def charts(state: PlaygroundState | None):
    """Acceptance charts and the timeline of the current run; after a comparison, its baseline
    joins the tokens-vs-steps chart and the theory chart shows the measured speedup."""
    state = state or PlaygroundState()
    session = state.session
    steps = session.steps if session else []
    prefill = session.prefill if session else []
    baseline, base_step_s, measured = [], None, None
    c = state.compare
    if c is not None and session is c.speculative and c.baseline.finished and verify_steps(c.baseline.steps):
        baseline = c.baseline.steps
        base_step_s = statistics.median(s.verify_s for s in verify_steps(baseline))
        ratios = speedups(c)
        measured = ratios[1] if ratios else None
    verify_ms = session.info.verify_ms if session else ()
    curve_k = session.info.k if session and session.info.method != "baseline" else None
    label = f"{session.info.model}, {session.info.dtype}" if session else ""
    return (per_position_chart(steps), accepted_histogram(steps), tokens_vs_steps_chart(steps, baseline),
            theory_chart_for(steps, baseline_step_s=base_step_s, measured_speedup=measured, verify_ms=verify_ms),
            trace_timeline(steps, prefill), verify_curve_chart(verify_ms, curve_k, label),
            machine_note(session, base_step_s))


def start_runs(requests: list[RunRequest]) -> list[RunSession]:
    """Runs to step through in turn: live (the model runs as they are stepped), or on ZeroGPU
    decoded whole in one GPU call and stepped through from their records (ui/gpu.py)."""
    if zero_gpu():
        return [RunSession.from_trace(trace, request) for trace, request in zip(decode_whole(tuple(requests)), requests)]
    load_model(requests[0].model, dtype=requests[0].dtype)
    return [RunSession.live(request) for request in requests]


def _session_for(state: PlaygroundState | None, settings: tuple) -> PlaygroundState:
    """Continue the session if its settings are unchanged and it is not finished; else start anew."""
    state = state or PlaygroundState()
    session = state.session
    if session is None or session.finished or (not session.replay and state.settings != settings):
        [run] = start_runs([build_request(*settings)])
        state.close()
        state.session, state.settings = run, settings
    return state


@user_errors
def step(state, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
         tree, dtype="auto"):
    """One draft/verify round: the drafts appear, then the verdict."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
                tree, dtype)
    state = _session_for(state, settings)
    record = state.session.advance()
    if record is not None and record.k > 0:
        yield (state, *views(state, pending=True))
        time.sleep(PENDING_PAUSE_S)
    yield (state, *views(state))


@user_errors
def play(state, speed_s, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw,
         rule, tree, dtype="auto"):
    """Stream rounds live; speed_s is the pause between rounds (0: as fast as the model goes)."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
                tree, dtype)
    state = _session_for(state, settings)
    pause = max(0.0, min(2.0, as_float(speed_s, "speed")))
    while state.session.advance() is not None:
        yield (state, *views(state))
        if pause:
            time.sleep(pause)
    yield (state, *views(state))


@user_errors
def compare(state, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
            tree, dtype="auto"):
    """Baseline, then speculative decoding, on the same prompt, each streamed live with its
    tokens/s; then the measured speedup and, for greedy decoding, whether the outputs are
    identical. The speculative run becomes the current run (verify table, charts, trace)."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
                tree, dtype)
    if method == "baseline":
        raise InputError("choose a drafter as the method: it is compared with the baseline")
    speculative = build_request(*settings)
    runs = start_runs([replace(speculative, drafter=DrafterSpec("baseline")), speculative])
    state = state or PlaygroundState()
    state.close()
    state.compare = Comparison(*runs)
    state.session, state.settings = None, None
    unchanged = [gr.skip()] * 6  # the current-run views wait until the speculative run is done
    for run in state.compare.sessions():  # one after the other, so each one's timing is its own
        while run.advance() is not None:
            yield (state, *unchanged, *compare_views(state.compare))
        if run.stop_reason == "stopped":
            break
    state.close()  # release the runs (after a Stop, the second one never started)
    state.session, state.settings = state.compare.speculative, settings
    yield (state, *views(state), *compare_views(state.compare))


def reset(state):
    if state:
        state.close()
    return (PlaygroundState(), *views(PlaygroundState()), None, *compare_views(None))


def stop(state):
    for session in state.sessions() if state else []:
        session.stop()
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
    if state:
        state.close()
    state = PlaygroundState(session=RunSession.from_trace(trace))
    return (state, *views(state))


def build_playground():
    """Lay out the tab and wire it; returns the components other tabs (lessons) may preset."""
    # each browser session gets its own copy from the start, so Stop reaches even a first run
    state = gr.State(PlaygroundState(), time_to_live=IDLE_STATE_S, delete_callback=PlaygroundState.close)
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            prompt = gr.Textbox(DEFAULT_PROMPT, label="Prompt", lines=4, max_lines=12, elem_id="prompt",
                                max_length=MAX_PROMPT_CHARS, info=PROMPT_POLICY)
            with gr.Row():
                preset = gr.Dropdown(preset_choices(), value=default_preset(), label="Model preset")
                method = gr.Dropdown(methods(), value="prompt-lookup", label="Method (drafter)", elem_id="method")
            with gr.Row():
                k = gr.Slider(1, MAX_K, value=4, step=1, label="k (draft length)")
                adaptive = gr.Checkbox(False, label="adaptive k")
            with gr.Row():
                temperature = gr.Slider(0, 2, value=0, step=0.05, label="temperature (0 = greedy)", elem_id="temperature")
                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p")
            with gr.Row():
                top_k = gr.Number(0, label="top-k (0 = off)", precision=0)
                seed = gr.Number(0, label="seed", precision=0)
            max_new = gr.Slider(1, UI_MAX_NEW_TOKENS, value=64, step=1,
                                label=f"max new tokens (cap {UI_MAX_NEW_TOKENS})", elem_id="max-new-tokens")
            with gr.Row():
                raw = gr.Checkbox(False, label="raw text (no chat template)")
                rule = gr.Radio([r.value for r in AcceptRule], value="exact", label="acceptance (typical is LOSSY)")
            tree = gr.Dropdown(tree_choices(), value=CHAIN, label="MTP tree shape (mtp, greedy only)", elem_id="tree")
            dtype = gr.Dropdown(list(DTYPE_CHOICES), value="auto", elem_id="dtype",
                                label="target dtype (auto: the fastest exact one on this machine)")
            speed = gr.Slider(0, 2, value=0.3, step=0.05, label="play speed (pause between rounds, s)")
        with gr.Column(scale=2):
            with gr.Row():
                step_btn = gr.Button("Step", variant="primary", elem_id="step-btn")
                play_btn = gr.Button("Play", elem_id="play-btn")
                run_btn = gr.Button("Generate (run to end)", elem_id="run-btn")
                compare_btn = gr.Button("Compare with baseline", elem_id="compare-btn")
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn")
                reset_btn = gr.Button("Reset", elem_id="reset-btn")
            info = gr.Markdown("Nothing generated yet.", elem_id="readout", label="readout")
            stream = gr.HTML(token_stream_html([]), elem_id="token-stream", label="token stream")
            with gr.Accordion("Verify table of the last step", open=True, elem_id="verify-accordion"):
                table = gr.Dataframe(label="drafted positions", interactive=False)
                top = gr.Dataframe(label="target's top-5 where it emitted its own token", interactive=False)
                residual = gr.Plot(label="residual distribution at the rejection")
                tree_plot = gr.Plot(label="MTP tree of the last step", visible=False, elem_id="mtp-tree")
            with gr.Accordion("Baseline vs speculative (same prompt, run one after the other)", open=False,
                              elem_id="compare-accordion"):
                compare_info = gr.Markdown("Nothing compared yet.", elem_id="compare-readout")
                with gr.Row():
                    base_stream = gr.HTML(token_stream_html([], legend=False), label="baseline",
                                          elem_id="compare-baseline")
                    spec_stream = gr.HTML(token_stream_html([]), label="speculative", elem_id="compare-speculative")
            with gr.Accordion("Acceptance charts and timeline", open=False, elem_id="charts-accordion"):
                charts_btn = gr.Button("Update charts")
                with gr.Row():
                    per_pos = gr.Plot()
                    hist = gr.Plot()
                tokens_steps = gr.Plot()
                theory = gr.Plot()
                timeline = gr.Plot(elem_id="run-timeline")
            with gr.Accordion("This machine: what verifying k drafts costs (the verify curve)", open=False,
                              elem_id="machine-accordion"):
                machine = gr.Markdown(machine_note(None), elem_id="machine-note")
                curve = gr.Plot(elem_id="verify-curve")
            with gr.Accordion("Trace: download, or upload one to replay without a model", open=False):
                with gr.Row():
                    download_btn = gr.Button("Prepare download")
                    trace_file = gr.File(label="trace JSON", interactive=False)
                upload = gr.File(label="upload a trace JSON to replay", file_types=[".json"], type="filepath")

    settings = [prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new, raw, rule, tree, dtype]
    shown = [state, stream, info, table, top, residual, tree_plot]
    compared = [base_stream, spec_stream, compare_info]
    chart_plots = [per_pos, hist, tokens_steps, theory, timeline, curve, machine]
    step_btn.click(step, [state, *settings], shown, api_name="step", concurrency_id="model")
    played = play_btn.click(play, [state, speed, *settings], shown, api_name="play", concurrency_id="model")
    ran = run_btn.click(play, [state, gr.Number(0.0, visible=False), *settings], shown, api_name="run",
                        concurrency_id="model")
    compared_run = compare_btn.click(compare, [state, *settings], [*shown, *compared], api_name="compare",
                                     concurrency_id="model")
    for event in (played, ran, compared_run):
        event.success(charts, [state], chart_plots, api_name=False)
    stop_btn.click(stop, [state], [state], api_name="stop", queue=False)
    reset_btn.click(reset, [state], [*shown, trace_file, *compared], api_name="reset")
    charts_btn.click(charts, [state], chart_plots, api_name="charts")
    download_btn.click(download_trace, [state], [trace_file], api_name="download_trace")
    upload.upload(upload_trace, [state, upload], shown, api_name="upload_trace")
    return {"prompt": prompt, "preset": preset, "method": method, "k": k, "temperature": temperature,
            "max_new_tokens": max_new, "state": state, "adaptive": adaptive, "seed": seed, "rule": rule,
            "top_k": top_k, "top_p": top_p, "raw": raw, "tree": tree, "dtype": dtype}
