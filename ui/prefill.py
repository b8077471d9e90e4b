"""Chunked prefill tab: requests arrive, a policy packs prefill chunks and decodes into each
engine step; watch the timeline fill, then compare TTFT and ITL of two settings."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gradio as gr

from engine.errors import InputError
from engine.models import LoadedModel, load_model
from engine.serving import (
    Policy,
    RequestRecord,
    ServeConfig,
    ServeResult,
    ServeStep,
    Workload,
    builtin_workloads,
    load_workload,
    serve,
    summary,
)
from ui.common import as_int, check_preset, default_preset, preset_choices, user_errors
from ui.gpu import paced, serve_whole, zero_gpu
from visualizations import (
    itl_distribution_chart,
    itl_over_time_chart,
    serving_summary_table,
    serving_timeline,
    timeline_axes,
    ttft_chart,
)
from visualizations.latency import SUMMARY_COLUMNS

CHUNK_RANGE = (16, 2048)  # smaller chunks make a long prompt take hundreds of steps
MAX_NEW_RANGE = (0, 256)  # 0: each request keeps the scenario's own limit
REFRESH_S = 0.3  # how often the timeline is checked for progress while a run is going
PREFIX_LABEL = "prefix cache (reuse the KV of prompt prefixes already prefilled)"
IDLE_STATE_S = 30 * 60  # a browser session idle this long loses its state
PLOT_MIN_PX = 400  # two charts side by side on a desktop, one above the other on a phone
# the summary's columns (SUMMARY_COLUMNS), each wide enough for its longest header word: 1080 px
# in all, inside a desktop page; a phone scrolls the table rather than break words apart
SUMMARY_WIDTHS = ["220px", "80px", "80px", "100px", "100px", "100px", "100px", "100px", "110px", "100px"]


class ServeRun:
    """One serving run's records, collected on a background thread: live from the model, or
    replayed at their recorded pace from a run done whole in one GPU call (ZeroGPU). The serving
    loop runs on a real clock, so the UI must never hold it up between two steps: it only reads
    the records collected so far."""

    def __init__(self, workload: Workload, cfg: ServeConfig, records: Iterator[ServeStep | RequestRecord],
                 model: str, device: str, dtype: str):
        self.workload, self.cfg = workload, cfg
        self.model, self.device, self.dtype = model, device, dtype
        self.steps: list[ServeStep] = []
        self.finished: dict[str, RequestRecord] = {}
        self.error: Exception | None = None
        self._records = records
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="speclab-serve")
        self._thread.start()

    @classmethod
    def live(cls, target: LoadedModel, workload: Workload, cfg: ServeConfig) -> ServeRun:
        return cls(workload, cfg, serve(target, workload, cfg), target.name, target.device,
                   str(target.dtype).removeprefix("torch."))

    @classmethod
    def replay(cls, result: ServeResult) -> ServeRun:
        return cls(result.workload, result.config, paced(result), result.model, result.device, result.dtype)

    def _run(self) -> None:
        records = self._records
        try:
            for record in records:
                if self._stop.is_set():
                    break
                if isinstance(record, ServeStep):
                    self.steps.append(record)
                else:
                    self.finished[record.request_id] = record
        except Exception as err:  # handed to the UI thread, which raises it
            self.error = err
        finally:
            records.close()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout: float) -> bool:
        """True once the run has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def requests_so_far(self) -> list:
        """Finished requests' records, and the arrived unfinished ones as partial records."""
        now = self.steps[-1].end_s if self.steps else 0.0
        return [self.finished.get(r.request_id) or {"request_id": r.request_id, "cls": r.cls.value,
                                                    "arrival_s": r.arrival_s, "first_token_s": None}
                for r in self.workload.requests if r.request_id in self.finished or r.arrival_s <= now]

    def result(self) -> ServeResult:
        """The records of a completed run, as engine.serving.run_serve collects them."""
        requests = tuple(self.finished[r.request_id] for r in self.workload.requests)
        return ServeResult(
            model=self.model, device=self.device, dtype=self.dtype, workload=self.workload, config=self.cfg,
            token_budget=self.cfg.budget([r.prompt_tokens for r in requests]), steps=tuple(self.steps),
            requests=requests,
        )


class PrefillJob:
    """One press of Run or Compare: its settings run in turn until they end or it is stopped."""

    def __init__(self) -> None:
        self.stopped = False
        self.running: ServeRun | None = None

    def stop(self) -> None:
        self.stopped = True
        if self.running is not None:
            self.running.stop()


@dataclass
class PrefillState:
    """Per-browser-session state (kept in gr.State): the job in progress, so Stop can reach it."""

    job: PrefillJob | None = None

    def start(self) -> PrefillJob:
        """A new job; the session's previous one, if still going, is stopped."""
        self.stop()
        self.job = PrefillJob()
        return self.job

    def stop(self) -> None:
        if self.job is not None:
            self.job.stop()


def scenario_choices() -> list[str]:
    return builtin_workloads()


