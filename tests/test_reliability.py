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
from apphelpers import OUTPUT_LINE, READOUT, STREAM

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
        ("verify curve with a zero time", json.dumps(dict(trace, info=dict(trace["info"], verify_ms=[0.0, 1.0]))),
         "verify_ms"),
        ("verify curve too long", json.dumps(dict(trace, info=dict(trace["info"], verify_ms=[1.0] * 65))),
         "verify_ms"),
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


def test_error_messages_show_markup_as_text():
    from ui.common import user_error

    assert user_error(InputError(f"unknown value '{HOSTILE}'")).message == \
        "unknown value '&lt;img src=x onerror=alert(1)>'"
    for plain in ("top-k must be an integer >= 0 (got -1)", "temperature must be <= 100", "k < 3 & k > 1"):
        assert user_error(InputError(plain)).message == plain


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


# the real app through its API client

SETTINGS = dict(prompt="Name three colors.", preset="embedded", method="prompt-lookup", k=4, adaptive=False,
                temperature=0, top_k=0, top_p=1, seed=0, max_new_tokens=2, raw=False, rule="exact", tree="chain")
PREFILL = dict(preset="embedded", scenario="doc-arrives", max_new_tokens=2, policy="decode-first", chunk_size=64)
GATE = dict(method="prompt-lookup", rule="exact", prompt_set="rewrite", limit=1, k=4, temperature=0, samples=100,
            max_new_tokens=2, seed=0)
GENERIC = "upstream Gradio app has raised an exception"  # gradio's own refusal of a wrongly typed value


def run_row(**changes) -> tuple[str, dict]:
    return "/run", dict(SETTINGS, speed_s=0, **changes)


def bad_inputs() -> list[tuple[str, str, dict | tuple, str]]:
    """(what, endpoint, arguments, expected message) for every kind of bad input a form or an API
    client can send; arguments by name, or by position for the undocumented lesson endpoints."""
    from lessons import NumericQuestion, load_lessons

    lesson = next(l for l in load_lessons() if any(isinstance(q, NumericQuestion) for q in l.questions))
    numeric = next(i for i, q in enumerate(lesson.questions, start=1) if isinstance(q, NumericQuestion))
    return [
        ("empty prompt", *run_row(prompt=""), "the prompt is empty"),
        ("whitespace prompt", *run_row(prompt=" \n\t "), "the prompt is empty"),
        ("prompt beyond the context", *run_row(prompt="w " * 9000), r"the prompt has \d+ tokens; this model's context is 8192"),
        ("prompt over the character limit", *run_row(prompt="x" * 100_001), r"100001 characters \(limit 100000\)"),
        ("max new tokens huge", *run_row(max_new_tokens=10**6), "greater than maximum value 512"),
        ("max new tokens 0", *run_row(max_new_tokens=0), "less than minimum value 1"),
        ("max new tokens fractional", *run_row(max_new_tokens=2.5), "whole number"),
        ("max new tokens missing", *run_row(max_new_tokens=None), GENERIC),
        ("k 0", *run_row(k=0), "less than minimum value 1"),
        ("k 17", *run_row(k=17), "greater than maximum value 16"),
        ("k 10^9", *run_row(k=10**9), "greater than maximum value 16"),
        ("temperature negative", *run_row(temperature=-1), "less than minimum value 0"),
        ("temperature huge", *run_row(temperature=1e9), "greater than maximum value 2"),
        ("temperature not a number", *run_row(temperature="nan"), GENERIC),
        ("top-p 0", *run_row(top_p=0), "less than minimum value 0.05"),
        ("top-p 1.5", *run_row(top_p=1.5), "greater than maximum value 1"),
        ("top-k negative", *run_row(top_k=-1), "top-k must be an integer >= 0"),
        ("top-k huge", *run_row(top_k=10**7), "top-k must be an integer >= 0"),
        ("seed negative", *run_row(seed=-1), "seed must be a non-negative integer"),
        ("seed 2^70", *run_row(seed=2**70), "seed must be a non-negative integer"),
        ("preset as a path", *run_row(preset="../../etc/passwd"), "not in the list of choices"),
        ("preset as an allowed hub id", *run_row(preset="HuggingFaceTB/SmolLM2-135M-Instruct"),
         "not in the list of choices"),
        ("preset as a folder", *run_row(preset="/tmp"), "not in the list of choices"),
        ("unknown method", *run_row(method="nope"), "not in the list of choices"),
        ("unknown acceptance rule", *run_row(rule="nope"), "not in the list of choices"),
        ("unknown tree shape", *run_row(tree="nope"), "not in the list of choices"),
        ("lookup first for prompt lookup itself", *run_row(lookup_first=2), "lookup-first is for drafters that run a model"),
        ("lookup first too long", *run_row(method="mtp", lookup_first=5), "greater than maximum value 4"),
        ("lookup first fractional", *run_row(method="mtp", lookup_first=1.5), "whole number"),
        ("draft stop 1", *run_row(method="mtp", draft_stop=1), "greater than maximum value 0.9"),
        ("draft stop negative", *run_row(method="mtp", draft_stop=-0.1), "less than minimum value 0"),
        ("compare without a drafter", "/compare", dict(SETTINGS, method="baseline"), "choose a drafter"),
        ("chunk size too small", "/prefill_run", dict(PREFILL, chunk_size=3), "less than minimum value 16"),
        ("chunk size huge", "/prefill_run", dict(PREFILL, chunk_size=10**6), "greater than maximum value"),
        ("unknown scenario", "/prefill_run", dict(PREFILL, scenario="../x"), "not in the list of choices"),
        ("unknown policy", "/prefill_run", dict(PREFILL, policy="nope"), "not in the list of choices"),
        ("gate: too many prompts", "/gate", dict(GATE, limit=99), "greater than maximum value 3"),
        ("gate: too few samples", "/gate", dict(GATE, samples=0), "less than minimum value"),
        ("lesson answer not a number", f"/lesson{lesson.order}_q{numeric}", ("<b>three</b>",), "enter a number"),
        ("certificate before the course", "/certificate", (HOSTILE,), "answer every question first"),
    ]


