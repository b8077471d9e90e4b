"""The DeepSeek-style MTP module (engine/mtp/module.py), its corpus (engine/train/corpus.py) and
trainer (engine/train/module.py), and the mtp drafter's choice between module and heads.

Tiny random models carry the exactness and trainer tests; the evaluation's acceptance length is
checked against the engine's own decoding with the same module."""

import functools
import itertools
import json

import pytest
import torch

from engine.decoding import DecodeConfig, generate
from engine.drafters import DrafterSpec, build_drafter
from engine.errors import InputError
from engine.models import load_model
from engine.mtp import fast, native
from engine.mtp.module import KIND, build_module, load_module, trained_state
from engine.mtp.weights import CARD_FILE, save_weights
from engine.train.corpus import HELDOUT_EVERY, CorpusConfig, build_corpus, corpus_dir, drawn, load_corpus, read_split
from engine.drafters.prompt_lookup import find_candidates
from engine.drafters.vocab import load_vocabulary
from engine.train.module import ModuleConfig, category, evaluate, train_module, training_vocabulary
from engine.mtp.tree import DynamicTree, order_paths, tree_shape
from engine.sampling import SamplingConfig
from engine.trace import RunInfo, Step, Trace, trace_from_json, trace_to_json
from transformers import DynamicCache

PROMPT = [5, 9, 14, 3, 22, 5, 9, 14, 7, 30, 31, 5, 9]


def tokens_of(events):
    return [t.token_id for e in events if isinstance(e, Step) for t in e.emitted]


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


def module_folder(target, folder, seed=0, scale=0.3, sharpen=1.0, feature_layers=()):
    """A module with random (not identity-like) weights saved as trained weights would be;
    sharpen > 1 scales its output norm, so its distributions are peaked, not near uniform. With
    feature_layers, a random fusion of those layers too."""
    module = build_module(target, 1, feature_layers)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.layers.parameters():
            p.add_(torch.randn_like(p) * scale)
        for layer in module.layers:
            layer.post_norm.weight.mul_(sharpen)
        if module.fusion is not None:
            module.fusion.proj.weight.normal_(0, 0.5)
    card = {"kind": KIND, "target": target.spec, "hidden_size": 32, "vocab_size": target.vocab_size, "layers": 1,
            "feature_layers": list(feature_layers)}
    save_weights(folder, trained_state(module), card)
    return folder


def test_building_a_module_leaves_the_target_alone(target):
    ids = torch.tensor([PROMPT])
    before = target.model(input_ids=ids).logits
    module = build_module(target, 2)
    assert module.embed_tokens is target.model.get_input_embeddings() and module.shared_head is target.model.lm_head
    assert torch.equal(target.model(input_ids=ids).logits, before)
    assert not getattr(target.model.config, "num_mtp_layers", None)  # the target still declares no MTP layers
    last = target.model.model.layers[-1]
    assert torch.equal(module.layers[1].mtp_block.mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert set(trained_state(module)) == {f"layers.{k}" for k in module.layers.state_dict()}


@pytest.mark.parametrize("k", [1, 4])
def test_module_greedy_output_is_plain_greedy(target, tmp_path, k):
    folder = module_folder(target, tmp_path / "module")
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder)))
    assert type(drafter).__name__ == "NativeMTPDrafter"
    cfg = DecodeConfig(max_new_tokens=30, k=k, ignore_eos=True)
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    events = list(generate(target, PROMPT, cfg, drafter))
    assert tokens_of(events) == plain
    assert [e for e in events if isinstance(e, Step)][1].k == k


def test_a_confidence_stop_shortens_chains_and_keeps_greedy_output(target, tmp_path):
    folder = module_folder(target, tmp_path / "module")
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    drafted = {}
    for stop in (0.0, 0.6):
        drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), draft_stop=stop))
        events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
        assert tokens_of(events) == plain
        steps, done = [], 0
        for e in events:  # steps that started with room for k = 4 (the length cuts the last ones)
            if isinstance(e, Step):
                if 0 < e.index and done + 5 <= 30:
                    steps.append(e)
                done += len(e.emitted)
        drafted[stop] = [len(s.draft_probs) for s in steps]
        for s in steps:  # every draft before the last of a chain passed the stop; a short chain ended on a doubt
            assert all(p >= stop for p in s.draft_probs[:-1])
            assert len(s.draft_probs) == 4 or s.draft_probs[-1] < stop
    assert set(drafted[0.0]) == {4}
    assert min(drafted[0.6]) < 4 and sum(drafted[0.6]) / len(drafted[0.6]) < 4 - 0.5  # the stop cut chains short
    with pytest.raises(InputError, match="draft stop"):
        DrafterSpec("mtp", draft_stop=1.0)


