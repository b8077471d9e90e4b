"""The app as users reach it: launched for real, driven through its own API client."""

import json

import pytest
from gradio_client import Client, handle_file

from apphelpers import running_app

pytestmark = [pytest.mark.app, pytest.mark.embedded]

SETTINGS = dict(prompt="Repeat exactly: red, green, blue, red, green, blue.", preset="embedded",
                method="prompt-lookup", k=4, adaptive=False, temperature=0, top_k=0, top_p=1, seed=0,
                max_new_tokens=12, raw=False, rule="exact")


@pytest.fixture(scope="module")
def client():
    with running_app() as url:
        yield Client(url, verbose=False)


def test_generation_is_answered_through_the_api(client):
    stream, readout, table, top, residual = client.predict(api_name="/run", speed_s=0, **SETTINGS)
    assert "sdl-stream" in stream and "tokens/s" in readout and "TTFT" in readout
    assert "12 tokens" in readout or "finished (eos)" in readout


def test_step_advances_one_round_per_call_and_reset_clears(client):
    first = client.predict(api_name="/step", **SETTINGS)[1]
    second = client.predict(api_name="/step", **SETTINGS)[1]
    assert "**1 tokens** in 1 target steps" in first
    assert "in 2 target steps" in second
    client.predict(api_name="/reset")
    again = client.predict(api_name="/step", **SETTINGS)[1]
    assert "**1 tokens** in 1 target steps" in again


def test_trace_download_and_upload_round_trip(client, tmp_path):
    client.predict(api_name="/reset")
    client.predict(api_name="/run", speed_s=0, **SETTINGS)
    path = client.predict(api_name="/download_trace")
    trace = json.loads(open(path, encoding="utf-8").read())
    assert trace["version"] == 1 and trace["steps"]
    client.predict(api_name="/reset")
    stream, readout, *_ = client.predict(handle_file(path), api_name="/upload_trace")
    assert "Replaying a saved trace" in readout and "sdl-stream" in stream
    # stepping a replay walks the recorded steps, no model needed
    stepped = client.predict(api_name="/step", **SETTINGS)[1]
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
    assert "tokens/s" in client.predict(api_name="/run", speed_s=0, **SETTINGS)[1]
