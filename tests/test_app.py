"""The app as users reach it: launched for real, driven through its own API client."""

import json
import re

import pytest
from gradio_client import Client, handle_file

from apphelpers import (
    CARD,
    OUTPUT_LINE,
    PLAYGROUND,
    PREFILL,
    READOUT,
    STREAM,
    play_then_stop,
    prefill_compare_then_stop,
    running_app,
)

pytestmark = [pytest.mark.app, pytest.mark.embedded]

SETTINGS = PLAYGROUND


@pytest.fixture(scope="module")
def client():
    with running_app() as url:
        yield Client(url, verbose=False)


def test_generation_is_answered_through_the_api(client):
    card, line, stream, readout, table, top, residual, tree = client.predict(api_name="/run", speed_s=0, **SETTINGS)
    assert "sdl-stream" in stream and "tokens/s" in readout and "TTFT" in readout
    assert "12 tokens" in readout or "finished (eos)" in readout
    assert "red, green" in line  # the clean output line: the text a user would get
    assert "Estimated vs plain decoding" in card  # a finished speculative run explains its own speed
    assert "draft acceptance rate" in readout and "tokens per step_ = output tokens" in readout


def test_step_advances_one_round_per_call_and_reset_clears(client):
    first = client.predict(api_name="/step", **SETTINGS)[READOUT]
    second = client.predict(api_name="/step", **SETTINGS)[READOUT]
    assert "**1 tokens** in 1 target steps" in first
    assert "in 2 target steps" in second
    client.predict(api_name="/reset")
    again = client.predict(api_name="/step", **SETTINGS)[READOUT]
    assert "**1 tokens** in 1 target steps" in again


def test_trace_download_and_upload_round_trip(client, tmp_path):
    client.predict(api_name="/reset")
    client.predict(api_name="/run", speed_s=0, **SETTINGS)
    path = client.predict(api_name="/download_trace")
    trace = json.loads(open(path, encoding="utf-8").read())
    assert trace["version"] == 1 and trace["steps"]
    client.predict(api_name="/reset")
    card, line, stream, readout, *_ = client.predict(handle_file(path), api_name="/upload_trace")
    assert "Replaying a saved trace" in readout and "sdl-stream" in stream
    # stepping a replay walks the recorded steps, no model needed
    stepped = client.predict(api_name="/step", **SETTINGS)[READOUT]
    assert "replaying a saved trace" in stepped


def test_bad_input_gets_a_message_and_the_app_stays_usable(client, tmp_path):
    client.predict(api_name="/reset")
    with pytest.raises(Exception, match="prompt is empty"):
        client.predict(api_name="/run", speed_s=0, **dict(SETTINGS, prompt="   "))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1, "steps": "nope"}')
    with pytest.raises(Exception, match="trace"):
        client.predict(handle_file(str(bad)), api_name="/upload_trace")
    client.predict(api_name="/reset")
    assert "tokens/s" in client.predict(api_name="/run", speed_s=0, **SETTINGS)[READOUT]


def test_play_streams_round_by_round_and_stop_ends_it(client):
    readout, updates = play_then_stop(client, SETTINGS)
    assert "finished (stopped)" in readout
    assert updates >= 2  # one update per round, then the final one


def test_compare_runs_baseline_then_speculative_and_greedy_outputs_are_identical(client):
    client.predict(api_name="/reset")
    *current, baseline, speculative, verdict = client.predict(api_name="/compare", rounds=2, **SETTINGS)
    assert "outputs identical" in verdict and "measured speedup" in verdict and "median of 2 interleaved" in verdict
    assert "**baseline**" in verdict and "tokens/s" in verdict
    assert "sdl-stream" in baseline and "sdl-stream" in speculative
    # the verdict card: both rates, the speedup, tokens per step, identical, and why, over 2 rounds
    card = current[CARD]
    assert "speclab-verdict" in card and "Medians of 2 runs" in card and "identical" in card
    assert "plain decoding (baseline)" in card and "tokens per target step" in card and "Why it" in card
    # the speculative run is now the current run: its views, charts and trace
    assert "target steps" in current[READOUT] and "sdl-stream" in current[STREAM] and current[OUTPUT_LINE]
    *plots, curve, machine = client.predict(api_name="/charts")
    assert len(plots) == 5 and "Verify curve" in curve["plot"]
    # this machine's verify curve, the dtype and why, and the prediction with the measured verify cost
    assert "Target **" in machine and "costs **" in machine and "with the measured verify cost" in machine
    float32 = client.predict(api_name="/compare", rounds=1, **dict(SETTINGS, dtype="float32"))[-1]
    assert "outputs identical" in float32
    assert "Target **float32**" in client.predict(api_name="/charts")[-1]
    with pytest.raises(Exception, match="not in the list of choices|unknown dtype"):
        client.predict(api_name="/run", speed_s=0, **dict(SETTINGS, dtype="float8"))
    trace = json.loads(open(client.predict(api_name="/download_trace"), encoding="utf-8").read())
    assert trace["info"]["method"] == "prompt-lookup"
    with pytest.raises(Exception, match="choose a drafter"):
        client.predict(api_name="/compare", **dict(SETTINGS, method="baseline"))


