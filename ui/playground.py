"""Playground tab: step through speculative decoding on a real model, or replay a saved trace."""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, replace

import gradio as gr

from engine.acceptance import AcceptRule
from engine.decoding import MAX_K, DecodeConfig
from engine.drafters import DrafterSpec, drafter_names
from engine.drafters.base import LOOKUP_DRAFTERS
from engine.errors import InputError
from engine import metrics
from engine.metrics import summary, verify_steps
from engine.models import DTYPE_CHOICES, load_model
from engine.run import MAX_PROMPT_CHARS, RunRequest
from engine.sampling import SamplingConfig
from engine.session import RunSession
from engine.mtp.tree import tree_shapes
from engine.trace import Step, trace_from_json, trace_to_json
from ui.common import (
    as_float,
    as_int,
    check_preset,
    default_preset,
    preset_choices,
    temp_file,
    user_error,
    user_errors,
)
from ui.compare import DEFAULT_ROUNDS, MAX_ROUNDS, Comparison, plain_step_s, round_order, verdict
from ui.gpu import decode_whole, zero_gpu
from ui.scenarios import Scenario, load_scenarios, spec_bench_examples
from visualizations import (
    accepted_histogram,
    mtp_tree_figure,
    output_line_html,
    per_position_chart,
    theory_chart_for,
    token_stream_html,
    tokens_vs_steps_chart,
    trace_timeline,
    verify_curve_chart,
    verify_view,
)
from visualizations.verdict import estimate_card_html, notice_html, verdict_card_html

UI_MAX_NEW_TOKENS = 512  # the cap shown on the slider; the engine's own limit is higher
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
class PlaygroundState:
    """Per-browser-session state (kept in gr.State)."""

    session: RunSession | None = None
    settings: tuple | None = None  # the settings the session was started with
    render_ms: float = 0.0  # time to build the views of the last step
    compare: Comparison | None = None  # the last comparison; its first speculative run becomes `session`

    def sessions(self) -> list[RunSession]:
        runs = [self.session, *(self.compare.sessions() if self.compare else ())]
        return [s for s in runs if s is not None]

    def close(self) -> None:
        for session in self.sessions():
            session.close()


def build_request(prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw,
                  rule, tree, dtype="auto", lookup_first=0, draft_stop=0.0, fit_k=False) -> RunRequest:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError("the prompt is empty: type something to continue")
    check_preset(preset)
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
    decode = DecodeConfig(max_new_tokens=max_new, k=as_int(k, "k"), adaptive=bool(adaptive), fit_k=bool(fit_k),
                          sampling=sampling, rule=AcceptRule(rule))
    drafter = DrafterSpec(method, tree=None if tree == CHAIN else tree, lookup_first=as_int(lookup_first, "lookup first"),
                          draft_stop=as_float(draft_stop, "draft stop"))
    return RunRequest(prompt=prompt, model=preset, raw=bool(raw), decode=decode, drafter=drafter, dtype=dtype)


READOUT_DEFINITIONS = (
    "_draft acceptance rate_ = accepted drafts ÷ drafted tokens · _tokens per step_ = output tokens ÷ target "
    "steps (counts the recovered or bonus token; plain decoding: 1.00) · _α_ (theory chart) = accepted ÷ "
    "examined drafts, the per-token chance in Leviathan et al.'s formula (drafts after a rejection are never "
    "examined, so α ≥ the acceptance rate)"
)