@pytest.mark.parametrize("tree", [None, "small"])
def test_lookup_first_copies_where_the_context_repeats_and_the_module_drafts_elsewhere(target, tmp_path, tree):
    """lookup_first = 2: a step whose context ends in an earlier 2- or 3-gram drafts what
    followed it (one-hot, no drafter alternatives), every other step is the module's (a chain
    or a tree); the output is plain greedy decoding either way."""
    from engine.drafters.prompt_lookup import find_candidates

    folder = module_folder(target, tmp_path / "module")
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), lookup_first=2, ngram_max=3, tree=tree))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
    assert tokens_of(events) == plain
    context, copied = list(PROMPT), []
    for e in (e for e in events if isinstance(e, Step)):
        if e.index > 0 and e.k > 0:  # (the last step has no room for drafts)
            copy = find_candidates(context, 4, 3, 2)
            copied.append(bool(copy))
            if copy:
                assert list(e.draft_token_ids) == copy[:len(e.draft_token_ids)] and not e.draft_parents
                assert set(e.draft_probs) <= {1.0} and e.draft_top == () and e.drafter == "prompt-lookup"
            else:
                assert e.draft_top and e.drafter == "mtp" and bool(e.draft_parents) == (tree is not None)
        context += [t.token_id for t in e.emitted]
    assert any(copied) and not all(copied)
    assert (drafter.looked_up, drafter.drafted) == (sum(copied), len(copied) - sum(copied))
    for bad in (-1, 17):
        with pytest.raises(InputError, match="lookup-first"):
            DrafterSpec("mtp", lookup_first=bad)
    with pytest.raises(InputError, match="lookup-first is for drafters that run a model"):
        build_drafter(target, DrafterSpec("prompt-lookup", lookup_first=2))


def test_module_loads_in_the_targets_dtype_and_refuses_another_target(target, tmp_path, tiny_draft):
    folder = module_folder(target, tmp_path / "module")
    bf16 = load_model(target.spec, dtype="bfloat16")
    module, card = load_module(folder, bf16)
    assert card["layers"] == 1 and all(p.dtype == torch.bfloat16 for p in module.layers.parameters())
    assert bf16.model.get_input_embeddings().weight.dtype == torch.bfloat16  # shared parts untouched
    card = json.loads((folder / CARD_FILE).read_text())
    (folder / CARD_FILE).write_text(json.dumps({**card, "hidden_size": 64}))
    with pytest.raises(InputError, match="hidden size 64"):
        load_module(folder, target)


def test_mtp_kind_chooses_module_or_heads(target, tmp_path):
    folder = module_folder(target, tmp_path / "module")
    with pytest.raises(InputError, match="holds 'mtp-module' weights, not mtp-heads"):
        build_drafter(target, DrafterSpec("mtp", draft=str(folder), mtp_kind="heads"))
    with pytest.raises(InputError, match="mtp kind must be one of"):
        build_drafter(target, DrafterSpec("mtp", draft=str(folder), mtp_kind="medusa"))
    with pytest.raises(InputError, match="no MTP module trained"):
        build_drafter(target, DrafterSpec("mtp", mtp_kind="module"))


@pytest.mark.parametrize("tree", ["small", "large", "dynamic-8", "dynamic-16", "dynamic-64"])
def test_module_tree_greedy_output_is_plain_greedy(target, tmp_path, tree):
    folder = module_folder(target, tmp_path / "module")
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), tree=tree))
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
    assert tokens_of(events) == plain
    steps = [e for e in events if isinstance(e, Step)][1:]
    shape = tree_shape(tree)
    assert len(steps[0].draft_parents) == (shape.nodes if isinstance(shape, DynamicTree) else len(shape.paths))
    assert all(max(len(r) for r in s.draft_ranks) <= 4 for s in steps if s.k)
    # a module tree's ranks are in each node's own distribution (no head_top): its trace loads
    info = RunInfo("tiny", "mtp", "mtp", 4, False, 0.0, 0, 1.0, 0, 30, 0, "cpu", "float32", "", tuple(PROMPT))
    trace = Trace(info, (), tuple(e for e in events if isinstance(e, Step)), "max_new_tokens")
    assert trace_from_json(trace_to_json(trace)) == trace


@pytest.mark.parametrize("tree", ["small", "dynamic-8"])
def test_lookup_joins_the_module_tree_as_a_branch(target, tmp_path, tree):
    """lookup_join: every step drafts the module's whole tree, and where prompt lookup finds the
    context's last tokens earlier, its drafts are a path from the root (through the tree's nodes
    where they hold its tokens, new nodes after them); greedy output is plain greedy."""
    folder = module_folder(target, tmp_path / "module")
    spec = DrafterSpec("mtp", draft=str(folder), tree=tree, lookup_first=1, ngram_max=3, lookup_join=True)
    drafter = build_drafter(target, spec)
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
    assert tokens_of(events) == plain
    shape = tree_shape(tree)
    size = shape.nodes if isinstance(shape, DynamicTree) else len(shape.paths)
    steps = [e for e in events if isinstance(e, Step)]
    context, joined = list(PROMPT), 0
    for step in steps:
        if step.index:
            k = min(4, 30 - (len(context) - len(PROMPT)) - 1)
            lookup = find_candidates(context, k, 3, 1)
            assert step.drafter == "mtp" and (k < 4 or len(step.draft_parents) >= size)  # the whole tree
            node = -1
            for token in lookup:  # the lookup's drafts are a path of the step's tree
                node = next(i for i, (p, t) in enumerate(zip(step.draft_parents, step.draft_token_ids))
                            if p == node and t == token)
            joined += len(step.draft_parents) > size
        context += [t.token_id for t in step.emitted]
    assert joined >= 3 and drafter.joined >= joined and drafter.looked_up == 0
    # the same lookups without join replace the tree on those steps
    alone = build_drafter(target, DrafterSpec("mtp", draft=str(folder), tree=tree, lookup_first=1, ngram_max=3))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), alone))
    assert tokens_of(events) == plain and alone.looked_up > 0
    with pytest.raises(InputError, match="lookup join needs lookup-first"):
        DrafterSpec("mtp", tree=tree, lookup_join=True)
    with pytest.raises(InputError, match="lookup join is for a drafter's tree"):
        build_drafter(target, DrafterSpec("mtp", draft=str(folder), lookup_first=2, lookup_join=True))