def describe(scenario: str) -> str:
    if scenario not in scenario_choices():
        return ""
    workload = load_workload(scenario)
    classes = [r.cls.value for r in workload.requests]
    counts = ", ".join(f"{classes.count(c)} {c}" for c in dict.fromkeys(classes))
    return f"{workload.description}\n\n{len(classes)} requests ({counts})."


def serve_config(policy, chunk_size, max_new_tokens, prefix_cache=False) -> ServeConfig:
    try:
        chosen = Policy(policy)
    except ValueError:
        raise InputError(f"unknown policy {policy!r} (choose one of {', '.join(p.value for p in Policy)})") from None
    chunk = as_int(chunk_size, "chunk size")
    if not CHUNK_RANGE[0] <= chunk <= CHUNK_RANGE[1]:
        raise InputError(f"chunk size must be in {CHUNK_RANGE[0]}..{CHUNK_RANGE[1]} tokens here (got {chunk})")
    max_new = as_int(max_new_tokens, "max new tokens")
    if not MAX_NEW_RANGE[0] <= max_new <= MAX_NEW_RANGE[1]:
        raise InputError(f"max new tokens must be in {MAX_NEW_RANGE[0]}..{MAX_NEW_RANGE[1]} (got {max_new})")
    return ServeConfig(policy=chosen, chunk_size=chunk, max_new_tokens=max_new or None, prefix_cache=bool(prefix_cache))


def setting_label(side: str, cfg: ServeConfig) -> str:
    cache = ", prefix cache" if cfg.prefix_cache else ""
    if cfg.policy is Policy.NONE:
        return f"{side}: none (no chunking){cache}"
    return f"{side}: {cfg.policy.value}, chunk {cfg.chunk_size}{cache}"


def progress_text(label: str, run: ServeRun) -> str:
    steps = run.steps
    clock = f" · {steps[-1].end_s:.2f} s" if steps else ""
    phase = "stopped" if run.stopped else "running"
    return (f"**{label}** ({phase}): {len(steps)} steps · {len(run.finished)}/{len(run.workload.requests)} "
            f"requests finished{clock}")


def final_views(results: dict[str, ServeResult]):
    runs = {label: result.requests for label, result in results.items()}
    table = serving_summary_table({label: summary(result) for label, result in results.items()})
    return table, ttft_chart(runs), itl_over_time_chart(runs), itl_distribution_chart(runs)


def shared_timelines(workload: Workload, runs: list[tuple[str, ServeRun]]) -> list:
    """The timelines of the settings run so far (None for one not started), on shared axes so
    they compare by eye: the same lanes (the workload's requests) and the same time range."""
    records = [(label, list(run.steps), run.requests_so_far()) for label, run in runs]
    axes = timeline_axes([(steps, reqs) for _, steps, reqs in records], workload.requests)
    drawn = [serving_timeline(steps, reqs, title=label, axes=axes) for label, steps, reqs in records]
    return drawn + [None] * (2 - len(drawn))  # settings A and B side by side


def serve_runs(preset: str, workload: Workload, configs: list[ServeConfig]) -> list[Callable[[], ServeRun]]:
    """How each config's run starts, in turn: live on the model, or on ZeroGPU all of them served
    now in one GPU call, each then replayed at its recorded pace (ui/gpu.py)."""
    if zero_gpu():
        return [functools.partial(ServeRun.replay, result) for result in serve_whole(preset, workload, tuple(configs))]
    target = load_model(preset)
    return [functools.partial(ServeRun.live, target, workload, cfg) for cfg in configs]


def _run_settings(state, preset, scenario, max_new_tokens, settings: list[tuple[str, object, object, object]]):
    """Run each (side, policy, chunk size, prefix cache) in turn on the same scenario, streaming
    its timeline."""
    check_preset(preset)
    if scenario not in scenario_choices():
        raise InputError(f"unknown scenario {scenario!r} (choose one of {', '.join(scenario_choices())})")
    configs = [(setting_label(side, cfg), cfg)
               for side, cfg in ((side, serve_config(p, c, max_new_tokens, pc)) for side, p, c, pc in settings)]
    workload = load_workload(scenario)
    starts = serve_runs(preset, workload, [cfg for _, cfg in configs])
    state = state or PrefillState()
    job = state.start()
    started: list[tuple[str, ServeRun]] = []
    results: dict[str, ServeResult] = {}
    waiting = [gr.skip()] * 4  # summary and latency charts come when the runs are done
    try:
        for (label, _), start in zip(configs, starts):
            if job.stopped:
                break
            run = job.running = start()
            started.append((label, run))
            drawn = None
            while not run.wait(REFRESH_S):
                progress = (len(run.steps), len(run.finished))
                if progress != drawn:  # redraw only when a step or a request has ended
                    yield (state, progress_text(label, run), *shared_timelines(workload, started), *waiting)
                    drawn = progress
            if run.error is not None:
                raise run.error
            if run.stopped:
                yield (state, progress_text(label, run), *shared_timelines(workload, started), *final_views(results))
                return
            results[label] = run.result()
    finally:
        job.stop()  # also when the page goes away mid-run
    done = " · ".join(f"**{label}**: {len(r.steps)} steps, {r.steps[-1].end_s:.2f} s" for label, r in results.items())
    yield (state, f"Done. {done}", *shared_timelines(workload, started), *final_views(results))


