"""Reliability for a public app: hostile trace files, runs that release their KV cache, the
context policy, and, through the real app and its API client, a table of bad inputs, several
users at once, Stop, and model output that tries to be HTML."""

from __future__ import annotations

import copy
import gc
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest
from transformers import DynamicCache

from engine.acceptance import AcceptRule
from engine.decoding import DecodeConfig
from engine.drafters import DrafterSpec
from engine.errors import InputError
from engine.run import RunRequest, run
from engine.sampling import SamplingConfig
from engine.session import RunSession
from engine.trace import MAX_ITEMS, MAX_OUTPUT_TOKENS, trace_from_json, trace_to_json

HOSTILE = "<img src=x onerror=alert(1)>"


# hostile trace files (no app: the loader and the views it feeds)


@pytest.fixture(scope="module")
def traces(tiny_target, tiny_draft):
    """Real traces of the tiny models as JSON objects: greedy, sampled, lossy, prompt lookup."""
    settings = [
        (SamplingConfig(), "draft-model", AcceptRule.EXACT, False),
        (SamplingConfig(temperature=1.0, seed=3), "draft-model", AcceptRule.EXACT, True),
        (SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, seed=1), "draft-model", AcceptRule.TYPICAL, False),
        (SamplingConfig(), "prompt-lookup", AcceptRule.EXACT, True),
    ]
    out = []
    for sampling, method, rule, adaptive in settings:
        decode = DecodeConfig(max_new_tokens=12, k=3, sampling=sampling, rule=rule, adaptive=adaptive, ignore_eos=True)
        drafter = DrafterSpec(method, draft=tiny_draft if method == "draft-model" else None)
        trace = run(RunRequest("w1 w2 w3 w1 w2 w3 w1 w2", model=tiny_target, raw=True, decode=decode, drafter=drafter))
        out.append(json.loads(trace_to_json(trace)))
    return out


def replay_everything(text: str) -> None:
    """Load a trace file and render every view the playground shows for it, step by step."""
    from ui.playground import PlaygroundState, charts, readout, views

    state = PlaygroundState(session=RunSession.from_trace(trace_from_json(text)))
    views(state)
    while state.session.advance() is not None:
        views(state, pending=True)
        views(state)
    charts(state)
    readout(state.session, 0.0)


def with_step(trace: dict, **fields) -> str:
    data = copy.deepcopy(trace)
    data["steps"][1].update(fields)
    return json.dumps(data)


def hostile_files(trace: dict) -> list[tuple[str, str | bytes, str]]:
    """(what, file content, expected message) rows."""
    big = copy.deepcopy(trace)
    big["steps"] = [big["steps"][0]] * (MAX_OUTPUT_TOKENS + 1)
    for i, step in enumerate(big["steps"]):
        big["steps"][i] = dict(step, index=i)
    return [
        ("empty file", b"", "not valid JSON"),
        ("not JSON", b"\x89PNG\r\n\x1a\n\x00\x00", "not valid JSON"),
        ("a JSON list", "[1, 2, 3]", "not a Speculative Decoding Lab trace"),
        ("NaN", with_step(trace, draft_s="@").replace('"@"', "NaN"), "NaN, which is not a number"),
        ("Infinity", '{"version": Infinity}', "not a number"),
        ("1e400 (overflows to inf)", with_step(trace, draft_s="@").replace('"@"', "1e400"), "finite number"),
        ("deep nesting", "[" * 100_000 + "]" * 100_000, "nested deeper|not valid JSON"),
        ("nesting past the schema", json.dumps({"version": 1, "extra": [[[[[[[[[[[[[[1]]]]]]]]]]]]]]}), "nested deeper"),
        ("huge array", json.dumps({"version": 1, "steps": [0] * (MAX_ITEMS + 1)}), "items"),
        ("huge file", b" " * 20_000_001, "bytes"),
        ("wrong type: steps", json.dumps(dict(trace, steps="nope")), "must be a list"),
        ("wrong type: k", with_step(trace, k="3"), "must be an integer"),
        ("wrong type: bool as int", with_step(trace, accepted=True), "must be an integer"),
        ("huge integer", with_step(trace, k=10**30), "must be an integer"),
        ("missing field", json.dumps({k: v for k, v in trace.items() if k != "info"}), "missing"),
        ("unknown token kind", with_step(trace, emitted=[dict(trace["steps"][1]["emitted"][0], kind=HOSTILE)]),
         "unknown value"),
        ("hostile stop reason", json.dumps(dict(trace, stop_reason=HOSTILE)), "stop_reason"),
        ("drafts shorter than k", with_step(trace, draft_texts=[]), "inconsistent"),
        ("accepted above k", with_step(trace, accepted=99), "inconsistent"),
        ("uniform draws missing", with_step(trace, sample_uniform=0.5, accept_uniforms=[]), "inconsistent"),
        ("steps out of order", with_step(trace, index=-1), "inconsistent"),
        ("negative timing", with_step(trace, verify_s=-1.0), "inconsistent"),
        ("tree ranks outside the heads", with_step(trace, draft_ranks=[[5]] * trace["steps"][1]["k"],
                                                    head_top=[[]]), "inconsistent"),
        ("more tokens than any run", json.dumps(big), "output tokens"),
    ]