@torch.inference_mode()
def test_each_tree_node_is_what_its_path_would_draft_from_scratch(tiny_target, tmp_path):
    """A node's token is the rank its path names in the distribution the module gives after that
    path's tokens, computed without any cache over the whole context (float32)."""
    target = load_model(tiny_target, dtype="float32")
    folder = module_folder(target, tmp_path / "module")
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), tree="medium", draft_vocab="full"))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=12, k=3, ignore_eos=True), drafter))
    context = PROMPT + tokens_of(events)
    drafter.observe(context, 0, torch.zeros(0, 32))
    proposal = drafter.propose(context, 3, SamplingConfig(), torch.Generator())
    mtp = drafter.layers.mtp
    below0 = target.model(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    n = len(context) - 2

    def from_scratch(path_tokens):
        """The module's distribution after drafting path_tokens, recomputed from nothing."""
        seq, below = context + path_tokens, below0
        for d in range(1, len(path_tokens) + 2):
            ids = torch.tensor([[seq[i + d] for i in range(n + 1)]])
            below = mtp.forward_layer(0, below[None], torch.arange(d, n + d + 1)[None], DynamicCache(), input_ids=ids)[0]
        return torch.softmax(mtp._project_to_logits(below[-1:][None])[0, -1].float(), -1)

    for path, token in zip(proposal.ranks, proposal.token_ids.tolist()):
        tokens = [int(proposal.token_ids[proposal.ranks.index(path[:j + 1])]) for j in range(len(path) - 1)]
        assert int(torch.topk(from_scratch(tokens), path[-1] + 1).indices[-1]) == token, path


@torch.inference_mode()
def test_a_chain_after_a_long_request_is_what_the_module_drafts_from_scratch(tiny_target, tmp_path, monkeypatch):
    """The module keeps each depth's settled states and cache entries across steps, in buffers
    that grow in place (engine.mtp.native._extend, engine.kv): after a long request (the state
    buffers and the depths' key/value buffers, from 16 rows, have doubled several times) a chain is still, draft by draft, the
    argmax of the module's distribution recomputed without any cache over the whole context."""
    monkeypatch.setattr(native, "MIN_ROWS", 16)
    monkeypatch.setattr(fast, "MIN_ROOM", 16)
    target = load_model(tiny_target, dtype="float32")
    folder = module_folder(target, tmp_path / "module")
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), draft_vocab="full"))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=200, k=3, ignore_eos=True), drafter))
    context = PROMPT + tokens_of(events)
    drafter.observe(context, 0, torch.zeros(0, 32))
    layers = drafter.layers
    assert len(context) > 200 and all(room.shape[0] >= 128 and state.data_ptr() == room.data_ptr()
                                      for room, state in zip(layers._room, layers.states))
    assert layers.fast is not None and all(entries._keys.shape[1] >= 128 for entries in layers.caches)  # (engine.mtp.fast)
    proposal = drafter.propose(context, 3, SamplingConfig(), torch.Generator())
    mtp = layers.mtp
    below0 = target.model(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    n, drafts = len(context) - 2, []
    for depth in range(1, 4):
        seq, below = context + drafts, below0
        for d in range(1, depth + 1):
            ids = torch.tensor([[seq[i + d] for i in range(n + 1)]])
            below = mtp.forward_layer(0, below[None], torch.arange(d, n + d + 1)[None], DynamicCache(), input_ids=ids)[0]
        drafts.append(int(torch.argmax(mtp._project_to_logits(below[-1:][None])[0, -1])))
    assert proposal.token_ids.tolist() == drafts


@torch.inference_mode()
def test_a_dynamic_tree_is_the_likeliest_paths_recomputed_from_scratch(tiny_target, tmp_path):
    """With a beam as wide as the tree, the dynamic tree is exactly the `nodes` paths (3 deep,
    6 ranks per node) whose product of draft probabilities is highest, each probability
    recomputed without any cache from the module's distribution after that path's tokens."""
    target = load_model(tiny_target, dtype="float32")
    folder = module_folder(target, tmp_path / "module", scale=1.0, sharpen=3.0)
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), tree="dynamic-8", draft_vocab="full"))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=12, k=3, ignore_eos=True), drafter))
    context = PROMPT + tokens_of(events)
    drafter.observe(context, 0, torch.zeros(0, 32))
    drafter.tree = DynamicTree("test", nodes=6, beam=6)
    proposal = drafter.propose(context, 3, SamplingConfig(), torch.Generator())
    mtp = drafter.layers.mtp
    below0 = target.model(input_ids=torch.tensor([context[:-1]]), output_hidden_states=True).hidden_states[-1][0]
    n = len(context) - 2

    @functools.cache
    def dist(path_tokens):
        seq, below = context + list(path_tokens), below0
        for d in range(1, len(path_tokens) + 2):
            ids = torch.tensor([[seq[i + d] for i in range(n + 1)]])
            below = mtp.forward_layer(0, below[None], torch.arange(d, n + d + 1)[None], DynamicCache(), input_ids=ids)[0]
        return torch.softmax(mtp._project_to_logits(below[-1:][None])[0, -1].float(), -1)

    chance, token_of = {}, {}
    for depth in (1, 2, 3):
        for path in itertools.product(range(6), repeat=depth):
            tokens = tuple(token_of[path[:j + 1]] for j in range(depth - 1))
            top = torch.topk(dist(tokens), 6)
            token_of[path] = int(top.indices[path[-1]])
            chance[path] = chance.get(path[:-1], 1.0) * float(top.values[path[-1]])
    assert proposal.ranks == order_paths(proposal.ranks) and len(proposal.ranks) == 6
    assert max(map(len, proposal.ranks)) == 3 and len({r[0] for r in proposal.ranks}) > 1  # deep and branching
    assert [token_of[r] for r in proposal.ranks] == proposal.token_ids.tolist()
    chosen = set(proposal.ranks)
    weakest = min(chance[r] for r in chosen)
    assert all(c <= weakest * (1 + 1e-4) for r, c in chance.items() if r not in chosen)
    assert proposal.parents == tuple(proposal.ranks.index(r[:-1]) if len(r) > 1 else -1 for r in proposal.ranks)