def readout(session: RunSession, render_ms: float) -> str:
    if not session.steps:
        if session.replay:
            return "Replaying a saved trace (no model): press Step or Play. Reset to go back to live runs."
        return "Nothing generated yet."
    m = summary(session.steps, session.prefill)
    last = session.steps[-1]
    plain = session.info.method == "baseline"
    parts = [
        f"**{m['output_tokens']} tokens** in {m['target_steps']} target steps",
        f"**{m['tokens_per_s']:.1f} tokens/s**" if m["tokens_per_s"] else "",
        f"TTFT **{m['ttft_ms']:.0f} ms**",
    ]
    if m["draft_acceptance_rate"] is not None:
        parts.append(f"draft acceptance rate **{m['draft_acceptance_rate']:.0%}**, "
                     f"**{m['mean_acceptance_length']:.2f}** tokens per step")
    looked_up = sum(1 for s in session.steps if s.index > 0 and s.drafter not in (session.info.drafter, "none"))
    if looked_up:  # lookup-first: some steps were prompt lookup's
        parts.append(f"prompt lookup drafted **{looked_up}** of {m['target_steps'] - 1} steps, "
                     f"{session.info.drafter} the rest")
    if session.info.fit_k:
        used = [s.k for s in verify_steps(session.steps) if s.k > 0]
        if used:
            parts.append(f"draft length fitted to this machine: **{statistics.mean(used):.1f}** drafts per step "
                         f"({min(used)}-{max(used)}, k = {session.info.k} at most)")
    what = "target step" if plain or last.k == 0 else "draft + verify"
    parts.append(f"last step: {what} {1000 * (last.draft_s + last.verify_s):.0f} ms, render {render_ms:.1f} ms")
    if session.info.lossy:
        parts.append("**LOSSY acceptance: the output distribution is not the target's**")
    if session.replay:
        parts.append("replaying a saved trace (no model)")
    if session.finished:
        parts.append(f"finished ({session.stop_reason})")
    text = " · ".join(p for p in parts if p)
    return text if plain else f"{text}\n\n{READOUT_DEFINITIONS}"


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


def card(state: PlaygroundState) -> str:
    """What goes under the buttons: a comparison's verdict, or a finished speculative run's
    estimate from its measured parts."""
    session, c = state.session, state.compare
    if session is None:
        return ""
    if c is not None and session is c.speculative:
        result = verdict(c)
        return verdict_card_html(result) if result else notice_html("Stopped before a round was complete.", "info")
    if session.info.method == "baseline" or not session.finished:
        return ""
    return estimate_card_html(session.info.method, metrics.step_economics(session.steps, session.info.verify_ms))


def views(state: PlaygroundState, pending: bool = False, show_rejected: bool = True):
    """Everything the tab shows for the current session: the card, the clean output, the
    annotated stream, the readout, the verify detail and the MTP tree.
    pending: show the last step's drafts only, before its verdict."""
    session = state.session
    begin = time.perf_counter()
    steps = session.steps if session else []
    last = steps[-1] if steps else None
    if pending and last is not None:
        stream = token_stream_html(steps[:-1], pending=last, show_rejected=show_rejected)
        line = output_line_html(steps[:-1])
    else:
        stream = token_stream_html(steps, show_rejected=show_rejected)
        line = output_line_html(steps)
    verdict_shown = last is not None and last.k > 0 and not pending
    detail = verify_view(last) if verdict_shown else None
    tree = tree_view(steps) if verdict_shown else None
    state.render_ms = (time.perf_counter() - begin) * 1000
    text = readout(session, state.render_ms) if session else "Nothing generated yet."
    tree_update = gr.update(value=tree, visible=tree is not None)
    head = (card(state), line, stream, text)
    if detail is None:
        return (*head, None, None, None, tree_update)
    return (*head, rounded(detail.table), rounded(detail.target_top), detail.residual, tree_update)


def blank_views():
    return views(PlaygroundState())


def rounded(table):
    """Probabilities shown to 4 decimals (the values stay exact for API clients)."""
    return table.style.format(precision=PROB_DECIMALS, na_rep="")


def side_readout(label: str, session: RunSession | None) -> str:
    if session is None or not session.steps:
        return f"**{label}**: {'stopped' if session is not None and session.finished else 'waiting'}"
    m = summary(session.steps, session.prefill)
    rate = f"**{m['tokens_per_s']:.1f} tokens/s**" if m["tokens_per_s"] else "…"
    done = " · finished" if session.finished else ""
    return f"**{label}**: {m['output_tokens']} tokens in {m['target_steps']} target steps · {rate}{done}"


