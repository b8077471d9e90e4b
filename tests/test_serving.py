"""The serving loop: exact per-request outputs under every policy, the policies' rules, the
token budget, workloads as data (validation, built-ins, replay) and the `serve` CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from engine.decoding import DecodeConfig, generate
from engine.errors import InputError
from engine.models import load_model
from engine.sampling import SamplingConfig
from engine.serving import (
    ItemKind, Policy, RequestClass, ServeConfig, Workload, WorkloadRequest, builtin_workloads, load_workload,
    parse_workload, report, run_serve,
)
from engine.serving.scheduler import Live, schedule
from engine.trace import Step

ROOT = Path(__file__).resolve().parents[1]


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def tiny_workload(ignore_eos: bool = False) -> Workload:
    """Two chats and a long prompt at once (so its chunks overlap their decodes), and a late chat."""
    spec = [
        ("chat-a", RequestClass.SHORT, 0.0, words(1, 2, 3, 4, 5), 10),
        ("chat-b", RequestClass.SHORT, 0.0, words(7, 8, 9), 12),
        ("doc", RequestClass.LONG, 0.0, words(*[(5 * i) % 60 + 2 for i in range(40)]), 5),
        ("late", RequestClass.SHORT, 0.05, words(11, 12, 13, 14, 15, 16, 17), 6),
    ]
    return Workload("tiny", "", tuple(WorkloadRequest(*s) for s in spec), ignore_eos=ignore_eos)


def solo(target, prompt: str, max_new_tokens: int, sampling=SamplingConfig(), ignore_eos=False) -> list[int]:
    """The request's output on its own: engine.decoding.generate, whole-prompt prefill."""
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, sampling=sampling, ignore_eos=ignore_eos)
    return [t for e in generate(target, target.encode(prompt), cfg) if isinstance(e, Step) for t in e.emitted_token_ids]


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def solo_outputs(tiny):
    return {r.request_id: solo(tiny, r.prompt, r.max_new_tokens) for r in tiny_workload().requests}


RUNS = [(Policy.NONE, 256, None), (Policy.DECODE_FIRST, 3, None), (Policy.DECODE_FIRST, 8, 10),
        (Policy.PREFILL_FIRST, 5, None), (Policy.PREFILL_FIRST, 16, 18)]


@pytest.fixture(scope="module")
def runs(tiny):
    return {(p, c, b): run_serve(tiny, tiny_workload(), ServeConfig(policy=p, chunk_size=c, token_budget=b))
            for p, c, b in RUNS}


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0].value}-{r[1]}-{r[2]}")
def test_each_request_equals_its_solo_greedy_output(runs, solo_outputs, run):
    result = runs[run]
    assert {r.request_id: list(r.output_token_ids) for r in result.requests} == solo_outputs


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0].value}-{r[1]}-{r[2]}")
def test_prompts_prefilled_once_within_budget_and_chunk(runs, run):
    result = runs[run]
    policy, chunk, _ = run
    for req in result.requests:
        ranges = [(i.start, i.end) for s in result.steps for i in s.items
                  if i.request_id == req.request_id and i.kind is ItemKind.PREFILL]
        covered = [t for start, end in ranges for t in range(start, end)]
        assert covered == list(range(req.prompt_tokens))  # every prompt token exactly once, in order
        decodes = [i for s in result.steps for i in s.items
                   if i.request_id == req.request_id and i.kind is ItemKind.DECODE]
        assert len(decodes) == len(req.output_token_ids) - 1  # the last token is never fed back
        assert len(req.token_times_s) == len(req.output_token_ids) and req.first_token_s == req.token_times_s[0]
    for step in result.steps:
        assert 0 < step.tokens <= result.token_budget
        assert len({i.request_id for i in step.items}) == len(step.items)  # one item per request per step
        if policy is not Policy.NONE:
            assert all(i.tokens <= chunk for i in step.items)
    assert [s.index for s in result.steps] == list(range(len(result.steps)))
    assert all(a.end_s <= b.start_s for a, b in zip(result.steps, result.steps[1:]))


