"""Prefix caching in the serving loop (engine.serving.prefix_cache): the cache's own rules
(blocks, never the last token, reference counts, LRU eviction of unheld leaves, the budget), and
on real models: every request's output equals its solo output with the cache on and off under
every policy, greedy and sampled, with a budget small enough to evict; reused tokens counted."""

import pytest
import torch

from engine.errors import InputError
from engine.models import load_model
from engine.sampling import SamplingConfig
from engine.serving import ItemKind, Policy, RequestClass, ServeConfig, Workload, WorkloadRequest, report, run_serve
from engine.serving.prefix_cache import PrefixCache, RequestKV
from test_serving import solo, words


# --- the cache on its own -------------------------------------------------------------------

def kv_for(n: int, layers: int = 2) -> RequestKV:
    """A request's KV holding positions [0, n): key value = position, every layer."""
    kv = RequestKV()
    for layer in range(layers):
        pos = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
        kv.update(pos, -pos, layer)
    return kv


def test_blocks_cover_full_prompt_blocks_and_never_the_last_token():
    cache = PrefixCache(block_size=4, budget_tokens=64)
    prompt = list(range(100, 110))  # 10 tokens: blocks [0, 4) and [4, 8); 8, 9 never
    assert cache.insert(prompt, 10, kv_for(10)) == 2 and len(cache) == 2
    hit = cache.match(prompt)
    assert [b.start for b in hit] == [0, 4] and all(b.refs == 1 for b in hit)
    assert torch.equal(hit[1].keys[1].flatten(), torch.tensor([4.0, 5, 6, 7]))
    assert cache.match(prompt[:8]) == hit[:1]  # an 8-token prompt: its last token is in block 2
    assert cache.match([100, 101, 102, 999, 104, 105, 106, 107, 1]) == []  # same block 2, other block 1
    assert cache.match([7] + prompt) == []  # same tokens, other position
    assert cache.stats.lookups == 4 and cache.stats.hits == 2
    # a request reusing the blocks reads them first, then its own entries
    kv = RequestKV(hit)
    keys, values = kv.update(torch.full((1, 1, 2, 1), 8.0), torch.full((1, 1, 2, 1), -8.0), 1)
    assert keys.flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 8] and kv.get_seq_length(1) == 10
    assert kv.entries(8, 10)[0][0].flatten().tolist() == [8, 8]  # (layer 1, the only one it holds)
    with pytest.raises(ValueError):
        kv.entries(4, 8)  # the prefix is the cache's, not the request's own
    kv.truncate(9)
    assert kv.get_seq_length(1) == 9 and kv.update(torch.zeros(1, 1, 1, 1), torch.zeros(1, 1, 1, 1), 1)[0].shape[-2] == 10
    with pytest.raises(ValueError):
        kv.truncate(7)


def test_lru_eviction_takes_unheld_leaves_and_a_full_budget_of_held_blocks_skips():
    cache = PrefixCache(block_size=2, budget_tokens=6)  # three blocks
    a, b = [1, 2, 3, 4, 5], [9, 8, 7, 6, 5]
    cache.insert(a, 5, kv_for(5))  # a0, a1
    held = cache.match(b)  # nothing yet
    cache.insert(b, 5, kv_for(5))  # b0 fits; b1 evicts a's leaf a1 (the least recently used unheld leaf)
    only_a0 = cache.match(a)
    assert cache.stats.evicted_blocks == 1 and [blk.start for blk in only_a0] == [0]
    cache.release(held + only_a0)
    hold_a, hold_b = cache.match(a), cache.match(b)  # hold a0, b0, b1: every block held
    assert len(hold_a) == 1 and len(hold_b) == 2
    cache.insert([4, 4, 4, 4, 4], 5, kv_for(5))
    assert cache.stats.skipped_blocks == 1 and len(cache) == 3 and cache.cached_tokens == 6
    cache.release(hold_b)
    cache.insert([4, 4, 4, 4, 4], 5, kv_for(5))  # now b1 (an unheld leaf) makes room; b0 has a child until then
    assert cache.match([4, 4, 4, 4, 4])[0].start == 0
    cache.release(hold_a)
    with pytest.raises(RuntimeError):
        cache.release(hold_a)


