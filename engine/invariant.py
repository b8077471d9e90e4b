"""Batch-invariant target forward: a position's logits and KV entries are bitwise the same
whether it is computed alone (plain decoding), inside a k+1-token verification, inside a tree
verification, or inside a prefill chunk of any size.

Why it is needed: in 16-bit on a CPU, the matrix kernels reduce in an order that can depend on
how many rows share a call. Two places were found on this machine (`tests/test_invariant.py`
proves the fix on the embedded model and on a tiny one):

- Linear layers: the single-row path (a matrix-vector kernel) reduces a long input (the MLP down
  projection's 1536 inputs) in another order than the multi-row kernel, which agrees with itself
  for every row count. Every linear (`product`) sends a single row through the multi-row kernel
  (two copies of the row, one result kept), with its weight prepacked in oneDNN's layout
  (`PackedWeight`: F.linear reorders the weight at every call, which for a few rows costs as much as
  the product); each packed shape is checked at its first use to give a row the same bits at
  every row count a verification, tree or prefill chunk uses, and takes F.linear if not. Where
  only calls of up to some row count agree (a Xeon with AMX: 32), longer forwards run in blocks
  of that many rows.
- Attention: SDPA (and transformers' eager path) reduce over a number of keys and with kernels
  that depend on the query count. `invariant_attention` computes each query's attention with
  shapes that do not: the queries sharing a key/value head are stacked (GQA: groups x tokens
  rows, never fewer than two), scores and the weighted sum of values are 16-bit matrix products
  whose per-element reduction runs over the head dimension and over the keys in key order
  (masked keys contribute exact zeros), and the softmax (`invariant_softmax`) is torch's own
  over each row's keys, one row per thread, which masked keys (exact zeros in its sequential
  sum) leave unchanged. Every row runs over as many keys as plain decoding of its position
  does, its visible keys rounded up to a multiple of 64 with masked zero keys (rows of one
  forward are grouped by that count: the weighted sum of values reduces in an order that depends
  on the key count, so a row padded to a longer neighbour's count could get other bits; and
  torch sends batched products under 16^3 multiply-adds to another kernel, cpublas rather than
  oneDNN, that rounds differently). Over SPLIT_FROM keys or more, every row's weighted sum of
  values runs as two products added, the keys before `_split_at` and the last 128, so that a
  tree verification (a draft sees only its ancestors) can compute each draft's row as plain
  decoding of its path does while reading the context once: the keys before the split, which
  every draft sees, in one product for all the drafts stacked, and the rest gathered per draft
  into a contiguous row (the last context keys, then the draft's own) in a buffer kept across
  layers and steps. A probe at first use (`_split_check`) confirms a score does not depend on the
  call that computes it; where it does, each draft gets a contiguous copy of all its keys.

Registered through transformers' AttentionInterface under ATTENTION_NAME; the model file is not
patched.

Float32 (the engine's dtype on CPUs without bfloat16 instructions, where 16-bit kernels are
emulated): the BLAS (MKL) reduces a row of x @ weight.T in one order for one row, another for two
or three, another from four on, and packs the weight at every call. `product` computes
weight @ x.T instead, which for a few rows streams the weight once through a kernel for a narrow
right-hand side: faster than F.linear at every row count up to 8 (one row included), and, over
the row counts a load-time probe finds (_float32_rows_agree: 4 and 8 on an AVX2 EPYC), each row
gets the same bits at every count and every place in the call. So a plain step is one call of 4
rows (one real, three zero), a verification of up to 4 tokens costs the same call, up to 8 one
call of 8, and longer forwards (prefill chunks, large trees) run in blocks of 8. The attention's
float32 products take at least FLOAT32_ATTENTION_ROWS query rows. self_check decides at load:
kernels that fail it give way to transformers' own (engine.models).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "speclab_invariant"
QUERY_BLOCK = 256  # long prefill chunks: queries in blocks (rows are independent) to bound memory


FLOAT32_ATTENTION_ROWS = 4  # float32 attention products run over at least this many query rows (see _grouped_attention)
KEY_BLOCK = 64  # key counts are rounded up to a multiple of this with masked keys (see _grouped_attention)
SPLIT_FROM = 512  # rows over at least this many keys split their products (see _split_at)


def invariant_softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim (float32, masked keys -inf, rows of at least 16 entries) whose
    value for a row depends only on the row's unmasked entries, not on its length or on how many
    rows share the call.

    torch's softmax over a contiguous last dim handles each row on one thread: the exp of every
    element through the vector kernel (a partial vector at the row's end too) and the sum as one
    sequential pass of vector accumulators. Masked entries are exact zeros there, and adding
    zeros leaves every accumulator unchanged, so a row padded with masked keys (inside a
    verification, or a prefill chunk) gets the bits it gets alone. Rows shorter than a vector take
    another path (a lane-by-lane sum), hence the 16-entry floor, which KEY_BLOCK keeps.
    (torch.exp on its own is not position-independent: each thread's share of a call ends in a
    scalar tail, and where the shares end depends on the tensor's size.)

    >>> x = torch.tensor([[0.5, 1.5, 2.0] * 6 + [float("-inf")] * 6, [0.5, 1.5, 2.0] * 8])
    >>> torch.equal(invariant_softmax(x)[0, :18], invariant_softmax(x[:1, :18])[0])
    True
    """
    return torch.softmax(scores.contiguous(), dim=-1)