def test_none_runs_whole_prompts_and_decodes_wait(runs):
    result = runs[(Policy.NONE, 256, None)]
    prompt = {r.request_id: r.prompt_tokens for r in result.requests}
    for step in result.steps:
        kinds = {i.kind for i in step.items}
        assert len(kinds) == 1  # never a prefill and a decode in one step
        for i in step.items:
            if i.kind is ItemKind.PREFILL:
                assert (i.start, i.end) == (0, prompt[i.request_id])
    # the chats' prompts fill step 0, the document's does not fit beside them (budget = longest prompt): the
    # chats' decodes wait for it
    assert [(i.request_id, i.kind) for s in result.steps[:3] for i in s.items][:3] == [
        ("chat-a", ItemKind.PREFILL), ("chat-b", ItemKind.PREFILL), ("doc", ItemKind.PREFILL)]
    assert result.token_budget == 40


def decoding_at(step, result):
    """Requests that had their first token before this step and more tokens to come."""
    return {r.request_id for r in result.requests
            if r.first_token_s <= step.start_s and r.token_times_s[-1] >= step.end_s}


def test_decode_first_never_makes_a_decode_wait(runs):
    result = runs[(Policy.DECODE_FIRST, 3, None)]
    overlapped = 0
    for step in result.steps:
        kinds = [i.kind for i in step.items]
        assert kinds == sorted(kinds, key=lambda k: k is ItemKind.PREFILL)  # decodes first
        assert {i.request_id for i in step.items if i.kind is ItemKind.DECODE} == decoding_at(step, result)
        overlapped += ItemKind.PREFILL in kinds and ItemKind.DECODE in kinds
    assert overlapped >= 5  # the long prompt's chunks ran next to the chats' decodes
    assert report(result)["summary"]["decode_traffic_active"]


def test_prefill_first_puts_chunks_first_and_decodes_take_the_rest(runs):
    result = runs[(Policy.PREFILL_FIRST, 16, 18)]
    for step in result.steps:
        kinds = [i.kind for i in step.items]
        assert kinds == sorted(kinds, key=lambda k: k is ItemKind.DECODE)  # prefill chunks first
        prefill = sum(i.tokens for i in step.items if i.kind is ItemKind.PREFILL)
        decodes = sum(1 for k in kinds if k is ItemKind.DECODE)
        assert decodes == min(len(decoding_at(step, result)), 18 - prefill)


LIVE = [Live("a", 4, 4, 3), Live("b", 6, 6, 1), Live("c", 20, 8, 0), Live("d", 9, 0, 0)]


@pytest.mark.parametrize("policy, chunk, budget, expected", [
    # decode-first: both decodes, then chunks in arrival order with what is left
    (Policy.DECODE_FIRST, 8, 12, [("a", "decode", 6, 7), ("b", "decode", 6, 7), ("c", "prefill", 8, 16),
                                  ("d", "prefill", 0, 2)]),
    (Policy.DECODE_FIRST, 8, 1, [("a", "decode", 6, 7)]),
    # prefill-first: chunks take the budget, decodes get the remainder
    (Policy.PREFILL_FIRST, 8, 12, [("c", "prefill", 8, 16), ("d", "prefill", 0, 4)]),
    (Policy.PREFILL_FIRST, 4, 9, [("c", "prefill", 8, 12), ("d", "prefill", 0, 4), ("a", "decode", 6, 7)]),
    # none: whole remaining prompts only while any is pending (c's 12 left fit, d's 9 do not)
    (Policy.NONE, 8, 20, [("c", "prefill", 8, 20)]),
    (Policy.NONE, 8, 21, [("c", "prefill", 8, 20), ("d", "prefill", 0, 9)]),
])
def test_schedule_rules(policy, chunk, budget, expected):
    got = [(i.request_id, i.kind.value, i.start, i.end) for i in schedule(policy, LIVE, chunk, budget)]
    assert got == expected
    assert sum(e - s for _, _, s, e in got) <= budget


def test_none_decodes_when_nothing_is_prefilling():
    live = [Live("a", 4, 4, 3), Live("b", 6, 6, 1)]
    assert [i.kind for i in schedule(Policy.NONE, live, 8, 64)] == [ItemKind.DECODE, ItemKind.DECODE]


