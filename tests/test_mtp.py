"""MTP: tree verification, MTP heads (chain and tree), native MTP layers, the distilled draft
model, the trainers and the shipped weights.

Tiny random models carry the exactness tests (greedy output identical to plain decoding,
sampling distribution exact for chain drafting); the embedded model checks the shipped weights.
"""

import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DynamicCache

from engine import metrics
from engine.acceptance import AcceptRule
from engine.decoding import DecodeConfig, generate, rollback, verify
from engine.drafters import DraftProposal, DrafterSpec, build_drafter
from engine.drafters.draft_model import DraftModelDrafter
from engine.drafters.mtp import MTPHeadsDrafter
from engine.drafters.prompt_lookup import LookupFirst
from engine.drafters.vocab import DraftVocabulary, load_vocabulary
from engine.errors import InputError
from engine.models import load_model, presets
from engine.mtp.heads import MTPHeads
from engine.mtp.tree import (DynamicTree, TreeShape, ancestor_mask, best_paths, greedy_accept_tree, order_paths,
                             parents_of, tree_inputs, tree_shape, tree_shapes)
from engine.mtp.weights import CARD_FILE, WEIGHTS_DIR, WEIGHTS_FILE, find_weights
from engine.sampling import SamplingConfig
from engine.trace import Step, trace_from_json, trace_to_json
from engine.train.prompts import build_prompts, read_prompts
import test_exactness_stats as stats
from tiny import tiny_llama, tiny_tokenizer

PROMPT = [5, 9, 14, 3, 22, 5, 9, 14, 7, 30, 31, 5, 9]


def tokens_of(events):
    return [t.token_id for e in events if isinstance(e, Step) for t in e.emitted]


def steps_of(events):
    return [e for e in events if isinstance(e, Step)][1:]


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


def random_heads(hidden=32, n=4, seed=0, scale=0.5):
    torch.manual_seed(seed)
    heads = MTPHeads(hidden, n)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=scale)
    return heads.eval().requires_grad_(False)


def baseline(target, n=30, prompt=PROMPT):
    return tokens_of(generate(target, prompt, DecodeConfig(max_new_tokens=n, ignore_eos=True)))


# --- tree math ---------------------------------------------------------------------------

