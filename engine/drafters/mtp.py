"""mtp: multi-token prediction, drafting from the target's own final hidden state.

One drafter name, three sources of MTP layers, chosen by DrafterSpec.mtp_kind ("auto" takes the
first that exists):
- a target whose config declares MTP layers (DeepSeek-V3 style) drafts with them
  (engine/mtp/native.py);
- a DeepSeek-style MTP module trained here (engine/mtp/module.py, kind "module"): each depth
  reads the previous depth's hidden state AND the token just drafted, through the same driver.
  A module with fused features (EAGLE-3) also reads the target's hidden states after some
  earlier layers at depth 1 (its `feature_layers`; the loop hands them over with the final ones).
  A tree (--tree SHAPE) is one rollout per branch: each node is ranked in the distribution the
  module gives after its own path's tokens (EAGLE-style), all nodes of a depth in one batch; a
  dynamic tree (--tree dynamic-8) is grown at every step from those distributions (EAGLE-2);
- trained Medusa-style heads (engine/mtp/heads.py, kind "heads"): every head reads the same
  hidden state, so one pass proposes all depths, none knowing the others' drafts.
  Chain drafting takes each head's choice (its argmax, or a draw from its distribution, which is
  then the draft_probs: the standard rule keeps sampling exact even though the heads ignore each
  other's drafts). Tree drafting (--tree SHAPE) proposes the heads' top-k combinations named by
  the shape; a dynamic tree, the combinations likeliest under this step's head probabilities.
Trees are verified in one target forward, greedily only, so with sampling every kind drafts the
chain instead (exact, never lossy).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from engine.drafters.base import DraftProposal, DrafterSpec, register
from engine.drafters.vocab import TRAINED, DraftVocabulary, check_choice, load_vocabulary
from engine.errors import InputError
from engine.models import LoadedModel
from engine.mtp.heads import KIND, MTPHeads, load_heads
from engine.mtp.module import KIND as MODULE_KIND
from engine.mtp.module import load_module
from engine.mtp.native import NativeMTP, has_mtp_layers
from engine.mtp.tree import DynamicTree, TreeShape, best_paths, order_paths, parents_of, rank_width, tree_shape
from engine.mtp.weights import CARD_FILE, find_weights, resolve_weights
from engine.sampling import SamplingConfig, choose, probs_from_logits
from engine.trace import TOP_N


class MTPHeadsDrafter:
    name = "mtp"

    def __init__(self, target: LoadedModel, heads: MTPHeads, tree: TreeShape | DynamicTree | None = None,
                 vocabulary: torch.Tensor | None = None):
        n = len(heads.blocks)
        if isinstance(tree, TreeShape) and tree.depth > n:
            raise InputError(f"tree {tree.name!r} is {tree.depth} deep but there are only {n} MTP heads")
        self.heads = heads.to(target.device, target.dtype)  # they read the target's hidden states
        lm_head = target.model.get_output_embeddings()
        self.subset = None if vocabulary is None else DraftVocabulary(vocabulary, lm_head, target.vocab_size)
        self.score = (lambda h: lm_head(h).float()) if vocabulary is None else self.subset.logits
        self.tree = tree
        self.hidden: torch.Tensor | None = None  # (H,) the last position's final hidden state

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.hidden = hidden[-1]
        if self.subset is not None:
            self.subset.include(context)  # the request's own tokens can be drafted

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        logits = self.score(self.heads(self.hidden))  # (heads, V)
        probs = probs_from_logits(logits, sampling)  # (heads, V)
        if self.tree is None or not sampling.greedy:
            n = min(k, logits.shape[0])
            ids = [choose(probs[i], logits[i], sampling, float(torch.rand((), generator=rng))) for i in range(n)]
            return DraftProposal(torch.tensor(ids, dtype=torch.long), probs[:n], head_probs=probs[:n])
        if isinstance(self.tree, DynamicTree):  # this step's likeliest paths under the heads' own probabilities
            ranked = [torch.topk(probs[d], self.tree.beam).values.tolist() for d in range(min(k, probs.shape[0]))]
            paths = order_paths(best_paths(ranked, self.tree.nodes))
        else:
            paths = self.tree.paths
        depth = max(len(p) for p in paths)
        # ranked on the same rows, with the same count, as the step record's per-head top candidates
        # (engine.decoding._head_top), so ties rank alike in both
        top = [torch.topk(probs[d], max(TOP_N, rank_width(paths, d + 1))).indices[:rank_width(paths, d + 1)].tolist()
               for d in range(depth)]
        ids = torch.tensor([top[len(p) - 1][p[-1]] for p in paths], dtype=torch.long)
        node_probs = probs[[len(p) - 1 for p in paths]]  # (nodes, V): each node's head distribution
        return DraftProposal(ids, node_probs, parents=parents_of(paths), head_probs=probs[:depth], ranks=paths)


class NativeMTPDrafter:
    """DeepSeek-style MTP layers: the target's own (module None) or a trained module."""

    name = "mtp"

    def __init__(self, target: LoadedModel, module: torch.nn.Module | None = None,
                 vocabulary: torch.Tensor | None = None, tree: TreeShape | DynamicTree | None = None,
                 stop: float = 0.0, int8: bool = False):
        self.layers = NativeMTP(target, module, vocabulary, int8)
        self.feature_layers = self.layers.feature_layers  # the target layers a fused module reads
        self.tree = tree
        self.stop = stop  # DrafterSpec.draft_stop

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.layers.observe(context, accepted, hidden)

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        if isinstance(self.tree, DynamicTree) and sampling.greedy:
            ids, probs, paths = self.layers.draft_dynamic(context, k, self.tree.nodes, self.tree.beam)
            return DraftProposal(ids, probs, parents=parents_of(paths), ranks=paths)
        if self.tree is not None and sampling.greedy:  # (trees are verified greedily: with sampling, a chain)
            ids, probs = self.layers.draft_tree(context, self.tree.paths)
            return DraftProposal(ids, probs, parents=self.tree.parents, ranks=self.tree.paths)
        ids, probs = self.layers.draft(context, k, sampling, rng, self.stop)
        return DraftProposal(ids, probs)


