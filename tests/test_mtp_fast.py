"""engine/mtp/fast.py: a trained MTP module's depths computed directly for drafting. Its hidden
states against transformers' MtpModel.forward_layer on the same inputs (a prompt's many rows,
a step's few rows over cached entries, a batch of tree branches over shared entries), which
modules it takes, and the embedded model's drafts through both paths."""

import pytest
import torch
from transformers import DynamicCache

from engine.decoding import DecodeConfig, generate
from engine.drafters import DrafterSpec, build_drafter
from engine.drafters import int8 as int8_kernel
from engine.drafters.int8 import ROWS, int8_weight
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


@torch.inference_mode()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_fast_fusion_is_the_modules_fusion(tiny_target, tmp_path, dtype):
    """observe's fused features (EAGLE-3) through FastFusion: the module's Fusion to float32
    rounding, and in bfloat16 no further from the float32 truth than Fusion's own bfloat16; the
    drafter of a fused module takes it."""
    folder = module_folder(load_model(tiny_target, dtype="float32"), tmp_path / "module", feature_layers=(1, 3))
    truth_module, _ = load_module(folder, load_model(tiny_target, dtype="float32"))
    target = load_model(tiny_target, dtype=dtype)
    module, _ = load_module(folder, target)
    assert fast.FastFusion.takes(module.fusion)
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 5, 70):  # one row (int8 in 16-bit), a verify step's, a prompt's (blocks of 64)
        hidden, features = torch.randn(rows, 32, generator=gen), 4 * torch.randn(rows, 64, generator=gen)
        truth = truth_module.fusion(hidden, features)
        theirs = module.fusion(hidden.to(target.dtype), features.to(target.dtype))
        for int8 in (False, True):
            mine = fast.FastFusion(module.fusion, int8)(hidden.to(target.dtype), features.to(target.dtype))
            assert mine.dtype == theirs.dtype == target.dtype and mine.shape == (rows, 32)
            if dtype == "float32":
                assert torch.allclose(mine, truth, atol=1e-5, rtol=1e-5), (mine - truth).abs().max()
            else:
                off, their_off = (mine.float() - truth).abs(), (theirs.float() - truth).abs()
                slack = 4.0 if int8 and rows <= ROWS else 1.25  # int8 weights round to 1/127 of a row's largest
                assert off.max() <= slack * their_off.max() + 1e-3, (rows, int8, off.max(), their_off.max())
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder)))
    assert isinstance(drafter.layers._fuse, fast.FastFusion)


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
    for use_fast in (True, False):  # (16-bit weights in both: the int8 copies are test_int8_drafting's)
        drafter = build_drafter(embedded, DrafterSpec("mtp", mtp_kind="module", tree=tree, draft_int8=False))
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


def test_int8_weights_multiply_as_their_rounded_copies():
    """An int8 weight's product is x times the weight rounded per row (scale = row absmax / 127,
    kept 16-bit: every weight within a step of its row's largest / 127),
    within 1 % of the 16-bit product; it takes only calls of at most ROWS rows in its dtype."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(96, 64, generator=gen) * torch.linspace(0.01, 1.0, 96)[:, None]).to(torch.bfloat16)
    int8 = int8_weight(weight)
    if int8 is None:
        pytest.skip(f"this torch build has no weight-only int8 kernel ({int8_kernel.unavailable})")
    rounded = int8.weight.float() * int8.scales.float()[:, None]
    assert (rounded - weight.float()).abs().max(dim=1).values.le(weight.float().abs().amax(1) / 127).all()
    x = torch.randn(ROWS, 64, generator=gen).to(torch.bfloat16)
    out = int8(x)
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, 96)
    assert torch.allclose(out.float(), x.float() @ rounded.T, atol=2e-2, rtol=2e-2)
    full = x.float() @ weight.float().T
    assert (out.float() - full).norm() <= 0.01 * full.norm()
    assert int8.takes(x) and not int8.takes(torch.zeros(ROWS + 1, 64, dtype=torch.bfloat16))
    assert not int8.takes(x.float())
    assert int8_weight(weight.float()) is None  # float32 weights keep their products


class _Counted:
    """An Int8Weight that records the rows of every call it computes."""

    def __init__(self, inner, calls: list):
        self.inner, self.calls = inner, calls

    def takes(self, x):
        return self.inner.takes(x)

    def __call__(self, x):
        self.calls.append(x.shape[0])
        return self.inner(x)


@pytest.mark.embedded
def test_int8_drafting_keeps_the_output_and_mostly_the_drafts(embedded):
    """The shipped module drafting a k = 4 chain with int8 copies of its weights (the default) and
    with its 16-bit weights: both outputs are plain greedy decoding, the int8 products are the
    ones drafting ran, and most steps that start from the same context draft the same tokens (they
    part where the module's top two are nearly tied)."""
    ids = embedded.encode("Write a short poem about the sea, then explain its rhyme scheme.")
    cfg = DecodeConfig(max_new_tokens=48, k=4, ignore_eos=True)
    plain = tokens_of(generate(embedded, ids, cfg))
    runs = []
    for int8 in (True, False):
        drafter = build_drafter(embedded, DrafterSpec("mtp", mtp_kind="module", draft_int8=int8))
        layer = drafter.layers.fast.layers[0]
        kept = (layer.gate_up.int8, layer.down.int8, drafter.layers.subset._int8)
        assert len({w is not None for w in kept}) == 1
        if int8 and layer.gate_up.int8 is None:
            pytest.skip(f"no int8 copies: the target is {embedded.dtype} ({embedded.dtype_reason}) or this torch "
                        f"build has no weight-only int8 kernel ({int8_kernel.unavailable})")
        calls = []
        if int8:
            layer.gate_up.int8 = _Counted(layer.gate_up.int8, calls)
        events = list(generate(embedded, ids, cfg, drafter))
        assert tokens_of(events) == plain
        assert not int8 or len(calls) >= 20
        # drafts by the context they were drafted after (the same output: the same contexts)
        runs.append({s.kv_len_before: s.draft_token_ids for s in events if getattr(s, "draft_token_ids", ())})
    common = runs[0].keys() & runs[1].keys()
    assert len(common) >= 10
    assert sum(runs[0][n] == runs[1][n] for n in common) >= 0.6 * len(common)  # (82 % on a Xeon with AMX)