# --- the corpus -------------------------------------------------------------------------------

def test_splits_are_disjoint_and_the_draw_extends():
    train, held = read_split("train"), read_split("heldout")
    assert len(train) + len(held) == 14106 and len(held) == -(-14106 // HELDOUT_EVERY)
    assert not {t for _, _, t in train} & {t for _, _, t in held}
    assert drawn("train", 50, 0)[:20] == drawn("train", 20, 0)  # a larger draw extends a smaller one
    assert drawn("self", 30, 0) == read_split("self")[:30]  # appended files: file order, so growing one extends the draw
    spec = read_split("spec-bench")
    assert len(spec) == 240 and not {t for _, _, t in spec} & {t for _, _, t in train}
    with pytest.raises(InputError, match="unknown corpus split"):
        read_split("test")


@torch.inference_mode()
def test_corpus_rows_are_the_targets_own_pass_and_shards_resume(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    cfg = CorpusConfig(prompts=6, max_new_tokens=6, batch_size=4, top_logits=4)
    shards = build_corpus(target, cfg, progress=False)
    seqs = load_corpus(shards)
    assert len(seqs) == 6 and len(shards) == 2
    s = seqs[0]
    assert 0 < s.answer_len <= 6 and s.hidden.shape == (len(s.ids), 32) and s.top_ids.shape == (len(s.ids), 4)
    out = target.model(input_ids=s.ids[None].long(), output_hidden_states=True)
    assert torch.allclose(s.hidden.float(), out.hidden_states[-1][0].float(), atol=0.05)  # (stored in bfloat16)
    assert torch.equal(s.top_ids[:, 0].long(), out.logits[0].argmax(-1))
    # the answer is the target's greedy continuation of the prompt
    plain = tokens_of(generate(target, s.ids[:s.prompt_len].tolist(), DecodeConfig(max_new_tokens=s.answer_len)))
    assert plain == s.ids[s.prompt_len:].tolist()
    stamps = {p: p.stat().st_mtime_ns for p in shards}
    again = build_corpus(target, cfg, progress=False)
    assert again == shards and all(p.stat().st_mtime_ns == stamps[p] for p in shards)  # nothing re-answered
    more = build_corpus(target, CorpusConfig(prompts=10, max_new_tokens=6, batch_size=4, top_logits=4), progress=False)
    assert len(load_corpus(more)) == 10


@torch.inference_mode()
def test_stored_answers_let_a_fresh_machine_skip_generation(target, tmp_path, monkeypatch):
    from engine.train import corpus

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    answers = tmp_path / "answers"
    cfg = CorpusConfig(prompts=6, max_new_tokens=6, batch_size=4, top_logits=4)
    first = load_corpus(build_corpus(target, cfg, progress=False, answers_dir=answers))
    (stored,) = answers.glob("answers-*.jsonl.gz")
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "fresh"))  # no shards: a fresh machine

    def refuse(*args, **kwargs):
        raise AssertionError("answers were generated again")

    monkeypatch.setattr(corpus, "generate_answers", refuse)
    again = load_corpus(build_corpus(target, cfg, progress=False, answers_dir=answers))
    assert [s.key for s in again] == [s.key for s in first]
    assert all(torch.equal(a.ids, b.ids) and torch.equal(a.top_ids, b.top_ids) for a, b in zip(first, again))
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "fresh2"))  # more prompts: a batch with a new one is answered
    with pytest.raises(AssertionError, match="generated again"):
        build_corpus(target, CorpusConfig(prompts=10, max_new_tokens=6, batch_size=4, top_logits=4), progress=False,
                     answers_dir=answers)
    assert stored.stat().st_size > 0
    monkeypatch.undo()  # the real generation again
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "answers-only"))
    assert build_corpus(target, cfg, progress=False, answers_dir=tmp_path / "only", answers_only=True) == []
    assert not (tmp_path / "answers-only").exists()  # no shards
    only = corpus.AnswerStore(tmp_path / "only", target, cfg)
    assert {key: row["answer"] for key, row in only.rows.items()} == {
        s.key: s.ids[s.prompt_len:].tolist() for s in first}
    # a batch answered again (one of its keys missing) adds that answer and keeps the stored ones,
    # which another machine's kernels could answer differently
    (_, batch), *_ = corpus._batches(target, cfg)
    held = {key: row["answer"] for key, row in only.rows.items()}
    del only.rows[batch[0][0]]
    only.put(batch, [[7, 7]] * len(batch))
    reread = corpus.AnswerStore(tmp_path / "only", target, cfg)
    assert reread.rows[batch[0][0]]["answer"] == [7, 7]
    assert all(reread.rows[key]["answer"] == held[key] != [7, 7] for key, _, _ in batch[1:])


