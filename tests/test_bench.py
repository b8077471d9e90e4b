"""`python -m engine bench` and `python -m engine gate` on tiny random models: the JSON contract,
identical-output flags, the lossy rule caught by the gate (greedy and sampling), exit codes.

No timing is asserted (speed is measured by the benchmark itself, never by a test)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.bench.gate import permutation_test, tv_per_position
from engine.bench.prompts import builtin_sets, load_prompts
from engine.cli import main
from engine.models import load_model
from tiny import WORDS, tiny_llama
from visualizations.bench import bench_charts, gate_chart, gate_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from bench_charts import write_charts  # noqa: E402

TINY_SET = """
name: tiny
raw: true
prompts:
  - id: repeat
    text: w1 w2 w3 w4 w1 w2 w3 w4 w1 w2
  - id: mixed
    text: w7 w8 w9 w10 w11 w12 w7 w8
"""
# every word of the vocabulary followed by w9: prompt lookup drafts w9 after any first token
FLOOD_SET = "name: flood\nraw: true\nprompts:\n  - id: w9\n    text: " + " ".join(
    f"{w} w9" for w in WORDS[2:] if w != "w9") + "\n"
DESIGN_FIELDS = ("device", "dtype", "model", "prompt_tokens", "k", "temperature", "chunk_size", "concurrency",
                 "decode_traffic_active", "evidence_class")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def any_model(monkeypatch):
    monkeypatch.setenv("SPECLAB_ALLOW_ANY_MODEL", "1")  # what main() sets, undone after each test


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    (root / "tiny.yaml").write_text(TINY_SET)
    (root / "flood.yaml").write_text(FLOOD_SET)
    return root


def engine(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def bench(tiny_target, tiny_draft, sets, tmp_path_factory):
    """One greedy benchmark of every engine method and transformers' counterparts."""
    out = tmp_path_factory.mktemp("bench-out")  # read via --out: a module fixture cannot take capsys
    code = main(["bench", "--model", tiny_target, "--draft", tiny_draft,
                 "--methods", "prompt-lookup,draft-model,early-exit,draft-model:vocab=full,baseline:kernels=stock", "--prompts", str(sets / "tiny.yaml"),
                 "--k", "3", "--repeats", "2", "--max-new-tokens", "8", "--vs-transformers", "--out", str(out)])
    assert code == 0
    return json.loads((out / "bench.json").read_text()), out


def test_bench_json_contract(bench):
    report, out = bench
    for key in DESIGN_FIELDS + ("schema", "command", "machine", "baseline_step_ms", "results", "transformers", "runs"):
        assert key in report, key
    assert report["evidence_class"] == "controlled benchmark" and report["concurrency"] == 1
    assert report["prompt_tokens"] == {"tiny/repeat": 10, "tiny/mixed": 8}
    assert [r["method"] for r in report["results"]] == ["baseline", "prompt-lookup", "draft-model", "early-exit",
                                                        "draft-model:vocab=full", "baseline:kernels=stock"]  # variants: own rows
    # auto: bfloat16 where the CPU has it, else float32, each with its invariant kernels where they pass
    assert report["batch_invariant"] == load_model(report["model"], dtype=report["dtype"]).batch_invariant
    # transformers' generate() runs its own (stock) kernels: compared with the engine's stock plain run
    stock = "baseline:kernels=stock" if report["batch_invariant"] else "baseline"
    assert {r["compared_with"] for r in report["transformers"]} == {stock}
    base = report["results"][0]
    assert base["speedup"] == 1.0 and base["predicted_speedup"] is None and base["per_position_acceptance"] == []
    for row in report["results"][1:-1]:
        for key in ("tokens_per_s_median", "speedup", "draft_acceptance_rate", "per_token_acceptance",
                    "mean_acceptance_length", "per_position_acceptance", "cost_ratio", "predicted_speedup",
                    "measured_over_predicted", "identical_to_baseline", "per_prompt", "lossy"):
            assert key in row, key
        assert len(row["per_position_acceptance"]) <= 3 and row["lossy"] is False
        assert [p["prompt"] for p in row["per_prompt"]] == ["tiny/repeat", "tiny/mixed"]
    assert report["results"][2]["cost_ratio"] > 0  # a draft model costs something
    assert {r["engine_method"]: r["method"] for r in report["transformers"]} == {
        "baseline": "transformers", "draft-model": "transformers:assistant_model",
        "prompt-lookup": "transformers:prompt_lookup_num_tokens", "early-exit": "transformers:assistant_early_exit"}
    assert all(r["engine_over_transformers"] > 0 for r in report["transformers"])
    assert report["transformers_skipped"] == {}  # every variant applies to a Llama
    assert {p.name for p in out.iterdir()} >= {"bench.json", "bench.md"}
    assert write_charts(out)[0].name == "charts.html" and "plotly" in (out / "charts.html").read_text()
    assert "| prompt-lookup |" in (out / "bench.md").read_text()


