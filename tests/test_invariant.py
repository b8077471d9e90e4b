"""Batch-invariant target forward (engine.invariant): a position's logits and KV entries are
bitwise the same whether it is computed alone, inside a k+1-token verification, inside a tree
verification with its ancestor mask, or inside a prefill chunk of any size. On a tiny model and
on the embedded model, in bfloat16 and in float32 (where this CPU's BLAS has row counts that
agree: engine.invariant._float32_rows_agree)."""

import pytest
import torch
from transformers import DynamicCache

from engine.decoding import DecodeConfig, generate
from engine.drafters import DrafterSpec, build_drafter
from engine.kv import growing_cache
from engine.invariant import FusedLinear, InvariantLinear, invariant_softmax, row_invariant, self_check
from engine.models import choose_dtype, cpu_bf16_flags, load_model
from engine.mtp.tree import tree_inputs
from engine.trace import Step


def tokens_of(events):
    return [t.token_id for e in events if isinstance(e, Step) for t in e.emitted]


@pytest.fixture(scope="module")
def tiny_bf16(tiny_target, one_thread):
    return load_model(tiny_target, dtype="bfloat16")


@pytest.fixture(scope="module")
def embedded_bf16():
    return load_model("embedded", dtype="bfloat16")


def _invariant(model, dtype: str):
    """bfloat16 must be invariant on every CPU the tests run on; float32 where the load-time
    check passed its kernels (its BLAS's row counts: engine.invariant._float32_rows_agree)."""
    if dtype == "float32" and not model.batch_invariant:
        pytest.skip(f"float32 kernels are not batch-invariant on this CPU: {model.dtype_reason}")
    assert model.batch_invariant and str(model.dtype) == f"torch.{dtype}"
    return model


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def tiny_inv(request, tiny_target, one_thread):
    """The tiny target with batch-invariant kernels, in each dtype that has them."""
    return _invariant(load_model(tiny_target, dtype=request.param), request.param)


AUTO_DTYPE = str(choose_dtype("auto", "cpu")[0]).removeprefix("torch.")


@pytest.fixture(scope="module", params=[AUTO_DTYPE])
def embedded_inv(request):
    """The embedded model with batch-invariant kernels in the dtype the engine runs it in on this
    CPU (bfloat16 with bfloat16 instructions, else float32; the tiny model's tests run both:
    emulated bfloat16 at the embedded model's size would take half an hour here)."""
    return _invariant(load_model("embedded", dtype=request.param), request.param)


