"""engine/mtp/fast.py: a trained MTP module's depths computed directly for drafting. Its hidden
states against transformers' MtpModel.forward_layer on the same inputs (a prompt's many rows,
a step's few rows over cached entries, a batch of tree branches over shared entries), which
modules it takes, and the embedded model's drafts through both paths."""

import pytest
import torch
from transformers import DynamicCache

from engine.decoding import DecodeConfig, generate
from engine.drafters import DrafterSpec, build_drafter
from engine.models import load_model
from engine.mtp import fast
from engine.mtp.module import load_module
from test_mtp_module import PROMPT, module_folder, tokens_of


def _inputs(vocab: int, rows: int, branches: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    return {"hidden": torch.randn(1, rows + 3, 32, generator=gen), "ids": torch.randint(1, vocab, (1, rows + 3), generator=gen),
            "b_hidden": torch.randn(branches, 2, 32, generator=gen), "b_ids": torch.randint(1, vocab, (branches, 2), generator=gen)}


def _depths(target, folder, rows=40, branches=4, fast_path=True):
    """Outputs of the fast path (or forward_layer's) for: `rows` rows from nothing, then 3 rows
    over them, then `branches` branches of 2 rows over all of those (not kept)."""
    module, _ = load_module(folder, target)
    x = {k: v.to(target.dtype) if v.is_floating_point() else v for k, v in _inputs(target.vocab_size, rows, branches).items()}
    positions = torch.arange(1, rows + 4)[None]
    b_pos = torch.arange(rows + 4, rows + 6)[None].expand(branches, -1)
    outs = []
    if fast_path:
        mine, entries = fast.FastModule(module), fast.Entries()
        for part in (slice(0, rows), slice(rows, rows + 3)):
            outs.append(mine.forward_layer(0, x["hidden"][:, part], positions[:, part], entries, x["ids"][:, part]))
        assert entries.n == rows + 3
        outs.append(mine.forward_layer(0, x["b_hidden"], b_pos, entries, x["b_ids"], keep=False))
        assert entries.n == rows + 3  # branches are not kept
        return outs
    cache = DynamicCache()
    for part in (slice(0, rows), slice(rows, rows + 3)):
        outs.append(module.forward_layer(0, x["hidden"][:, part], positions[:, part], cache, input_ids=x["ids"][:, part]))
    layer, copies = cache.layers[0], DynamicCache()  # each branch over its own copy of the entries
    copies.update(layer.keys.expand(branches, -1, -1, -1).contiguous(), layer.values.expand(branches, -1, -1, -1).contiguous(), 0)
    outs.append(module.forward_layer(0, x["b_hidden"], b_pos, copies, input_ids=x["b_ids"]))
    return outs


@torch.inference_mode()
def test_fast_depths_are_forward_layers_in_float32(tiny_target, tmp_path):
    """Many rows (SDPA's kernel), a few rows over cached entries, and tree branches reading shared
    entries: the same hidden states as MtpModel.forward_layer, to float32 rounding."""
    target = load_model(tiny_target, dtype="float32")
    folder = module_folder(target, tmp_path / "module", scale=1.0)
    for mine, theirs in zip(_depths(target, folder), _depths(target, folder, fast_path=False)):
        assert mine.shape == theirs.shape
        assert torch.allclose(mine, theirs, atol=1e-4, rtol=1e-4), (mine - theirs).abs().max()


@torch.inference_mode()
def test_fast_depths_in_bfloat16_are_as_close_to_float32_as_forward_layers(tiny_target, tmp_path):
    """In bfloat16 the products are packed for oneDNN (on CPUs whose build has the kernel) and
    run in another order, and the attention in float32: not forward_layer's bits, but at least as
    close to the module computed in float32 (same weights, same inputs)."""
    folder = module_folder(load_model(tiny_target, dtype="float32"), tmp_path / "module", scale=1.0)
    exact = _depths(load_model(tiny_target, dtype="float32"), folder, fast_path=False)
    target = load_model(tiny_target, dtype="bfloat16")
    for mine, theirs, truth in zip(_depths(target, folder), _depths(target, folder, fast_path=False), exact):
        assert mine.dtype == theirs.dtype == torch.bfloat16
        mine_off, theirs_off = (mine.float() - truth).abs(), (theirs.float() - truth).abs()
        assert mine_off.max() <= 1.25 * theirs_off.max() + 1e-3 and mine_off.mean() <= 1.25 * theirs_off.mean() + 1e-4


def test_only_llama_blocks_with_plain_attention_are_taken(tiny_target, tmp_path):
    target = load_model(tiny_target, dtype="float32")
    module, _ = load_module(module_folder(target, tmp_path / "module"), target)
    assert fast.supported(module)
    for key, value in (("hidden_act", "gelu"), ("attention_bias", True), ("sliding_window", 8)):
        saved = getattr(module.config, key, None)
        setattr(module.config, key, value)
        assert not fast.supported(module), key
        setattr(module.config, key, saved)
    assert fast.supported(module)


def test_a_module_it_does_not_take_drafts_through_forward_layer_and_stays_exact(tiny_target, tmp_path, monkeypatch):
    target = load_model(tiny_target, dtype="float32")
    folder = module_folder(target, tmp_path / "module")
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    for supported in (True, False):
        monkeypatch.setattr(fast, "supported", lambda module: supported)
        for tree in (None, "dynamic-8"):
            drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), tree=tree))
            assert (drafter.layers.fast is not None) == supported
            events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=3, ignore_eos=True), drafter))
            assert tokens_of(events) == plain


