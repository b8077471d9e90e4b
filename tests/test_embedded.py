"""The embedded SmolLM2-135M-Instruct: real forward passes on CPU."""

import pytest
import torch

from engine.decoding import DecodeConfig, generate
from engine.drafters import DrafterSpec, build_drafter
from engine.models import cache_root, choose_dtype, gguf_path, presets, resolve_local
from engine.trace import Step

pytestmark = pytest.mark.embedded

CHAT = "Explain in two sentences why the sky is blue."
COPY = (
    "Fix the typos in this paragraph and return it unchanged otherwise:\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and the fox ran "
    "away into the forrest, where it met an owl who asked it why it was running."
)


def tokens_of(events):
    return [t.token_id for e in events if isinstance(e, Step) for t in e.emitted]


def test_preset_and_conversion_cache(embedded):
    assert presets()["embedded"].target.startswith("gguf:")
    folder = resolve_local(presets()["embedded"].target)
    assert folder.parent == cache_root() and (folder / "model.safetensors").is_file()
    assert gguf_path(presets()["embedded"].target).name in (folder / "SOURCE").read_text()
    assert embedded.model.config.num_hidden_layers == 30
    # auto: bfloat16 on a CPU with bfloat16 instructions, else float32; batch-invariant kernels in
    # both (the CPUs the tests run on pass the load-time check in each)
    assert embedded.dtype == choose_dtype("auto", "cpu")[0]
    assert embedded.batch_invariant, embedded.dtype_reason
    assert embedded.dtype_reason.startswith(("bfloat16: auto", "float32: auto"))


def test_chat_template_and_raw_mode(embedded):
    chat = embedded.encode("hello")
    raw = embedded.encode("hello", raw=True)
    assert len(chat) > len(raw) and embedded.tokenizer.decode(chat).count("<|im_start|>") >= 2


@pytest.mark.parametrize("prompt", [CHAT, COPY])
def test_plain_greedy_equals_model_generate(embedded, prompt):
    ids = embedded.encode(prompt)
    ours = tokens_of(generate(embedded, ids, DecodeConfig(max_new_tokens=24)))
    ref = embedded.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    assert ours == ref


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method", ["prompt-lookup", "early-exit"])
def test_speculative_greedy_is_identical_on_the_embedded_model(embedded, method, k):
    ids = embedded.encode(COPY)
    plain = tokens_of(generate(embedded, ids, DecodeConfig(max_new_tokens=32)))
    drafter = build_drafter(embedded, DrafterSpec(method, exit_layer=8))
    events = list(generate(embedded, ids, DecodeConfig(max_new_tokens=32, k=k), drafter))
    assert tokens_of(events) == plain
    if method == "prompt-lookup":
        assert any(e.accepted > 0 for e in events if isinstance(e, Step)), "copying text must accept drafts"


def test_chunked_prefill_gives_the_same_next_token_logits(embedded):
    ids = torch.tensor([embedded.encode(COPY)])
    from transformers import DynamicCache

    one, chunked = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        a = embedded.model(input_ids=ids, cache=one).logits[0, -1]
        for s in range(0, ids.shape[1], 16):
            b = embedded.model(input_ids=ids[:, s:s + 16], cache=chunked).logits[0, -1]
    if embedded.batch_invariant:
        assert torch.equal(a, b)
    else:
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-4)


def test_a_corrupt_conversion_cache_is_rebuilt(tmp_path, monkeypatch):
    """Point the cache at a fresh folder, corrupt the converted weights, load again."""
    import shutil

    from engine import models

    source = resolve_local(presets()["embedded"].target)
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    (copy / "model.safetensors").write_bytes(b"not a safetensors file")
    monkeypatch.setattr(models, "_loaded", {})
    loaded = models.load_model("embedded")
    assert loaded.model.config.num_hidden_layers == 30
    assert (copy / "model.safetensors").stat().st_size > 100_000_000


@pytest.mark.parametrize("rule, verdict", [("typical", "## ❌ FAIL"), ("exact", "## ✅ PASS")])
def test_gate_tab_defaults_catch_the_lossy_rule(embedded, monkeypatch, rule, verdict):
    """The Gate tab invites trying the typical rule "to see the gate catch it": with the tab's
    own defaults (greedy, so 2 runs a prompt) it must fail, and the exact rule must pass."""
    from dataclasses import astuple, replace

    from ui.gate import DEFAULTS, run_gate_tab

    monkeypatch.delenv("SPECLAB_PRESET", raising=False)  # the tab runs on the app's model: embedded
    *_, (text, table, _) = run_gate_tab(*astuple(replace(DEFAULTS, rule=rule)))
    assert text.startswith(verdict)
    assert len(table) == DEFAULTS.limit and (rule == "exact") == all(table["verdict"] == "pass")
