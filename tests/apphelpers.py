"""Launch the real app in a subprocess on a free port and talk to it with gradio_client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_app(extra_env: dict | None = None, timeout: float = 240):
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", GRADIO_SERVER_NAME="127.0.0.1", GRADIO_SERVER_PORT=str(port),
               GRADIO_ANALYTICS_ENABLED="False", PYTHONPATH=str(ROOT), **(extra_env or {}))
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py")], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"app exited early: {proc.stderr.read()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError("app did not start in time")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def play_then_stop(client, settings: dict, first_output_s: float = 120) -> tuple[str, int]:
    """Start Play through the API, press Stop once the first round has streamed; the final
    readout and how many updates streamed."""
    client.predict(api_name="/reset")
    job = client.submit(api_name="/play", speed_s=1.0, **dict(settings, max_new_tokens=40))
    deadline = time.time() + first_output_s
    while not job.outputs() and time.time() < deadline:
        time.sleep(0.2)
    client.predict(api_name="/stop")
    readout = job.result(timeout=120)[READOUT]
    return readout, len(job.outputs())


# where the playground's /step, /play and /run outputs put each view (ui.playground.views)
CARD, OUTPUT_LINE, STREAM, READOUT = 0, 1, 2, 3

# request settings the app tests send (a copy prompt prompt lookup drafts well)
PLAYGROUND = dict(prompt="Repeat exactly: red, green, blue, red, green, blue.", preset="embedded",
                  method="prompt-lookup", k=4, adaptive=False, temperature=0, top_k=0, top_p=1, seed=0,
                  max_new_tokens=12, raw=False, rule="exact", tree="chain")
PREFILL = dict(preset="embedded", scenario="doc-arrives", max_new_tokens=2)


def prefill_compare_then_stop(client, chunk_size: int, first_output_s: float = 120) -> tuple:
    """Start a chunked-prefill Compare (decode-first vs none), press Stop at its first update;
    the job's final outputs."""
    job = client.submit(api_name="/prefill_compare", policy="decode-first", chunk_size=chunk_size, policy_b="none",
                        chunk_size_b=chunk_size, **PREFILL)
    deadline = time.time() + first_output_s
    while not job.outputs() and time.time() < deadline:
        time.sleep(0.1)
    client.predict(api_name="/prefill_stop")
    return job.result(timeout=300)