def test_tree_mask_positions_and_acceptance_on_a_table():
    parents = (-1, -1, 0, 2)  # two children of the root; a chain 0 -> 2 -> 3
    assert ancestor_mask(parents).int().tolist() == [
        [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    inputs = tree_inputs(parents, past=10, device="cpu", dtype=torch.float32)
    assert inputs["position_ids"].tolist() == [[10, 11, 11, 12, 13]]
    mask = inputs["attention_mask"][0, 0]
    assert mask.shape == (5, 15) and (mask[:, :10] == 0).all() and mask[2, 11] < -1e30 and mask[4, 13] == 0
    logits = torch.eye(6)[[4, 2, 5, 1, 3]] * 5  # the target's argmax per row: 4, 2, 5, 1, 3
    a, path = greedy_accept_tree(torch.tensor([0, 4, 5, 1]), parents, logits)  # root's argmax 4 = draft 1
    assert path == (1,) and a.accepted == 1 and a.next_token == 5 and a.rejected_at is None  # draft 1 is a leaf
    a, path = greedy_accept_tree(torch.tensor([4, 0, 2, 5]), parents, logits)
    assert path == (0, 2) and a.next_token == 1 and a.rejected_at == 2 and a.accept_probs == (1.0, 1.0, 0.0)


def test_shipped_tree_shapes_are_valid():
    shapes = tree_shapes()
    static = [s for s in shapes.values() if isinstance(s, TreeShape)]
    assert static and all(s.paths[0] == (0,) and 1 <= s.depth <= 4 for s in static)
    for s in static:
        assert all(p == -1 or p < i for i, p in enumerate(s.parents))
    dynamic = {s.nodes: s for s in shapes.values() if isinstance(s, DynamicTree)}
    # a dynamic tree beside each static size it is compared with (same verification size)
    assert {len(s.paths) for s in static} <= set(dynamic)
    with pytest.raises(InputError, match="unknown tree"):
        tree_shape("no-such-tree")


@pytest.mark.parametrize("seed", range(5))
def test_best_paths_are_the_likeliest_paths_of_all(seed):
    """best_paths against brute force: of every path through 3 depths x 4 ranks, the n with the
    highest product of probabilities; listed parents first."""
    gen = torch.Generator().manual_seed(seed)
    ranked = [sorted(torch.rand(4, generator=gen).tolist(), reverse=True) for _ in range(3)]
    every = [p for d in (1, 2, 3) for p in itertools.product(range(4), repeat=d)]
    chance = {p: math.prod(ranked[d][r] for d, r in enumerate(p)) for p in every}
    for n in (1, 5, 16, 84):
        got = best_paths(ranked, n)
        assert len(got) == n and sorted(chance[p] for p in got) == sorted(chance.values())[-n:]
        assert parents_of(order_paths(got))  # a tree: every parent listed
    with pytest.raises(ValueError, match="after its parent"):
        parents_of(((0, 0), (0,)))


def test_proposal_within_prunes_a_tree_by_depth():
    p = DraftProposal(torch.tensor([1, 2, 3, 4]), None, parents=(-1, 0, -1, 1), ranks=((0,), (0, 0), (1,), (0, 0, 0)))
    cut = p.within(2)
    assert cut.token_ids.tolist() == [1, 2, 3] and cut.parents == (-1, 0, -1) and cut.ranks == ((0,), (0, 0), (1,))
    assert DraftProposal(torch.tensor([1, 2, 3]), None).within(2).token_ids.tolist() == [1, 2]


def test_tree_kv_keeps_only_the_accepted_path(target):
    """After verifying a tree and keeping a path that is not a prefix, the cache equals the
    cache of feeding the path's tokens alone."""
    cache = DynamicCache()
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([PROMPT[:-1]]), cache=cache)
    parents = (-1, -1, 1, 0, 2)
    drafts = torch.tensor([7, 8, 9, 10, 11])
    verify(target, cache, PROMPT[-1], drafts, parents)
    rollback(cache, drafted=5, accepted=3, tree_path=(1, 2, 4))
    fresh = DynamicCache()
    with torch.inference_mode():
        target.model(input_ids=torch.tensor([PROMPT + [8, 9, 11]]), cache=fresh)
    assert cache.get_seq_length() == fresh.get_seq_length()
    for mine, ref in zip(cache.layers, fresh.layers):
        assert torch.allclose(mine.keys, ref.keys, atol=1e-5) and torch.allclose(mine.values, ref.values, atol=1e-5)


class OracleTreeDrafter:
    """Knows the greedy continuation; hides it in a tree among decoys at a varying rank and
    depth, so deep paths, non-prefix KV compaction and early rejections all happen."""

    name = "oracle-tree"

    def __init__(self, greedy: list[int], prompt_len: int):
        self.greedy, self.prompt_len, self.calls = greedy, prompt_len, 0
        self.observed_rows: list[int] = []

    def observe(self, context, accepted, hidden):
        self.observed_rows.append(hidden.shape[0])

    def propose(self, context, k, sampling, rng):
        self.calls += 1
        done = len(context) - self.prompt_len
        truth = self.greedy[done : done + k]
        wrong_at = self.calls % (k + 1)  # the truth goes wrong at this depth (k+1: never)
        tokens, parents, parent = [], [], -1
        for depth, tok in enumerate(truth):
            decoy = (tok + 1 + self.calls) % 64
            pair = [decoy, tok] if (self.calls + depth) % 2 else [tok, decoy]
            if depth == wrong_at:
                pair = [decoy, (tok + 2) % 64]
            tokens += pair
            parents += [parent, parent]
            parent = len(tokens) - 1 - pair[::-1].index(tok if depth != wrong_at else pair[1])
        return DraftProposal(torch.tensor(tokens), None, parents=tuple(parents))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_tree_verification_is_plain_greedy(target, k):
    greedy = baseline(target, n=40)
    drafter = OracleTreeDrafter(greedy, len(PROMPT))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=40, k=k, ignore_eos=True), drafter))
    assert tokens_of(events) == greedy
    steps = steps_of(events)
    assert max(s.accepted for s in steps) == k and min(s.accepted for s in steps) < k
    assert drafter.observed_rows == [len(PROMPT)] + [len(s.emitted) for s in steps]  # hidden rows per new token
    for s in steps[:-1]:
        assert len(s.accepted_nodes) == s.accepted and s.draft_parents and len(s.draft_parents) == s.k
        assert [s.draft_token_ids[i] for i in s.accepted_nodes] == [t.token_id for t in s.emitted][: s.accepted]
        assert s.kv_len_after == s.kv_len_before + 1 + s.accepted or s is steps[-1]
    # per-position acceptance reads a tree by depth (its k counts 2 nodes a depth here)
    full = [s for s in steps if len(s.draft_parents) == 2 * k]
    rates = metrics.per_position_acceptance(full)
    assert len(rates) == k and rates == [sum(s.accepted > i for s in full) / len(full) for i in range(k)]


