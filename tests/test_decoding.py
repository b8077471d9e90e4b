"""The decoding loop on tiny random models built in the test: exactness for every drafter,
KV rollback, budgets, EOS, adaptive k and bad input."""

import pytest
import torch
from transformers import DynamicCache

from engine.acceptance import TokenKind
from engine.decoding import DecodeConfig, Finished, generate, rollback, verify
from engine.drafters import DrafterSpec, build_drafter
from engine.errors import InputError
from engine.models import load_model
from engine.run import RunRequest, collect, prepare, report, run
from engine.sampling import SamplingConfig
from engine.trace import Step, trace_from_json, trace_to_json

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 14, 3, 22, 5, 9, 14, 7, 30, 31, 5, 9]  # repeats, so prompt lookup finds n-grams


def tokens_of(events):
    return [t.token_id for e in events if isinstance(e, Step) for t in e.emitted]


def hf_greedy(loaded, prompt, n):
    ids = torch.tensor([prompt])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


def baseline(target, n=24, prompt=PROMPT, **kw):
    return list(generate(target, prompt, DecodeConfig(max_new_tokens=n, ignore_eos=True, **kw)))


def test_plain_greedy_equals_transformers_generate(target):
    assert tokens_of(baseline(target)) == hf_greedy(target, PROMPT, 24)


def test_chunked_prefill_matches_one_shot_logits(target):
    for chunk in (1, 4, 5):
        one, chunked = DynamicCache(), DynamicCache()
        ids = torch.tensor([PROMPT])
        with torch.inference_mode():
            a = target.model(input_ids=ids, cache=one).logits[0, -1]
            for s in range(0, len(PROMPT), chunk):
                b = target.model(input_ids=ids[:, s:s + chunk], cache=chunked).logits[0, -1]
        assert torch.allclose(a, b, atol=1e-5)
        events = baseline(target, prefill_chunk=chunk)
        chunks = [e for e in events if not isinstance(e, (Step, Finished))]
        assert [(c.start, c.end) for c in chunks][0] == (0, chunk)
        assert chunks[-1].end == len(PROMPT) and len(chunks) == -(-len(PROMPT) // chunk)
        assert tokens_of(events) == tokens_of(baseline(target))


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("method", ["draft-model", "prompt-lookup", "early-exit", "self-draft"])
def test_greedy_speculative_output_is_plain_greedy(target, tiny_draft, tiny_target, method, k):
    spec = {
        "draft-model": DrafterSpec("draft-model", draft=tiny_draft),
        "self-draft": DrafterSpec("draft-model", draft=tiny_target),  # drafts all accepted: bonus path
        "prompt-lookup": DrafterSpec("prompt-lookup", ngram_max=3),
        "early-exit": DrafterSpec("early-exit", exit_layer=2),
    }[method]
    drafter = build_drafter(target, spec)
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=24, k=k, ignore_eos=True), drafter))
    steps = [e for e in events if isinstance(e, Step)]
    assert tokens_of(events) == tokens_of(baseline(target))
    assert sum(len(s.emitted) for s in steps) == 24
    for s in steps[1:]:
        assert s.k <= k and 0 <= s.accepted <= s.k
        assert [t.kind for t in s.emitted][: s.accepted] == [TokenKind.ACCEPTED] * s.accepted
        assert s.kv_len_after == s.kv_len_before + 1 + s.accepted or s is steps[-1]
    if method == "self-draft":
        assert all(s.accepted == s.k for s in steps[1:])
        assert any(s.emitted[-1].kind is TokenKind.BONUS and s.k > 0 for s in steps)


def test_kv_rollback_equals_feeding_only_the_accepted_tokens(target):
    cache = DynamicCache()
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([PROMPT[:-1]]), cache=cache)
    drafts = torch.tensor([7, 8, 9, 10])
    verify(target, cache, PROMPT[-1], drafts)
    rollback(cache, drafted=4, accepted=2)
    fresh = DynamicCache()
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([PROMPT + [7, 8]]), cache=fresh)
    assert cache.get_seq_length() == fresh.get_seq_length() == len(PROMPT) + 2
    for mine, ref in zip(cache.layers, fresh.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5) and torch.allclose(mine.values, ref.values, atol=1e-5)