def hostile_uploads(folder: Path, trace: dict) -> list[tuple[str, object, str]]:
    from gradio_client import handle_file

    def file(name: str, content: str | bytes):
        path = folder / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return handle_file(str(path))

    return [
        ("trace: not JSON", file("a.json", b"\x00\xff{"), "not valid JSON"),
        ("trace: NaN", file("b.json", '{"version": 1, "x": NaN}'), "not a number"),
        ("trace: deep nesting", file("c.json", "[" * 50_000 + "]" * 50_000), "nested deeper|not valid JSON"),
        ("trace: huge array", file("d.json", json.dumps({"version": 1, "steps": [0] * (MAX_ITEMS + 1)})), "items"),
        ("trace: wrong types", file("e.json", json.dumps(dict(trace, steps="nope"))), "must be a list"),
        ("trace: inconsistent step", file("f.json", with_step(trace, draft_texts=[])), "inconsistent"),
        ("trace: hostile stop reason", file("g.json", json.dumps(dict(trace, stop_reason=HOSTILE))), "stop_reason"),
        ("trace: not a .json file", file("h.txt", json.dumps(trace)), "Invalid file type"),
    ]


@pytest.fixture(scope="module")
def app_url():
    from apphelpers import running_app

    with running_app() as url:
        yield url


def client(url):
    from gradio_client import Client

    return Client(url, verbose=False)


def normal_request_succeeds(c) -> None:
    readout = c.predict(api_name="/step", **SETTINGS)[READOUT]
    assert "target steps" in readout, readout


def test_every_bad_input_gets_a_message_and_the_next_request_succeeds(app_url, traces, tmp_path):
    c = client(app_url)
    normal_request_succeeds(c)
    rows = [(what, endpoint, args, message) for what, endpoint, args, message in bad_inputs()]
    rows += [(what, "/upload_trace", {"file": upload}, message)
             for what, upload, message in hostile_uploads(tmp_path, traces[0])]
    for what, endpoint, args, message in rows:
        with pytest.raises(Exception, match=message):
            c.predict(*args, api_name=endpoint) if isinstance(args, tuple) else c.predict(api_name=endpoint, **args)
            pytest.fail(f"{what}: accepted")
        normal_request_succeeds(c)
    print(f"\nbad inputs: {len(rows)} rows, each refused with a message, each followed by a request that succeeded")


def test_trace_upload_reads_no_server_path(app_url, tmp_path):
    """A raw API call naming a file on the server instead of an upload is refused before the file
    is read (gradio_client would upload a local path itself, so this goes around it)."""
    import httpx

    outside = tmp_path / "outside.json"
    outside.write_text('{"version": 1}')  # read, it would fail with "trace.info is missing"
    for path in (str(outside), "/etc/hostname", "../../../../etc/passwd"):
        file = {"path": path, "meta": {"_type": "gradio.FileData"}}
        event = httpx.post(f"{app_url}gradio_api/call/upload_trace", json={"data": [file]}).json()["event_id"]
        answer = httpx.get(f"{app_url}gradio_api/call/upload_trace/{event}", timeout=60).text
        assert answer.startswith("event: error") and "trace" not in answer, answer
    normal_request_succeeds(client(app_url))