# --- MTP heads drafter --------------------------------------------------------------------

@pytest.mark.parametrize("tree", [None, "small", "medium", "dynamic-8"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_mtp_heads_greedy_output_is_plain_greedy(target, tree, k):
    drafter = MTPHeadsDrafter(target, random_heads(), tree_shape(tree) if tree else None)
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=k, ignore_eos=True), drafter))
    assert tokens_of(events) == baseline(target)
    drafting = [s for s in steps_of(events) if s.k]  # (the last step may have no budget to draft)
    for s in drafting:
        depth = max(len(r) for r in s.draft_ranks) if tree else s.k
        assert len(s.head_top) == depth <= k and all(len(h) >= 5 for h in s.head_top)
        if tree:
            assert s.draft_ranks and max(len(r) for r in s.draft_ranks) <= k
            assert all(s.head_top[len(r) - 1][r[-1]].token_id == t for r, t in zip(s.draft_ranks, s.draft_token_ids))
        else:
            assert s.head_top[0][0].token_id == s.draft_token_ids[0] and not s.draft_parents
    assert tree or drafting[0].k == min(k, 4)
    if tree == "dynamic-8":  # this step's likeliest paths under the heads' recorded probabilities
        for s in drafting:
            def chance(r):
                return math.prod(s.head_top[d][i].prob for d, i in enumerate(r))
            chosen = set(s.draft_ranks)
            assert len(chosen) == len(s.draft_ranks) == min(8, sum(4 ** d for d in range(1, min(k, 4) + 1)))
            # the candidates left out that could have come next: a chosen node's next sibling or first child
            left = ({r[:-1] + (r[-1] + 1,) for r in chosen if r[-1] + 1 < 4}
                    | {r + (0,) for r in chosen if len(r) < len(s.head_top)}) - chosen
            assert min(map(chance, chosen)) >= max(map(chance, left), default=0.0) - 1e-6


def test_identity_heads_repeat_the_last_token(target):
    """Untrained heads are the identity: each applies the target's LM head to the very hidden
    state that chose the last token, so every head proposes that token again."""
    drafter = MTPHeadsDrafter(target, MTPHeads(32, 2))
    events = [e for e in generate(target, PROMPT, DecodeConfig(max_new_tokens=20, k=2, ignore_eos=True), drafter)
              if isinstance(e, Step)]
    for before, step in zip(events, events[1:]):
        assert set(step.draft_token_ids) <= {before.emitted[-1].token_id}


def test_tree_with_sampling_drafts_a_chain_and_stays_exact(target):
    drafter = MTPHeadsDrafter(target, random_heads(), tree_shape("medium"))
    cfg = DecodeConfig(max_new_tokens=12, k=3, ignore_eos=True, sampling=SamplingConfig(temperature=1.0, seed=3))
    steps = steps_of(generate(target, PROMPT, cfg, drafter))
    assert all(not s.draft_parents and s.k <= 3 for s in steps)
    typical = DecodeConfig(max_new_tokens=4, k=3, rule=AcceptRule.TYPICAL, ignore_eos=True)
    with pytest.raises(InputError, match="greedily only"):
        list(generate(target, PROMPT, typical, MTPHeadsDrafter(target, random_heads(), tree_shape("small"))))


@pytest.mark.parametrize("vocabulary", [None, "half"])
def test_mtp_chain_sampling_has_the_target_distribution(tmp_path, vocabulary):
    """Heads draft from one hidden state, ignoring each other's drafts; with their
    distributions as draft_probs the standard rule still samples exactly from the target, also
    when they score only part of the vocabulary (draft probabilities 0 elsewhere)."""
    target = load_model(str(tiny_llama(tmp_path / "t", seed=10, layers=2, scale=2.0)))
    p2, p3 = stats.exact_marginals(target, 1.0)
    subset = torch.arange(0, target.vocab_size, 2) if vocabulary else None
    drafter = MTPHeadsDrafter(target, random_heads(seed=4, scale=0.3), vocabulary=subset)
    counts2, counts3 = torch.zeros(64), torch.zeros(64)
    accepted = 0
    for seed in range(2000):
        cfg = DecodeConfig(max_new_tokens=3, k=2, ignore_eos=True, sampling=SamplingConfig(temperature=1.0, seed=seed))
        events = list(generate(target, stats.PROMPT, cfg, drafter))
        out = tokens_of(events)
        accepted += sum(s.accepted for s in steps_of(events))
        counts2[out[1]] += 1
        counts3[out[2]] += 1
    assert accepted > 100  # the heads' drafts are often kept: the test exercises acceptance
    assert stats.chi_square_pvalue(counts2, p2) > stats.ALPHA
    assert stats.chi_square_pvalue(counts3, p3) > stats.ALPHA