def test_sampled_outputs_equal_solo_sampled_outputs(tiny):
    sampling = SamplingConfig(temperature=1.0, top_k=20, seed=7)
    workload = tiny_workload(ignore_eos=True)
    result = run_serve(tiny, workload, ServeConfig(policy=Policy.DECODE_FIRST, chunk_size=4, sampling=sampling))
    for spec, rec in zip(workload.requests, result.requests):
        assert list(rec.output_token_ids) == solo(tiny, spec.prompt, spec.max_new_tokens, sampling, ignore_eos=True)
        assert len(rec.output_token_ids) == spec.max_new_tokens and rec.stop_reason == "max_new_tokens"


def test_max_new_tokens_override_and_report(tiny):
    result = run_serve(tiny, tiny_workload(ignore_eos=True), ServeConfig(chunk_size=6, max_new_tokens=3))
    assert all(len(r.output_token_ids) == 3 for r in result.requests)
    out = report(result)
    s = out["summary"]
    assert s["requests"] == 4 and s["output_tokens"] == 12
    assert s["prefill_tokens"] == sum(s["prompt_tokens"]["short"] + s["prompt_tokens"]["long"])
    assert s["evidence_class"] == "controlled benchmark" and s["k"] == 0 and s["policy"] == "decode-first"
    assert s["token_budget"] == 6 + 4 and s["step_tokens_max"] <= 10
    assert s["by_class"]["short"]["requests"] == 3 and s["by_class"]["long"]["requests"] == 1
    for r in out["requests"]:
        assert r["ttft_ms"] == pytest.approx((r["first_token_s"] - r["arrival_s"]) * 1000)
        assert len(r["itl_ms"]) == 2


# --- bad input ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"chunk_size": 0}, "chunk size must be an integer >= 1"),
    ({"chunk_size": 2.5}, "chunk size"),
    ({"token_budget": 0}, "token budget must be"),
    ({"max_new_tokens": 0}, "max new tokens must be"),
])
def test_bad_config(kwargs, message):
    with pytest.raises(InputError, match=message):
        ServeConfig(**kwargs)


def test_bad_runs_are_refused_before_any_step(tiny):
    ok = tiny_workload()
    with pytest.raises(InputError, match="above the model's context 256"):
        run_serve(tiny, ok, ServeConfig(chunk_size=257))
    with pytest.raises(InputError, match="no requests"):
        run_serve(tiny, Workload("empty", "", ()), ServeConfig())
    huge = Workload("huge", "", (WorkloadRequest("big", RequestClass.LONG, 0.0, words(*[3] * 300), 4),))
    with pytest.raises(InputError, match="request big: the prompt has 300 tokens; this model's context is 256"):
        run_serve(tiny, huge, ServeConfig())
    with pytest.raises(InputError, match="below the longest prompt"):
        run_serve(tiny, ok, ServeConfig(policy=Policy.NONE, token_budget=10))


def request(**fields):
    return {"cls": "short", "arrival_s": 0.0, "prompt": "w1 w2"} | fields


@pytest.mark.parametrize("data, message", [
    ([], "workload x must be an object \\(got list\\)"),
    ({"requests": []}, "requests must hold 1..1000 requests"),
    ({}, "give exactly one of requests or poisson"),
    ({"requests": [request()], "poisson": {}}, "give exactly one of requests or poisson"),
    ({"requests": [request(cls="medium")]}, "requests\\[0\\].cls must be 'long' or 'short'"),
    ({"requests": [request(), request(arrival_s=-1)]}, "requests\\[1\\].arrival_s must be a number in 0..3600"),
    ({"requests": [request(arrival_s="soon")]}, "requests\\[0\\].arrival_s must be a number"),
    ({"requests": [request(arival_s=1)]}, "requests\\[0\\].arival_s is not a field here"),
    ({"requests": [{"cls": "short", "arrival_s": 0}]}, "requests\\[0\\].prompt is missing"),
    ({"requests": [request(prompt="  ")]}, "requests\\[0\\].prompt is empty"),
    ({"requests": [request(prompt=7)]}, "requests\\[0\\].prompt must be a string or an object"),
    ({"requests": [request(prompt={"words": 0})]}, "requests\\[0\\].prompt.words must be an integer in 1..20000"),
    ({"requests": [request(prompt={"word": 3})]}, "requests\\[0\\].prompt.word is not a field here"),
    ({"requests": [request(max_new_tokens=True)]}, "requests\\[0\\].max_new_tokens must be an integer"),
    ({"requests": [request(request_id="a"), request(request_id="a")]}, "requests\\[1\\].request_id 'a' is used twice"),
    ({"requests": "r"}, "requests must be a list"),
    ({"raw": "yes", "requests": [request()]}, "raw must be true or false"),
    ({"poisson": {"rate_per_s": 0, "count": 3, "classes": []}}, "poisson.rate_per_s must be a number"),
    ({"poisson": {"rate_per_s": 1, "count": 3, "classes": []}}, "poisson.classes must be a non-empty list"),
    ({"poisson": {"rate_per_s": 1, "count": 3, "classes": [{"cls": "short", "words": [5, 2]}]}},
     "poisson.classes\\[0\\].words must be \\[min, max\\]"),
    ({"poisson": {"rate_per_s": 1, "count": 3, "classes": [{"cls": "short", "words": [2, 5], "then": []}]}},
     "poisson.classes\\[0\\].then must be a string or a non-empty list"),
    ({"poisson": {"rate_per_s": 1, "count": 3, "classes": [{"cls": "short", "words": [2, 5], "starts": [-1]}]}},
     "poisson.classes\\[0\\].starts must be a list of word offsets"),
    ({"system": "  ", "requests": [request()]}, "system is empty"),
    ({"requests": [request(system=5)]}, "requests\\[0\\].system must be a string or an object"),
])
def test_workload_validation_names_the_field(data, message):
    with pytest.raises(InputError, match=message) as err:
        parse_workload(data, "x")
    assert "\n" not in str(err.value)