def _split_at(width: int) -> int:
    """Where a row over `width` keys (a multiple of KEY_BLOCK) splits its weighted sum of values:
    the keys before this in one product, the last 2 x KEY_BLOCK in another, the two added. Rows
    under SPLIT_FROM keys do not split (there one product costs less than two). Plain decoding
    splits the same way, so a tree's rows can share a product over the context: every key
    before the split is the context's (a row sees more than KEY_BLOCK keys past it, and no tree
    is that deep), read once for all the rows, and each row copies only its last keys. On the
    embedded model (a Xeon with AMX, bfloat16) a 65-node tree's verification after 1,024 tokens
    went from 302 to 187 ms, plain steps 50.0 to 50.5 ms (tools/tree_verify_cost.py).

    >>> [_split_at(w) for w in (64, 448, 512, 1024)]
    [0, 0, 384, 896]
    """
    return width - 2 * KEY_BLOCK if width >= SPLIT_FROM else 0


def _product(a: torch.Tensor, b: torch.Tensor, most: int) -> torch.Tensor:
    """a @ b (the last two dims multiply) with each row of a getting the bits it gets in a call of
    two rows: too few rows would take another kernel (16-bit: one row, the matrix-vector kernel;
    float32: under FLOAT32_ATTENTION_ROWS, the BLAS's small-row kernels), so the first row is
    repeated to make up; many rows run in calls of at most `most`."""
    r = a.shape[-2]
    pad = max(0, (FLOAT32_ATTENTION_ROWS if a.dtype == torch.float32 else 2) - r)
    if pad:
        a = torch.cat([a, a[..., :1, :].expand(*a.shape[:-2], pad, a.shape[-1])], dim=-2)
    out = _matmul_in_blocks(a, b, most)
    return out[..., :r, :] if pad else out


def _most_rows(dtype: torch.dtype) -> int:
    return ANY_ROWS if dtype == torch.float32 else _attention_rows(dtype)


def _grouped_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                       bias: torch.Tensor | None) -> torch.Tensor:
    """query (..., Hq, T, D), key/value (..., Hkv, N, D), bias (..., T, N) float32 or None
    -> (..., T, Hq, D). Every output row's value depends only on its own query row and keys."""
    *lead, hq, t, d = query.shape
    hkv, n = key.shape[-3], key.shape[-2]
    g = hq // hkv
    extra = -n % KEY_BLOCK
    if extra:
        # Key counts are rounded up to a multiple of KEY_BLOCK with masked keys, for two reasons:
        # torch hands batched products below 16^3 multiply-adds to another kernel (cpublas, not
        # oneDNN), which rounds differently, so a short context would take it alone and not
        # inside a verification; and oneDNN builds a kernel for each new shape, which on some
        # CPUs costs more than the product (a plain step's context grows by one key each time).
        key, value = _with_room(key, n + extra), _with_room(value, n + extra)
        if bias is not None:
            bias = F.pad(bias, (0, extra), value=float("-inf"))
    rows = query.reshape(*lead, hkv, g * t, d)  # queries sharing a KV head: (group, token) rows
    out = _attend(rows, key, value, scale, bias, t, _split_at(n + extra), None if bias is not None or not extra else n)
    return out.reshape(*lead, hq, t, d).transpose(-2, -3)