# --- drafting vocabulary (engine/drafters/vocab.py) -----------------------------------------

def test_drafting_vocabulary_scores_only_its_tokens(target):
    lm_head = target.model.get_output_embeddings()
    ids = torch.tensor([40, 3, 17, 3, 63])  # unsorted, repeated: kept once each, sorted
    vocab = DraftVocabulary(ids, lm_head, target.vocab_size)
    hidden = torch.randn(2, lm_head.weight.shape[1], dtype=lm_head.weight.dtype)  # the target's hidden states
    logits = vocab.logits(hidden)
    full = lm_head(hidden).float()
    assert len(vocab) == 4 and logits.shape == full.shape
    assert torch.allclose(logits[:, [3, 17, 40, 63]], full[:, [3, 17, 40, 63]], atol=1e-5)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[[3, 17, 40, 63]] = False
    assert torch.isneginf(logits[:, outside]).all()
    with pytest.raises(InputError, match="token ids"):
        DraftVocabulary(torch.tensor([target.vocab_size]), lm_head, target.vocab_size)


def test_a_drafting_vocabulary_is_the_tokens_the_target_emits_most():
    from engine.train.common import drafting_vocabulary, vocabulary_coverage

    answers = [torch.tensor([7, 7, 7, 2, 9]), torch.tensor([9, 7, 4])]
    # 7 four times, 9 twice, then of the tokens seen once the lower id (2 before 4); sorted
    assert drafting_vocabulary(answers, 12, size=3).tolist() == [2, 7, 9]
    assert drafting_vocabulary(answers, 6, size=8).tolist() == list(range(6))  # never past the vocabulary
    # an answer 7 9 5 3 after the prompt 1 5: 7 and 9 are in the subset, 5 only in the context, 3 in neither
    coverage = vocabulary_coverage(torch.tensor([7, 9]), [(torch.tensor([1, 5, 7, 9, 5, 3]), 2)], 12)
    assert coverage == {"heldout_coverage": 0.5, "heldout_coverage_with_context": 0.75}


def test_a_drafting_vocabulary_takes_in_the_requests_own_tokens(target):
    """include(context): the context's tokens outside the subset are scored too (exactly as the
    LM head scores them), each once, looking only at tokens past the previous call."""
    lm_head = target.model.get_output_embeddings()
    vocab = DraftVocabulary(torch.tensor([3, 17]), lm_head, target.vocab_size)
    vocab.include([5, 17, 5, 2])
    assert len(vocab) == 4 and vocab.extra_ids.tolist() == [2, 5]
    vocab.include([5, 17, 5, 2, 9, 3])  # the context grew by 9 and 3 (already scored)
    vocab.include([5, 17, 5, 2, 9, 3])  # nothing new
    assert len(vocab) == 5 and vocab.extra_ids.tolist() == [2, 5, 9]
    hidden = torch.randn(3, lm_head.weight.shape[1], dtype=lm_head.weight.dtype)
    logits, full = vocab.logits(hidden), lm_head(hidden).float()
    scored = [2, 3, 5, 9, 17]
    assert torch.allclose(logits[:, scored], full[:, scored], atol=1e-5)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[scored] = False
    assert torch.isneginf(logits[:, outside]).all() and logits.shape == (3, target.vocab_size)


@pytest.mark.parametrize("tree", [None, "small"])
def test_a_drafting_vocabulary_changes_drafts_never_the_output(target, tiny_draft, tree):
    """Drafters scoring half the vocabulary (and the request's own tokens) only propose those
    tokens; the output is still exactly plain greedy decoding (the target verifies over its whole
    vocabulary)."""
    half = torch.arange(0, target.vocab_size, 2)
    drafters = [MTPHeadsDrafter(target, random_heads(), tree_shape(tree) if tree else None, vocabulary=half)]
    if tree is None:
        drafters.append(DraftModelDrafter(target, load_model(tiny_draft), vocabulary=half))
    for drafter in drafters:
        events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=3, ignore_eos=True), drafter))
        assert tokens_of(events) == baseline(target)
        drafted = [t for s in steps_of(events) for t in s.draft_token_ids]
        own = set(PROMPT) | set(tokens_of(events))
        assert drafted and all(t % 2 == 0 or t in own for t in drafted)
        assert any(t % 2 for t in own) and len(drafter.subset if isinstance(drafter, MTPHeadsDrafter) else drafter.lm.vocabulary) > len(half)  # (odd ones did join)