def test_workload_files_and_names(tmp_path):
    with pytest.raises(InputError, match="unknown workload 'nope'"):
        load_workload("nope")
    bad = tmp_path / "bad.json"
    bad.write_text('{"requests": [')
    with pytest.raises(InputError, match="workload bad.json: not valid JSON"):
        load_workload(str(bad))
    nan = tmp_path / "nan.json"
    nan.write_text('{"requests": [{"cls": "short", "arrival_s": NaN, "prompt": "w1"}]}')
    with pytest.raises(InputError, match="NaN is not a JSON number"):
        load_workload(str(nan))
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"max_new_tokens": 5, "requests": [request(arrival_s=2), request(request_id="z")]}))
    w = load_workload(str(good))
    assert [(r.request_id, r.arrival_s, r.max_new_tokens) for r in w.requests] == [("z", 0.0, 5), ("r0", 2.0, 5)]


def test_a_shared_system_prompt_and_shared_documents():
    data = {"system": {"words": 5, "then": "Be brief."}, "requests": [request(), request(request_id="own", system="Mine.")]}
    w = parse_workload(data)
    assert w.requests[0].system == "A lighthouse is a promise\n\nBe brief." and w.requests[1].system == "Mine."
    assert parse_workload(w.to_jsonable()).requests == w.requests  # the recorded form keeps each system prompt
    mix = load_workload("doc-mix")
    starts = {r.prompt.split("\n\n")[0][:40] for r in mix.requests}
    questions = {r.prompt.rsplit("\n\n", 1)[1] for r in mix.requests}
    assert len(starts) == 4 and len(questions) > 3  # four documents, several questions about each
    shared = load_workload("shared-system-prompt")
    assert len({r.system for r in shared.requests}) == 1 and len(shared.requests[0].system.split()) > 400


def test_builtin_scenarios():
    assert {"doc-arrives", "poisson-mixed"} <= set(builtin_workloads())
    doc = load_workload("doc-arrives")
    chats = [r for r in doc.requests if r.cls is RequestClass.SHORT]
    long = [r for r in doc.requests if r.cls is RequestClass.LONG]
    assert len(chats) == 4 and len(long) == 1 and max(r.arrival_s for r in chats) < long[0].arrival_s
    assert len(long[0].prompt.split()) > 1500  # about 2,000 SmolLM2 tokens
    mixed = load_workload("poisson-mixed")
    assert mixed == load_workload("poisson-mixed")  # seeded: the same requests every time
    assert {r.cls for r in mixed.requests} == set(RequestClass)
    assert list(mixed.requests) == sorted(mixed.requests, key=lambda r: r.arrival_s)


