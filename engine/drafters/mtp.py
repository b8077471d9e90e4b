"""mtp: multi-token prediction, drafting from the target's own final hidden state.

One drafter name, two kinds of MTP module:
- a target whose config declares MTP layers (DeepSeek-V3 style) drafts a chain with them
  (engine/mtp/native.py);
- otherwise trained Medusa-style heads (engine/mtp/heads.py; shipped for the embedded model in
  engine/weights/): every head reads the same hidden state, so one pass proposes all depths.
  Chain drafting takes each head's choice (its argmax, or a draw from its distribution, which is
  then the draft_probs: the standard rule keeps sampling exact even though the heads ignore each
  other's drafts). Tree drafting (--tree SHAPE) proposes the heads' top-k combinations named by
  the shape and is verified in one target forward; it is greedy only, so with sampling the
  drafter drafts the chain instead (exact, never lossy).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.drafters.base import DraftProposal, DrafterSpec, register
from engine.drafters.vocab import TRAINED, DraftVocabulary, check_choice, load_vocabulary
from engine.errors import InputError
from engine.models import LoadedModel
from engine.mtp.heads import KIND, MTPHeads, load_heads
from engine.mtp.native import NativeMTP, has_mtp_layers
from engine.mtp.tree import TreeShape, tree_shape
from engine.mtp.weights import find_weights, resolve_weights
from engine.sampling import SamplingConfig, choose, probs_from_logits
from engine.trace import TOP_N


class MTPHeadsDrafter:
    name = "mtp"

    def __init__(self, target: LoadedModel, heads: MTPHeads, tree: TreeShape | None = None,
                 vocabulary: torch.Tensor | None = None):
        n = len(heads.blocks)
        if tree is not None and tree.depth > n:
            raise InputError(f"tree {tree.name!r} is {tree.depth} deep but there are only {n} MTP heads")
        self.heads = heads.to(target.device, target.dtype)  # they read the target's hidden states
        lm_head = target.model.get_output_embeddings()
        if vocabulary is None:
            self.score = lambda h: lm_head(h).float()
        else:
            self.score = DraftVocabulary(vocabulary, lm_head, target.vocab_size).logits
        self.tree = tree
        self.hidden: torch.Tensor | None = None  # (H,) the last position's final hidden state

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.hidden = hidden[-1]

    @torch.inference_mode()
    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        logits = self.score(self.heads(self.hidden))  # (heads, V)
        probs = probs_from_logits(logits, sampling)  # (heads, V)
        if self.tree is None or not sampling.greedy:
            n = min(k, logits.shape[0])
            ids = [choose(probs[i], logits[i], sampling, float(torch.rand((), generator=rng))) for i in range(n)]
            return DraftProposal(torch.tensor(ids, dtype=torch.long), probs[:n], head_probs=probs[:n])
        paths = self.tree.paths
        # ranked on the same rows, with the same count, as the step record's per-head top candidates
        # (engine.decoding._head_top), so ties rank alike in both
        top = [torch.topk(probs[d], max(TOP_N, self.tree.top_k(d + 1))).indices[:self.tree.top_k(d + 1)].tolist()
               for d in range(self.tree.depth)]
        ids = torch.tensor([top[len(p) - 1][p[-1]] for p in paths], dtype=torch.long)
        node_probs = probs[[len(p) - 1 for p in paths]]  # (nodes, V): each node's head distribution
        return DraftProposal(ids, node_probs, parents=self.tree.parents, head_probs=probs[: self.tree.depth],
                             ranks=paths)


class NativeMTPDrafter:
    name = "mtp"

    def __init__(self, target: LoadedModel):
        self.layers = NativeMTP(target)

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.layers.observe(context, accepted, hidden)

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        ids, probs = self.layers.draft(context, k, sampling, rng)
        return DraftProposal(ids, probs)


@register("mtp")
def _build(target: LoadedModel, spec: DrafterSpec):
    if has_mtp_layers(target):
        if spec.tree:
            raise InputError("tree drafting needs MTP heads; this model's own MTP layers draft a chain")
        return NativeMTPDrafter(target)
    folder = resolve_weights(spec.draft) if spec.draft else find_weights(KIND, target.spec)
    if folder is None:
        raise InputError(
            f"no MTP heads trained for {target.spec!r} and its config declares no MTP layers "
            f"(train heads: python -m engine.train mtp-heads --model {target.spec})"
        )
    heads, _ = load_heads(Path(folder), target)
    vocabulary = load_vocabulary(Path(folder)) if check_choice(spec.draft_vocab) == TRAINED else None
    return MTPHeadsDrafter(target, heads, tree_shape(spec.tree) if spec.tree else None, vocabulary)