def _prefilled(model, ids: torch.Tensor, chunk: int) -> DynamicCache:
    cache = growing_cache()  # the cache decoding uses
    for s in range(0, ids.shape[1], chunk):
        model(input_ids=ids[:, s:s + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    return cache


@torch.inference_mode()
def one_at_a_time(model, ids: torch.Tensor, context: int) -> tuple[torch.Tensor, DynamicCache]:
    """Logits (T, V) of positions context.. computed one token per forward (plain decoding)."""
    cache = _prefilled(model, ids[:, :context], context)
    rows = [model(input_ids=ids[:, i:i + 1], cache=cache, use_cache=True).logits[0, 0] for i in range(context, ids.shape[1])]
    return torch.stack(rows), cache


@torch.inference_mode()
def all_at_once(model, ids: torch.Tensor, context: int, chunk: int | None = None) -> tuple[torch.Tensor, DynamicCache]:
    """Logits (T, V) of positions context.. from forwards of `chunk` tokens (one forward: None)."""
    cache = _prefilled(model, ids[:, :context], context)
    chunk = chunk or ids.shape[1] - context
    rows = [model(input_ids=ids[:, s:s + chunk], cache=cache, use_cache=True).logits[0]
            for s in range(context, ids.shape[1], chunk)]
    return torch.cat(rows), cache


def assert_same_kv(a: DynamicCache, b: DynamicCache) -> None:
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def random_ids(vocab: int, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


# --- the kernels ------------------------------------------------------------------------------

def test_invariant_linear_sends_one_row_through_the_multi_row_kernel():
    torch.manual_seed(0)
    linear = torch.nn.Linear(1536, 64, bias=False).to(torch.bfloat16)
    x = torch.randn(9, 1536, dtype=torch.bfloat16)
    fixed = InvariantLinear(1536, 64, bias=False, dtype=torch.bfloat16)
    fixed.weight = linear.weight
    assert row_invariant(fixed)
    together = fixed(x)
    assert all(torch.equal(fixed(x[i:i + 1])[0], together[i]) for i in range(9))
    assert torch.equal(fixed(x[None, 2:3])[0, 0], together[2])  # (B, T, H) input, T = 1


def test_a_packed_weight_gives_every_row_count_the_same_bits_and_follows_its_weight():
    """The linears keep their weight prepacked (oneDNN's layout, engine.invariant.PackedWeight): a row
    gets the same bits at every row count, the packed copy is remade when the weight is written
    in place or replaced, and a deep copy (a distilled draft copies layers) packs its own."""
    import copy

    from engine.invariant import _PACKABLE, CHECK_ROWS

    torch.manual_seed(1)
    linear = InvariantLinear(1536, 96, bias=True, dtype=torch.bfloat16)
    x = torch.randn(max(CHECK_ROWS), 1536, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i:i + 1]) for i in range(len(x))])
        for m in CHECK_ROWS:
            assert torch.equal(linear(x[:m]), alone[:m]), m
        if cpu_bf16_flags():  # oneDNN's 16-bit kernels are native there, and their packing row-invariant
            assert _PACKABLE[(96, 1536, torch.bfloat16)], "oneDNN packing is available on CPUs with bfloat16 instructions"
        # elsewhere (AVX2 only) the emulated packed product may fail its row check: then F.linear
        assert (linear._packed.tensor is not None) == bool(_PACKABLE[(96, 1536, torch.bfloat16)])
        # the packed product is F.linear's multi-row product
        assert torch.equal(linear(x[:9]), torch.nn.functional.linear(x[:9], linear.weight, linear.bias))
    with torch.no_grad():
        linear.weight.mul_(0.5)  # loading trained weights writes in place
    with torch.inference_mode():
        assert torch.equal(linear(x[:5]), torch.nn.functional.linear(x[:5], linear.weight, linear.bias))
    linear.weight = torch.nn.Parameter(torch.randn(96, 1536, dtype=torch.bfloat16))  # replaced
    twin = copy.deepcopy(linear)
    with torch.no_grad():
        twin.weight.mul_(2)
    with torch.inference_mode():
        assert torch.equal(linear(x[:5]), torch.nn.functional.linear(x[:5], linear.weight, linear.bias))
        assert torch.equal(twin(x[:5]), torch.nn.functional.linear(x[:5], twin.weight, twin.bias))
        assert not torch.equal(twin(x[:5]), linear(x[:5]))
    twin.weight.requires_grad_(True)  # training: plain F.linear, so gradients reach the weight
    twin(x[:3]).sum().backward()
    assert twin.weight.grad is not None


@torch.inference_mode()
def fused_members_match_their_own_products(model: torch.nn.Module, rows=(1, 2, 5, 9, 33)) -> int:
    """Each fused projection's slice, called as the model calls it (every member on one input),
    equals the member's own product bitwise, for one row and for many; returns the members seen."""
    layers = [m for m in model.modules() if hasattr(m, "q_proj") or hasattr(m, "gate_proj")]
    seen = 0
    for layer in layers[:3] + layers[-3:]:
        members = [m for m in layer.children() if isinstance(m, FusedLinear)]
        for n in rows:
            x = torch.randn(1, n, members[0].in_features, generator=torch.Generator().manual_seed(n)).to(members[0].weight.dtype)
            together = [m(x) for m in members]  # the first computes the fused product, the others slice it
            for m, out in zip(members, together):
                alone = torch.stack([torch.nn.functional.linear(torch.cat([x[:, i:i + 1]] * 2, dim=1), m.weight, m.bias)[0, 0]
                                     for i in range(n)])
                assert torch.equal(out[0], alone), (m, n)
            assert members[0]._group._pending.value is None  # nothing kept once each member had its share
        seen += len(members)
    return seen