def test_replay_of_a_recorded_run(tiny, tmp_path):
    workload = tiny_workload()
    first = report(run_serve(tiny, workload, ServeConfig(chunk_size=4)))
    recorded = tmp_path / "run.json"
    recorded.write_text(json.dumps(first))
    replay = load_workload(str(recorded))
    assert replay.evidence == "replay"
    assert [(r.request_id, r.cls, r.arrival_s, r.prompt, r.max_new_tokens) for r in replay.requests] == [
        (r.request_id, r.cls, r.arrival_s, r.prompt, r.max_new_tokens) for r in workload.requests]
    again = report(run_serve(tiny, replay, ServeConfig(chunk_size=4)))
    assert again["summary"]["evidence_class"] == "replay"
    assert [r["output_token_ids"] for r in again["requests"]] == [r["output_token_ids"] for r in first["requests"]]


# --- CLI ------------------------------------------------------------------------------------

def cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def test_cli_json_schema(tiny_target, tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps(tiny_workload().to_jsonable()))
    r = cli("serve", "--workload", str(path), "--model", tiny_target, "--policy", "decode-first", "--chunk-size", "4",
            "--max-new-tokens", "4", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) == {"settings", "steps", "requests", "summary", "workload"}
    for step in out["steps"]:
        assert set(step) == {"index", "start_s", "end_s", "items"}
        for item in step["items"]:
            assert set(item) == {"request_id", "kind", "start", "end", "tokens"}
            assert item["kind"] in ("prefill", "decode") and item["tokens"] == item["end"] - item["start"]
    for req in out["requests"]:
        assert {"request_id", "cls", "arrival_s", "first_token_s", "token_times_s", "ttft_ms", "itl_ms",
                "output_token_ids", "prompt_tokens"} <= set(req)
        assert req["cls"] in ("long", "short") and len(req["output_token_ids"]) <= 4
    s = out["summary"]
    for key in ("model", "device", "dtype", "evidence_class", "prompt_tokens", "k", "temperature", "chunk_size",
                "concurrency", "decode_traffic_active", "output_tokens_per_s", "by_class"):
        assert key in s, key
    for stats in s["by_class"].values():
        for key in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90", "itl_ms_p99"):
            assert key in stats, key


def test_cli_bad_input_is_one_line(tiny_target):
    r = cli("serve", "--workload", "doc-arrives", "--model", tiny_target, "--chunk-size", "0")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("error: chunk size must be an integer >= 1") and r.stderr.count("\n") == 1


def test_cli_compare_and_text_output(tiny_target, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECLAB_ALLOW_ANY_MODEL", "1")  # what main() sets; restored after the test
    path = tmp_path / "w.json"
    path.write_text(json.dumps(tiny_workload().to_jsonable()))
    assert main(["serve", "--workload", str(path), "--model", tiny_target, "--max-new-tokens", "3"]) == 0
    assert "chat-a" in capsys.readouterr().out
    assert main(["serve-compare", "--workload", str(path), "--model", tiny_target, "--runs", "none",
                 "decode-first:4", "--repeats", "1", "--max-new-tokens", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["run"] for row in out["results"]] == ["none", "decode-first:4"]
    assert out["evidence_class"] == "controlled benchmark" and out["results"][1]["short.itl_ms_p99_median"] is not None
    assert out["same_outputs_in_every_run"]
    assert main(["serve-compare", "--workload", str(path), "--model", tiny_target, "--runs", "fast:4"]) == 2


# --- the embedded model ---------------------------------------------------------------------

@pytest.mark.embedded
def test_embedded_outputs_equal_solo_greedy(embedded):
    from engine.serving.workload import shipped_text

    spec = [
        ("chat-0", RequestClass.SHORT, 0.0, "Name three colors.", 6),
        ("chat-1", RequestClass.SHORT, 0.0, "What is a lighthouse?", 6),
        ("doc", RequestClass.LONG, 0.0, shipped_text(80, then="Summarize the text above."), 4),
    ]
    workload = Workload("embedded-small", "", tuple(WorkloadRequest(*s) for s in spec))
    result = run_serve(embedded, workload, ServeConfig(policy=Policy.DECODE_FIRST, chunk_size=32))
    assert any(len({i.kind for i in s.items}) == 2 for s in result.steps)  # chunks next to decodes
    for req, rec in zip(workload.requests, result.requests):
        assert list(rec.output_token_ids) == solo(embedded, req.prompt, req.max_new_tokens)