@torch.inference_mode()
def test_a_float32_pass_reads_the_answers_written_in_bfloat16(tiny_target, tiny_draft, tmp_path, monkeypatch):
    """On a CPU that emulates bfloat16 the teacher-forced pass runs in float32 over the committed
    bfloat16 answers: the answers are reused, not written again, and the rows are float32's."""
    from engine.train import corpus
    from engine.train.corpus import corpus_models
    from engine.models import cpu_bf16_flags

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    bf16, f32 = load_model(tiny_target, dtype="bfloat16"), load_model(tiny_target, dtype="float32")
    answers = tmp_path / "answers"
    cfg = CorpusConfig(prompts=6, max_new_tokens=6, batch_size=4, top_logits=4)
    written = load_corpus(build_corpus(bf16, cfg, progress=False, answers_dir=answers))
    answered_by = []
    real = corpus.generate_answers
    monkeypatch.setattr(corpus, "generate_answers", lambda model, *a: answered_by.append(model.dtype) or real(model, *a))
    shards = build_corpus(f32, cfg, progress=False, answers_dir=answers, answerer=bf16)
    read = load_corpus(shards)
    assert answered_by == [] and [s.ids.tolist() for s in read] == [s.ids.tolist() for s in written]
    assert shards[0].parent == corpus.corpus_dir(f32, cfg, bf16) != corpus.corpus_dir(f32, cfg)
    info = json.loads((shards[0].parent / "info.json").read_text())
    assert (info["dtype"], info["answer_dtype"]) == ("float32", "bfloat16")
    s = read[0]
    out = f32.model(input_ids=s.ids[None].long(), output_hidden_states=True)
    assert torch.allclose(s.hidden.float(), out.hidden_states[-1][0], atol=0.02)  # float32's rows (stored in bfloat16)
    assert torch.equal(s.top_ids[:, 0].long(), out.logits[0].argmax(-1))
    more = CorpusConfig(prompts=10, max_new_tokens=6, batch_size=4, top_logits=4)
    assert len(load_corpus(build_corpus(f32, more, progress=False, answers_dir=answers, answerer=bf16))) == 10
    assert answered_by and set(answered_by) == {torch.bfloat16}  # a missing answer is written in the answers' dtype
    with pytest.raises(InputError, match="own"):
        build_corpus(f32, cfg, progress=False, answerer=load_model(tiny_draft, dtype="float32"))
    teacher, answerer = corpus_models(tiny_target, "bfloat16")
    assert answerer.dtype == torch.bfloat16 and teacher.dtype == (torch.bfloat16 if cpu_bf16_flags() else torch.float32)
    teacher, answerer = corpus_models(tiny_target, "float32")
    assert teacher is answerer


# --- the trainer --------------------------------------------------------------------------------

@pytest.mark.parametrize("feature_layers", [(), (1, 2)])
def test_evaluated_acceptance_is_what_decoding_with_the_module_accepts(tiny_target, tmp_path, monkeypatch,
                                                                        feature_layers):
    """The trainer's teacher-forced chain acceptance, anchor by anchor, is what the engine's
    decoding with the same module accepts at each step (float32, so both see the same argmax).
    With fused features, the engine hands the module the same layers' hidden states as the
    corpus stored (training and drafting read the same inputs)."""
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    target = load_model(tiny_target, dtype="float32")
    seqs = load_corpus(build_corpus(target, CorpusConfig(prompts=4, max_new_tokens=40, batch_size=4, top_logits=4,
                                                         feature_layers=feature_layers), progress=False))
    out = tmp_path / "module"  # a module fitted to these very answers, so chains get accepted
    train_module(target, seqs, {}, ModuleConfig(depths=3, steps=60, batch_positions=256, lr=3e-3,
                                                feature_layers=feature_layers), out, "test", {}, progress=False)
    module, card = load_module(out, target)
    assert card["feature_layers"] == list(feature_layers)
    if feature_layers:  # the fusion was trained: it changes what depth 1 reads
        assert module.fusion.feature_layers == feature_layers and module.fusion.proj.weight.abs().max() > 1e-3
    vocab = load_vocabulary(out)
    weight = target.model.get_output_embeddings().weight[vocab].float()
    report = evaluate(module, weight, vocab, seqs, 3, min(target.eos_token_ids), autocast=False, per_anchor=True)
    compared = accepted = 0
    for s, per_anchor in zip(seqs, report["per_anchor"]):
        prompt = s.ids[:s.prompt_len].tolist()
        drafter = build_drafter(target, DrafterSpec("mtp", draft=str(out)))  # a drafter per run (it keeps caches)
        events = list(generate(target, prompt, DecodeConfig(max_new_tokens=s.answer_len, k=3), drafter))
        assert tokens_of(events) == s.ids[s.prompt_len:].tolist()
        for step in [e for e in events if isinstance(e, Step)][1:]:
            anchor = step.kv_len_before - 1  # the row whose hidden state chose the context's last token
            if step.k == 3 and anchor + 4 < len(s.ids):  # a whole chain inside the answer
                assert per_anchor[anchor] == step.accepted, (anchor, per_anchor[anchor], step.accepted)
                compared += 1
                accepted += step.accepted
    assert compared >= 5 and accepted > 0  # chains were compared, and some drafts were accepted
    per_category = {}  # the per-category figure is the mean over that category's anchors, + 1
    for s, per_anchor in zip(seqs, report["per_anchor"]):
        per_category.setdefault(category(s.source), []).extend(n for n in per_anchor if n is not None)
    assert report["mean_acceptance_length_k3_by_category"] == {c: round(1 + sum(v) / len(v), 4)
                                                               for c, v in sorted(per_category.items())}