def test_fused_projections_keep_the_bits_of_the_separate_products(tiny_bf16, embedded_bf16):
    assert fused_members_match_their_own_products(tiny_bf16.model) > 0
    # the first and last three attention or MLP modules: q, k, v (3) and gate, up (2) alternate
    assert fused_members_match_their_own_products(embedded_bf16.model) == (3 + 2) * 3
    # a member called on another input (or twice) computes its own share again
    member = next(m for m in embedded_bf16.model.modules() if isinstance(m, FusedLinear))
    x = torch.randn(1, 3, member.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(member(x), member(x)) and torch.equal(member(x), member(x.clone()))
        member._group._pending.value = None


def test_a_copied_or_reloaded_fused_layer_uses_its_own_current_weights(tiny_bf16):
    import copy

    layer = copy.deepcopy(tiny_bf16.model.model.layers[0].self_attn)  # as a distilled draft copies layers
    q, k = layer.q_proj, layer.k_proj
    assert isinstance(q, FusedLinear) and q._group is not tiny_bf16.model.model.layers[0].self_attn.q_proj._group
    x = torch.randn(1, 4, q.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        before = k(x)
    with torch.no_grad():
        k.weight.mul_(2)  # loading trained weights writes in place
    with torch.inference_mode():
        assert torch.equal(q(x), torch.nn.functional.linear(x, q.weight)) and torch.equal(k(x), torch.nn.functional.linear(x, k.weight))
        assert not torch.equal(k(x), before)
    assert torch.equal(tiny_bf16.model.model.layers[0].self_attn.k_proj.weight * 2, k.weight)  # the original is untouched
    # a copy that shares the tensors (the packed serving view) keeps the one fused weight
    attn = tiny_bf16.model.model.layers[0].self_attn
    shared = {id(t): t for t in attn.parameters()}
    view = copy.deepcopy(attn, memo=shared)
    with torch.inference_mode():
        assert torch.equal(view.q_proj(x), attn.q_proj(x)) and view.q_proj._group.weight is attn.q_proj._group.weight
    k.weight.requires_grad_(True)  # training: the members run alone, so gradients reach them
    k(x.float().to(torch.bfloat16)).sum().backward()
    assert k.weight.grad is not None


@torch.inference_mode()
def test_float32_products_give_every_row_count_the_same_bits():
    """float32 linears (engine.invariant.product): weight @ x.T over the row counts the probe
    found, so every row of every count 1..40 (plain steps, verifications, trees, prefill blocks)
    gets the bits it gets alone, at any place in the call; the values are F.linear's within
    float32 rounding. The embedded model's shapes (fused q/k/v and gate/up, o, down, LM head)."""
    from engine.invariant import _float32_rows_agree, product

    for out_features, in_features in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        counts = _float32_rows_agree(out_features, in_features)
        if counts is None:
            pytest.skip("this CPU's float32 BLAS has no row counts that agree (transformers' kernels then)")
        assert counts[0] in (2, 4, 8) and counts[-1] >= 4
        gen = torch.Generator().manual_seed(out_features)
        weight = torch.randn(out_features, in_features, generator=gen) * in_features ** -0.5
        bias = torch.randn(out_features, generator=gen)
        x = torch.randn(40, in_features, generator=gen)
        alone = torch.cat([product(x[i:i + 1], weight, bias, None) for i in range(40)])
        for m in (2, 3, 4, 5, 7, 8, 9, 12, 17, 40):
            assert torch.equal(product(x[:m], weight, bias, None), alone[:m]), (out_features, m)
            assert torch.equal(product(x[40 - m:], weight, bias, None), alone[40 - m:]), (out_features, m)  # other places
        assert torch.equal(product(x[None, :5], weight, bias, None)[0], alone[:5])  # (B, T, H) inputs
        torch.testing.assert_close(alone, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_softmax_of_a_row_does_not_depend_on_its_masked_tail_or_its_neighbours(threads):
    """A query's row alone (its keys only) and the same row inside a verification or a prefill
    block (masked keys after it, up to the longest row, many rows in one call)."""
    gen = torch.Generator().manual_seed(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(200):
            n = int(torch.randint(16, 3000, (1,), generator=gen))
            tail = int(torch.randint(1, 300, (1,), generator=gen))
            rows = int(torch.randint(1, 40, (1,), generator=gen))
            scores = torch.randn(rows, n + tail, generator=gen) * 8
            scores[0, n:] = float("-inf")
            alone = invariant_softmax(scores[:1, :n])[0]
            together = invariant_softmax(scores)
            assert torch.equal(together[0, :n], alone) and not together[0, n:].any()
    finally:
        torch.set_num_threads(before)


def test_auto_dtype_follows_the_cpu_and_a_forced_dtype_wins():
    dtype, reason = choose_dtype("auto", "cpu")
    assert dtype in (torch.bfloat16, torch.float32) and "auto" in reason
    assert choose_dtype("float16", "cpu") == (torch.float16, "float16: asked for by the preset or the caller")
    assert choose_dtype("auto", "cuda")[0] is torch.bfloat16


def test_a_bfloat16_cpu_model_is_invariant_and_stock_kernels_are_marked(tiny_target, tiny_bf16):
    assert tiny_bf16.batch_invariant and tiny_bf16.model.config._attn_implementation == "speclab_invariant"
    stock = load_model(tiny_target, dtype="bfloat16", kernels="stock")
    assert not stock.batch_invariant and "stock kernels" in stock.dtype_reason
    assert stock.model is not tiny_bf16.model and stock.model.config._attn_implementation != "speclab_invariant"
    assert not load_model(tiny_target, dtype="float32", kernels="stock").batch_invariant
    # the same weights asked for as "auto" after "bfloat16": one model, each call's own reason
    auto = load_model(tiny_target)
    if auto.dtype is torch.bfloat16:
        assert auto.model is tiny_bf16.model and auto is load_model(tiny_target)
        assert auto.dtype_reason.startswith("bfloat16: auto") and tiny_bf16.dtype_reason.startswith("bfloat16: asked")


# --- logits and KV bitwise, tiny model --------------------------------------------------------

@pytest.mark.parametrize("context", [1, 5, 40])
def test_tiny_verification_of_any_length_equals_plain_steps(tiny_inv, context):
    ids = random_ids(tiny_inv.vocab_size, context + 17, seed=context)
    alone, alone_kv = one_at_a_time(tiny_inv.model, ids, context)
    for t in range(2, 18):  # T = k + 1 for k = 1..16
        together, together_kv = all_at_once(tiny_inv.model, ids[:, :context + t], context)
        assert torch.equal(together, alone[:t]), f"T = {t}"
    assert_same_kv(together_kv, alone_kv)


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_tiny_prefill_chunks_give_bitwise_the_same_cache(tiny_inv, chunk):
    ids = random_ids(tiny_inv.vocab_size, 130, seed=7)
    whole, whole_kv = all_at_once(tiny_inv.model, ids, 1)
    chunked, chunked_kv = all_at_once(tiny_inv.model, ids, 1, chunk)
    assert torch.equal(whole, chunked)
    assert_same_kv(whole_kv, chunked_kv)


def test_16bit_products_past_the_rows_that_agree_run_in_blocks(monkeypatch):
    """Where a 16-bit kernel gives a row the same bits only up to some row count (a Xeon with AMX:
    32 rows; engine.invariant._packed_block_rows and _attention_block_rows find it at load),
    longer calls run in blocks of at most that many rows, a lone last row as two copies. Forced
    to blocks of 4 here, so the path runs on every CPU: each row keeps the bits it gets alone."""
    import engine.invariant as inv

    torch.manual_seed(3)
    linear = InvariantLinear(1536, 96, bias=True, dtype=torch.bfloat16)
    x = torch.randn(9, 1536, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([linear(x[i:i + 1]) for i in range(9)])
        if linear._packed.tensor is None:
            pytest.skip("no row-invariant oneDNN packing on this CPU: 16-bit products take F.linear")
        calls = []
        real = inv._packed_call
        monkeypatch.setattr(inv, "_packed_call", lambda rows, w, bias: calls.append(len(rows)) or real(rows, w, bias))
        linear._packed.rows = 4
        assert torch.equal(linear(x.unsqueeze(0))[0], alone)
        assert calls == [4, 4, 1]
    a = torch.randn(1, 3, 9, 64).to(torch.bfloat16)
    b = torch.randn(1, 3, 64, 130).to(torch.bfloat16)
    pairs = torch.cat([torch.matmul(torch.cat([a[..., i:i + 1, :]] * 2, dim=-2), b)[..., :1, :] for i in range(9)], dim=-2)
    assert torch.equal(inv._matmul_in_blocks(a, b, 4), pairs)


def test_tiny_model_in_forced_blocks_of_four_rows_is_still_invariant(tiny_target, monkeypatch):
    """The tiny bfloat16 target loaded while every 16-bit product and the attention's products
    are held to blocks of 4 rows: a 40-token prefill, in chunks and as plain steps, gives bitwise
    the same logits and cache (the blocks themselves are invariant, not just the kernel)."""
    import engine.invariant as inv

    monkeypatch.setattr(inv, "_PACKABLE", {})
    monkeypatch.setattr(inv, "_ATTENTION_ROWS", {torch.bfloat16: 4})
    real = inv._packed_block_rows
    monkeypatch.setattr(inv, "_packed_block_rows", lambda *a, **k: min(4, real(*a, **k)))
    model = load_model(tiny_target, dtype="bfloat16")
    assert model.batch_invariant
    ids = random_ids(model.vocab_size, 40, seed=5)
    whole, whole_kv = all_at_once(model.model, ids, 1)
    chunked, chunked_kv = all_at_once(model.model, ids, 1, 7)
    assert torch.equal(whole, chunked)
    assert_same_kv(whole_kv, chunked_kv)
    alone, _ = one_at_a_time(model.model, ids, 1)
    assert torch.equal(whole, alone)
    assert {v for v in inv._PACKABLE.values()} <= {0, 4}


@torch.inference_mode()
def tree_matches_paths(target, context_ids: torch.Tensor, parents: tuple[int, ...], nodes: torch.Tensor) -> None:
    """Verify a tree of drafts in one forward; every node's row must be bitwise the row plain
    decoding of its path (root .. node) gives."""
    model = target.model
    cache = _prefilled(model, context_ids[:, :-1], context_ids.shape[1] - 1)
    tree = tree_inputs(parents, cache.get_seq_length(), target.device, target.dtype)
    ids = torch.cat([context_ids[:, -1:], nodes[None]], dim=1)
    rows = model(input_ids=ids, cache=cache, use_cache=True, **tree).logits[0]
    for i in range(len(parents)):
        path, node = [], i
        while node >= 0:
            path.insert(0, int(nodes[node]))
            node = parents[node]
        alone, _ = one_at_a_time(model, torch.cat([context_ids, torch.tensor([path])], dim=1), context_ids.shape[1] - 1)
        assert torch.equal(rows[0], alone[0]) and torch.equal(rows[i + 1], alone[-1]), f"node {i}, path {path}"


def test_tiny_tree_verification_equals_decoding_each_path(tiny_inv):
    parents = (-1, -1, 0, 0, 1, 2, 2, 5)  # two roots, branches, a depth-4 path
    ids = random_ids(tiny_inv.vocab_size, 30, seed=3)
    tree_matches_paths(tiny_inv, ids[:, :22], parents, ids[0, 22:30])


@pytest.mark.parametrize("shared_context", [True, False])
def test_tiny_tree_over_a_long_context_equals_decoding_each_path(tiny_inv, shared_context, monkeypatch):
    """Over SPLIT_FROM keys a tree's rows read the context's keys before the split in one product
    for them all and copy only their last keys (engine.invariant._split_at); where the probe finds
    scores that depend on the call (forced here), each row copies all its keys. Either way every
    row is bitwise its path's plain decoding; the rows fall in two key-count groups (576 and 640
    keys: two split points)."""
    from engine import invariant

    if not shared_context:
        monkeypatch.setitem(invariant._SPLIT_AGREES, tiny_inv.dtype, False)
    copied = []
    rows_of = invariant._rows_of
    monkeypatch.setattr(invariant, "_rows_of", lambda x, shared, tail, width, split, slot: copied.append(
        width - split) or rows_of(x, shared, tail, width, split, slot))
    ids = random_ids(tiny_inv.vocab_size, 582, seed=7)
    tree_matches_paths(tiny_inv, ids[:, :574], (-1, -1, 0, 0, 1, 2, 2, 5), ids[0, 574:582])
    shares = shared_context and invariant._split_agrees(tiny_inv.dtype)
    assert set(copied) == ({2 * invariant.KEY_BLOCK} if shares else {576, 640})


def test_tree_rows_reuse_their_buffer_and_stay_exact(tiny_bf16):
    """A tree's rows are gathered into a buffer kept across layers and steps: a big tree over a
    long context first (the buffer grows and holds its keys), then smaller ones over shorter
    contexts, still bitwise each path's plain decoding; a chain's verification never uses it."""
    from engine import invariant

    ids = random_ids(tiny_bf16.vocab_size, 200, seed=5)
    big = (-1, -1, -1, 0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10)
    tree_matches_paths(tiny_bf16, ids[:, :150], big, ids[0, 150:166])
    buffers = {key: b for key, b in invariant._scratch.buffers.items() if key[1] == tiny_bf16.dtype}  # (float32 tests keep their own)
    assert len(buffers) == 2 and all(b.numel() * b.element_size() <= invariant.SCRATCH_BYTES for b in buffers.values())
    tree_matches_paths(tiny_bf16, ids[:, :40], (-1, 0, 0, 1), ids[0, 40:44])
    tree_matches_paths(tiny_bf16, ids[:, :90], (-1, -1, 0, 2, 3), ids[0, 90:95])
    assert all(invariant._scratch.buffers[key] is b for key, b in buffers.items())  # reused, not reallocated


# --- the embedded model in the engine's dtype -----------------------------------------------------------

COPY = (
    "Fix the typos in this paragraph and return it unchanged otherwise:\n"
    "The quick brown fox jumpd over the lazy dog. The dog was not amused, and the fox ran "
    "away into the forrest, where it met an owl who asked it why it was running."
)


@pytest.mark.embedded
@pytest.mark.parametrize("context", [9, 300, 1020, 1100])  # 1020: rows on both sides of 1,024 keys
def test_embedded_verification_of_k_plus_1_tokens_equals_plain_steps(embedded_inv, context):
    ids = random_ids(embedded_inv.vocab_size, context + 9, seed=context)
    alone, alone_kv = one_at_a_time(embedded_inv.model, ids, context)
    for k in range(1, 9):
        together, together_kv = all_at_once(embedded_inv.model, ids[:, :context + k + 1], context)
        assert torch.equal(together, alone[:k + 1]), f"k = {k}"
    assert_same_kv(together_kv, alone_kv)


@pytest.mark.embedded
def test_the_load_time_check_passes_the_invariant_kernels_and_catches_stock_ones(embedded_bf16):
    """Stock bfloat16 kernels on this CPU are not batch-invariant (the MLP down projection's
    single-row kernel and SDPA reduce in another order): the check at load must see it, or an
    automatic bfloat16 choice could not fall back to float32 where the fix does not hold."""
    assert self_check(embedded_bf16.model)
    stock = load_model("embedded", dtype="bfloat16", kernels="stock")
    assert not self_check(stock.model)
    if cpu_bf16_flags():  # there the stock single-row kernel is one culprit (elsewhere others are; the check sees them)
        assert not row_invariant(stock.model.model.layers[0].mlp.down_proj)


@pytest.mark.embedded
def test_embedded_tree_verification_equals_decoding_each_path(embedded_inv):
    ids = torch.tensor([embedded_inv.encode(COPY)])
    parents = (-1, -1, 0, 0, 2, 4)
    tree_matches_paths(embedded_inv, ids[:, :-6], parents, ids[0, -6:])
    # over 1,021 tokens: the root's row sees 1,021 keys, the deepest node's 1,025 (two key counts)
    ids = random_ids(embedded_inv.vocab_size, 1029, seed=1021)
    tree_matches_paths(embedded_inv, ids[:, :1021], (-1, -1, 0, 0, 1, 2, 2, 5), ids[0, 1021:])


def test_rows_are_grouped_by_the_key_count_plain_decoding_uses():
    """Each row's weighted sum of values runs over its visible keys rounded up to KEY_BLOCK, as
    a plain step at that position does: a row padded to a longer neighbour's key count can get
    other bits (found on the embedded model: a 5-token verification after 1,021 tokens, its first
    row over 1,088 keys, disagreed with the plain step over 1,024)."""
    from engine.invariant import _plan

    plan = _plan(None, 5, 1026, "cpu")  # a chain: rows see 1,022 .. 1,026 keys
    assert [(lo, hi, keys) for lo, hi, keys, _ in plan.blocks] == [(0, 3, 1024), (3, 5, 1026)]
    assert [tuple(bias.shape) for *_, bias in plan.blocks] == [(3, 1024), (2, 1026)]
    assert [hi - lo for lo, hi, _, _ in _plan(None, 600, 600, "cpu").blocks] == [64] * 9 + [24]  # a prefill chunk
    # a tree after 1,020 cached tokens: the root and two children see up to 1,023 keys, deeper
    # nodes 1,024 and 1,025 -> groups padded to 1,024 and 1,088
    parents = (-1, -1, 0, 2, 3)
    mask = tree_inputs(parents, 1020, "cpu", torch.bfloat16)["attention_mask"]
    plan = _plan(mask, 6, 1026, "cpu")
    assert plan.shared == 1021
    assert [(rows.tolist(), bias.shape[-1]) for rows, _, bias in plan.groups] == [([0, 1, 2, 3, 4], 1024), ([5], 1088)]
    rows, tail, bias = plan.groups[1]
    assert tail.tolist() == [[1021, 1023, 1024, 1025]] and int((bias[0] == 0).sum()) == 1025


@pytest.mark.embedded
@pytest.mark.parametrize("chunk", [1, 7, 64, 256])
def test_embedded_prefill_chunks_give_bitwise_the_same_logits_and_cache(embedded_inv, chunk):
    ids = random_ids(embedded_inv.vocab_size, 520 if chunk > 1 else 90, seed=11)
    whole, whole_kv = all_at_once(embedded_inv.model, ids, 1)
    chunked, chunked_kv = all_at_once(embedded_inv.model, ids, 1, chunk)
    assert torch.equal(whole, chunked)
    assert_same_kv(whole_kv, chunked_kv)


@pytest.mark.embedded
def test_embedded_long_prefill_equals_chunks_and_plain_steps(embedded_inv):
    """A 1,300-token prompt in one forward, in chunks of 100, and its rows 1,000..1,039 as plain
    steps: bitwise the same (rows of one forward used to share the longest row's key count)."""
    ids = random_ids(embedded_inv.vocab_size, 1300, seed=11)
    whole, whole_kv = all_at_once(embedded_inv.model, ids, 1)
    chunked, chunked_kv = all_at_once(embedded_inv.model, ids, 1, 100)
    assert torch.equal(whole, chunked)
    assert_same_kv(whole_kv, chunked_kv)
    alone, _ = one_at_a_time(embedded_inv.model, ids[:, :1040], 1000)
    assert torch.equal(whole[999:1039], alone)


@pytest.mark.embedded
@pytest.mark.parametrize("method", ["prompt-lookup", "early-exit", "draft-model", "mtp", "mtp:small"])
def test_embedded_speculative_greedy_is_plain_greedy_in_each_invariant_dtype(embedded_inv, method):
    """The point of invariance: in the fast dtype, every method's greedy output is the plain one."""
    name, _, tree = method.partition(":")
    plain_ids = None
    for prompt in (COPY, "Explain in two sentences why the sky is blue."):
        ids = embedded_inv.encode(prompt)
        plain_ids = tokens_of(generate(embedded_inv, ids, DecodeConfig(max_new_tokens=40)))
        drafter = build_drafter(embedded_inv, DrafterSpec(name, exit_layer=8, tree=tree or None))
        events = list(generate(embedded_inv, ids, DecodeConfig(max_new_tokens=40, k=4, prefill_chunk=16), drafter))
        assert tokens_of(events) == plain_ids, f"{method} on {prompt[:20]!r}"
    assert plain_ids


@torch.inference_mode()
def test_a_left_padded_batch_decodes_as_each_sequence_alone(tiny_bf16):
    """Padding positions see no key at all; they must not turn into NaNs that poison the real
    rows (transformers' batched generate() with left padding, as the training corpus runs it)."""
    model = tiny_bf16.model
    prompts = [[5, 9, 14, 3, 22, 5, 9], [7, 30, 31, 5, 9, 14, 3, 22, 5, 9, 14, 7, 30]]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batched = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=[],
                             pad_token_id=0)[:, width:]
    for p, row in zip(prompts, batched.tolist()):
        alone = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=[], pad_token_id=0)
        assert row == alone[0, len(p):].tolist()


FIRST_FORWARD_AFTER_FLOAT32 = """
import sys, torch
sys.path.insert(0, sys.argv[1])
torch.randn(2, 64) @ torch.randn(96, 64).T  # a float32 product (MKL) before the model's first forward
from engine.models import load_model
target = load_model("embedded")
print(target.dtype, target.batch_invariant)
"""


@pytest.mark.embedded
def test_a_float32_product_before_loading_does_not_fail_the_load_check():
    """The first forward of a process that has run a float32 product does not always get the
    bits later forwards get (a Xeon with AMX: 3 loads in 10 failed the check and fell back to
    float32); self_check warms up first, so each of several fresh processes keeps bfloat16."""
    import subprocess
    import sys
    from pathlib import Path

    if choose_dtype("auto", "cpu")[0] is not torch.bfloat16:
        pytest.skip("this CPU has no fast bfloat16 kernels: auto is float32 anyway")
    root = str(Path(__file__).resolve().parents[1])
    for _ in range(6):
        r = subprocess.run([sys.executable, "-c", FIRST_FORWARD_AFTER_FLOAT32, root], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split()[-2:] == ["torch.bfloat16", "True"], r.stdout