def test_hostile_trace_files_are_refused_with_a_reason(traces):
    for what, content, message in hostile_files(traces[0]):
        with pytest.raises(InputError, match=message):
            trace_from_json(content)
            pytest.fail(f"{what} was accepted")


def test_real_traces_load_and_replay(traces):
    for trace in traces:
        replay_everything(json.dumps(trace))


JUNK = [None, -1, 10**6, 1e308, "x", [], [1], [[]], {}, True, [0.5] * 40, [HOSTILE] * 40, [[0, 9]], [[99]]]


def test_mutated_traces_are_refused_or_replay_without_a_crash(traces):
    """Every step field of real traces set to junk: the loader refuses it with InputError, or
    everything the playground shows for it renders."""
    refused = rendered = 0
    for trace in traces[:2]:
        for field in trace["steps"][1]:
            for junk in JUNK:
                try:
                    replay_everything(with_step(trace, **{field: junk}))
                    rendered += 1
                except InputError:
                    refused += 1
    assert refused > 100 and rendered > 10


# runs release their KV cache; the context policy


def live_caches() -> int:
    gc.collect()
    return sum(isinstance(o, DynamicCache) for o in gc.get_objects())


def test_a_finished_or_closed_run_holds_no_kv_cache(tiny_target):
    before = live_caches()
    request = RunRequest("w1 w2 w3", model=tiny_target, raw=True, decode=DecodeConfig(max_new_tokens=6, ignore_eos=True))
    finished = RunSession.live(request)
    while finished.advance() is not None:
        assert live_caches() == before + 1  # the run's own cache, while it runs
    assert finished.stop_reason == "max_new_tokens" and live_caches() == before
    halfway = RunSession.live(request)
    halfway.advance()
    assert live_caches() == before + 1
    halfway.close()
    assert live_caches() == before and halfway.stop_reason == "stopped"
    assert halfway.trace().steps  # the records stay for the views and the download


def test_close_from_another_thread_stops_a_run_that_is_advancing(tiny_target):
    request = RunRequest("w1 w2 w3", model=tiny_target, raw=True,
                         decode=DecodeConfig(max_new_tokens=200, ignore_eos=True))
    session = RunSession.live(request)
    session.advance()
    closing = threading.Thread(target=lambda: [session.close() for _ in range(200)])
    closing.start()
    while session.advance() is not None:
        pass
    closing.join()
    assert session.stop_reason == "stopped" and len(session.steps) < 200


def test_a_prompt_beyond_the_context_is_refused_and_a_long_run_stops_at_the_context(tiny_target):
    # the tiny model's context is 256 tokens
    too_long = RunRequest(" ".join(["w5"] * 256), model=tiny_target, raw=True)
    with pytest.raises(InputError, match="the prompt has 256 tokens; this model's context is 256"):
        run(too_long)
    near_the_end = RunRequest(" ".join(["w5"] * 250), model=tiny_target, raw=True,
                              decode=DecodeConfig(max_new_tokens=20, ignore_eos=True))
    trace = run(near_the_end)
    assert trace.stop_reason == "context" and len(trace.output_token_ids) == 6
    assert trace_from_json(trace_to_json(trace)) == trace