def comparison_readout(c: Comparison) -> str:
    """The comparison in words (the card shows it large): each side, identical or not, speedup."""
    method = c.speculative.info.method if c.speculative else "speculative"
    lines = [side_readout("baseline", c.baseline), side_readout(f"speculative ({method})", c.speculative)]
    result = verdict(c)
    if c.stopped():
        lines.append("stopped before every round finished")
    if result is not None:
        if result.identical is None:
            lines.append("sampled (temperature > 0): the two outputs may differ; speculative sampling keeps the "
                         "target's distribution, not its draws")
        elif result.identical:
            lines.append(f"✓ **outputs identical**: {result.output_tokens} tokens, token for token, in every round")
        else:
            lines.append(f"✗ **outputs differ** from output token {result.diverge_at}")
        decode = f" (decode only {result.decode_speedup:.2f}×)" if result.decode_speedup else ""
        lines.append(f"measured speedup **{result.speedup:.2f}×** end to end{decode}, median of {result.rounds} "
                     f"interleaved round{'s' if result.rounds != 1 else ''}")
        if result.lossy:
            lines.append("**LOSSY acceptance: the output distribution is not the target's**")
    return "\n\n".join(lines)


def compare_views(c: Comparison | None):
    if c is None:
        return token_stream_html([], legend=False), token_stream_html([]), "Nothing compared yet."
    base = c.baseline.steps if c.baseline else []
    spec = c.speculative.steps if c.speculative else []
    return token_stream_html(base, legend=False), token_stream_html(spec), comparison_readout(c)


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
        verdict_text = ("about one step: the premise of speculation holds" if cost <= 1.15 else
                        "well over one step: each step must emit that many more tokens just to break even")
        lines.append(f"Verifying k = {k} drafts (one forward over {k + 1} tokens) costs **{cost:.2f}×** a one-token "
                     f"forward here: {verdict_text}. (Measured once, when the model loaded: the median of 3 forwards "
                     f"per point, the lower of two passes; on a busy or shared machine the points scatter by "
                     f"10-20 %.)")
    if info.fit_k:
        lines.append(f"Fitted draft lengths: each step drafts m of at most k = {k} tokens, the m that maximises the "
                     "expected tokens per step (from this run's acceptance so far) divided by the step's cost (this "
                     "curve at m + 1 tokens plus m drafts). Exact like any draft length: only the speed changes.")
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
    if c is not None and session is c.speculative and c.complete_pairs():
        baseline = c.baseline.steps
        base_step_s = plain_step_s(c)
        result = verdict(c)
        measured = result.decode_speedup if result else None
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
        state.session, state.settings, state.compare = run, settings, None
    return state


SHOWN = 9  # outputs of Step / Play / Run: state, card, output line, stream, readout, table, top, residual, tree
COMPARED = 3  # the comparison's own outputs: baseline stream, speculative stream, its readout
CHARTS = 7  # charts(): five plots, the verify curve and the machine note


def errors_in_place(outputs: int):
    """Bad input shows as a message where the verdict card goes, every other view left as it was;
    the error is still raised, so API clients (and the page's toast) get it too."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                yield from fn(*args, **kwargs)
            except InputError as err:
                yield (gr.skip(), notice_html(str(err)), *[gr.skip()] * (outputs - 2))
                error = user_error(err)
                error.visible = False  # shown in place already: no toast over the buttons
                raise error from None

        return wrapper

    return decorate


@errors_in_place(SHOWN)
def step(state, show_rejected, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens,
         raw, rule, tree, dtype="auto", lookup_first=0, draft_stop=0.0, fit_k=False):
    """One draft/verify round: the drafts appear, then the verdict."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
                tree, dtype, lookup_first, draft_stop, fit_k)
    state = _session_for(state, settings)
    record = state.session.advance()
    if record is not None and record.k > 0:
        yield (state, *views(state, pending=True, show_rejected=show_rejected))
        time.sleep(PENDING_PAUSE_S)
    yield (state, *views(state, show_rejected=show_rejected))


