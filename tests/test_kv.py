"""The decoding KV cache that grows in place (engine/kv.py): the same entries and logits as
transformers' DynamicCache through appends, crops (rejected drafts), a tree's kept path and
growth past its room, on the tiny model in float32 and in bfloat16 with the invariant kernels."""

import pytest
import torch
from transformers import DynamicCache

from engine.kv import MIN_ROOM, GrowingLayer, growing_cache
from engine.models import load_model
from engine.mtp.tree import keep_path


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def tiny(request, tiny_target, one_thread):
    return load_model(tiny_target, dtype=request.param)


def _same(a: DynamicCache, b: DynamicCache) -> None:
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


@torch.inference_mode()
def test_growing_cache_matches_dynamic_cache_through_appends_crops_trees_and_growth(tiny):
    model = tiny.model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tiny.vocab_size, (1, 2 * MIN_ROOM + 40), generator=gen)
    grow, plain = growing_cache(), DynamicCache()
    step = lambda cache, s, e: model(input_ids=ids[:, s:e], cache=cache, use_cache=True).logits
    assert torch.equal(step(grow, 0, 30), step(plain, 0, 30))  # prefill
    assert all(type(layer) is GrowingLayer for layer in grow.layers)
    pos = 30
    for t, keep in [(1, 1), (5, 2), (5, 5), (9, 0), (1, 1), (3, 1)]:  # verifications, then a rollback
        assert torch.equal(step(grow, pos, pos + t), step(plain, pos, pos + t))
        if keep < t:
            grow.crop(keep - t)
            plain.crop(keep - t)
        pos += keep
        _same(grow, plain)
    # a tree keeps one path, written in place: the growing layer keeps its buffer
    t = 4
    step(grow, pos, pos + t), step(plain, pos, pos + t)
    buffer = grow.layers[0]._key_buffer
    keep_path(grow, pos, (1, 2))
    keep_path(plain, pos, (1, 2))
    _same(grow, plain)
    assert grow.layers[0]._key_buffer is buffer and grow.layers[0].keys.data_ptr() == buffer.data_ptr()
    # anything that replaces the entries with tensors of its own is adopted by the next write
    grow.layers[1].keys, grow.layers[1].values = grow.layers[1].keys.clone(), grow.layers[1].values.clone()
    pos += 3
    room = grow.layers[0]._key_buffer.shape[-2]
    while pos < ids.shape[1] - 8:  # past the room: the buffers grow
        assert torch.equal(step(grow, pos, pos + 8), step(plain, pos, pos + 8))
        pos += 8
    _same(grow, plain)
    assert grow.layers[0]._key_buffer.shape[-2] > room
    assert grow.get_seq_length() == plain.get_seq_length() == pos


@torch.inference_mode()
def test_a_cropped_view_held_elsewhere_is_not_what_decoding_reads_next(tiny):
    """The write after a crop reuses the room, so only the layer's own views are current:
    the cache's keys are always exactly the entries kept."""
    layer = GrowingLayer()
    k = torch.arange(24, dtype=torch.float32).reshape(1, 1, 6, 4)
    keys, _ = layer.update(k, k.clone())
    layer.crop(-2)
    new = torch.full((1, 1, 1, 4), -1.0)
    keys, values = layer.update(new, new.clone())
    assert torch.equal(keys, torch.cat([k[..., :4, :], new], dim=-2)) and torch.equal(values, keys)
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.update(new, new)[0].shape[-2] == 1