def test_trainer_smoke_on_a_tiny_model(tiny_target, tmp_path, monkeypatch):
    from engine.train.__main__ import main

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "module"
    args = ["mtp-module", "--model", tiny_target, "--prompts", "12", "--self-prompts", "3", "--task-prompts", "2",
            "--heldout", "4", "--spec-bench", "6",
            "--max-new-tokens", "8", "--data-batch", "4", "--steps", "8", "--batch-positions", "256",
            "--depths", "3", "--out", str(out), "--dtype", "float32", "--quiet", "--answers-dir", str(tmp_path / "answers")]
    assert main(args) == 0
    assert len(list((tmp_path / "answers").glob("answers-*.jsonl.gz"))) == 1  # train, heldout, spec-bench: one store
    card = json.loads((out / CARD_FILE).read_text())
    assert card["kind"] == KIND and card["layers"] == 1 and card["training"]["steps"] == 8
    assert set(card["evaluation"]) == {"heldout", "spec_bench"}
    sources = card["data"]["train"]["sources"]
    assert len(card["evaluation"]["spec_bench"]["top1"]) == 3 and card["data"]["train"]["sequences"] == sum(sources.values())
    assert sources["magpie-self"] == 3 and "self_prompts" in card["data"]["prompts_file"]
    assert sources.get("task-summarize", 0) + sources.get("task-passages", 0) == 2
    assert "task_prompts" in card["data"]["prompts_file"]
    assert 0 < card["data"]["eval_spec_bench"]["sequences"] <= 6  # (prompts over 512 tokens are skipped)
    target = load_model(tiny_target)
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=16, ignore_eos=True)))
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(out)))
    assert tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=16, k=3, ignore_eos=True), drafter)) == plain
    shards = [p for split in ("train", "self", "tasks") for p in sorted((tmp_path / "cache").glob(f"train/corpus-*/{split}-*.pt"))]
    assert card["training"]["train_vocabulary"] == len(training_vocabulary(load_corpus(shards), target.vocab_size))
    entry = card["draft_vocabulary"]  # the tiny target has fewer tokens than a drafting vocabulary holds
    assert entry["tokens"] == len(load_vocabulary(out)) == target.vocab_size and entry["heldout_coverage"] == 1
    # a warm start continues from those weights (its evaluation before training is theirs after,
    # up to their float16 storage), and the card lists the run it continued
    again = tmp_path / "module-2"
    warm = args[:args.index("--steps")] + ["--steps", "4"] + args[args.index("--batch-positions"):args.index("--out")]
    warm += ["--out", str(again), "--dtype", "float32", "--quiet", "--answers-dir", str(tmp_path / "answers")]
    assert main(warm + ["--init", str(out)]) == 0
    second = json.loads((again / CARD_FILE).read_text())
    before, trained = second["evaluation_before_training"]["heldout"], card["evaluation"]["heldout"]
    assert all(abs(a - b) < 0.05 for a, b in zip(before["top1"], trained["top1"]))
    assert before != card["evaluation_before_training"]["heldout"]  # not the untrained module
    assert [run["steps_run"] for run in second["training_history"]] == [8] and second["training"]["steps_run"] == 4
    # it draws other batches than the run it continues (same --seed, same corpus)
    assert card["training"]["draw_seed"] == card["training"]["seed"] != second["training"]["draw_seed"]
    assert main(warm + ["--init", "no-such-weights"]) == 2


@torch.inference_mode()
def test_the_corpus_keeps_the_feature_layers_hidden_states(target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    plain = CorpusConfig(prompts=4, max_new_tokens=6, batch_size=4, top_logits=4)
    fused = CorpusConfig(**{**plain.__dict__, "feature_layers": (1, 3)})
    assert corpus_dir(target, fused) != corpus_dir(target, plain)  # other content, other shards
    assert all(s.features is None for s in load_corpus(build_corpus(target, plain, progress=False)))
    for s in load_corpus(build_corpus(target, fused, progress=False)):
        out = target.model(input_ids=s.ids[None].long(), output_hidden_states=True)
        assert s.features.shape == (len(s.ids), 2 * 32) and s.features.dtype == torch.bfloat16
        for n, layer in enumerate((1, 3)):
            assert torch.allclose(s.features[:, 32 * n:32 * (n + 1)].float(), out.hidden_states[layer][0].float(), atol=0.05)


@pytest.mark.parametrize("spec", [{}, {"tree": "dynamic-8"}, {"lookup_first": 2, "ngram_max": 3}, {"draft_stop": 0.3}])
def test_a_module_with_fused_features_keeps_greedy_output(target, tmp_path, spec):
    """A module fusing the target's layers 1 and 3 (random fusion): the drafter asks the engine
    for those layers' states (through lookup first too), and greedy output is plain greedy."""
    folder = module_folder(target, tmp_path / "module", feature_layers=(1, 3))
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder), **spec))
    assert drafter.feature_layers == (1, 3)
    plain = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, ignore_eos=True)))
    events = list(generate(target, PROMPT, DecodeConfig(max_new_tokens=30, k=4, ignore_eos=True), drafter))
    assert tokens_of(events) == plain
    assert sum(len(e.draft_token_ids) for e in events if isinstance(e, Step)) > 10