def app_pid() -> int:
    """The app process this test process started (running_app launches it as a child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and b"app.py" in cmdline:
            return int(entry.name)
    raise RuntimeError("the app process was not found")


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1]) / 1024


PROMPTS = ["Name three colors.", "Count from one to five.", "What is the capital of France?",
           "Repeat exactly: apples, pears, plums."]


def output_of(c, prompt: str) -> tuple[str, list[int]]:
    """Run one prompt to the end in this client's session; its trace's prompt and output ids."""
    c.predict(api_name="/reset")
    c.predict(api_name="/run", **dict(SETTINGS, prompt=prompt, max_new_tokens=12, speed_s=0))
    trace = json.loads(Path(c.predict(api_name="/download_trace")).read_text(encoding="utf-8"))
    return trace["info"]["prompt_text"], [t["token_id"] for s in trace["steps"] for t in s["emitted"]]


def test_concurrent_sessions_never_mix_outputs(app_url):
    solo_client = client(app_url)
    solo = {p: output_of(solo_client, p)[1] for p in PROMPTS}
    clients = [client(app_url) for _ in PROMPTS]
    rounds, errors = 2, 0
    begin = time.perf_counter()
    with ThreadPoolExecutor(len(clients)) as pool:
        for r in range(rounds):
            # each round shifts the prompts, so every session runs different prompts over time
            jobs = {pool.submit(output_of, c, PROMPTS[(i + r) % len(PROMPTS)]): PROMPTS[(i + r) % len(PROMPTS)]
                    for i, c in enumerate(clients)}
            for job, prompt in jobs.items():
                try:
                    got_prompt, got = job.result(timeout=600)
                except Exception:
                    errors += 1
                    raise
                assert got_prompt == prompt and got == solo[prompt], f"outputs mixed for {prompt!r}"
    wall = time.perf_counter() - begin
    print(f"\nconcurrency: {len(clients)} sessions, {rounds * len(clients)} concurrent runs "
          f"({3 * rounds * len(clients)} requests) in {wall:.1f} s, {errors} errors, "
          f"limit SPECLAB_CONCURRENCY={os.environ.get('SPECLAB_CONCURRENCY', '2')}, "
          f"app peak memory (VmHWM) {peak_rss_mb(app_pid()):.0f} MB")


def test_stop_ends_only_its_own_sessions_play_promptly(app_url):
    player, other = client(app_url), client(app_url)
    player.predict(api_name="/reset")
    job = player.submit(api_name="/play", speed_s=0.5, **dict(SETTINGS, max_new_tokens=200))
    deadline = time.time() + 300
    while len(job.outputs()) < 2 and time.time() < deadline:
        time.sleep(0.1)
    other.predict(api_name="/stop")  # another user's Stop: this play goes on
    shown = len(job.outputs())
    while len(job.outputs()) < shown + 2 and time.time() < deadline:
        time.sleep(0.1)
    assert not job.done()
    stopped_at = time.perf_counter()
    player.predict(api_name="/stop")
    readout = job.result(timeout=60)[READOUT]
    took = time.perf_counter() - stopped_at
    assert "finished (stopped)" in readout and took < 30
    print(f"\nstop: the play ended {took:.2f} s after Stop")
    normal_request_succeeds(player)


def visible_text_and_tags(page: str) -> tuple[str, set[str]]:
    class Collect(HTMLParser):
        def __init__(self):
            super().__init__()
            self.text, self.tags = [], set()

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)

        def handle_data(self, data):
            self.text.append(data)

    parser = Collect()
    parser.feed(page)
    return "".join(parser.text).replace("␣", " "), parser.tags


def test_model_output_that_is_html_is_shown_as_text(app_url):
    c = client(app_url)
    c.predict(api_name="/reset")
    prompt = f"Repeat exactly: {HOSTILE}"
    shown = c.predict(api_name="/run", **dict(SETTINGS, prompt=prompt, max_new_tokens=16, speed_s=0))
    trace = json.loads(Path(c.predict(api_name="/download_trace")).read_text(encoding="utf-8"))
    output = "".join(t["text"] for s in trace["steps"] for t in s["emitted"])
    assert HOSTILE in output  # the model really echoed it
    for view in (shown[STREAM], shown[OUTPUT_LINE]):  # the annotated stream and the clean output line
        text, tags = visible_text_and_tags(view)
        assert HOSTILE in text and "img" not in tags