def test_max_new_tokens_reached_mid_draft_never_emits_more(target, tiny_target):
    drafter = build_drafter(target, DrafterSpec("draft-model", draft=tiny_target))  # accepts everything
    for n in (1, 2, 5, 7):
        events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=n, k=8, ignore_eos=True), drafter))
        assert len(tokens_of(events)) == n
        assert events[-1] == Finished("max_new_tokens")


def test_eos_inside_a_draft_stops_there(target, tiny_target):
    plain = tokens_of(baseline(target, n=12))
    eos_token = plain[5]  # pretend the 6th output token is EOS
    saved = target.model.generation_config.eos_token_id
    target.model.generation_config.eos_token_id = eos_token
    try:
        drafter = build_drafter(target, DrafterSpec("draft-model", draft=tiny_target))
        events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=12, k=8), drafter))
    finally:
        target.model.generation_config.eos_token_id = saved
    out = tokens_of(events)
    assert out == plain[: plain.index(eos_token) + 1]
    assert events[-1] == Finished("eos")


def test_adaptive_k_grows_after_full_acceptance_and_is_recorded(target, tiny_target):
    drafter = build_drafter(target, DrafterSpec("draft-model", draft=tiny_target))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=40, k=2, adaptive=True, ignore_eos=True), drafter))
    ks = [e.k for e in events if isinstance(e, Step)][1:]
    assert ks[:3] == [2, 4, 6]


# a CPU-like verify curve (ms of a forward over T = 1..17 tokens): flat to 4 tokens, then steps
STEEP = (1000.0, 1010.0, 1020.0, 1030.0, *[1400.0] * 4, *[1900.0] * 4, *[2400.0] * 4, 2800.0)
FLAT = (1000.0,) * 17


@pytest.mark.parametrize("method", ["draft-model", "prompt-lookup", "self-draft"])
def test_fitted_draft_lengths_keep_greedy_output_and_follow_the_curve(target, tiny_draft, tiny_target, method):
    """fit_k: each step's chain is cut where the machine's curve makes more drafts cost more
    than they are expected to bring; the output is plain greedy's either way. On the steep
    curve a drafter whose drafts are always accepted (the target drafting for itself) earns
    the longer forwards; one whose drafts are seldom accepted never gets past the flat part."""
    spec = {"draft-model": DrafterSpec("draft-model", draft=tiny_draft),
            "self-draft": DrafterSpec("draft-model", draft=tiny_target),
            "prompt-lookup": DrafterSpec("prompt-lookup", ngram_max=3)}[method]
    cfg = DecodeConfig(max_new_tokens=40, k=8, ignore_eos=True, fit_k=True)
    plain = tokens_of(baseline(target, n=40))
    fitted = {}
    for curve in (STEEP, FLAT):
        events = list(generate(target, PROMPT, cfg, build_drafter(target, spec), verify_ms=curve))
        assert tokens_of(events) == plain
        ks = fitted[curve] = [e.k for e in events if isinstance(e, Step)][1:]
        assert all(k <= 8 for k in ks)
        if method == "self-draft":  # every draft accepted: it goes as far as k on both curves
            assert max(ks) == 8 if curve is FLAT else 4 < max(ks), (curve, ks)
        elif method == "draft-model" and curve is STEEP:  # a random tiny draft: seldom accepted
            assert max(ks) <= 3 and min(ks[:-1]) >= 1, ks
    fixed = [e.k for e in generate(target, PROMPT, DecodeConfig(max_new_tokens=40, k=8, ignore_eos=True),
                                   build_drafter(target, spec)) if isinstance(e, Step)][1:]
    assert fixed != fitted[STEEP]  # the fit changed what the steps drafted