def test_entries_grow_in_place_and_crop_from_the_end(monkeypatch):
    monkeypatch.setattr(fast, "MIN_ROOM", 4)
    entries = fast.Entries()
    rows = torch.arange(2 * 9 * 3, dtype=torch.float32).view(2, 9, 3)
    entries.add(rows[:, :3], -rows[:, :3])
    entries.add(rows[:, 3:9], -rows[:, 3:9])
    assert entries.n == 9 and entries._keys.shape[1] >= 9 and torch.equal(entries.keys, rows)
    entries.crop(-4)
    assert torch.equal(entries.values, -rows[:, :5])
    entries.crop(0)
    assert entries.n == 5
    with pytest.raises(ValueError):
        entries.crop(2)


@pytest.mark.embedded
@pytest.mark.parametrize("tree", [None, "dynamic-8"])
def test_the_embedded_modules_drafts_mostly_match_forward_layers(embedded, tree):
    """Both paths keep the output exact; in bfloat16 their drafts differ only where the module's
    own choice is nearly tied (the hidden states round differently): a chain's steps draft the
    same tokens, or part ways at a position whose top two are within 0.05 in both paths."""
    ids = embedded.encode("Write a short poem about the sea, then explain its rhyme scheme.")
    runs = []
    for use_fast in (True, False):
        drafter = build_drafter(embedded, DrafterSpec("mtp", mtp_kind="module", tree=tree))
        assert drafter.layers.fast is not None
        if not use_fast:
            drafter.layers.fast = None
        events = list(generate(embedded, ids, DecodeConfig(max_new_tokens=48, k=4, ignore_eos=True), drafter))
        runs.append(events)
    assert tokens_of(runs[0]) == tokens_of(runs[1])
    steps = [[s for s in events if hasattr(s, "draft_token_ids")] for events in runs]
    same = total = steps_same = steps_total = 0
    for a, b in zip(*steps):
        if list(a.emitted) != list(b.emitted):
            break  # the runs' steps part ways where a draft differed
        total += len(b.draft_token_ids)
        same += sum(x == y for x, y in zip(a.draft_token_ids, b.draft_token_ids))
        steps_total += 1
        steps_same += a.draft_token_ids == b.draft_token_ids
        if tree is None and a.draft_token_ids != b.draft_token_ids:
            # a chain's drafts part ways at one position, where each path's own top two are a near
            # tie (the drafts after it then follow different tokens)
            j = next(i for i, (x, y) in enumerate(zip(a.draft_token_ids, b.draft_token_ids)) if x != y)
            for mine, other in ((a, b), (b, a)):
                probs = {t.token_id: t.prob for t in mine.draft_top[j]}
                assert other.draft_token_ids[j] in probs and probs[mine.draft_token_ids[j]] - probs[other.draft_token_ids[j]] < 0.05
    assert total >= 20
    if tree is None:
        assert steps_same >= 0.75 * steps_total
    else:
        assert same >= 0.8 * total  # (a tree's low ranks are often near ties)