def test_trace_with_a_tree_round_trips(target):
    drafter = MTPHeadsDrafter(target, random_heads(), tree_shape("small"))
    steps = [e for e in generate(target, PROMPT, DecodeConfig(max_new_tokens=8, ignore_eos=True), drafter)
             if isinstance(e, Step)]
    from engine.trace import RunInfo, Trace

    info = RunInfo("tiny", "mtp", "mtp", 4, False, 0.0, 0, 1.0, 0, 8, 0, "cpu", "float32", "", tuple(PROMPT))
    trace = Trace(info, (), tuple(steps), "max_new_tokens")
    assert trace_from_json(trace_to_json(trace)) == trace


def test_a_heads_tree_with_the_lookup_joined_is_exact_and_round_trips(target):
    """Lookup drafts joined into a heads tree: the output is plain greedy, a step whose tree
    gained nodes records no ranks (a lookup draft has none among the heads' candidates; the
    tree view leaves the step out), the others keep theirs, and the trace loads back."""
    drafter = LookupFirst(MTPHeadsDrafter(target, random_heads(), tree_shape("small")), 1, 3, join=True)
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
    assert tokens_of(events) == baseline(target)
    steps = [e for e in events if isinstance(e, Step)]
    joined = [s for s in steps if len(s.draft_parents) > len(tree_shape("small").paths)]
    assert joined and drafter.joined >= len(joined) and not any(s.draft_ranks for s in joined)
    assert all(s.draft_ranks for s in steps[1:] if s not in joined and s.k)
    from engine.trace import RunInfo, Trace

    info = RunInfo("tiny", "mtp", "mtp", 4, False, 0.0, 0, 1.0, 0, 30, 0, "cpu", "float32", "", tuple(PROMPT))
    trace = Trace(info, (), tuple(steps), "max_new_tokens")
    assert trace_from_json(trace_to_json(trace)) == trace


# --- native MTP layers --------------------------------------------------------------------

@pytest.fixture(scope="module")
def native_target(tmp_path_factory):
    """A tiny Mellum (one of transformers' configs with MTP layers) whose checkpoint holds a
    random MTP layer under the "mtp." prefix, as released checkpoints store it."""
    from transformers import MellumConfig, MellumForCausalLM
    from transformers.modeling_layers import MtpModel

    folder = tmp_path_factory.mktemp("native_mtp")
    torch.manual_seed(0)
    config = MellumConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, layer_types=["full_attention"] * 2,
        mlp_layer_types=["dense"] * 2, num_mtp_layers=1, mtp_layer_types=["full_attention"],
        mtp_mlp_layer_types=["dense"], sliding_window=None, eos_token_id=0, pad_token_id=0,
    )
    model = MellumForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    mtp = MtpModel(model, 1)
    checkpoint = load_file(folder / "model.safetensors")
    checkpoint.update({f"mtp.{k}": v.clone() for k, v in mtp.state_dict().items()
                       if not k.startswith(("embed_tokens", "shared_head"))})
    save_file(checkpoint, folder / "model.safetensors", metadata={"format": "pt"})
    return load_model(str(folder))


@pytest.mark.parametrize("k", [1, 3])
def test_native_mtp_layers_greedy_output_is_plain_greedy(native_target, k):
    drafter = build_drafter(native_target, DrafterSpec("mtp"))
    assert type(drafter).__name__ == "NativeMTPDrafter"
    events = list(generate(native_target, PROMPT, DecodeConfig(max_new_tokens=30, k=k, ignore_eos=True), drafter))
    assert tokens_of(events) == baseline(native_target)
    assert steps_of(events)[0].k == k