def test_fitted_draft_lengths_are_recorded_and_leave_trees_alone(tiny_target, tiny_draft):
    request = RunRequest("w5 w9 w14 w3 w5 w9", model=tiny_target, raw=True,
                         decode=DecodeConfig(max_new_tokens=10, k=3, ignore_eos=True, fit_k=True),
                         drafter=DrafterSpec("draft-model", draft=tiny_draft))
    trace = run(request)
    assert trace.info.fit_k and trace_from_json(trace_to_json(trace)).info.fit_k
    assert report(trace)["settings"]["fit_k"] is True
    assert not run(RunRequest("w5 w9", model=tiny_target, raw=True, decode=DecodeConfig(max_new_tokens=4))).info.fit_k


def test_sampled_runs_are_reproducible_by_seed(target, tiny_draft):
    cfg = DecodeConfig(max_new_tokens=16, k=3, ignore_eos=True, sampling=SamplingConfig(temperature=1.0, seed=7))
    runs = [tokens_of(generate(target, PROMPT, cfg, build_drafter(target, DrafterSpec("draft-model", draft=tiny_draft))))
            for _ in range(2)]
    assert runs[0] == runs[1]
    steps = [e for e in generate(target, PROMPT, cfg, build_drafter(target, DrafterSpec("draft-model", draft=tiny_draft)))
             if isinstance(e, Step)]
    rejected = [s for s in steps if s.accepted < s.k]
    assert rejected, "random tiny models must disagree somewhere"
    s = rejected[0]
    assert s.emitted[-1].kind is TokenKind.RECOVERED and s.residual_top
    assert s.accept_uniforms[s.accepted] >= s.accept_probs[s.accepted]


def test_trace_round_trip_and_report(tiny_target, tiny_draft):
    request = RunRequest("w5 w9 w14 w3 w5 w9", model=tiny_target, raw=True, decode=DecodeConfig(max_new_tokens=10, k=3, ignore_eos=True),
                         drafter=DrafterSpec("draft-model", draft=tiny_draft))
    trace = run(request)
    again = trace_from_json(trace_to_json(trace))
    assert again == trace
    r = report(trace)
    assert r["output_token_ids"] == trace.output_token_ids and len(r["output_token_ids"]) == 10
    assert r["metrics"]["drafted_tokens"] == sum(s["k"] for s in r["steps"])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t, d: DecodeConfig(k=0), "draft length"),
        (lambda t, d: DecodeConfig(k=17), "draft length"),
        (lambda t, d: DecodeConfig(max_new_tokens=0), "max new tokens"),
        (lambda t, d: DecodeConfig(max_new_tokens=10**7), "max new tokens"),
        (lambda t, d: build_drafter(t, DrafterSpec("early-exit", exit_layer=4)), "exit layer"),
        (lambda t, d: build_drafter(t, DrafterSpec("prompt-lookup", ngram_max=1, ngram_min=3)), "ngram"),
        (lambda t, d: build_drafter(t, DrafterSpec("prompt-lookup", ngram_max=40)), "ngram"),
        (lambda t, d: build_drafter(t, DrafterSpec("nonsense")), "unknown method"),
        (lambda t, d: list(generate(t, [], DecodeConfig())), "empty"),
        (lambda t, d: list(generate(t, [1] * 300, DecodeConfig())), "context"),
        (lambda t, d: prepare(RunRequest("   ", model=d)), "empty"),
        (lambda t, d: load_model("no-such-model"), "unknown model"),
    ],
)
def test_bad_input_is_a_clear_error(target, tiny_draft, make, message):
    with pytest.raises(InputError, match=message):
        make(target, tiny_draft)


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    from tiny import tiny_llama, tiny_tokenizer

    folder = tiny_llama(tmp_path / "other", seed=3, layers=1)
    tok = tiny_tokenizer()
    tok.add_tokens(["extra-token"])
    tok.save_pretrained(folder)
    with pytest.raises(InputError, match="different vocabulary"):
        build_drafter(target, DrafterSpec("draft-model", draft=str(folder)))


def test_a_run_stops_when_asked(target):
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=50), None, should_stop=lambda: True))
    assert events[-1] == Finished("stopped")
    assert len(tokens_of(events)) == 1  # only the prefill's token
    trace = collect(prepare(RunRequest("w1 w2", model=target.spec, raw=True)).info, iter(events))
    assert trace.stop_reason == "stopped" and trace.output_token_ids == tokens_of(events)