@user_errors
def run_setting(state, preset, scenario, max_new_tokens, policy, chunk_size, prefix_cache=False):
    """Run setting A on the scenario; the timeline fills as the engine steps."""
    yield from _run_settings(state, preset, scenario, max_new_tokens, [("A", policy, chunk_size, prefix_cache)])


@user_errors
def compare_settings(state, preset, scenario, max_new_tokens, policy, chunk_size, policy_b, chunk_size_b,
                     prefix_cache=False, prefix_cache_b=False):
    """Run setting A, then setting B, on the same scenario; timelines side by side, then TTFT and
    ITL of both."""
    yield from _run_settings(state, preset, scenario, max_new_tokens,
                             [("A", policy, chunk_size, prefix_cache), ("B", policy_b, chunk_size_b, prefix_cache_b)])


def stop(state):
    if state is not None:
        state.stop()
    return state


def build_prefill():
    """Lay out the tab and wire it; returns the components other tabs (lessons) may preset."""
    # each browser session gets its own copy from the start, so Stop reaches even a first run
    state = gr.State(PrefillState(), time_to_live=IDLE_STATE_S, delete_callback=PrefillState.stop)
    policies = [p.value for p in Policy]
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, min_width=280):
            preset = gr.Dropdown(preset_choices(), value=default_preset(), label="Model preset")
            scenario = gr.Dropdown(scenario_choices(), value="doc-arrives", label="Scenario", elem_id="prefill-scenario")
            max_new = gr.Slider(*MAX_NEW_RANGE, value=0, step=1, elem_id="prefill-max-new",
                                label="max new tokens per request (0 = the scenario's own)")
        with gr.Column(scale=2, min_width=240):
            gr.Markdown("**Setting A**")
            policy = gr.Radio(policies, value=Policy.NONE.value, label="policy", elem_id="prefill-policy-a")
            chunk_size = gr.Slider(*CHUNK_RANGE, value=256, step=16, label="chunk size (tokens)")
            prefix_cache = gr.Checkbox(False, label=PREFIX_LABEL, elem_id="prefill-prefix-a")
        with gr.Column(scale=2, min_width=240):
            gr.Markdown("**Setting B** (for the comparison)")
            policy_b = gr.Radio(policies, value=Policy.DECODE_FIRST.value, label="policy", elem_id="prefill-policy-b")
            chunk_size_b = gr.Slider(*CHUNK_RANGE, value=256, step=16, label="chunk size (tokens)")
            prefix_cache_b = gr.Checkbox(False, label=PREFIX_LABEL, elem_id="prefill-prefix-b")
        with gr.Column(scale=3, min_width=280):
            description = gr.Markdown(describe("doc-arrives"))
    with gr.Row():
        run_btn = gr.Button("Run A", variant="primary", elem_id="prefill-run-btn")
        compare_btn = gr.Button("Compare A, then B", elem_id="prefill-compare-btn")
        stop_btn = gr.Button("Stop", variant="stop", elem_id="prefill-stop-btn")
    progress = gr.Markdown("Choose a scenario and press Run.", elem_id="prefill-progress")
    with gr.Row(elem_id="prefill-timelines"):
        timeline_a = gr.Plot(label="timeline A", elem_id="prefill-timeline-a", min_width=PLOT_MIN_PX)
        timeline_b = gr.Plot(label="timeline B", elem_id="prefill-timeline-b", min_width=PLOT_MIN_PX)
    table = gr.Dataframe(headers=list(SUMMARY_COLUMNS), label="summary per setting", interactive=False, wrap=True,
                         column_widths=SUMMARY_WIDTHS, elem_id="prefill-summary")
    with gr.Row(elem_id="prefill-latency"):
        ttft = gr.Plot(label="TTFT", elem_id="prefill-ttft", min_width=PLOT_MIN_PX)
        itl_dist = gr.Plot(label="ITL distribution", elem_id="prefill-itl-dist", min_width=PLOT_MIN_PX)
    itl_time = gr.Plot(label="ITL over time", elem_id="prefill-itl-time")

    scenario.change(describe, [scenario], [description], api_name=False)
    shown = [state, progress, timeline_a, timeline_b, table, ttft, itl_time, itl_dist]
    common = [state, preset, scenario, max_new]
    run_btn.click(run_setting, [*common, policy, chunk_size, prefix_cache], shown, api_name="prefill_run",
                  concurrency_id="model")
    compare_btn.click(compare_settings, [*common, policy, chunk_size, policy_b, chunk_size_b, prefix_cache,
                                         prefix_cache_b], shown, api_name="prefill_compare", concurrency_id="model")
    stop_btn.click(stop, [state], [state], api_name="prefill_stop", queue=False)
    return {"scenario": scenario, "policy": policy, "chunk_size": chunk_size, "policy_b": policy_b,
            "chunk_size_b": chunk_size_b, "max_new_tokens": max_new, "preset": preset, "state": state,
            "prefix_cache": prefix_cache, "prefix_cache_b": prefix_cache_b}