@torch.inference_mode()
def test_native_mtp_drafts_equal_a_cache_free_recomputation(native_target):
    """The drafter's per-depth caches (settled rows kept, transient rows recomputed) give the
    same drafts as running the MTP layer over the whole context from scratch."""
    drafter = build_drafter(native_target, DrafterSpec("mtp"))
    events = list(generate(native_target, PROMPT, DecodeConfig(max_new_tokens=20, k=3, ignore_eos=True), drafter))
    context = PROMPT + tokens_of(events)
    drafter.observe(context, 0, torch.zeros(0, 32, dtype=native_target.dtype))  # nothing new: the last step's rows are in already
    mine = drafter.propose(context, 3, SamplingConfig(), torch.Generator()).token_ids.tolist()
    mtp = drafter.layers.mtp
    below = native_target.model(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    drafts: list[int] = []
    for d in (1, 2, 3):
        seq = context + drafts
        n = len(context) - 2
        ids = torch.tensor([[seq[i + d] for i in range(n + 1)]])
        out = mtp.forward_layer(0, below[None], torch.arange(d, n + d + 1)[None], DynamicCache(), input_ids=ids)[0]
        drafts.append(int(mtp._project_to_logits(out[-1:][None])[0, -1].argmax()))
        below = out
    assert mine == drafts


@pytest.mark.parametrize("tree", ["small", "medium", "dynamic-16"])
def test_native_mtp_tree_greedy_output_is_plain_greedy(native_target, tree):
    drafter = build_drafter(native_target, DrafterSpec("mtp", tree=tree))
    events = list(generate(native_target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
    assert tokens_of(events) == baseline(native_target)
    shape = tree_shape(tree)
    assert len(steps_of(events)[0].draft_parents) == (shape.nodes if tree.startswith("dynamic") else len(shape.paths))


def test_mtp_without_heads_or_layers_is_a_clear_error(target):
    with pytest.raises(InputError, match="no MTP module or MTP heads trained"):
        build_drafter(target, DrafterSpec("mtp"))


# --- trainers, the distilled draft model, shipped weights ---------------------------------

def test_prompt_set_is_varied_and_reproducible():
    prompts = read_prompts()
    assert prompts == build_prompts()
    assert len(prompts) >= 300 and len({p["prompt"] for p in prompts}) == len(prompts)
    assert {p["category"] for p in prompts} == {"chat", "code", "lists", "rewriting", "explanations"}
    assert 0.05 < sum(p["split"] == "heldout" for p in prompts) / len(prompts) < 0.2


def _trained_drafters_are_exact(target, folder, tree: str) -> list[int]:
    """Heads in folder/heads (drafting a `tree`) and the draft model in folder/draft give plain
    decoding's greedy tokens, which are returned."""
    plain = baseline(target, n=16)
    for spec in (DrafterSpec("mtp", draft=str(folder / "heads"), tree=tree),
                 DrafterSpec("draft-model", draft=f"distilled:{folder / 'draft'}")):
        drafter = build_drafter(target, spec)
        assert tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=16, k=3, ignore_eos=True), drafter)) == plain
    return plain


def _tiny_set(folder) -> object:
    """A bench prompt set of one raw prompt in the tiny vocabulary (tests/tiny.py)."""
    path = folder / "tiny.yaml"
    path.write_text("name: tiny\nraw: true\nprompts:\n  - id: repeat\n    text: w1 w2 w3 w4 w1 w2 w3 w4\n")
    return path