def test_a_fusion_at_zero_drafts_as_the_module_without_it(target, tmp_path):
    """What a warm start from a module without features begins with: the fusion's projection at
    zero leaves every draft as it was (the depth-1 input is the final hidden state, bitwise)."""
    plain = module_folder(target, tmp_path / "plain")
    module = build_module(target, 1, (1, 2))
    from engine.mtp.module import load_trained

    from engine.mtp.weights import load_weights

    load_trained(module, load_weights(plain, "cpu", torch.float32) | {
        f"fusion.{k}": v for k, v in module.fusion.state_dict().items()})
    card = {"kind": KIND, "target": target.spec, "hidden_size": 32, "vocab_size": target.vocab_size, "layers": 1,
            "feature_layers": [1, 2]}
    save_weights(tmp_path / "zero", trained_state(module), card)
    drafts = []
    for folder in (plain, tmp_path / "zero"):
        drafter = build_drafter(target, DrafterSpec("mtp", draft=str(folder)))
        events = generate(target, PROMPT, DecodeConfig(max_new_tokens=24, k=4, ignore_eos=True), drafter)
        drafts.append([e.draft_token_ids for e in events if isinstance(e, Step)])
    assert drafts[0] == drafts[1] and sum(map(len, drafts[0])) > 10


def test_fused_features_must_agree_between_card_weights_and_target(target, tmp_path):
    folder = module_folder(target, tmp_path / "module", feature_layers=(1, 2))
    card = json.loads((folder / CARD_FILE).read_text())
    (folder / CARD_FILE).write_text(json.dumps({**card, "feature_layers": []}))
    with pytest.raises(InputError, match="disagree on the fused features"):
        load_module(folder, target)
    (folder / CARD_FILE).write_text(json.dumps({**card, "feature_layers": [1, 7]}))
    with pytest.raises(InputError, match=r"feature layers are 0\.\.3"):
        load_module(folder, target)


def test_the_trainer_fuses_feature_layers_from_a_warm_start(tiny_target, tmp_path, monkeypatch, capsys):
    """--feature-layers: the corpus keeps those layers, the module starts from one without them
    (its fusion at zero, so its evaluation before training is that module's), and the card says so."""
    from engine.train.__main__ import main

    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path / "cache"))
    common = ["mtp-module", "--model", tiny_target, "--prompts", "8", "--heldout", "4", "--spec-bench", "0",
              "--max-new-tokens", "8", "--data-batch", "4", "--batch-positions", "256", "--depths", "2",
              "--dtype", "float32", "--quiet", "--answers-dir", str(tmp_path / "answers")]
    assert main(common + ["--steps", "6", "--out", str(tmp_path / "plain")]) == 0
    assert main(common + ["--steps", "6", "--out", str(tmp_path / "fused"), "--feature-layers", "1,2",
                          "--init", str(tmp_path / "plain")]) == 0
    plain = json.loads((tmp_path / "plain" / CARD_FILE).read_text())
    fused = json.loads((tmp_path / "fused" / CARD_FILE).read_text())
    assert fused["feature_layers"] == [1, 2] and plain["feature_layers"] == []
    assert "fused features" in fused["design"] and "fused" not in plain["design"]
    before, trained = fused["evaluation_before_training"]["heldout"], plain["evaluation"]["heldout"]
    assert all(abs(a - b) < 0.05 for a, b in zip(before["top1"], trained["top1"]))
    target = load_model(tiny_target)
    plain_tokens = tokens_of(generate(target, PROMPT, DecodeConfig(max_new_tokens=16, ignore_eos=True)))
    drafter = build_drafter(target, DrafterSpec("mtp", draft=str(tmp_path / "fused")))
    events = generate(target, PROMPT, DecodeConfig(max_new_tokens=16, k=2, ignore_eos=True), drafter)
    assert tokens_of(events) == plain_tokens
    # training it further takes its feature layers by default; other ones cannot continue it
    assert main(common + ["--steps", "2", "--out", str(tmp_path / "further"), "--init", str(tmp_path / "fused")]) == 0
    assert json.loads((tmp_path / "further" / CARD_FILE).read_text())["feature_layers"] == [1, 2]
    capsys.readouterr()
    assert main(common + ["--steps", "2", "--out", str(tmp_path / "other"), "--feature-layers", "1,3",
                          "--init", str(tmp_path / "fused")]) == 2
    assert "fuses feature layers [1, 2]" in capsys.readouterr().err
    assert main(common + ["--steps", "2", "--out", str(tmp_path / "other"), "--feature-layers", "4"]) == 2
    assert "feature layers are 0..3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(common + ["--feature-layers", "2,1"])
    assert "ascending" in capsys.readouterr().err
    # a warm start from weights of another kind is refused with a clear error
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / CARD_FILE).write_text(json.dumps({"kind": "mtp-heads"}))
    assert main(common + ["--steps", "2", "--out", str(tmp_path / "other"), "--init", str(tmp_path / "heads")]) == 2
    assert "holds 'mtp-heads' weights, not 'mtp-module'" in capsys.readouterr().err