MTP_KINDS = ("auto", "module", "heads")


def _weights_folder(target: LoadedModel, spec: DrafterSpec) -> tuple[Path, str]:
    """The trained weights this spec asks for and their kind (KIND or MODULE_KIND)."""
    if spec.draft:  # an explicit folder: its card says what it holds
        folder = resolve_weights(spec.draft)
        kind = json.loads((folder / CARD_FILE).read_text()).get("kind")
        wanted = {"module": MODULE_KIND, "heads": KIND}.get(spec.mtp_kind)
        if kind not in (KIND, MODULE_KIND) or (wanted and kind != wanted):
            raise InputError(f"{folder} holds {kind!r} weights, not {wanted or 'MTP heads or an MTP module'}")
        return folder, kind
    # auto: the module for a chain; the heads for a tree while they are shipped (the playground's
    # tree view shows the heads' per-depth candidates; mtp:kind=module drafts module trees)
    kinds = {"module": (MODULE_KIND,), "heads": (KIND,)}.get(spec.mtp_kind) or (
        (KIND, MODULE_KIND) if spec.tree else (MODULE_KIND, KIND))
    for kind in kinds:
        folder = find_weights(kind, target.spec)
        if folder is not None:
            return folder, kind
    what = " or ".join({MODULE_KIND: "MTP module", KIND: "MTP heads"}[k] for k in kinds)
    raise InputError(
        f"no {what} trained for {target.spec!r} and its config declares no MTP layers "
        f"(train: python -m engine.train {'mtp-module' if kinds[0] == MODULE_KIND else 'mtp-heads'} --model {target.spec})"
    )


@register("mtp")
def _build(target: LoadedModel, spec: DrafterSpec):
    if spec.mtp_kind not in MTP_KINDS:
        raise InputError(f"mtp kind must be one of {', '.join(MTP_KINDS)} (got {spec.mtp_kind!r})")
    tree = tree_shape(spec.tree) if spec.tree else None
    if has_mtp_layers(target) and spec.mtp_kind == "auto":
        return NativeMTPDrafter(target, tree=tree, stop=spec.draft_stop)
    folder, kind = _weights_folder(target, spec)
    vocabulary = load_vocabulary(folder) if check_choice(spec.draft_vocab) == TRAINED else None
    if kind == MODULE_KIND:
        module, _ = load_module(folder, target)
        return NativeMTPDrafter(target, module, vocabulary, tree, spec.draft_stop, spec.draft_int8)
    heads, _ = load_heads(folder, target)
    return MTPHeadsDrafter(target, heads, tree, vocabulary)
