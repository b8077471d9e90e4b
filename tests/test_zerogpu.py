"""ZeroGPU: a run is done whole in one GPU call, then stepped through from its records.

On tiny random models: what crosses to ZeroGPU's worker process (arguments, results, errors)
pickles, and a recorded run steps, stops and replays like a live one. Through the real app with
SPECLAB_ZEROGPU=1 (the ZeroGPU path without the spaces package; every call goes through pickle):
Step, Run, Play and Stop, Compare and the chunked-prefill tab give the live path's tokens and
views.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
import time
from pathlib import Path

import gradio as gr
import pytest

from apphelpers import PLAYGROUND, PREFILL, READOUT, play_then_stop, prefill_compare_then_stop, running_app
from engine.decoding import DecodeConfig
from engine.drafters import DrafterSpec
from engine.models import load_model
from engine.run import RunRequest
from engine.sampling import SamplingConfig
from engine.serving import Policy, ServeConfig, ServeStep, parse_workload, serve
from engine.session import RunSession
from ui.gpu import decode_whole, gpu, paced, serve_whole, zero_gpu
from ui.prefill import ServeRun

PROMPT = "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"


def round_trip(value):
    return pickle.loads(pickle.dumps(value))


def untimed(step):
    return dataclasses.replace(step, draft_s=0.0, verify_s=0.0, end_s=0.0)


@pytest.fixture(scope="module")
def requests(tiny_target, tiny_draft):
    """A greedy baseline and a sampled draft-model run, as a comparison sends them."""
    greedy = DecodeConfig(max_new_tokens=12, k=3, ignore_eos=True)
    sampled = DecodeConfig(max_new_tokens=12, k=3, sampling=SamplingConfig(temperature=1.0, seed=3), ignore_eos=True)
    return (RunRequest(PROMPT, model=tiny_target, raw=True, decode=greedy),
            RunRequest(PROMPT, model=tiny_target, raw=True, decode=sampled,
                       drafter=DrafterSpec("draft-model", draft=tiny_draft)))


def test_the_whole_run_call_pickles_both_ways(requests, one_thread):
    assert round_trip(requests) == requests
    traces = decode_whole(requests)
    assert len(traces) == 2 and all(t.steps for t in traces)
    assert round_trip(traces) == traces


def test_a_recorded_run_steps_like_a_live_run(requests, one_thread):
    for request, trace in zip(requests, decode_whole(requests)):
        recorded, live = RunSession.from_trace(trace, request), RunSession.live(request)
        while (step := live.advance()) is not None:
            assert untimed(recorded.advance()) == untimed(step)  # tokens, drafts, probabilities, draws
        assert recorded.advance() is None and recorded.stop_reason == live.stop_reason == "max_new_tokens"
        assert recorded.trace() == trace  # the GPU run's own timings
        assert recorded.request is request and not recorded.replay  # treated as a live run by the tab


def test_stop_ends_a_recorded_run_before_its_next_step_as_it_ends_a_live_run(requests, one_thread):
    request = requests[1]
    [trace] = decode_whole((request,))
    uploaded = RunSession.from_trace(trace)  # a replayed trace file: Stop ends its Play too
    assert uploaded.replay and uploaded.request is None
    for run in (RunSession.from_trace(trace, request), uploaded, RunSession.live(request)):
        run.advance()
        run.advance()
        run.stop()
        assert run.advance() is None and run.stop_reason == "stopped" and len(run.steps) == 2


TINY_WORKLOAD = {
    "name": "tiny", "raw": True, "ignore_eos": True,
    "requests": [
        {"request_id": "doc", "cls": "long", "arrival_s": 0.0, "prompt": " ".join(["w5", "w6", "w7"] * 20),
         "max_new_tokens": 3},
        {"request_id": "chat-0", "cls": "short", "arrival_s": 0.0, "prompt": "w1 w2", "max_new_tokens": 6},
        {"request_id": "chat-1", "cls": "short", "arrival_s": 0.0, "prompt": "w3 w4 w5", "max_new_tokens": 4},
    ],
}


def test_a_served_run_pickles_and_replays_its_records_in_serves_order(tiny_target, one_thread):
    workload = parse_workload(TINY_WORKLOAD)
    configs = (ServeConfig(policy=Policy.DECODE_FIRST, chunk_size=16), ServeConfig(policy=Policy.NONE))
    arguments = (tiny_target, workload, configs)
    assert round_trip(arguments) == arguments
    results = serve_whole(*arguments)
    assert round_trip(results) == results

    def order(records):
        return [r.index if isinstance(r, ServeStep) else r.request_id for r in records]

    live = list(serve(load_model(tiny_target), workload, configs[0]))
    begin = time.perf_counter()
    replayed = list(paced(results[0]))
    assert order(replayed) == order(live)
    assert time.perf_counter() - begin >= results[0].steps[-1].end_s  # at the recorded pace
    for result in results:
        run = ServeRun.replay(result)
        assert run.wait(60) and run.error is None
        assert run.result() == result


def test_forced_zerogpu_calls_go_through_pickle(monkeypatch):
    monkeypatch.setenv("SPECLAB_ZEROGPU", "1")
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    sent = {"ids": [1, 2, 3]}
    received = []
    echo = gpu(lambda value: received.append(value) or value)
    back = echo(sent)
    assert back == sent and back is not sent and received[0] is not sent
    with pytest.raises(TypeError, match="pickle"):
        gpu(threading.Lock)()  # what a live run holds (with its generator and KV cache) cannot cross

    def refuse():
        raise gr.Error("k must be in 1..16")

    with pytest.raises(gr.Error, match="k must be in 1..16"):
        gpu(refuse)()

    def stream():
        yield {"ids": [1]}
        yield {"ids": [1, 2]}

    assert list(gpu(stream)()) == [{"ids": [1]}, {"ids": [1, 2]}]


@pytest.mark.parametrize("value, on", [("true", True), ("True", True), ("1", True), ("t", True), ("false", False),
                                       ("0", False), ("", False), ("yes", False)])
def test_zero_gpu_is_read_from_the_variable_the_spaces_package_reads(monkeypatch, value, on):
    monkeypatch.delenv("SPECLAB_ZEROGPU", raising=False)
    monkeypatch.setenv("SPACES_ZERO_GPU", value)
    assert zero_gpu() is on


def test_without_zerogpu_the_decorator_leaves_a_function_as_it_is(monkeypatch):
    monkeypatch.delenv("SPECLAB_ZEROGPU", raising=False)
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)

    def handler():
        return 1

    assert not zero_gpu()
    assert gpu(handler)() == 1  # spaces.GPU is a no-op off ZeroGPU; without spaces gpu returns handler


# the real app on the ZeroGPU path, through its API client

SETTINGS = dict(PLAYGROUND, max_new_tokens=16)


@pytest.fixture(scope="module")
def client():
    from gradio_client import Client

    with running_app({"SPECLAB_ZEROGPU": "1"}) as url:
        yield Client(url, verbose=False)


@pytest.fixture(scope="module")
def live_trace():
    """SETTINGS run on the live path, in this process."""
    from ui.playground import build_request

    session = RunSession.live(build_request(**SETTINGS))
    while session.advance() is not None:
        pass
    return session.trace()


def downloaded(client) -> dict:
    return json.loads(Path(client.predict(api_name="/download_trace")).read_text(encoding="utf-8"))


def emitted(steps) -> list[list[int]]:
    return [[t["token_id"] for t in s["emitted"]] for s in steps]


@pytest.mark.app
@pytest.mark.embedded
def test_stepping_on_the_zerogpu_path_gives_the_live_runs_tokens(client, live_trace):
    client.predict(api_name="/reset")
    first = client.predict(api_name="/step", **SETTINGS)[READOUT]
    second = client.predict(api_name="/step", **SETTINGS)[READOUT]
    assert "**1 tokens** in 1 target steps" in first and "in 2 target steps" in second
    assert "replaying" not in second
    live = [list(s.emitted_token_ids) for s in live_trace.steps]
    assert emitted(downloaded(client)["steps"]) == live[:2]
    readout = client.predict(api_name="/run", speed_s=0, **SETTINGS)[READOUT]  # same settings: the run goes on
    trace = downloaded(client)
    assert emitted(trace["steps"]) == live and trace["stop_reason"] == live_trace.stop_reason
    assert f"finished ({live_trace.stop_reason})" in readout
    client.predict(api_name="/reset")
    assert "**1 tokens** in 1 target steps" in client.predict(api_name="/step", **SETTINGS)[READOUT]


@pytest.mark.app
@pytest.mark.embedded
def test_play_on_the_zerogpu_path_streams_and_stop_ends_it(client):
    readout, updates = play_then_stop(client, SETTINGS, first_output_s=300)  # the first round waits for the whole run
    assert "finished (stopped)" in readout
    assert updates >= 2


@pytest.mark.app
@pytest.mark.embedded
def test_compare_and_bad_input_on_the_zerogpu_path(client, live_trace):
    client.predict(api_name="/reset")
    *current, baseline, speculative, verdict = client.predict(api_name="/compare", **SETTINGS)
    assert "outputs identical" in verdict and "measured speedup" in verdict
    assert emitted(downloaded(client)["steps"]) == [list(s.emitted_token_ids) for s in live_trace.steps]
    # an error raised inside the GPU call comes back as the same message
    with pytest.raises(Exception, match=r"the prompt has \d+ tokens; this model's context is 8192"):
        client.predict(api_name="/run", speed_s=0, **dict(SETTINGS, prompt="w " * 9000))
    assert "target steps" in client.predict(api_name="/step", **SETTINGS)[READOUT]


@pytest.mark.app
@pytest.mark.embedded
def test_chunked_prefill_on_the_zerogpu_path_replays_the_timeline_and_stop_ends_it(client):
    job = client.submit(api_name="/prefill_compare", policy="none", chunk_size=512, policy_b="decode-first",
                        chunk_size_b=512, **PREFILL)
    progress, timeline_a, timeline_b, table, ttft, itl_time, itl_dist = job.result(timeout=600)
    assert progress.startswith("Done.") and "B: decode-first, chunk 512" in progress
    assert [row[0] for row in table["data"]] == ["A: none (no chunking)", "B: decode-first, chunk 512"]
    assert timeline_a and timeline_b and ttft and itl_time and itl_dist
    assert len(job.outputs()) > 1  # the timeline filled step by step
    # both settings are served in the GPU call; the replay of A takes as long as A took (the
    # document arrives at 1 s), so a Stop at its first update lands inside it
    progress, timeline_a, timeline_b, *_ = prefill_compare_then_stop(client, chunk_size=512, first_output_s=300)
    assert "**A: decode-first, chunk 512** (stopped)" in progress
    assert timeline_b is None


@pytest.mark.app
@pytest.mark.embedded
def test_the_gate_tab_on_the_zerogpu_path(client):
    verdict, table, chart = client.predict(api_name="/gate", method="prompt-lookup", rule="exact", prompt_set="rewrite",
                                           limit=1, k=4, temperature=0, samples=100, max_new_tokens=2, seed=0)
    assert "PASS" in verdict and table["data"] and chart