def test_a_time_budget_sets_the_number_of_steps(tiny_target, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECLAB_CACHE", str(tmp_path))
    target = load_model(tiny_target, dtype="float32")
    seqs = load_corpus(build_corpus(target, CorpusConfig(prompts=4, max_new_tokens=8, batch_size=4, top_logits=4),
                                    progress=False))
    card = train_module(target, seqs, {}, ModuleConfig(depths=2, steps=10**6, batch_positions=128, minutes=0.02),
                        tmp_path / "module", "test", {}, progress=False)
    assert 5 < card["training"]["steps_run"] < 10**4  # about 1.2 s of steps, not the million asked for


# --- requests the target writes itself (Magpie) ----------------------------------------------

def test_self_prompts_are_sampled_from_the_pre_query_template_and_resume(embedded, tmp_path, monkeypatch):
    from engine.train import self_prompts as sp

    head = embedded.tokenizer.decode(sp.pre_query(embedded))
    assert head.endswith("<|im_start|>user\n") and "<|im_start|>assistant" not in head  # nothing after the user's turn opens
    path = tmp_path / "self.jsonl"
    cfg = sp.SelfPromptConfig(count=2, batch_size=4, max_new_tokens=48, min_words=3)
    info = sp.build_self_prompts(embedded, cfg, path, progress=False)
    rows = sp.read_self_prompts(path)
    assert len(rows) == info["kept"] >= 2 and all(r["source"] == sp.SOURCE for r in rows)
    assert len({r["text"].lower() for r in rows}) == len(rows) and all(r["text"] == r["text"].strip() for r in rows)
    monkeypatch.setattr(sp, "sample_batch", lambda *a: (_ for _ in ()).throw(AssertionError("sampled again")))
    assert sp.build_self_prompts(embedded, cfg, path, progress=False)["kept"] == len(rows)  # enough: nothing sampled
    monkeypatch.undo()
    more = sp.build_self_prompts(embedded, sp.SelfPromptConfig(**{**cfg.__dict__, "count": len(rows) + 1}), path,
                                 progress=False)
    after = sp.read_self_prompts(path)
    assert after[: len(rows)] == rows and more["kept"] == len(after) > len(rows)
    assert min(r["batch"] for r in after[len(rows):]) > max(r["batch"] for r in rows)  # later batches, new seeds
    with pytest.raises(InputError, match="kept after 1 batches"):
        sp.build_self_prompts(embedded, sp.SelfPromptConfig(**{**cfg.__dict__, "count": 100, "max_batches": 1}), path,
                              progress=False)


def test_self_prompts_drop_unfinished_short_duplicate_and_spec_bench_text(tiny_target):
    from engine.bench.prompts import SPEC_BENCH_FILE
    from engine.train import self_prompts as sp

    cfg = sp.SelfPromptConfig()
    grams, train_texts = sp._banned()
    question = json.loads(SPEC_BENCH_FILE.read_text().splitlines()[0])["turns"][0]
    ok = "Could you explain how the tides are caused by the moon and the sun?"
    assert sp.drop_reason(ok, True, cfg, set(), grams) is None
    assert sp.drop_reason(ok, False, cfg, set(), grams) == "unfinished"
    assert sp.drop_reason("Tell me.", True, cfg, set(), grams) == "length"
    assert sp.drop_reason(ok, True, cfg, {ok.lower()}, grams) == "duplicate"
    assert sp.drop_reason("Please answer this: " + question, True, cfg, set(), grams) == "spec-bench overlap"
    with pytest.raises(InputError, match="chat template"):
        sp.pre_query(load_model(tiny_target))  # a model without a chat template has no pre-query text
    # the shipped file obeys the same rules
    rows = sp.read_self_prompts()
    assert len(rows) >= 500 and len({r["text"].lower() for r in rows}) == len(rows)
    assert not any(sp.ngrams(r["text"]) & grams for r in rows)
    assert not any(r["text"].strip().lower() in train_texts for r in rows)
    assert [key for key, _, _ in read_split("self")][:2] == ["self/0", "self/1"]


# --- requests about a text, made from the target's answers -----------------------------------

def test_task_prompts_are_requests_about_the_targets_own_answers():
    from engine.models import load_model
    from engine.train import task_prompts as tp
    from engine.train.corpus import ANSWERS_DIR

    embedded = load_model("embedded", dtype="bfloat16")  # the dtype the committed answers were written in

    texts = tp.answered_texts(embedded, ANSWERS_DIR, tp.SHIPPED_FROM_SELF)
    assert len(tp.answered_texts(embedded, ANSWERS_DIR)) > len(texts)  # later self-written requests are answered too
    assert len(texts) >= 1000 and all(key.startswith("self/") for key, _, _ in texts)  # never held out, never Spec-Bench
    assert all(len(tp._words(text)) >= tp.MIN_WORDS for _, _, text in texts)
    by_key = {key: (request, text) for key, request, text in texts}
    rows = tp.make_task_prompts(texts, 40, seed=3)
    assert rows == tp.make_task_prompts(texts, 40, seed=3) != tp.make_task_prompts(texts, 40, seed=4)
    assert len(rows) == 40 and {r["source"] for r in rows} == {"task-summarize", "task-passages"}
    for r in rows:
        if r["source"] == "task-summarize":
            assert r["text"] == "Summarize: " + by_key[r["from"][0]][1]
        else:
            passages, question = r["text"].rsplit("\n", 1)
            assert passages == " ".join(by_key[key][1] for key in r["from"]) and len(set(r["from"])) == tp.PASSAGES
            assert question.endswith("?") and question in [by_key[key][0] for key in r["from"]]
    # a text sharing a 13-word run with a Spec-Bench question is never made into a request
    from engine.bench.prompts import SPEC_BENCH_FILE

    question = json.loads(SPEC_BENCH_FILE.read_text().splitlines()[0])["turns"][0]
    leaky = [("self/x", "What is it?", question + " " + "word " * 40)] * 3
    assert tp.make_task_prompts(leaky, 5) == []
    with pytest.raises(InputError, match="at least 3 answers"):
        tp.make_task_prompts(texts[:2], 5)
    # the shipped file is what the command makes from the committed answers
    shipped = tp.read_task_prompts()
    assert len(shipped) >= 500 and shipped == tp.make_task_prompts(texts, len(shipped))
    assert [key for key, _, _ in read_split("tasks")][:2] == ["tasks/0", "tasks/1"]