def _attend(rows: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, bias: torch.Tensor | None,
            t: int, split: int, cut: int | None = None, head: tuple | None = None) -> torch.Tensor:
    """rows (..., Hkv, g x t, D) attending over key/value (..., Hkv, W, D) -> (..., Hkv, g x t, D).
    bias (..., t, W) float32 (masked keys -inf) or None; cut: keys from it are masked (no bias).

    The weighted sum of values runs as two products, keys before `split` and from it on
    (_split_at), added. head: a tree's keys before the split, shared by its rows, as (the rows
    stacked in one call (1, Hkv, g x R, D), keys (1, Hkv, split, D), values); key/value then
    hold each row's keys from the split on (W - split of them), and the context's are read once
    for all the rows. A score does not depend on which call computes it (_split_agrees), so a
    plain step's scores are one product."""
    most = _most_rows(rows.dtype)
    # keys and values are copied contiguous first: a view into the decoding cache's buffer (a
    # batch stride past its length) sends the product down a path three times slower than the
    # copy and the product together
    scores = _product(rows, key.contiguous().transpose(-1, -2), most)  # (..., Hkv, rows, W)
    if head is not None:
        scores = torch.cat([_unstack(_product(head[0], head[1].contiguous().transpose(-1, -2), most), rows.shape),
                            scores], dim=-1)
    scores = scores.float().mul_(scale)
    if bias is not None:  # (..., t, W) -> shared by the heads and the query groups
        *lead, hkv, r, width = scores.shape
        scores = (scores.reshape(*lead, hkv, r // t, t, width) + bias.unsqueeze(-3).unsqueeze(-4)).reshape(*lead, hkv, r, width)
    elif cut is not None:
        scores[..., cut:] = float("-inf")
    weights = invariant_softmax(scores).to(value.dtype)
    if not split:
        return _product(weights, value.contiguous(), most)
    if head is None:
        return _product(weights[..., split:], value[..., split:, :].contiguous(), most).add_(
            _product(weights[..., :split], value[..., :split, :].contiguous(), most))
    stacked = weights[..., :split].permute(1, 2, 0, 3).reshape(*head[0].shape[:-1], split)
    return _product(weights[..., split:], value.contiguous(), most).add_(
        _unstack(_product(stacked, head[2].contiguous(), most), rows.shape))


def _unstack(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A stacked call's result (1, Hkv, g x R, M) -> each batch entry's rows (R, Hkv, g, M), as
    `shape` (R, Hkv, g, D) has them; unchanged where the rows were not stacked."""
    if tuple(x.shape[:-1]) == tuple(shape[:-1]):
        return x
    r, hkv, g = shape[0], shape[-3], shape[-2]
    return x.reshape(hkv, g, r, x.shape[-1]).permute(2, 0, 1, 3)


def _matmul_in_blocks(a: torch.Tensor, b: torch.Tensor, most: int) -> torch.Tensor:
    """a @ b in calls of at most `most` rows of a (the last two dims multiply), each of at least
    two rows (a lone last row as two copies of itself, one result kept)."""
    r = a.shape[-2]
    if r <= most:
        return torch.matmul(a, b)
    outs = []
    for lo in range(0, r, most):
        part = a[..., lo:lo + most, :]
        if part.shape[-2] == 1:
            outs.append(torch.matmul(torch.cat([part, part], dim=-2), b)[..., :1, :])
        else:
            outs.append(torch.matmul(part, b))
    return torch.cat(outs, dim=-2)


_ATTENTION_ROWS: dict[torch.dtype, int] = {}  # dtype -> _attention_block_rows


def _probed(results: dict, dtype: torch.dtype, probe):
    """probe(dtype), run once per dtype (the first caller runs it; others wait for its result)."""
    if dtype not in results:
        with _pack_lock:
            if dtype not in results:
                results[dtype] = probe(dtype)
    return results[dtype]


def _attention_rows(dtype: torch.dtype) -> int:
    return _probed(_ATTENTION_ROWS, dtype, _attention_block_rows)


ATTENTION_CHECK_KEYS = (256, 1024, 1280, 2048)  # key counts the attention's products are checked at


@torch.inference_mode()
def _attention_block_rows(dtype: torch.dtype, heads: int = 3, dim: int = 64, seed: int = 0) -> int:
    """The most query rows one of the attention's 16-bit batched products (scores = rows @ keys^T,
    reducing over the head dimension; the weighted sum of values = weights @ values, reducing over
    the keys) may take with each row getting the bits it gets in a call of two rows, as
    _packed_block_rows decides it for the linears: ANY_ROWS where every count in CHECK_ROWS
    agrees, else the largest of BLOCK_ROWS up to which every count does (2 if none: the fewest
    the attention ever uses). On a Xeon with AMX the weighted sum of values over 1,024 or 1,280
    keys gave rows 33-48 of a call other bits (a 64-token prefill block is 192 query rows with
    three query heads per key/value head); up to 32 rows agree."""
    gen = torch.Generator().manual_seed(seed)
    pool = max(CHECK_ROWS)

    def counts_agree(counts) -> bool:
        for n in ATTENTION_CHECK_KEYS:
            keys = torch.randn(1, heads, dim, n, generator=gen).to(dtype)
            values = torch.randn(1, heads, n, dim, generator=gen).to(dtype)
            for a, b in ((torch.randn(1, heads, pool, dim, generator=gen).to(dtype), keys),
                         (torch.softmax(torch.randn(1, heads, pool, n, generator=gen) * 3, -1).to(dtype), values)):
                alone = torch.cat([torch.matmul(torch.cat([a[..., i:i + 1, :]] * 2, dim=-2), b)[..., :1, :]
                                   for i in range(pool)], dim=-2)
                for m in counts:
                    calls = max(1, min(pool // m, -(-CHECK_VALUES // (m * heads * b.shape[-1]))))
                    if not all(torch.equal(torch.matmul(a[..., i * m:(i + 1) * m, :], b), alone[..., i * m:(i + 1) * m, :])
                               for i in range(calls)):
                        return False
        return True

    return _block_rows(counts_agree) or 2


_SPLIT_AGREES: dict[torch.dtype, bool] = {}  # dtype -> _split_check


def _split_agrees(dtype: torch.dtype) -> bool:
    return _probed(_SPLIT_AGREES, dtype, _split_check)


@torch.inference_mode()
def _split_check(dtype: torch.dtype, heads: int = 3, dim: int = 64, seed: int = 0) -> bool:
    """Whether a tree's rows may share the context's product (_attend's head): a row's scores
    over keys split at _split_at, in two calls, are bitwise its scores in one call; and a
    weighted sum over a slice of a softmax's rows (as plain decoding takes it) equals the same
    over a contiguous copy (as the stacked tree rows take it). Where not, a tree's rows each get
    a contiguous copy of all their keys, as plain decoding reads them."""
    gen = torch.Generator().manual_seed(seed)
    for n in ATTENTION_CHECK_KEYS:
        split = _split_at(n)
        for m in (3, 9, 24):
            rows = torch.randn(1, heads, m, dim, generator=gen).to(dtype)
            keys = torch.randn(1, heads, n, dim, generator=gen).to(dtype)
            values = torch.randn(1, heads, n, dim, generator=gen).to(dtype)
            whole = torch.matmul(rows, keys.transpose(-1, -2))
            parts = torch.cat([torch.matmul(rows, keys[..., :split, :].transpose(-1, -2)),
                               torch.matmul(rows, keys[..., split:, :].transpose(-1, -2))], dim=-1)
            weights = torch.softmax(torch.randn(1, heads, m, n, generator=gen) * 3, -1).to(dtype)
            sliced = torch.matmul(weights[..., :split], values[..., :split, :])
            copied = torch.matmul(weights[..., :split].contiguous(), values[..., :split, :])
            if not (torch.equal(whole, parts) and torch.equal(sliced, copied)):
                return False
    return True


def _with_room(x: torch.Tensor, size: int) -> torch.Tensor:
    """x (..., N, D) extended to `size` positions along N: a view over the room after it when x
    lies in a buffer of the decoding cache (engine.kv, zero-filled, so the positions past N hold
    zeros or the finite entries of dropped drafts; their weight is an exact zero), else a padded
    copy. Never a view over memory that could hold NaN: 0 x NaN would poison the row."""
    from engine.kv import buffer_with_room

    d, n = x.shape[-1], x.shape[-2]
    buffer = buffer_with_room(x)
    if (buffer is not None and x.stride(-1) == 1 and x.stride(-2) == d and x.dim() >= 3
            and x.stride(-3) >= size * d and buffer.dtype == x.dtype):
        sizes = (*x.shape[:-2], size, d)
        last = x.storage_offset() + sum((s - 1) * st for s, st in zip(sizes, x.stride()))
        if x.storage_offset() >= buffer.storage_offset() and last < buffer.storage_offset() + buffer.numel():
            return x.as_strided(sizes, x.stride())
    return F.pad(x, (0, 0, 0, size - n))


def _visible(attention_mask: torch.Tensor | None, t: int, n: int, device) -> torch.Tensor:
    """(T, N) bool: may query row i attend to key j. No mask: causal, the T queries being the
    last T positions."""
    if attention_mask is None:
        return torch.arange(n, device=device)[None, :] <= torch.arange(n - t, n, device=device)[:, None]
    mask = attention_mask[0, 0]  # one sequence; the mask is shared by the heads
    if mask.dtype != torch.bool:  # additive: 0 where allowed, the dtype's minimum where not
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask[-t:, -n:]


def _masked_tail(counts: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, width) float32: 0 for the first counts[r] slots of row r, -inf after. A row that
    may see no key at all (a padding position of a left-padded batch) sees its first slot: its
    output is never read, but an all-masked row would be NaN, and a NaN value in the cache
    poisons every row that masks it (0 x NaN)."""
    counts = counts.clamp_min(1)
    slots = torch.arange(width, device=counts.device)[None, :]
    return torch.zeros(len(counts), width, device=counts.device).masked_fill_(slots >= counts[:, None], float("-inf"))


@dataclass(frozen=True)
class _Plan:
    """How a forward's T query rows are computed; the same for every layer of the forward.

    Every row is computed over exactly as many keys as plain decoding of its position uses: its
    visible keys rounded up to KEY_BLOCK (masked keys after them). Rows are grouped so that a
    group shares that key count: the kernels reduce a row's weighted sum of values in an order
    that depends on the key count (on this CPU a row over 1,022 keys gets other bits with 1,088
    keys than with 1,024), so a verification or prefill row padded to a longer neighbour's count
    would not be the row plain decoding computes."""

    blocks: tuple[tuple[int, int, int, torch.Tensor], ...] = ()  # prefix rows lo..hi-1: (lo, hi, keys, bias)
    shared: int = 0  # rows with holes (a tree): keys 0..shared-1 are visible to every row
    # rows with holes, grouped by padded key count: (row indices, each row's other visible keys in
    # key order (rows, w), bias (rows, width) with width the group's padded key count)
    groups: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...] = ()


def _padded(counts: torch.Tensor) -> torch.Tensor:
    """The key count plain decoding uses for a row that sees `counts` keys (_grouped_attention)."""
    return (counts.clamp_min(1) + KEY_BLOCK - 1) // KEY_BLOCK * KEY_BLOCK


def _runs(padded: list[int], most: int) -> list[tuple[int, int]]:
    """(lo, hi) spans of consecutive rows sharing a padded key count, at most `most` rows each.

    >>> _runs([64, 64, 128, 128, 128], 2)
    [(0, 2), (2, 4), (4, 5)]
    """
    spans, lo = [], 0
    for i in range(1, len(padded) + 1):
        if i == len(padded) or padded[i] != padded[lo] or i - lo == most:
            spans.append((lo, i))
            lo = i
    return spans


def _plan(attention_mask: torch.Tensor | None, t: int, n: int, device) -> _Plan:
    visible = _visible(attention_mask, t, n, device)
    counts = visible.sum(-1)  # (T,)
    padded = _padded(counts)
    if torch.equal(torch.arange(n, device=device)[None, :] < counts[:, None], visible):
        # causal rows (a chain's verification, prefill chunks): keys past the group's longest row
        # are cut, the rest masked; long chunks in blocks of rows
        blocks = []
        for lo, hi in _runs(padded.tolist(), QUERY_BLOCK):
            c = counts[lo:hi]
            keys = max(1, int(c.max()))
            blocks.append((lo, hi, keys, _masked_tail(c, keys)))
        return _Plan(blocks=tuple(blocks))
    # a tree's ancestor mask: the keys every row sees (the context and the root), then each
    # row's own (its ancestors and itself) in key order (a stable sort puts them first)
    every = visible.all(0)
    shared = int(every.long().cumprod(0).sum())
    rest = visible[:, shared:]
    own = rest.sum(-1)
    order = torch.sort((~rest).to(torch.int8), dim=-1, stable=True).indices
    groups = []
    for width in sorted(set(padded.tolist())):
        rows = torch.nonzero(padded == width).flatten()
        w = max(1, int(own[rows].max()))
        groups.append((rows, shared + order[rows, :w], _masked_tail(counts[rows], width)))
    return _Plan(shared=shared, groups=tuple(groups))


_last_plan = threading.local()  # (mask, T, N, plan) of the forward in progress on this thread


def _plan_for(attention_mask: torch.Tensor | None, t: int, n: int, device) -> _Plan:
    """The plan, made once per forward: every layer gets the same mask object and shapes."""
    last = getattr(_last_plan, "value", None)
    if last is not None and last[0] is attention_mask and last[1:3] == (t, n):
        return last[3]
    plan = _plan(attention_mask, t, n, device)
    _last_plan.value = (attention_mask, t, n, plan)
    return plan


def invariant_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers attention function: query (B, Hq, T, D), key/value (B, Hkv, N, D) -> (B, T, Hq, D).
    A batch (the decoding loop runs one sequence; tests score many) runs sequence by sequence,
    each with its own mask."""
    if query.shape[0] != 1:
        outs = [invariant_attention(module, query[b:b + 1], key[b:b + 1], value[b:b + 1],
                                    None if attention_mask is None else attention_mask[b:b + 1], dropout, scaling)[0]
                for b in range(query.shape[0])]
        return torch.cat(outs), None
    t, n, d = query.shape[2], key.shape[2], query.shape[3]
    scale = scaling if scaling is not None else d ** -0.5
    if t == 1 and attention_mask is None:  # plain decoding: every cached key is visible
        return _grouped_attention(query, key, value, scale, None), None
    plan = _plan_for(attention_mask, t, n, query.device)
    if not plan.groups:
        outs = [_grouped_attention(query[:, :, lo:hi], key[:, :, :keys], value[:, :, :keys], scale, bias)
                for lo, hi, keys, bias in plan.blocks]
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), None
    # rows with holes (a tree): each row is computed as plain decoding of its path computes it, in
    # two parts (_split_at): the context's keys before the split, read once for all the group's
    # rows stacked in one product, and the rest, made contiguous per row (one batch entry each:
    # the shared keys from the split on, then the row's own, then zeros, finite and masked). One
    # group per padded key count.
    hq, hkv = query.shape[1], key.shape[1]
    g = hq // hkv
    q = query[0].transpose(0, 1)  # (T, Hq, D)
    out = q.new_empty(t, hkv, g, d)
    for rows, tail, bias in plan.groups:
        width = bias.shape[-1]
        split = _split_at(width)
        shared = split if _split_agrees(query.dtype) else 0  # keys the rows read together
        keys, values = (_rows_of(x[0], plan.shared, tail, width, shared, slot) for slot, x in enumerate((key, value)))
        r = len(rows)
        head = (query[:, :, rows].reshape(1, hkv, g * r, d), key[:, :, :split], value[:, :, :split]) if shared else None
        out[rows] = _attend(q[rows].reshape(r, hkv, g, d), keys, values, scale, bias[:, None, :], 1, split, head=head)
    return out.reshape(1, t, hq, d), None


SCRATCH_BYTES = 64 << 20  # the most a thread keeps for _rows_of, per slot
_scratch = threading.local()  # slot -> a zero-initialised buffer _rows_of writes into, reused


def _rows_of(x: torch.Tensor, shared: int, tail: torch.Tensor, width: int, split: int, slot: int) -> torch.Tensor:
    """x (Hkv, N, D) -> (R, Hkv, width - split, D): per row the shared keys from `split` on, then
    its own keys (tail (R, w) indices), then finite entries the bias masks. Written into a buffer
    reused across layers and steps (a fresh one per layer costs more than the attention: page
    faults on new memory); it starts zeroed and only ever holds keys and values, so the masked
    entries are finite (0 x NaN would poison a row)."""
    assert split <= shared, "a tree row's split falls in the context (_split_at)"
    t, w = tail.shape
    h, _, d = x.shape
    width -= split
    size = t * h * width * d
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buffer = buffers.get((slot, x.dtype, x.device))
    if buffer is None or buffer.numel() < size:
        buffer = x.new_zeros(max(size, 2 * (0 if buffer is None else buffer.numel())))
        if buffer.numel() * buffer.element_size() <= SCRATCH_BYTES:  # (a huge tree: not kept)
            buffers[(slot, x.dtype, x.device)] = buffer
    out = buffer[:size].view(t, h, width, d)
    out[:, :, :shared - split] = x[None, :, split:shared]
    out[:, :, shared - split:shared - split + w] = x[:, tail].transpose(0, 1)
    return out


AttentionInterface.register(ATTENTION_NAME, invariant_attention)
AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)  # boolean masks, None when causal


class PackedWeight:
    """oneDNN's prepacked copy of one weight (its blocked layout, made once), for `product`.

    A 16-bit F.linear on this CPU reorders its weight into oneDNN's layout at every call; for
    one to nine rows that reorder costs about as much as the product itself (a plain step is
    ~120 products), so the reordered copy is kept, as inductor's frozen CPU graphs keep theirs.
    The copy is remade when its weight changes (another tensor, or an in-place write); a deep
    copy starts empty (oneDNN's opaque tensors cannot be copied) and packs at its first call.
    `rows`: the most rows one call of the packed product may take (_packed_block_rows)."""

    __slots__ = ("tensor", "stamp", "rows")

    def __init__(self) -> None:
        self.tensor, self.stamp, self.rows = None, None, 0

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        version = -1 if weight.is_inference() else weight._version
        if self.stamp is None or self.stamp[0] is not weight or self.stamp[1] != version:
            self.tensor, self.rows = _pack(weight)
            self.stamp = (weight, version)
        return self.tensor

    def __deepcopy__(self, memo: dict) -> "PackedWeight":
        return PackedWeight()


ANY_ROWS = 1 << 62  # _packed_block_rows: every row count checked agreed, so calls of any size
_PACKABLE: dict[tuple, int] = {}  # (out, in, dtype) -> _packed_block_rows of that shape (0: F.linear)
_pack_lock = threading.Lock()


def _pack(weight: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """The packed weight and the most rows one call of it may take, or (None, 0) where packing
    is not available or not row-invariant for this shape (then `product` takes F.linear)."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2:
        return None, 0
    key = (*weight.shape, weight.dtype)
    with _pack_lock:
        if key not in _PACKABLE:
            _PACKABLE[key] = _packed_block_rows(*weight.shape, weight.dtype)
    if not _PACKABLE[key]:
        return None, 0
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 2), _PACKABLE[key]


# row counts a 16-bit product is checked at (verifications, trees, prefill blocks): every count up
# to 64 (on a Xeon with AMX the attention's weighted sum of values disagreed at 33-48 rows only)
CHECK_ROWS = (*range(2, 65), 96, 128, 192, 257)
BLOCK_ROWS = (64, 32, 16, 8, 4)  # if one of them disagrees: call sizes tried, largest first, every count up to each


CHECK_VALUES = 1 << 16  # outputs compared per row count: a reordered reduction often rounds to the same 16 bits


def _block_rows(counts_agree) -> int:
    """ANY_ROWS if counts_agree(CHECK_ROWS), else the largest of BLOCK_ROWS up to which every row
    count agrees, else 0."""
    if counts_agree(CHECK_ROWS):
        return ANY_ROWS
    return next((most for most in BLOCK_ROWS if counts_agree(range(2, most + 1))), 0)


@torch.inference_mode()
def _packed_block_rows(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> int:
    """The most rows one packed product of this shape may take with each row getting the bits it
    gets alone (as two copies of the row): ANY_ROWS if every count in CHECK_ROWS agrees, else the
    largest of BLOCK_ROWS up to which every count agrees (longer forwards then run in blocks of
    it), 0 if none does. Random weights at a layer's scale: the kernel's reduction order depends
    on the shapes, not on the values; but a reduction in another order rounds to the same 16-bit
    result more often than not, so each count is compared over at least CHECK_VALUES outputs
    (calls over further rows where the shape has few outputs).

    Why blocks: on a Xeon with AMX (amx_bf16), oneDNN reduces a row in one order for up to 32
    rows and in others from 33 rows on, so a 64-token prefill chunk gave its rows other bits than
    plain decoding; on CPUs with avx512_bf16 and no AMX every count checked agrees."""
    try:
        gen = torch.Generator().manual_seed(seed)
        weight = (torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 2)
        pool = max(max(CHECK_ROWS), -(-CHECK_VALUES // out_features) + max(BLOCK_ROWS))
        x = torch.randn(pool, in_features, generator=gen).to(dtype)
        run = lambda rows: torch.ops.mkldnn._linear_pointwise(rows, packed, None, "none", [], "")
        alone = torch.cat([run(torch.cat([x[i:i + 1]] * 2))[:1] for i in range(pool)])

        def agrees(m: int) -> bool:
            calls = max(1, min((pool - m) // m + 1, -(-CHECK_VALUES // (m * out_features))))
            return all(torch.equal(run(x[i * m:(i + 1) * m]), alone[i * m:(i + 1) * m]) for i in range(calls))

        return _block_rows(lambda counts: all(agrees(m) for m in counts))
    except (RuntimeError, AttributeError):  # no oneDNN, or no 16-bit support in it
        return 0


FLOAT32_LOW_ROWS = (2, 4, 8)  # the fewest rows per float32 call tried, cheapest first (_float32_rows_agree)
FLOAT32_MOST_ROWS = 16  # the most rows per float32 call tried


@torch.inference_mode()
def _float32_rows_agree(out_features: int, in_features: int, seed: int = 0) -> tuple[int, ...] | None:
    """The row counts at which float32 products `weight @ x.T` of this shape give each row the
    bits it gets in a call of the fewest of them (lo), at every place in the call: a sorted
    tuple starting at lo, or None if no lo in FLOAT32_LOW_ROWS has a count of 4 or more among
    them (a 3-draft verification in one call). Random values at a layer's scale: the kernel's
    reduction order depends on the shapes, not on the values.

    Why this orientation: for a few rows the BLAS here (MKL on an AVX2 CPU) streams the weight
    once through a kernel made for a narrow right-hand side, where x @ weight.T (F.linear) packs
    the weight at every call (BENCHMARKS.md 1o: over the embedded model's linears, 4 rows cost
    ~0.7x one F.linear row). That kernel takes the rows in groups of 4, a ragged last group
    through an edge kernel that rounds otherwise, and past 11 rows another kernel: on that CPU
    the counts found are (4, 8)."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
    x = torch.randn(FLOAT32_MOST_ROWS, in_features, generator=gen)
    filler = torch.randn(max(FLOAT32_LOW_ROWS), in_features, generator=gen)
    run = lambda rows: (weight @ rows.t()).t()
    together = {m: run(x[:m]) for m in range(1, FLOAT32_MOST_ROWS + 1)}  # row i at place i
    for lo in FLOAT32_LOW_ROWS:
        alone = torch.stack([run(torch.cat([x[i:i + 1], filler[:lo - 1]]))[0] for i in range(FLOAT32_MOST_ROWS)])
        counts = tuple(m for m in range(lo, FLOAT32_MOST_ROWS + 1) if torch.equal(together[m], alone[:m]))
        if counts and counts[0] == lo and counts[-1] >= 4:
            return counts
    return None


_FLOAT32_ROWS: dict[tuple[int, int], tuple[int, ...] | None] = {}  # (out, in) -> _float32_rows_agree


def _float32_rows(weight: torch.Tensor) -> tuple[int, ...] | None:
    """The shape's row counts, probed once (every linear of every step asks: no lock once known)."""
    key = tuple(weight.shape)
    if key in _FLOAT32_ROWS:
        return _FLOAT32_ROWS[key]
    with _pack_lock:
        if key not in _FLOAT32_ROWS:
            _FLOAT32_ROWS[key] = _float32_rows_agree(*key)
        return _FLOAT32_ROWS[key]


def _float32_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     counts: tuple[int, ...]) -> torch.Tensor:
    """x @ weight.T + bias in calls whose row counts are in `counts` (_float32_rows_agree):
    blocks of the largest, the rest padded with zero rows up to the smallest count that holds
    it, so each row's bits are the same at every row count."""
    flat = x.reshape(-1, x.shape[-1])
    m, most = flat.shape[0], counts[-1]
    if m == 0:  # (logits_to_keep with nothing to keep)
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    outs = []
    for start in range(0, m, most):
        block = flat[start:start + most]
        n = block.shape[0]
        size = next(c for c in counts if c >= n)
        if size > n:
            block = torch.cat([block, block.new_zeros(size - n, block.shape[1])])
        outs.append((weight @ block.t()).t()[:n])
    out = torch.cat(outs) if len(outs) > 1 else outs[0].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
    """x @ weight.T + bias with each row's bits independent of how many rows share the call.
    16-bit: a single row goes through the multi-row kernel as two copies of itself (one result
    kept), and the weight is the packed copy where that passed its row check, in calls of at most
    as many rows as the check found to agree (longer forwards in blocks). float32 on a CPU:
    calls of a row count range whose kernel passed its row check (_float32_product), else F.linear."""
    if weight.dtype == torch.float32 and weight.device.type == "cpu" and weight.dim() == 2:
        counts = _float32_rows(weight)
        if counts is not None:
            return _float32_product(x, weight, bias, counts)
        return F.linear(x, weight, bias)
    w = packed.get(weight) if packed is not None else None
    if w is None:
        one = x.numel() == x.shape[-1]
        out = F.linear(torch.cat([x, x], dim=-2) if one else x, weight, bias)
        return out[..., :1, :] if one else out
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] == 0:  # (logits_to_keep with nothing to keep)
        return x.new_zeros(*x.shape[:-1], weight.shape[0])
    outs = [_packed_call(flat[start:start + packed.rows], w, bias) for start in range(0, flat.shape[0], packed.rows)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _packed_call(rows: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One packed product over (rows, in); a single row as two copies of itself (one kept)."""
    if rows.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(torch.cat([rows, rows]), w, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(rows, w, bias, "none", [], "")


class InvariantLinear(torch.nn.Linear):
    """A linear layer whose rows do not depend on how many rows share the call (`product`):
    single rows take the multi-row kernel, and the weight is kept packed."""

    _packed: PackedWeight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (self.weight.requires_grad or x.requires_grad):
            return F.linear(x, self.weight, self.bias)
        if "_packed" not in self.__dict__:
            self._packed = PackedWeight()
        return product(x, self.weight, self.bias, self._packed)


FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # linears that read one input


class _FusedGroup:
    """Sibling linears that read the same input (a layer's q/k/v projections; an MLP's gate and
    up projections) computed as one matrix product, as vLLM's merged QKV and gate-up layers do:
    one call instead of three takes about half the time of the three one-row products on this
    CPU. The members' weights start as slices of the fused weight (no extra memory). The first
    member called with an input computes every member's output; the others take their slice of
    it, and the stored output is dropped once each member has had its share. Each output element
    is the same reduction over the same inputs, so the bits are those of the separate products
    (tests/test_invariant.py checks this on the embedded model).

    A member whose weights changed since (copied with its layer, loaded into, trained) makes the
    group fuse again from the members' current weights; with gradients on, members run alone."""

    def __init__(self, members: list[torch.nn.Linear]):
        self.members = members
        self._pending = threading.local()  # (input, output, members still to take their share)
        self._build()
        start = 0
        for module in members:  # the members' parameters become slices of the fused ones
            rows = module.out_features
            module.weight = torch.nn.Parameter(self.weight[start:start + rows], requires_grad=module.weight.requires_grad)
            if self.bias is not None:
                module.bias = torch.nn.Parameter(self.bias[start:start + rows], requires_grad=module.bias.requires_grad)
            start += rows
        self._stamps = self._current()

    def _current(self) -> tuple:
        """Each member parameter (its module's dict, its name, the tensor) and its in-place write
        count: a layer copied with its members, weights loaded into them or trained since no
        longer match the fused weight."""
        return tuple((m._parameters, name, p, -1 if p.is_inference() else p._version)
                     for m in self.members for name, p in m._parameters.items() if p is not None)

    @torch.no_grad()
    def _build(self) -> None:
        members = self.members
        self.weight = torch.cat([m.weight.detach() for m in members])
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self._packed = PackedWeight()
        self._stamps = self._current()

    def _fresh(self) -> bool:
        if self._stamps is None:  # a copy: fresh if its members' weights are still slices of the fused ones
            if not self._slices_of_fused():
                return False
            self._stamps = self._current()
        for params, name, p, version in self._stamps:
            q = params.get(name)
            if q is not p or (version >= 0 and q._version != version):
                return False
        return True

    def _slices_of_fused(self) -> bool:
        start = 0
        for m in self.members:
            for p, fused in ((m.weight, self.weight), (m.bias, self.bias)):
                if (p is None) != (fused is None):
                    return False
                if p is not None and (p.data_ptr() != fused[start].data_ptr() or p.shape[0] != m.out_features):
                    return False
            start += m.out_features
        return True

    def output(self, x: torch.Tensor, member: int) -> torch.Tensor:
        pending = getattr(self._pending, "value", None)
        if pending is None or pending[0] is not x or member not in pending[2]:
            if not self._fresh():
                self._build()
            out = product(x, self.weight, self.bias, self._packed)
            pending = (x, out, set(range(len(self.members))))
        pending[2].discard(member)
        self._pending.value = pending if pending[2] else None
        return pending[1]

    def __deepcopy__(self, memo: dict) -> "_FusedGroup":
        """A copied layer gets its own group over its copied members. At its first call it keeps
        the fused weight if their weights are still its slices (a copy sharing the tensors) and
        fuses again if they are copies (as Parameter copies are)."""
        new = _FusedGroup.__new__(_FusedGroup)
        memo[id(self)] = new
        new.members = [copy.deepcopy(m, memo) for m in self.members]
        new.weight, new.bias, new._packed, new._stamps = self.weight, self.bias, self._packed, None
        new._pending = threading.local()
        return new


class FusedLinear(torch.nn.Linear):
    """One member of a _FusedGroup: its output is its slice of the group's product."""

    _group: _FusedGroup
    _member: int
    _columns: slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (self._parameters["weight"].requires_grad or x.requires_grad):
            return F.linear(x, self.weight, self.bias)
        return self._group.output(x, self._member)[..., self._columns]


def _fuse(members: list[torch.nn.Linear]) -> None:
    group = _FusedGroup(members)
    start = 0
    for index, module in enumerate(members):
        module.__class__ = FusedLinear
        module._group, module._member = group, index
        module._columns = slice(start, start + module.out_features)
        start += module.out_features


def _fusable(parent: torch.nn.Module, names: tuple[str, ...]) -> list[torch.nn.Linear] | None:
    members = [getattr(parent, name, None) for name in names]
    if not all(type(m) is torch.nn.Linear for m in members):
        return None
    first = members[0]
    same = all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in members)
    return members if same else None


@torch.inference_mode()
def row_invariant(linear: torch.nn.Linear, rows: int = 64, seed: int = 0) -> bool:
    """Does this linear give each row bitwise the same output alone as inside a call of many
    rows (random inputs at the scale of its weights)?"""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, linear.in_features, generator=gen).to(linear.weight.device, linear.weight.dtype)
    together = linear(x)
    return all(torch.equal(linear(x[i:i + 1])[0], together[i]) for i in range(rows))


def make_invariant(model: torch.nn.Module) -> list[str]:
    """Switch a loaded 16-bit model to batch-invariant attention and linears, in place: the
    sibling projections fused (_FusedGroup), every other linear an InvariantLinear, weights
    packed at their first call. Returns the names of the linears switched."""
    for parent in list(model.modules()):
        for names in FUSED_GROUPS:
            members = _fusable(parent, names)
            if members is not None:
                _fuse(members)
    fixed = []
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = InvariantLinear  # same parameters, another forward
            fixed.append(name)
    model.config._attn_implementation = ATTENTION_NAME
    for sub in model.modules():  # submodules that hold their own config object
        config = getattr(sub, "config", None)
        if config is not None and config is not model.config and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION_NAME
    return fixed


@torch.inference_mode()
def self_check(model: torch.nn.Module, context: int = 70, chunk: int = 7, tokens: int = 5, seed: int = 0) -> bool:
    """A load-time check (tests/test_invariant.py proves it more widely): a `context`-token
    prefill in one forward and in chunks of `chunk` leave bitwise the same cache, and a
    `tokens`-token forward's logits after it are bitwise those of the same tokens one at a time.
    The prefill is long enough for blocks of over 64 rows (a Xeon with AMX reduced rows in
    another order from 33 rows on, which a 12-token context never showed)."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, context + tokens), generator=gen).to(model.device)
    # a warm-up forward first, compared with nothing: the first forward of a process whose
    # threads have run a float32 product (MKL) before it does not always get the bits later
    # forwards get (a Xeon with AMX, bfloat16: the check failed 3 of 10 loads after one 2 x 64
    # float32 product, every later check passed), and requests only ever meet later forwards
    model(input_ids=ids[:, :chunk], cache=DynamicCache(), use_cache=True, logits_to_keep=1)
    together, alone = DynamicCache(), DynamicCache()
    model(input_ids=ids[:, :context], cache=together, use_cache=True, logits_to_keep=1)
    for start in range(0, context, chunk):
        model(input_ids=ids[:, start:min(start + chunk, context)], cache=alone, use_cache=True, logits_to_keep=1)
    if not all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(together.layers, alone.layers)):
        return False
    block = model(input_ids=ids[:, context:], cache=together, use_cache=True).logits[0]
    rows = [model(input_ids=ids[:, i:i + 1], cache=alone, use_cache=True).logits[0, 0] for i in range(context, context + tokens)]
    return all(torch.equal(block[i], row) for i, row in enumerate(rows))