def test_greedy_outputs_are_flagged_identical(bench):
    report, _ = bench
    for row in report["results"] + report["transformers"]:
        assert row["identical_to_baseline"] is True, row["method"]
        assert all(p["identical_to_baseline"] for p in row["per_prompt"])
        assert all(p["output_tokens"] == 8 for p in row["per_prompt"])  # EOS ignored: equal lengths


def test_repeats_are_interleaved(bench):
    report, _ = bench
    runs = report["runs"]
    assert len(runs) == 10 * 2 * 2  # 6 engine methods (variants too) + 4 transformers variants, 2 prompts, 2 repeats
    rounds = {}
    for r in runs:
        rounds.setdefault((r["repeat"], r["prompt"]), []).append(r)
    firsts = set()
    for members in rounds.values():
        assert sorted(r["order"] for r in members) == list(range(10))
        firsts.add(next(r["method"] for r in members if r["order"] == 0))
    assert len(firsts) == len(rounds)  # a different entrant starts each round


def test_bench_charts(bench):
    report, _ = bench
    charts = bench_charts(report)
    assert set(charts) == {"speed", "speedup", "acceptance"}
    assert all(fig.data for fig in charts.values())


def test_sampling_bench_has_no_identical_flags(tiny_target, sets, capsys):
    code, out, _ = engine(capsys, "bench", "--model", tiny_target, "--methods", "prompt-lookup", "--prompts",
                          sets / "tiny.yaml", "--limit", "1", "--repeats", "1", "--max-new-tokens", "5",
                          "--temperature", "0.8", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["temperature"] == 0.8
    assert all(r["identical_to_baseline"] is None for r in report["results"])


@pytest.mark.parametrize("args, reason", [
    (["--methods", "teleport"], "method 'teleport' is not available"),
    (["--methods", "draft-model"], "method draft-model: no draft model given"),
    (["--methods", "prompt-lookup,prompt-lookup"], "named twice"),
    (["--methods", "prompt-lookup:tree=small"], "unknown variant 'tree=small'"),
    (["--methods", "mtp:vocab=some"], "draft vocabulary must be one of"),
    (["--methods", "mtp:kind=module:tree=small:kind=heads"], "sets kind twice"),
    (["--methods", "mtp:kind=module:ngram=3"], "unknown variant 'ngram=3'"),
    (["--methods", "mtp:kind=module:tree=bushy"], "unknown tree shape 'bushy'"),
    (["--methods", "mtp:draft=/no/such/module"], "method mtp:draft=/no/such/module:"),
    (["--methods", "prompt-lookup:draft=x"], "unknown variant 'draft=x'"),
    (["--methods", "mtp:int8=maybe"], "int8 takes on or off"),
    (["--methods", "draft-model:int8=off"], "unknown variant 'int8=off'"),
    (["--repeats", "0"], "repeats must be in"),
    (["--prompts", "no-such-set"], "unknown prompt set"),
    (["--k", "0"], "draft length"),
])
def test_bench_bad_input_is_one_line_and_exit_2(tiny_target, sets, capsys, args, reason):
    base = ["bench", "--model", tiny_target, "--prompts", sets / "tiny.yaml", "--max-new-tokens", "4"]
    code, out, err = engine(capsys, *base, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and reason in lines[0], err
    assert not out


def gate(capsys, model, *args) -> tuple[int, dict]:
    code, out, _ = engine(capsys, "gate", "--model", model, "--json", *args)
    return code, json.loads(out)


@pytest.mark.parametrize("method", ["prompt-lookup", "draft-model", "early-exit"])
def test_greedy_gate_passes_exact_methods(tiny_target, tiny_draft, sets, capsys, method):
    code, result = gate(capsys, tiny_target, "--method", method, "--draft", tiny_draft,
                        "--prompts", sets / "tiny.yaml", "--k", "3", "--max-new-tokens", "10")
    assert code == 0 and result["passed"] and result["mode"] == "greedy" and not result["lossy"]
    assert all(p["divergence"] is None and p["compared_tokens"] == 10 for p in result["prompts"])


@pytest.mark.parametrize("method", ["baseline", "prompt-lookup"])
def test_greedy_gate_checks_chunked_prefill_against_one_forward(tiny_target, sets, capsys, method):
    code, result = gate(capsys, tiny_target, "--method", method, "--prefill-chunk", "2",
                        "--prompts", sets / "tiny.yaml", "--k", "3", "--max-new-tokens", "10")
    assert code == 0 and result["passed"] and result["prefill_chunk"] == 2
    assert all(p["divergence"] is None and p["compared_tokens"] == 10 for p in result["prompts"])
    code, out, _ = engine(capsys, "gate", "--model", tiny_target, "--method", method, "--prefill-chunk", "2",
                          "--prompts", sets / "tiny.yaml", "--max-new-tokens", "4")
    assert code == 0 and "prefill chunk 2 (baseline: one forward)" in out


def test_greedy_gate_reports_the_first_divergence_of_the_lossy_rule(tiny_target, sets, capsys):
    code, result = gate(capsys, tiny_target, "--method", "prompt-lookup", "--accept", "typical",
                        "--prompts", sets / "tiny.yaml", "--k", "3", "--max-new-tokens", "10")
    assert code == 1 and not result["passed"] and result["lossy"]
    diverged = [p for p in result["prompts"] if p["divergence"]]
    assert diverged
    d = diverged[0]["divergence"]
    assert 0 <= d["position"] < 10 and d["baseline"]["token_id"] != d["method"]["token_id"]
    assert d["baseline"]["text"] == WORDS[d["baseline"]["token_id"]]
    # the baseline's token is the target's argmax there: the method's token scores lower
    assert d["target_logit_gap"] > 0 and d["target_top2_margin"] >= 0
    assert d["target_logit_gap"] >= d["target_top2_margin"] - 1e-5


def test_greedy_gate_human_output(tiny_target, sets, capsys):
    code, out, _ = engine(capsys, "gate", "--model", tiny_target, "--method", "prompt-lookup", "--accept", "typical",
                          "--prompts", sets / "tiny.yaml", "--max-new-tokens", "6")
    assert code == 1
    assert "LOSSY" in out and "diverges at output token" in out and out.strip().endswith("FAIL")


@pytest.fixture(scope="module")
def flat_target(tmp_path_factory):
    """A near-uniform target: the lossy rule's threshold is then below every token's probability."""
    return str(tiny_llama(tmp_path_factory.mktemp("flat"), seed=10, layers=2, scale=1.0))


@pytest.mark.parametrize("rule, passed", [("exact", True), ("typical", False)])
def test_sampling_gate_passes_exact_and_fails_typical(flat_target, sets, capsys, rule, passed):
    """Prompt lookup drafts w9 after every first token. The exact rule accepts it with the target's
    small probability; typical acceptance keeps it whenever that probability clears its threshold,
    so w9 floods position 1 and the TV distance there is far above the threshold."""
    code, result = gate(capsys, flat_target, "--method", "prompt-lookup", "--accept", rule, "--prompts",
                        sets / "flood.yaml", "--k", "2", "--max-new-tokens", "3", "--temperature", "1",
                        "--samples", "120")
    assert result["mode"] == "sampling" and result["passed"] is passed and code == (0 if passed else 1)
    assert 0 < result["threshold"] < 1 and result["samples"] == 120
    (prompt,) = result["prompts"]
    assert len(prompt["tv"]) == 3
    if passed:
        assert result["p_value"] > result["alpha"]
    else:
        assert prompt["worst_position"] >= 1 and prompt["differences"][0]["token"]["text"] == "w9"
        assert prompt["differences"][0]["method_freq"] > 0.5 > prompt["differences"][0]["baseline_freq"]
        table = gate_table(result)
        assert list(table["verdict"]) == ["FAIL"] and "w9" in table["detail"][0]
        assert gate_chart(result).data


@pytest.mark.parametrize("args, reason", [
    (["--method", "baseline"], "choose a drafter method"),
    (["--method", "teleport"], "not available"),
    (["--method", "prompt-lookup", "--temperature", "1", "--samples", "5"], "samples must be in"),
    (["--method", "prompt-lookup", "--alpha", "0.001", "--permutations", "100", "--temperature", "1"],
     "permutations must be in"),
    (["--method", "prompt-lookup", "--limit", "-1"], "limit must be"),
])
def test_gate_bad_input_exits_2(tiny_target, sets, capsys, args, reason):
    code, out, err = engine(capsys, "gate", "--model", tiny_target, "--prompts", sets / "tiny.yaml", *args)
    assert code == 2 and reason in err and not out


def test_permutation_threshold_holds_the_false_alarm_rate_and_shrinks_with_samples():
    rng = np.random.default_rng(0)
    probs = np.array([0.4, 0.3, 0.2, 0.1])

    def draw(n, p=probs):
        return rng.choice(len(p), size=(n, 2), p=p)

    alarms = sum(permutation_test([(draw(100), draw(100))], 0.05, 199, seed=s)[2] <= 0.05 for s in range(40))
    assert alarms <= 6  # about 5% of 40, with room for chance
    _, small, _ = permutation_test([(draw(50), draw(50))], 0.01, 200)
    _, large, _ = permutation_test([(draw(800), draw(800))], 0.01, 200)
    assert large < small / 2  # roughly 1/sqrt(N)
    shifted = np.array([0.1, 0.2, 0.3, 0.4])
    observed, threshold, p_value = permutation_test([(draw(300), draw(300, shifted))], 0.01, 200)
    assert observed > threshold and p_value <= 0.01


def test_tv_per_position_is_half_the_l1_distance():
    a = np.array([[0, 1], [0, 1], [1, 1], [2, 1]])
    b = np.array([[0, 1], [1, 1], [1, 1], [1, 3]])
    assert tv_per_position(a, b).tolist() == [0.5, 0.25]


def test_shipped_prompt_sets():
    assert set(builtin_sets()) == {"chat", "code", "rewrite", "long-qa"}
    prompts = load_prompts("all")
    assert len({p.key for p in prompts}) == len(prompts)
    for name in builtin_sets():
        mine = [p for p in prompts if p.set == name]
        assert len(mine) >= 3 and all(p.text.strip() for p in mine)
    assert min(len(p.text) for p in prompts if p.set == "long-qa") > 1500
    assert [p.key for p in load_prompts("chat,code", limit=1)] == ["chat/colors", "code/fizzbuzz"]


def test_spec_bench_loads_per_category():
    from engine.bench.prompts import SPEC_BENCH_CATEGORIES

    prompts = load_prompts("spec-bench")
    assert len(prompts) == 240
    assert [name for name in dict.fromkeys(p.set for p in prompts)] == [f"spec-bench:{c}" for c in SPEC_BENCH_CATEGORIES]
    mt = load_prompts("spec-bench:mt_bench", limit=8)  # interleaved: one of each MT-bench kind
    assert [p.id.split("-")[0] for p in mt] == ["writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                 "stem", "humanities"]
    qa = load_prompts("spec-bench:qa")
    assert len(qa) == 40 and qa[0].key == "spec-bench:qa/322" and not qa[0].raw
    assert len(load_prompts("spec-bench,chat", limit=2)) == 6 * 2 + 2
    with pytest.raises(Exception, match="unknown Spec-Bench category 'math'"):
        load_prompts("spec-bench:math")


def test_bench_reports_each_prompt_set(tiny_target, sets, capsys, tmp_path):
    code, _, _ = engine(capsys, "bench", "--model", tiny_target, "--methods", "prompt-lookup",
                        "--prompts", f"{sets / 'tiny.yaml'},{sets / 'flood.yaml'}", "--k", "3", "--repeats", "1",
                        "--max-new-tokens", "6", "--out", tmp_path)
    assert code == 0
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["prompt_sets"] == {"tiny": 2, "flood": 1}
    lookup = report["results"][1]
    assert [p["set"] for p in lookup["per_set"]] == ["tiny", "flood"]
    flood = lookup["per_set"][1]
    per_prompt = next(p for p in lookup["per_prompt"] if p["prompt"] == "flood/w9")
    assert flood["mean_acceptance_length"] == per_prompt["mean_acceptance_length"] and flood["speedup"] > 0
    assert flood["identical_to_baseline"] is True and report["results"][0]["per_set"][0]["speedup"] == 1.0
    md = (tmp_path / "bench.md").read_text()
    assert "| method | tiny (2) | flood (1) | all |" in md and "tau" in md


SHORT_SET = """
name: short
prompts:
  - id: one-word
    text: "Answer with one word only: is the sky blue?"
  - id: capital
    text: "What is the capital of France? Answer in one short sentence."
"""


@pytest.mark.embedded
def test_bench_stops_at_eos_as_spec_bench_does(capsys, tmp_path):
    """--stop-at-eos: each run ends at the model's EOS (Spec-Bench's protocol); exact methods,
    the MTP module and prompt lookup first among them, still emit the baseline's tokens."""
    (tmp_path / "short.yaml").write_text(SHORT_SET)
    common = ["bench", "--methods", "mtp:lookup=2:stop=0.4", "--prompts", tmp_path / "short.yaml",
              "--repeats", "1", "--max-new-tokens", "48"]
    code, _, _ = engine(capsys, *common, "--stop-at-eos", "--out", tmp_path / "eos")
    assert code == 0
    report = json.loads((tmp_path / "eos" / "bench.json").read_text())
    assert report["ignore_eos"] is False
    lengths = {p["prompt"]: p["output_tokens"] for p in report["results"][0]["per_prompt"]}
    assert all(0 < n < 48 for n in lengths.values()), lengths  # short answers end well before the budget
    mtp = report["results"][1]
    assert mtp["identical_to_baseline"] is True
    assert {p["prompt"]: p["output_tokens"] for p in mtp["per_prompt"]} == lengths
    assert "48 new tokens at most (each run stops at EOS)" in (tmp_path / "eos" / "bench.md").read_text()
    code, _, _ = engine(capsys, *common, "--limit", "1", "--out", tmp_path / "all")  # default: EOS ignored
    assert code == 0
    report = json.loads((tmp_path / "all" / "bench.json").read_text())
    assert report["ignore_eos"] is True
    assert [p["output_tokens"] for p in report["results"][0]["per_prompt"]] == [48]


def test_gate_tab_validates_and_renders(tiny_target, sets, capsys):
    from ui.gate import gate_config, verdict_markdown

    with pytest.raises(Exception, match="capped"):
        gate_config("prompt-lookup", "exact", "chat", 1, 4, 1.0, 10_000, 8, 0)
    cfg = gate_config("prompt-lookup", "typical", "rewrite", 1, 4, 0, 100, 8, 0)
    assert cfg.greedy and cfg.decode.rule.value == "typical" and len(cfg.prompts) == 1
    _, result = gate(capsys, tiny_target, "--method", "prompt-lookup", "--accept", "typical",
                     "--prompts", Path(sets / "tiny.yaml"), "--max-new-tokens", "6")
    text = verdict_markdown(result)
    assert "FAIL" in text and "LOSSY" in text


def test_gate_tab_handler_runs_the_gate(tiny_target, monkeypatch):
    from ui.gate import run_gate_tab

    monkeypatch.setenv("SPECLAB_PRESET", tiny_target)  # the tab runs on the app's model
    updates = list(run_gate_tab("prompt-lookup", "exact", "chat", 1, 3, 0, 100, 6, 0))
    assert len(updates) == 2 and "Running the baseline" in updates[0][0]
    verdict, table, chart = updates[1]
    assert verdict.startswith("## ✅ PASS") and list(table["verdict"]) == ["pass"] and chart.layout.title.text
