"""One packed forward for a whole engine step: every scheduled token of every request in a
single sequence, as vLLM does, with attention kept per request.

Why not transformers' continuous batching (generate_batch / ContinuousBatchingManager)? It runs
steps on a background thread with its own paged KV cache and schedulers (FIFO, prefill-first),
so recording each step's composition and wall-time span means patching its internals, the
`none` policy (whole prompts, decodes wait) is not one of its schedulers, and its paged
attention kernels compute each request's attention over different shapes than a solo run does.

So the step is built here, on the loaded model itself:
- The T scheduled tokens go through the model as one (1, T) sequence, with position_ids per
  request; every linear layer, norm and the LM head run once for all requests.
- Attention is routed, through transformers' AttentionInterface, to `packed_attention`, which
  splits the T tokens into their requests' segments, appends each segment's keys/values to that
  request's own KV (engine.serving.prefix_cache.RequestKV: the prefix blocks it reuses from the
  prefix cache, if any, then its own entries), and runs the model's own attention per segment (transformers'
  SDPA, or engine.invariant's batch-invariant attention) with the same mask a solo run would use
  (causal; offset by the cached length). A request's attention is therefore computed as in a
  solo run with the same prefill chunks. With a batch-invariant model (bfloat16 or float32 on a CPU) the
  packed linears and norms give each row bitwise its solo value too, so every request's output
  is bitwise its solo output; otherwise the last bits of the packed matrix products can differ
  (BLAS blocks rows differently for T rows than for one), which only matters at an exact near-tie
  of the top two logits.
- The model is shared read-only by every session, so packing uses a view: a copy of the module
  tree that shares every weight tensor with the loaded model and differs only in its config's
  attention implementation. The loaded model itself is never modified.

Full causal attention only: models with sliding-window layers are refused.
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from engine.errors import InputError
from engine.invariant import invariant_attention
from engine.models import LoadedModel
from engine.serving.prefix_cache import RequestKV

ATTENTION_NAME = "speclab_packed"


@dataclass(frozen=True)
class Segment:
    """The tokens [lo, hi) of the packed sequence belong to the request whose KV cache this is."""

    lo: int
    hi: int
    cache: RequestKV


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     speclab_segments: tuple[Segment, ...] = (), speclab_attention=sdpa_attention_forward,
                     **kwargs):
    """Attention of a packed step, request by request. query (1, Hq, T, D); key, value
    (1, Hkv, T, D) hold the new tokens only; returns (1, T, Hq, D) like every attention
    function of transformers."""
    outputs = []
    for seg in speclab_segments:
        # (1, Hkv, S, D): the request's cached keys/values followed by this segment's
        k, v = seg.cache.update(key[:, :, seg.lo:seg.hi], value[:, :, seg.lo:seg.hi], module.layer_idx)
        n, total = seg.hi - seg.lo, k.shape[2]
        # a solo run passes no mask for one token or a first chunk (SDPA is_causal), else an
        # explicit causal mask offset by the cached length
        mask = None
        if 1 < n < total:
            mask = torch.ones(n, total, dtype=torch.bool, device=k.device).tril(total - n)[None, None]  # (1, 1, n, S)
        out, _ = speclab_attention(module, query[:, :, seg.lo:seg.hi], k, v, mask,
                                   dropout=dropout, scaling=scaling, **kwargs)
        outputs.append(out)  # (1, n, Hq, D)
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(ATTENTION_NAME, packed_attention)
# the model's own mask is never used: packed_attention builds each request's mask itself
AttentionMaskInterface.register(ATTENTION_NAME, lambda *args, **kwargs: None)

_views: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_views_lock = threading.Lock()


def packed_view(target: LoadedModel) -> torch.nn.Module:
    """The model's packing view (made once per model): same weights, packed attention."""
    with _views_lock:
        view = _views.get(target.model)
        if view is None:
            model = target.model
            if any(getattr(m, "sliding_window", None) for m in model.modules()):
                raise InputError(
                    f"model {target.name!r} uses sliding-window attention, which packed serving does not support"
                )
            shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
            view = copy.deepcopy(model, memo=shared)  # new modules and config, same tensors
            view.config._attn_implementation = ATTENTION_NAME
            _views[model] = view
        return view


@torch.inference_mode()
def forward_packed(target: LoadedModel, token_ids: list[int], positions: list[int],
                   segments: tuple[Segment, ...], keep: list[int]) -> torch.Tensor:
    """One forward over the packed sequence; appends every segment's KV to its cache and
    returns float32 logits (len(keep), V) at the packed indices in `keep`."""
    device = target.device
    out = packed_view(target)(
        input_ids=torch.tensor([token_ids], device=device),  # (1, T)
        position_ids=torch.tensor([positions], device=device),  # (1, T)
        use_cache=False,  # the per-request caches live in the segments
        logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
        speclab_segments=segments,
        speclab_attention=invariant_attention if target.batch_invariant else sdpa_attention_forward,
    )
    return out.logits[0].float()  # (len(keep), V)