def test_prompt_lookup_first_and_the_draft_stop_are_settings_and_lookup_steps_say_so(client):
    """mtp with lookup first = 1 on a chat prompt: some steps copy (the readout counts them and
    each such step names prompt lookup as its drafter), the module drafts the rest, and with a
    draft stop too the greedy text equals plain decoding's."""
    client.predict(api_name="/reset")
    mixed = dict(SETTINGS, prompt="Name three colors and say why you like them.", method="mtp", lookup_first=1,
                 draft_stop=0.3, max_new_tokens=24)
    plain = client.predict(api_name="/run", speed_s=0, **dict(mixed, method="baseline", lookup_first=0))[OUTPUT_LINE]
    shown = client.predict(api_name="/run", speed_s=0, **mixed)
    line, stream, readout = shown[OUTPUT_LINE], shown[STREAM], shown[READOUT]
    assert "prompt lookup drafted **" in readout and "mtp the rest" in readout, readout
    assert "· prompt-lookup ·" in stream and "· mtp ·" in stream
    assert line == plain  # greedy: the same text as plain decoding


def test_fit_k_is_a_setting_its_steps_stay_within_k_and_the_text_is_plain_decodings(client):
    """The playground's "fit k to this machine": the greedy text equals plain decoding's, the
    readout says how many drafts the steps used (never more than k), the machine note says how
    they were chosen, and the downloaded trace records it."""
    client.predict(api_name="/reset")
    fitted = dict(SETTINGS, prompt="Name three colors and say why you like them.", method="mtp", k=8, fit_k=True,
                  max_new_tokens=24)
    plain = client.predict(api_name="/run", speed_s=0, **dict(fitted, method="baseline", fit_k=False))[OUTPUT_LINE]
    shown = client.predict(api_name="/run", speed_s=0, **fitted)
    assert shown[OUTPUT_LINE] == plain
    used = re.search(r"draft length fitted to this machine: \*\*([\d.]+)\*\* drafts per step \((\d+)-(\d+), "
                     r"k = 8 at most\)", shown[READOUT])
    assert used, shown[READOUT]
    assert 1 <= int(used[2]) <= float(used[1]) <= int(used[3]) <= 8
    assert "Fitted draft lengths" in client.predict(api_name="/charts")[-1]
    trace = json.loads(open(client.predict(api_name="/download_trace"), encoding="utf-8").read())
    assert trace["info"]["fit_k"] is True and max(s["k"] for s in trace["steps"]) <= 8


def test_a_scenario_button_sets_prompt_method_and_k_and_says_what_to_expect(client):
    from ui.scenarios import load_scenarios

    first = load_scenarios()[0]
    expect, prompt, method, k, adaptive, temperature, *_ = client.predict(api_name="/scenario_fix_typos")
    assert (prompt, method, k, temperature) == (first.prompt, first.method, first.k, first.temperature)
    assert first.expect.split()[0] in expect and "Compare with baseline" in expect
    with pytest.raises(Exception, match="compare rounds|maximum value"):
        client.predict(api_name="/compare", rounds=9, **SETTINGS)


def test_chunked_prefill_compares_two_settings_and_streams_the_timeline(client):
    job = client.submit(api_name="/prefill_compare", policy="none", chunk_size=512, policy_b="decode-first",
                        chunk_size_b=512, **PREFILL)
    progress, timeline_a, timeline_b, table, ttft, itl_time, itl_dist = job.result(timeout=600)
    assert progress.startswith("Done.") and "A: none" in progress and "B: decode-first, chunk 512" in progress
    assert [row[0] for row in table["data"]] == ["A: none (no chunking)", "B: decode-first, chunk 512"]
    assert timeline_a and timeline_b and ttft and itl_time and itl_dist
    assert len(job.outputs()) > 1  # the timeline was streamed while the runs went


def test_chunked_prefill_with_the_prefix_cache_shows_reused_blocks(client):
    progress, timeline_a, timeline_b, table, *_ = client.predict(
        api_name="/prefill_compare", preset="embedded", scenario="doc-questions", max_new_tokens=2,
        policy="decode-first", chunk_size=256, prefix_cache=True, policy_b="decode-first", chunk_size_b=256,
        prefix_cache_b=False)
    assert "A: decode-first, chunk 256, prefix cache" in progress
    rows = {row[0]: dict(zip(table["headers"], row)) for row in table["data"]}
    assert int(rows["A: decode-first, chunk 256, prefix cache"]["prompt tokens reused (%)"]) >= 70
    assert rows["B: decode-first, chunk 256"]["prompt tokens reused (%)"] == "off"
    assert "reused (prefix cache)" in json.dumps(timeline_a) and "reused (prefix cache)" not in json.dumps(timeline_b)


def test_chunked_prefill_stop_ends_the_job_before_its_second_setting(client):
    progress, timeline_a, timeline_b, *_ = prefill_compare_then_stop(client, chunk_size=64)
    assert "**A: decode-first, chunk 64** (stopped)" in progress
    assert timeline_b is None  # B never ran


def test_chunked_prefill_bad_input_gets_a_message(client):
    with pytest.raises(Exception, match="minimum value 16"):
        client.predict(api_name="/prefill_run", policy="decode-first", chunk_size=3, **PREFILL)
    with pytest.raises(Exception, match="chunk size must be a whole number"):
        client.predict(api_name="/prefill_run", policy="decode-first", chunk_size=100.5, **PREFILL)
    with pytest.raises(Exception, match="nope"):
        client.predict(api_name="/prefill_run", policy="decode-first", chunk_size=64,
                       **dict(PREFILL, scenario="nope"))