@errors_in_place(SHOWN)
def play(state, speed_s, show_rejected, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed,
         max_new_tokens, raw, rule, tree, dtype="auto", lookup_first=0, draft_stop=0.0, fit_k=False):
    """Stream rounds live; speed_s is the pause between rounds (0: as fast as the model goes)."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
                tree, dtype, lookup_first, draft_stop, fit_k)
    state = _session_for(state, settings)
    pause = max(0.0, min(2.0, as_float(speed_s, "speed")))
    while state.session.advance() is not None:
        yield (state, *views(state, show_rejected=show_rejected))
        if pause:
            time.sleep(pause)
    yield (state, *views(state, show_rejected=show_rejected))


def _live_side(c: Comparison, run: RunSession, label: str, show_rejected: bool):
    """The first round streams in the main views while it runs: the card says which side."""
    progress = notice_html(f"Compare, round 1 of {c.rounds}: {label} running (the stream below is this run); "
                           "the verdict follows when the round is complete.", "info")
    return (progress, output_line_html(run.steps), token_stream_html(run.steps, show_rejected=show_rejected),
            side_readout(label, run))


@errors_in_place(SHOWN + COMPARED)
def compare(state, rounds, show_rejected, prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed,
            max_new_tokens, raw, rule, tree, dtype="auto", lookup_first=0, draft_stop=0.0, fit_k=False):
    """Plain decoding, then speculative decoding, on the same prompt, `rounds` times in alternating
    order; the first round streams live. Then the verdict (medians over the rounds: tokens/s,
    speedup, tokens per step, identical or not, and why it won or lost), and the first round's
    speculative run becomes the current run (verify table, charts, trace)."""
    settings = (prompt, preset, method, k, adaptive, temperature, top_k, top_p, seed, max_new_tokens, raw, rule,
                tree, dtype, lookup_first, draft_stop, fit_k)
    if method == "baseline":
        raise InputError("choose a drafter as the method: it is compared with the baseline")
    n = as_int(rounds, "compare rounds")
    if not 1 <= n <= MAX_ROUNDS:
        raise InputError(f"compare rounds must be in 1..{MAX_ROUNDS} (got {n})")
    speculative = build_request(*settings)
    baseline = replace(speculative, drafter=DrafterSpec("baseline"))
    state = state or PlaygroundState()
    state.close()
    c = state.compare = Comparison(n)
    state.session, state.settings = None, settings
    rest = [gr.skip()] * (SHOWN - 5)  # the verify table and tree wait until the comparison is done
    for index in range(n):
        spec_first = round_order(index)[0]
        first, second = start_runs([speculative, baseline] if spec_first else [baseline, speculative])
        c.baselines.append(second if spec_first else first)
        c.speculatives.append(first if spec_first else second)
        for run in (first, second):
            label = f"speculative ({method})" if run is c.speculatives[-1] else "plain decoding (baseline)"
            while run.advance() is not None:
                if index == 0:
                    yield (state, *_live_side(c, run, label, show_rejected), *rest, *compare_views(c))
            if run.stop_reason == "stopped":
                break
        if c.stopped():
            break
        if index + 1 < n:
            result = verdict(c)
            running = notice_html(f"Round {index + 2} of {n} running (interleaved: the other side first)…", "info")
            shown = (verdict_card_html(result) if result else "") + running
            yield (state, shown, *[gr.skip()] * (SHOWN - 2), *compare_views(c))
    state.close()  # release the runs (after a Stop, the later ones never started)
    state.session, state.settings = c.speculative, settings
    yield (state, *views(state, show_rejected=show_rejected), *compare_views(c))


def reset(state):
    if state:
        state.close()
    return (PlaygroundState(), *blank_views(), None, *compare_views(None))


SETTINGS_CHANGED = ("Settings changed: the run shown before was cleared. Press Step, Play, Generate or Compare "
                    "to run with the new settings.")


def settings_changed(state, *settings):
    """A change of a run setting (by hand, a scenario, a lesson's try-it) clears what was shown, so
    a view never pairs a run with settings it was not made with. A change event that arrives after
    a run already started with these very settings (the click came right after the edit) changes
    nothing."""
    if state is not None and state.settings == settings and state.sessions():
        return (gr.skip(),) * (SHOWN + COMPARED + CHARTS)
    had_run = bool(state and state.sessions())
    if state:
        state.close()
    fresh = PlaygroundState()
    shown = list(blank_views())
    shown[0] = notice_html(SETTINGS_CHANGED, "info") if had_run else ""
    return (fresh, *shown, *compare_views(None), *charts(fresh))


def rerender(state, show_rejected):
    """The same run, drawn again (the rejected-drafts toggle)."""
    return views(state or PlaygroundState(), show_rejected=show_rejected)


def stop(state):
    for session in state.sessions() if state else []:
        session.stop()
    return state


@user_errors
def download_trace(state):
    if not state or not state.session or not state.session.steps:
        raise InputError("nothing to download yet: run or step first")
    return temp_file("speclab-trace.json", trace_to_json(state.session.trace()))


@errors_in_place(SHOWN)
def upload_trace(state, file):
    if file is None:
        raise InputError("no trace file was given")
    with open(file if isinstance(file, str) else file.name, "rb") as fh:
        data = fh.read(25_000_000)
    trace = trace_from_json(data)
    if state:
        state.close()
    state = PlaygroundState(session=RunSession.from_trace(trace))
    yield (state, *views(state))


def scenario_values(scenario: Scenario) -> dict:
    """The settings a scenario button sets (the model preset and dtype stay as chosen)."""
    return {"prompt": scenario.prompt, "method": scenario.method, "k": scenario.k, "adaptive": False,
            "temperature": scenario.temperature, "top_k": 0, "top_p": 1.0, "seed": 0,
            "max_new_tokens": scenario.max_new_tokens, "raw": False, "rule": AcceptRule.EXACT.value, "tree": CHAIN,
            "lookup_first": scenario.lookup_first, "draft_stop": scenario.draft_stop, "fit_k": scenario.fit_k}


def expectation(scenario: Scenario) -> str:
    return f"**{scenario.label}.** {scenario.expect} Press **Compare with baseline** to measure it."


SCENARIO_FIELDS = ("prompt", "method", "k", "adaptive", "temperature", "top_k", "top_p", "seed", "max_new_tokens",
                   "raw", "rule", "tree", "lookup_first", "draft_stop", "fit_k")


def choose_scenario(scenario: Scenario):
    values = scenario_values(scenario)
    return (expectation(scenario), *(values[f] for f in SCENARIO_FIELDS))


def build_playground():
    """Lay out the tab and wire it; returns the components other tabs (lessons) may preset."""
    # each browser session gets its own copy from the start, so Stop reaches even a first run
    state = gr.State(PlaygroundState(), time_to_live=IDLE_STATE_S, delete_callback=PlaygroundState.close)
    scenarios = load_scenarios()
    gr.Markdown("**Try a scenario** (sets the prompt, the method and k), then press **Compare with baseline**:")
    with gr.Row(elem_id="scenarios"):
        scenario_btns = [gr.Button(s.label, size="sm", elem_id=f"scenario-{s.id}",
                                   variant="primary" if i == 0 else "secondary") for i, s in enumerate(scenarios)]
    expect = gr.Markdown(expectation(scenarios[0]), elem_id="scenario-expect")
    with gr.Row():
        with gr.Column(scale=1, min_width=320):
            prompt = gr.Textbox(scenarios[0].prompt, label="Prompt", lines=4, max_lines=12, elem_id="prompt",
                                max_length=MAX_PROMPT_CHARS, info=PROMPT_POLICY)
            example = gr.Dropdown(list(spec_bench_examples()), value=None, label="Or a Spec-Bench prompt, by category",
                                  elem_id="spec-bench-example")
            with gr.Row():
                preset = gr.Dropdown(preset_choices(), value=default_preset(), label="Model preset", elem_id="preset")
                method = gr.Dropdown(methods(), value=scenarios[0].method, label="Method (drafter)", elem_id="method")
            with gr.Row():
                k = gr.Slider(1, MAX_K, value=scenarios[0].k, step=1, label="k (draft length)", elem_id="k")
                adaptive = gr.Checkbox(False, label="adaptive k")
                fit_k = gr.Checkbox(False, label="fit k to this machine", elem_id="fit-k",
                                    info="chains: each step drafts as far as pays on this machine's verify curve "
                                         "and the run's acceptance so far, k at most")
            with gr.Row():
                temperature = gr.Slider(0, 2, value=scenarios[0].temperature, step=0.05,
                                        label="temperature (0 = greedy)", elem_id="temperature")
                top_p = gr.Slider(0.05, 1, value=1, step=0.05, label="top-p")
            with gr.Row():
                top_k = gr.Number(0, label="top-k (0 = off)", precision=0)
                seed = gr.Number(0, label="seed", precision=0)
            max_new = gr.Slider(1, UI_MAX_NEW_TOKENS, value=scenarios[0].max_new_tokens, step=1,
                                label=f"max new tokens (cap {UI_MAX_NEW_TOKENS})", elem_id="max-new-tokens")
            with gr.Row():
                raw = gr.Checkbox(False, label="raw text (no chat template)")
                rule = gr.Radio([r.value for r in AcceptRule], value="exact", label="acceptance (typical is LOSSY)")
            tree = gr.Dropdown(tree_choices(), value=CHAIN, label="MTP tree shape (mtp, greedy only)", elem_id="tree")
            with gr.Row():
                lookup_first = gr.Slider(0, 4, value=0, step=1, label="prompt lookup first (n-gram length, 0 = off)",
                                         info=f"{', '.join(LOOKUP_DRAFTERS)}: where the last n tokens occurred before, "
                                              "copy what followed them and skip the model this step",
                                         elem_id="lookup-first")
                draft_stop = gr.Slider(0, 0.9, value=0, step=0.05, label="draft stop (confidence, 0 = off)",
                                       info="draft-model, early-exit, mtp chains: end the chain after a draft "
                                            "the drafter gives less than this probability", elem_id="draft-stop")
            dtype = gr.Dropdown(list(DTYPE_CHOICES), value="auto", elem_id="dtype",
                                label="target dtype (auto: the fastest exact one on this machine)")
            with gr.Row():
                speed = gr.Slider(0, 2, value=0.3, step=0.05, label="play speed (pause between rounds, s)")
                rounds = gr.Slider(1, MAX_ROUNDS, value=DEFAULT_ROUNDS, step=1, label="compare rounds (each side)",
                                   elem_id="compare-rounds")
        with gr.Column(scale=2):
            with gr.Row():
                # one row at 1440 px: the long labels get the room, the short ones their minimum
                compare_btn = gr.Button("Compare with baseline", variant="primary", elem_id="compare-btn", scale=2,
                                        min_width=150)
                step_btn = gr.Button("Step", elem_id="step-btn", min_width=70)
                play_btn = gr.Button("Play", elem_id="play-btn", min_width=70)
                run_btn = gr.Button("Generate (run to end)", elem_id="run-btn", scale=2, min_width=150)
                stop_btn = gr.Button("Stop", variant="stop", elem_id="stop-btn", min_width=70)
                reset_btn = gr.Button("Reset", elem_id="reset-btn", min_width=70)
            verdict_card = gr.HTML("", elem_id="verdict")
            output_line = gr.HTML(output_line_html([]), elem_id="output-line")
            info = gr.Markdown("Nothing generated yet.", elem_id="readout", label="readout")
            show_rejected = gr.Checkbox(True, label="show rejected drafts (struck through)", elem_id="show-rejected")
            stream = gr.HTML(token_stream_html([]), elem_id="token-stream", label="token stream")
            with gr.Accordion("Verify table of the last step", open=True, elem_id="verify-accordion"):
                table = gr.Dataframe(label="drafted positions", interactive=False)
                top = gr.Dataframe(label="target's top-5 where it emitted its own token", interactive=False)
                residual = gr.Plot(label="residual distribution at the rejection")
                tree_plot = gr.Plot(label="MTP tree of the last step", visible=False, elem_id="mtp-tree")
            with gr.Accordion("Baseline vs speculative: the first round's outputs", open=False,
                              elem_id="compare-accordion"):
                compare_info = gr.Markdown("Nothing compared yet.", elem_id="compare-readout")
                with gr.Row():
                    with gr.Column():
                        gr.Markdown("**Plain decoding (baseline)**: one token per target step")
                        base_stream = gr.HTML(token_stream_html([], legend=False), elem_id="compare-baseline")
                    with gr.Column():
                        gr.Markdown("**Speculative decoding**: drafts verified by the target")
                        spec_stream = gr.HTML(token_stream_html([]), elem_id="compare-speculative")
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

    fields = {"prompt": prompt, "preset": preset, "method": method, "k": k, "adaptive": adaptive,
              "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed, "max_new_tokens": max_new,
              "raw": raw, "rule": rule, "tree": tree, "dtype": dtype, "lookup_first": lookup_first,
              "draft_stop": draft_stop, "fit_k": fit_k}
    settings = list(fields.values())
    shown = [state, verdict_card, output_line, stream, info, table, top, residual, tree_plot]
    compared = [base_stream, spec_stream, compare_info]
    chart_plots = [per_pos, hist, tokens_steps, theory, timeline, curve, machine]
    stepped = step_btn.click(step, [state, show_rejected, *settings], shown, api_name="step", concurrency_id="model")
    played = play_btn.click(play, [state, speed, show_rejected, *settings], shown, api_name="play",
                            concurrency_id="model")
    ran = run_btn.click(play, [state, gr.Number(0.0, visible=False), show_rejected, *settings], shown, api_name="run",
                        concurrency_id="model")
    compared_run = compare_btn.click(compare, [state, rounds, show_rejected, *settings], [*shown, *compared],
                                     api_name="compare", concurrency_id="model")
    resetted = reset_btn.click(reset, [state], [*shown, trace_file, *compared], api_name="reset")
    uploaded = upload.upload(upload_trace, [state, upload], shown, api_name="upload_trace")
    for event in (stepped, played, ran, compared_run, uploaded):
        event.success(charts, [state], chart_plots, api_name=False, show_progress="hidden")
    resetted.then(charts, [state], chart_plots, api_name=False, show_progress="hidden")
    stop_btn.click(stop, [state], [state], api_name="stop", queue=False)
    charts_btn.click(charts, [state], chart_plots, api_name="charts")
    download_btn.click(download_trace, [state], [trace_file], api_name="download_trace")
    show_rejected.change(rerender, [state, show_rejected], shown[1:], api_name=False, show_progress="hidden")
    for component in settings:
        component.change(settings_changed, [state, *settings], [*shown, *compared, *chart_plots], api_name=False,
                         show_progress="hidden", trigger_mode="always_last", queue=False)
    method.change(lambda m: gr.Button(interactive=m != "baseline"), [method], [compare_btn], api_name=False,
                  queue=False, show_progress="hidden")
    example.change(lambda text: gr.skip() if not text else spec_bench_examples()[text], [example], [prompt],
                   api_name=False, queue=False, show_progress="hidden")
    scenario_fields = [fields[f] for f in SCENARIO_FIELDS]
    for scenario, button in zip(scenarios, scenario_btns):
        button.click(functools.partial(choose_scenario, scenario), None, [expect, *scenario_fields],
                     api_name=f"scenario_{scenario.id.replace('-', '_')}", queue=False)
    return {**fields, "state": state, "clear": (settings_changed, [state, *settings], [*shown, *compared, *chart_plots])}
