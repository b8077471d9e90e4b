"""The target's KV cache during decoding: transformers' DynamicCache whose layers grow in place.

transformers' DynamicLayer appends by concatenation: each step allocates the layer's whole cache
again and copies it, 2 x layers copies of everything cached per forward. `GrowingLayer` keeps
each layer's keys and values in a buffer with spare room (it doubles when full) and writes the
new entries into it; `keys` and `values` are views of the filled part. Cropping (rejected drafts)
shortens the views and the next write reuses the room (a tree verification keeping one path,
engine.mtp.tree.keep_path, writes it in place and cuts the rest). Anything that replaces
`keys`/`values` with tensors of its own is adopted: the next write grows from them. The entries, and so every logit, are the same as with
DynamicLayer (tests/test_kv.py and the invariance tests). Buffers are zero-filled and their
length a multiple of 64, so the invariant attention can read past the entries as masked keys
(engine.invariant._with_room) rather than copy the cache to pad its key count.
"""

from __future__ import annotations

import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 256  # positions a buffer has at least
ROOM_BLOCK = 64  # a buffer's positions are a multiple of this (the invariant attention's key block)

_buffers: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # storage ptr -> buffer


def buffer_with_room(x: torch.Tensor) -> torch.Tensor | None:
    """The decoding-cache buffer x is a view of, if any: zero-filled when made, so its positions
    past a layer's entries hold zeros or entries of dropped drafts, finite either way
    (engine.invariant reads that room as masked keys instead of copying to pad)."""
    buffer = _buffers.get(x.untyped_storage().data_ptr())
    return buffer if buffer is not None and buffer.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() else None


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that writes new entries into spare room instead of concatenating."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, t = self.get_seq_length(), key_states.shape[-2]
        if not self._holds(n, key_states) or n + t > self._key_buffer.shape[-2]:
            self._grow(n, n + t, key_states, value_states)
        self._key_buffer[..., n:n + t, :] = key_states
        self._value_buffer[..., n:n + t, :] = value_states
        self.keys = self._key_buffer[..., :n + t, :]
        self.values = self._value_buffer[..., :n + t, :]
        return self.keys, self.values

    def _holds(self, n: int, key_states: torch.Tensor) -> bool:
        """Are keys/values still views of this layer's buffers (nobody replaced them)?"""
        kb, vb = self._key_buffer, self._value_buffer
        if kb is None or n == 0:
            return kb is not None and kb.shape[:-2] == key_states.shape[:-2] and kb.dtype == key_states.dtype
        return (self.keys.data_ptr() == kb.data_ptr() and self.values.data_ptr() == vb.data_ptr()
                and self.keys.stride() == kb.stride() and self.values.stride() == vb.stride()
                and kb.shape[:-2] == key_states.shape[:-2])

    def _grow(self, n: int, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        room = -(-max(MIN_ROOM, 2 * need) // ROOM_BLOCK) * ROOM_BLOCK
        kb = key_states.new_zeros(*key_states.shape[:-2], room, key_states.shape[-1])
        vb = value_states.new_zeros(*value_states.shape[:-2], room, value_states.shape[-1])
        _buffers[kb.untyped_storage().data_ptr()] = kb
        _buffers[vb.untyped_storage().data_ptr()] = vb
        if n:
            kb[..., :n, :] = self.keys
            vb[..., :n, :] = self.values
        self._key_buffer, self._value_buffer = kb, vb

    def reset(self) -> None:
        self._key_buffer = self._value_buffer = None
        super().reset()


def growing_cache() -> DynamicCache:
    """A DynamicCache of GrowingLayers (one made per model layer as the first forward fills it)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache
