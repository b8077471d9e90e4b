"""`python -m engine generate` as a user runs it: a subprocess, its stdout, stderr and status."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import load_model

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def test_json_contract_on_a_tiny_model(tiny_target, tiny_draft):
    r = cli("generate", "--model", tiny_target, "--raw", "--prompt", "w1 w2 w3 w1 w2", "--max-new-tokens", "9",
            "--method", "draft-model", "--draft", tiny_draft, "--k", "3", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # exactly one JSON object on stdout
    for key in ("method", "model", "prompt_tokens", "output_token_ids", "text", "steps", "metrics"):
        assert key in out
    assert out["method"] == "draft-model" and out["prompt_tokens"] == 5 and len(out["output_token_ids"]) <= 9
    for key in ("target_steps", "wall_s", "tokens_per_s", "ttft_ms", "itl_ms_p50", "itl_ms_p90", "drafted_tokens",
                "accepted_tokens", "draft_acceptance_rate", "mean_acceptance_length", "per_position_acceptance",
                "cost_ratio", "predicted_speedup"):
        assert key in out["metrics"], key
    step = out["steps"][1]
    for key in ("k", "draft_token_ids", "accepted", "emitted_token_ids", "kinds", "draft_probs", "target_probs",
                "verify_ms"):
        assert key in step, key
    assert [t for s in out["steps"] for t in s["emitted_token_ids"]] == out["output_token_ids"]
    assert out["metrics"]["target_steps"] == len(out["steps"])


@pytest.mark.embedded
def test_human_output_streams_text_and_summary():
    r = cli("generate", "--prompt", "Name three colors.", "--max-new-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tokens/s" in r.stderr and "TTFT" in r.stderr and "ITL p50" in r.stderr


@pytest.mark.parametrize(
    "args, reason",
    [
        (["--prompt", ""], "prompt is empty"),
        (["--prompt", "   \n"], "prompt is empty"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "max new tokens"),
        (["--prompt", "hi", "--max-new-tokens", "99999999"], "max new tokens"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--top-p", "0"], "top-p"),
        (["--prompt", "hi", "--top-p", "1.5"], "top-p"),
        (["--prompt", "hi", "--k", "17", "--method", "prompt-lookup"], "draft length"),
        (["--prompt", "hi", "--model", "/no/such/folder-or-model"], "unknown model"),
        (["--prompt", "hi", "--method", "teleport"], "unknown method"),
        (["--prompt", "hi", "--method", "mtp", "--lookup-first", "-2"], "lookup-first must be"),
        (["--prompt", "hi", "--method", "prompt-lookup", "--lookup-first", "2"], "lookup-first is for drafters"),
        (["--prompt-file", "/no/such/file.txt"], "cannot read prompt file"),
        (["--prompt", "hi", "--max-new-tokens", "ten"], "invalid int"),
        (["--prompt", "hi", "--method", "mtp", "--draft-int8", "maybe"], "invalid choice"),
    ],
)
def test_bad_input_exits_non_zero_with_one_line(tiny_target, args, reason):
    if "--model" not in args:
        args = args + ["--model", tiny_target]
    r = cli("generate", *args)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and reason in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.embedded
def test_prompt_longer_than_the_context(tmp_path):
    long = tmp_path / "long.txt"
    long.write_text("word " * 9000)
    r = cli("generate", "--prompt-file", str(long), "--raw")
    assert r.returncode == 2 and "context is 8192" in r.stderr


def test_profile_reports_parts_floor_verify_curve_and_kernels(tiny_target):
    """`python -m engine profile --json`: the step split into parts that add up, the bandwidth
    floor, the verify curve (T = 1 is the reference) and the LM head matvec per dtype."""
    proc = cli("profile", "--model", tiny_target, "--tokens", "4", "--repeats", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    ms = out["per_step_ms"]
    assert out["evidence"] == "microbenchmark" and ms["step"] > 0 and out["floor_ms"] > 0
    assert abs(ms["forward"] + ms["sampling"] + ms["record keeping"] + ms["loop python"] - ms["step"]) < 1e-6
    assert set(out["verify_over_single"]) == {"1", "2", "3", "5", "9", "17"} and out["verify_over_single"]["1"] == 1.0
    assert set(out["lm_head_matvec"]) == {"float32", "float16", "bfloat16"}
    assert all(k["ms"] > 0 and k["gb_s"] > 0 for k in out["lm_head_matvec"].values())
    # the speculative step's parts add up, and the engine's share is theirs minus draft and forward
    spec = out["speculative_step"]
    parts = spec["ms"]
    assert spec["method"] == "prompt-lookup" and spec["k"] == 4 and spec["tokens_per_step"] >= 1
    assert set(parts) == {"step", "draft", "verify forward", "acceptance", "KV rollback", "records", "loop python"}
    assert abs(sum(v for p, v in parts.items() if p != "step") - parts["step"]) < 1e-6
    # the model forward is found behind torch.inference_mode()'s wrapper, in both kinds of step
    assert ms["forward"] > ms["sampling"] > 0 and parts["verify forward"] > parts["acceptance"] > 0
    engine_ms = parts["acceptance"] + parts["KV rollback"] + parts["records"] + parts["loop python"]
    assert spec["engine_share"] == pytest.approx(engine_ms / parts["step"])
    # one verify curve per dtype; bfloat16 on a CPU is the batch-invariant one
    curves = out["verify_curves"]
    assert set(curves) == {"float32", "bfloat16", "bfloat16:stock", "float16"}
    assert all(c["over_single"]["1"] == 1.0 and set(c["forward_ms"]) == set(out["verify_over_single"]) for c in curves.values())
    # float32's invariant kernels where this CPU's BLAS passes their check (engine.invariant)
    assert curves["bfloat16"]["batch_invariant"]
    assert curves["float32"]["batch_invariant"] == load_model(tiny_target, dtype="float32").batch_invariant
    assert not curves["bfloat16:stock"]["batch_invariant"]
    human = cli("profile", "--model", tiny_target, "--tokens", "4", "--repeats", "1", "--curve-dtypes", "float32,bfloat16")
    assert "the floor" in human.stdout and "T = k + 1" in human.stdout and "LM head" in human.stdout
    assert "the engine's own work" in human.stdout and "(batch-invariant)" in human.stdout