def test_trainers_smoke_on_a_tiny_model(tiny_target, tmp_path, monkeypatch):
    """Self-distillation, both trainers, their cards, and the drafters built from what they
    wrote: greedy output still identical to plain decoding."""
    from engine.train.__main__ import main

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    common = ["--model", tiny_target, "--limit", "10", "--max-new-tokens", "10", "--data-batch", "5"]
    assert main(["mtp-heads", "--out", str(tmp_path / "heads"), "--steps", "15", "--batch", "32", "--heads", "4", *common]) == 0
    assert main(["draft-model", "--out", str(tmp_path / "draft"), "--steps", "4", "--batch", "2", "--layers", "2", *common]) == 0
    heads_card = json.loads((tmp_path / "heads" / CARD_FILE).read_text())
    draft_card = json.loads((tmp_path / "draft" / CARD_FILE).read_text())
    assert heads_card["heads"] == 4 and len(heads_card["heldout"]["top1"]) == 4 and heads_card["data"]["prompts"] == 10
    assert draft_card["layers"] == 2 and 0 <= draft_card["heldout"]["top1"] <= 1 and draft_card["target"] == tiny_target
    assert heads_card["command"].startswith("python -m engine.train mtp-heads")
    target = load_model(tiny_target)
    plain = _trained_drafters_are_exact(target, tmp_path, "small")
    for folder, card in ((tmp_path / "heads", heads_card), (tmp_path / "draft", draft_card)):
        ids = load_vocabulary(folder)
        entry = card["draft_vocabulary"]
        assert entry["tokens"] == len(ids) and 0 <= entry["heldout_coverage"] <= entry["heldout_coverage_with_context"] <= 1
        assert (ids.diff() > 0).all() and int(ids[-1]) < target.vocab_size
    full = build_drafter(target, DrafterSpec("mtp", draft=str(tmp_path / "heads"), draft_vocab="full"))
    assert tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=16, k=3, ignore_eos=True), full)) == plain
    draft = load_model(f"distilled:{tmp_path / 'draft'}")
    assert draft.model.model.embed_tokens is target.model.model.embed_tokens  # shared, not copied
    assert draft.model.config.num_hidden_layers == 2
    # a folder of distilled weights is a draft model by its card (the CLI's --draft, the bench's
    # draft=FOLDER variant: weights other than the shipped ones side by side)
    from engine.cli import main as engine_main
    from engine.models import resolve_draft

    assert resolve_draft(tiny_target, str(tmp_path / "draft")) == f"distilled:{tmp_path / 'draft'}"
    assert resolve_draft(tiny_target, str(tmp_path / "heads")) == str(tmp_path / "heads")  # not a draft model
    out = tmp_path / "bench"
    methods = f"baseline,draft-model:draft={tmp_path / 'draft'},mtp:draft={tmp_path / 'heads'}"
    assert engine_main(["bench", "--model", tiny_target, "--methods", methods, "--prompts", str(_tiny_set(tmp_path)),
                        "--max-new-tokens", "6", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert rows.keys() == set(methods.split(",")) and all(r["identical_to_baseline"] for r in rows.values())


def test_heads_and_draft_model_train_on_the_modules_corpus(tiny_target, tmp_path, monkeypatch):
    """--corpus N: the heads and the draft model learn from the MTP module's data (real prompts,
    self-written and task requests), answer rows only, within a time budget; still exact."""
    from engine.train.__main__ import main

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    common = ["--model", tiny_target, "--corpus", "6", "--self-prompts", "2", "--task-prompts", "1", "--heldout", "3",
              "--answers-dir", str(tmp_path / "answers")]
    assert main(["mtp-heads", "--out", str(tmp_path / "heads"), "--steps", "1000000",
                 "--minutes", "0.02", "--batch", "16", *common]) == 0
    assert main(["draft-model", "--out", str(tmp_path / "draft"), "--steps", "3", "--batch", "2", "--layers", "1", *common]) == 0
    heads_card = json.loads((tmp_path / "heads" / CARD_FILE).read_text())
    draft_card = json.loads((tmp_path / "draft" / CARD_FILE).read_text())
    for card in (heads_card, draft_card):
        data = card["data"]
        assert data["sources"]["magpie-self"] == 2
        assert data["sources"].get("task-summarize", 0) + data["sources"].get("task-passages", 0) == 1
        assert data["train_sequences"] == 9 and data["heldout_sequences"] == 3 and "task_prompts" in data["prompts_file"]
        assert data["answer_dtype"] == "bfloat16" and data["train_tokens"] > 0
    assert 5 < heads_card["training"]["steps_run"] < 1000000 and draft_card["training"]["steps_run"] == 3
    assert len(list((tmp_path / "answers").glob("answers-*.jsonl.gz"))) == 1  # the module's answer store, shared
    _trained_drafters_are_exact(load_model(tiny_target), tmp_path, "dynamic-8")


@pytest.mark.parametrize("name, kind", [("mtp-heads", "mtp-heads"), ("draft-model", "draft-model"),
                                        ("mtp-module", "mtp-module")])
def test_shipped_weights_match_their_cards(name, kind):
    folder = WEIGHTS_DIR / name
    card = json.loads((folder / CARD_FILE).read_text())
    weights = load_file(folder / WEIGHTS_FILE)
    hidden = card["hidden_size"]
    assert card["kind"] == kind and card["target"] == presets()["embedded"].target
    assert all(t.dtype == torch.float16 for t in weights.values())
    if kind == "mtp-module":
        assert {k.split(".")[1] for k in weights if k.startswith("layers.")} == {str(i) for i in range(card["layers"])}
        assert weights["layers.0.eh_proj.weight"].shape == (hidden, 2 * hidden)
        fused = card.get("feature_layers", [])  # EAGLE-3's fused features: their projection and norms
        assert {k for k in weights if not k.startswith("layers.")} == (
            {"fusion.proj.weight"} | {f"fusion.norms.{i}.weight" for i in range(len(fused))} if fused else set())
        if fused:
            assert weights["fusion.proj.weight"].shape == (hidden, len(fused) * hidden)
        for split in ("heldout", "spec_bench"):
            after, before = card["evaluation"][split], card["evaluation_before_training"][split]
            assert len(after["top1"]) == card["training"]["depths"] and after["top1"][0] > before["top1"][0]
            assert after[f"mean_acceptance_length_k{card['training']['depths']}"] > 1
        assert card["data"]["train"]["answer_positions"] > 100_000 and card["training"]["steps_run"] > 0
        assert find_weights(kind, card["target"]) == folder and len(load_vocabulary(folder)) == card["draft_vocabulary"]["tokens"]
        return
    if kind == "mtp-heads":
        assert set(weights) == {f"blocks.{i}.linear.{p}" for i in range(card["heads"]) for p in ("weight", "bias")}
        assert weights["blocks.0.linear.weight"].shape == (hidden, hidden)
        assert len(card["heldout"]["top1"]) == card["heads"] and card["heldout"]["top1"][0] > card["heldout_untrained_top1"][0]
    else:
        assert {k.split(".")[1] for k in weights if k.startswith("layers.")} == {str(i) for i in range(card["layers"])}
        assert weights["norm.weight"].shape == (hidden,)
        assert card["heldout"]["top1"] > card["heldout_untrained"]["top1"]
    assert card["data"]["train_sequences"] > 250 and card["training"]["steps"] > 0
    vocab = load_vocabulary(folder)  # the drafting vocabulary scored at run time
    assert card["draft_vocabulary"]["tokens"] == len(vocab) and (vocab.diff() > 0).all()
    assert int(vocab[-1]) < card["vocab_size"] and card["draft_vocabulary"]["heldout_coverage_with_context"] > 0.95
    assert find_weights(kind, card["target"]) == folder
    assert sum(f.stat().st_size for f in WEIGHTS_DIR.glob("*/*")) < 60 * 2**20


@pytest.mark.embedded
@pytest.mark.parametrize("spec", [DrafterSpec("mtp"), DrafterSpec("mtp", tree="medium"), DrafterSpec("mtp", mtp_kind="heads"),
                                  DrafterSpec("mtp", mtp_kind="module", tree="small"), DrafterSpec("draft-model"),
                                  DrafterSpec("mtp", mtp_kind="module", tree="dynamic-16", lookup_first=1, lookup_join=True),
                                  DrafterSpec("mtp", tree="medium", lookup_first=1, lookup_join=True),
                                  DrafterSpec("draft-model", draft_vocab="full")])
def test_shipped_drafters_are_exact_on_the_embedded_model(embedded, spec):
    ids = embedded.encode("Explain in two sentences why the sky is blue.")
    plain = tokens_of(generate(embedded, ids, DecodeConfig(max_new_tokens=24)))
    drafter = build_drafter(embedded, spec)
    events = list(generate(embedded, ids, DecodeConfig(max_new_tokens=24, k=4), drafter))
    assert tokens_of(events) == plain
    assert sum(s.accepted for s in steps_of(events)) > 0  # trained drafters do get drafts accepted


@pytest.mark.embedded
@pytest.mark.parametrize("tree", [None, "small", "dynamic-8"])
def test_the_modules_drafts_are_the_same_without_building_masks(embedded, tree):
    """load_module lets the module's depths skip MtpModel's mask building (the batch-invariant
    attention reads no mask as causal): every draft and its probabilities are bitwise what the
    module drafts with the masks built, in a chain, a static tree and a dynamic tree. (Through
    MtpModel.forward_layer, which drives modules engine.mtp.fast does not compute.)"""
    ids = embedded.encode("Write a short poem about the sea, then explain its rhyme scheme.")
    runs = []
    for build_masks in (False, True):
        drafter = build_drafter(embedded, DrafterSpec("mtp", mtp_kind="module", tree=tree))
        drafter.layers.fast = None  # forward_layer's path
        assert "create_masks_for_mtp_layer" in vars(drafter.layers.mtp)  # the skip is in place
        if build_masks:
            del drafter.layers.mtp.create_masks_for_mtp_layer  # MtpModel's own again
        events = list(generate(embedded, ids, DecodeConfig(max_new_tokens=32, k=4), drafter))
        runs.append([(s.draft_token_ids, s.draft_probs, s.draft_top) for s in steps_of(events)])
    assert runs[0] == runs[1] and sum(len(ids) for ids, _, _ in runs[0]) > 20