@pytest.mark.parametrize("kwargs, message", [
    (dict(prefix_block=0), "block size"), (dict(prefix_block=True), "block size"),
    (dict(prefix_budget=8, prefix_block=16), "budget"), (dict(prefix_budget=None), "budget"),
])
def test_bad_cache_settings(kwargs, message):
    with pytest.raises(InputError, match=message):
        ServeConfig(prefix_cache=True, **kwargs)
    ServeConfig(prefix_cache=False, **kwargs)  # not checked when the cache is off


# --- the serving loop on a tiny model -------------------------------------------------------

DOC = words(*[(7 * i) % 50 + 2 for i in range(60)])


def doc_questions(spacing: float = 0.0) -> Workload:
    """One document asked four questions; the first two arrive together (the second is looked
    up again until it starts), the others later."""
    spec = [("q0", 0.0, "w1 w2 w3"), ("q1", 0.0, "w4 w5"), ("q2", spacing, "w6 w7 w8 w9"), ("q3", 2 * spacing, "w3")]
    return Workload("doc-questions", "", tuple(
        WorkloadRequest(rid, RequestClass.LONG, t, f"{DOC}\n\n{q}", 5) for rid, t, q in spec))


@pytest.fixture(scope="module")
def tiny(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def solos(tiny):
    return {r.request_id: solo(tiny, r.prompt, r.max_new_tokens) for r in doc_questions().requests}


CACHED_RUNS = [(Policy.NONE, 256, 8, 4096), (Policy.DECODE_FIRST, 16, 8, 4096), (Policy.PREFILL_FIRST, 24, 4, 4096),
               (Policy.DECODE_FIRST, 16, 8, 48)]  # the last: a budget of 6 blocks, so blocks are evicted


@pytest.mark.parametrize("policy, chunk, block, budget", CACHED_RUNS)
def test_outputs_equal_solo_with_the_cache_on_and_reused_tokens_are_counted(tiny, solos, policy, chunk, block, budget):
    on = run_serve(tiny, doc_questions(0.5), ServeConfig(policy=policy, chunk_size=chunk, prefix_cache=True,
                                                      prefix_block=block, prefix_budget=budget))
    off = run_serve(tiny, doc_questions(), ServeConfig(policy=policy, chunk_size=chunk))
    for result in (on, off):
        assert {r.request_id: list(r.output_token_ids) for r in result.requests} == solos
    assert all(r.reused_tokens == 0 for r in off.requests) and off.cache_stats is None
    a, b = (tiny.encode(r.prompt) for r in doc_questions().requests[:2])
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the template's start and the document
    first, *later = on.requests
    assert first.reused_tokens == 0
    for index, rec in enumerate(later, start=1):
        assert rec.reused_tokens % block == 0 and rec.reused_tokens < rec.prompt_tokens
        if budget > 1000 and index >= 2:  # arrived after the first prompt was prefilled
            assert rec.reused_tokens == shared // block * block
        # its prompt: the cached prefix shown once, in its first step, then computed from there on
        items = [(s.index, i) for s in on.steps for i in s.items if i.request_id == rec.request_id]
        cached = [i for _, i in items if i.kind is ItemKind.CACHED]
        computed = [t for _, i in items if i.kind is ItemKind.PREFILL for t in range(i.start, i.end)]
        if rec.reused_tokens:
            assert [(c.start, c.end) for c in cached] == [(0, rec.reused_tokens)] and items[0][1] == cached[0]
        assert computed == list(range(rec.reused_tokens, rec.prompt_tokens)) and rec.prefilled_tokens == len(computed)
    stats = on.cache_stats
    assert stats.lookups >= len(on.requests) and stats.hits >= sum(r.reused_tokens > 0 for r in on.requests)
    if budget < 1000:
        assert stats.evicted_blocks > 0
    assert all(s.tokens == sum(i.tokens for i in s.items if i.kind is not ItemKind.CACHED) for s in on.steps)
    summary = report(on)["summary"]
    assert summary["prefix_cache"]["reused_tokens"] == sum(r.reused_tokens for r in on.requests)
    requested = sum(r.prompt_tokens for r in on.requests)
    assert summary["prefix_cache"]["prefill_cost"] == pytest.approx(summary["prefill_tokens"] / requested)
    assert report(off)["summary"]["prefix_cache"]["prefill_cost"] == 1.0


def test_a_request_waiting_for_its_turn_picks_up_blocks_computed_meanwhile(tiny):
    """q1 arrives with q0 but under prefill-first with a small budget waits: by its first
    step q0's blocks exist, so it reuses them though nothing was cached when it arrived."""
    result = run_serve(tiny, doc_questions(), ServeConfig(policy=Policy.PREFILL_FIRST, chunk_size=8, token_budget=8,
                                                          prefix_cache=True, prefix_block=8))
    q1 = result.requests[1]
    assert q1.arrival_s == 0.0 and q1.reused_tokens > 0


def test_sampled_outputs_equal_solo_with_the_cache(tiny):
    sampling = SamplingConfig(temperature=0.9, seed=3)
    workload = doc_questions()
    result = run_serve(tiny, workload, ServeConfig(policy=Policy.DECODE_FIRST, chunk_size=16, sampling=sampling,
                                                   prefix_cache=True, prefix_block=8))
    assert sum(r.reused_tokens for r in result.requests) > 0
    for req, rec in zip(workload.requests, result.requests):
        assert list(rec.output_token_ids) == solo(tiny, req.prompt, req.max_new_tokens, sampling)


# --- the embedded model ---------------------------------------------------------------------

@pytest.mark.embedded
def test_embedded_document_questions_equal_solo_greedy(embedded):
    from engine.serving.workload import shipped_text

    doc = shipped_text(120)
    spec = [("q0", 0.0, "Who keeps the light?"), ("q1", 0.0, "Name one danger."), ("q2", 0.0, "How old is it?")]
    workload = Workload("embedded-doc", "", tuple(
        WorkloadRequest(rid, RequestClass.LONG, t, f"{doc}\n\n{q}", 4) for rid, t, q in spec))
    # one chunk per step: the later questions wait for the first one's chunks, then reuse them
    result = run_serve(embedded, workload, ServeConfig(policy=Policy.PREFILL_FIRST, chunk_size=64, token_budget=64,
                                                       prefix_cache=True, prefix_block=16))
    assert result.requests[0].reused_tokens == 0 and all(r.reused_tokens >= 128 for r in result.requests[1:])
    for req, rec in zip(workload.requests, result.requests):
        assert list(rec.output_token_ids) == solo(embedded, req.prompt, req.max_new_tokens)


def test_cli_serve_and_compare_with_the_cache(tiny_target, tmp_path, capsys, monkeypatch):
    import json

    from engine.cli import main

    monkeypatch.setenv("SPECLAB_ALLOW_ANY_MODEL", "1")
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc_questions(0.2).to_jsonable()))
    assert main(["serve", "--workload", str(path), "--model", tiny_target, "--max-new-tokens", "2",
                 "--prefix-cache", "on", "--prefix-block", "8"]) == 0
    out = capsys.readouterr().out
    assert "reused" in out and "prefix cache (8-token blocks" in out and "prefill cost" in out
    assert main(["serve-compare", "--workload", str(path), "--model", tiny_target, "--runs", "decode-first:16",
                 "decode-first:16+cache", "--repeats", "2", "--max-new-tokens", "2", "--prefix-block", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    off, on = out["results"]
    assert out["same_outputs_in_every_run"] and off["prefix_cache.reused_share_median"] == 0
    assert on["prefix_cache.reused_share_median"] > 0.3 and on["prefix_cache.prefill_cost_median"] < 0.7
    assert on["by_request"]["q3"]["reused_tokens"] > 0 and off["by_request"]["q3"]["reused_tokens"] == 0
    assert main(["serve-compare", "--workload", str(path), "--model", tiny_target, "--runs", "decode-first:16+fast"]) == 2
    assert main(["serve", "--workload", str(path), "--model", tiny_target, "--prefix-cache", "on",
                 "--prefix-block", "0"]) == 2
    assert "block size" in capsys.readouterr().err


# --- the routing simulation -----------------------------------------------------------------

def doc_requests(n: int = 24, docs: int = 4, seed: int = 0):
    """n questions about `docs` 64-token documents, one every 0.1 s, documents in a seeded order."""
    import random

    rng = random.Random(seed)
    prompts = [[1000 * (1 + d) + i for i in range(64)] + [rng.randrange(50), rng.randrange(50), 7]
               for d in (rng.randrange(docs) for _ in range(n))]
    return prompts, [0.1 * i for i in range(n)], [4] * n, [f"r{i}" for i in range(n)]


def test_cache_aware_routing_reuses_more_than_round_robin_on_a_fixed_seed():
    from engine.serving.routing import Costs, RoutePolicy, simulate

    costs = Costs(0.002, 0.01, "given")
    prompts, arrivals, outputs, ids = doc_requests()
    results = {p: simulate(prompts, arrivals, outputs, ids, 3, p, costs, block_size=16, budget_tokens=128)
               for p in RoutePolicy}  # a replica holds two documents of four
    rr, aware = results[RoutePolicy.ROUND_ROBIN].summary(), results[RoutePolicy.CACHE_AWARE].summary()
    assert rr["requests_per_replica"] == [8, 8, 8]
    assert aware["hit_rate"] > rr["hit_rate"] + 0.2 and aware["ttft_ms_p50"] < rr["ttft_ms_p50"]
    assert aware == simulate(prompts, arrivals, outputs, ids, 3, RoutePolicy.CACHE_AWARE, costs, 16, 128).summary()
    for result in results.values():  # the accounting of every request
        for req, prompt in zip(result.requests, prompts):
            assert req.reused_tokens % 16 == 0 and req.reused_tokens <= 64 and req.prompt_tokens == len(prompt)
            assert req.first_token_s == pytest.approx(req.start_s + (len(prompt) - req.reused_tokens) * 0.002)
            assert req.start_s >= req.arrival_s
        by_replica = {}
        for req in sorted(result.requests, key=lambda r: r.start_s):  # one request at a time per replica
            assert req.start_s >= by_replica.get(req.replica, 0.0) - 1e-9
            by_replica[req.replica] = req.finish_s
    one = {p: simulate(prompts, arrivals, outputs, ids, 1, p, costs, 16, 128).summary()["hit_rate"] for p in RoutePolicy}
    assert len(set(one.values())) == 1  # one replica: routing changes nothing


def test_route_sim_cli_is_labelled_a_simulation(tiny_target, tmp_path, capsys, monkeypatch):
    import json

    from engine.cli import main

    monkeypatch.setenv("SPECLAB_ALLOW_ANY_MODEL", "1")
    small = tmp_path / "mix.json"  # doc-mix's shape at the tiny model's context
    small.write_text(json.dumps({"name": "small-mix", "ignore_eos": True, "poisson": {
        "seed": 0, "rate_per_s": 4, "count": 12, "classes": [
            {"cls": "long", "words": [30, 30], "starts": [0, 100, 200], "max_new_tokens": 3,
             "then": ["Summarize.", "Title?"]}]}}))
    assert main(["route-sim", "--workload", str(small), "--model", tiny_target, "--replicas", "3",
                 "--prefix-budget", "64", "--prefix-block", "8", "--json"]) == 0  # costs measured on the model
    out = json.loads(capsys.readouterr().out)
    assert out["evidence_class"] == "simulation" and out["costs"]["source"].startswith("measured")
    assert out["costs"]["prefill_ms_per_token"] > 0 and [r["policy"] for r in out["results"]] == [
        "round-robin", "cache-aware", "least-loaded"]
    assert main(["route-sim", "--workload", str(small), "--model", tiny_target, "--prefill-ms-per-token", "1",
                 "--decode-ms-per-step", "20", "--policies", "round-robin,cache-aware"]) == 0
    assert capsys.readouterr().out.startswith("SIMULATION: small-mix")
    assert main(["route-sim", "--workload", "doc-mix", "--model", tiny_target, "--prefill-ms-per-token", "1",
                 "--decode-ms-per-step", "20"]) == 2  # its prompts do not fit the tiny model's context
    assert "context" in capsys.readouterr().err
    assert main(["route-sim", "--workload", "doc-mix", "--model", tiny_target, "--policies", "random"]) == 2
    assert main(["route-sim", "--workload", "doc-mix", "--model", tiny_target, "--prefill-ms-per-token", "1"]) == 2
    assert main(["route-sim", "--workload", "doc-mix", "--model", tiny_target, "--replicas", "0",
                 "--prefill-ms-per-token", "1", "--decode-ms-per-step", "20"]) == 2
