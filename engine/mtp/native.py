"""MTP layers of DeepSeek-V3's design (DeepSeek-AI 2024, section 2.2) as a drafter: a target's own
(its config declares num_mtp_layers / num_nextn_predict_layers), or a module trained here for a
target without them (engine/mtp/module.py); both are transformers' MtpModel, driven alike.

transformers builds and loads a target's own layers (`MtpModel.from_pretrained(target)`): per layer an
enorm and an hnorm, eh_proj over [enorm(embedding of the next token), hnorm(previous hidden
state)], one decoder block of the target's own kind, and the target's embedding and LM head,
shared. This module drives them with its own cache bookkeeping so drafting fits the loop. Each
depth runs through MtpModel.forward_layer, or, for layers whose block is a Llama decoder layer
(the modules trained here for Llama-kind targets), through engine/mtp/fast.py, which computes
the same depth without transformers' per-call machinery.

Depth d (1-based) at position i reads h^{d-1}_i (d = 1: the target's final hidden state) and
token x_{i+d}, and predicts x_{i+d+1}; depth d runs MTP layer (d - 1) mod L, so a chain longer
than the L layers reuses them (as vLLM does). Each depth keeps a KV cache over positions. An
entry whose token x_{i+d} is still a draft is transient: dropped after the proposal and
recomputed once the target has decided.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.drafters.vocab import DraftVocabulary
from engine.errors import InputError
from engine.kv import growing_cache
from engine.models import LoadedModel
from engine.mtp import fast
from engine.mtp.tree import order_paths
from engine.sampling import SamplingConfig, choose, probs_from_logits


MIN_ROWS = 256  # rows a depth's state buffer has at least (it doubles when full)


def full_attention(config) -> bool:
    """Every position of these layers attends to all before it: no sliding window, no other
    layer kind."""
    return getattr(config, "sliding_window", None) is None and all(
        kind == "full_attention" for kind in (getattr(config, "layer_types", None) or ()))


def has_mtp_layers(target: LoadedModel) -> bool:
    return bool(getattr(target.model.config.get_text_config(), "num_mtp_layers", None))


class NativeMTP:
    """MTP layers with per-depth caches, fed the target's hidden states: the target's own
    (module None), or a trained module (engine.mtp.module.load_module), optionally scoring only a
    drafting vocabulary (engine/drafters/vocab.py). int8: a trained module's drafting products
    (its block in engine/mtp/fast.py, the vocabulary's head rows) by int8 copies of 16-bit CPU
    weights (engine/drafters/int8.py)."""

    def __init__(self, target: LoadedModel, module: torch.nn.Module | None = None,
                 vocabulary: torch.Tensor | None = None, int8: bool = False):
        if module is None:
            from transformers.modeling_layers import MtpModel

            try:
                module = MtpModel.from_pretrained(target.model, device_map={"": target.device})
            except (OSError, ValueError, RuntimeError) as err:
                raise InputError(f"could not load the MTP layers of {target.spec!r}: {str(err).splitlines()[0][:160]}") from err
            module.eval().requires_grad_(False)
        self.mtp = module
        self.mtp_config = module.config
        # EAGLE-3's fused features (engine.mtp.module.Fusion): the target's hidden states after
        # these layers come beside the final ones (observe) and are fused into depth 1's input
        self.fusion = getattr(module, "fusion", None)
        self.feature_layers = () if self.fusion is None else self.fusion.feature_layers
        # a Llama-kind module's depths computed directly (engine/mtp/fast.py), else forward_layer
        self.fast = fast.FastModule(module, int8) if fast.supported(module) else None
        self._fuse = fast.FastFusion(self.fusion, int8) if self.fast is not None and fast.FastFusion.takes(self.fusion) \
            else self.fusion
        self.vocab = target.vocab_size
        self.subset = None if vocabulary is None else DraftVocabulary(vocabulary, target.model.get_output_embeddings(),
                                                                      target.vocab_size, int8)
        hidden_size = self.mtp_config.hidden_size
        # states[d]: h^d (rows = positions 0..) where it no longer depends on a draft; states[0]
        # holds the target's final hidden states. Each is a view of a buffer with spare room
        # (_room[d]; _extend writes new rows into it), and a depth's cache grows in place when its
        # layers have full attention (engine.kv): a step then copies only its new rows, not
        # every state and cached entry of the request (4 depths x 1,000 positions: ~15 MB a step)
        self.states = [torch.zeros(0, hidden_size, device=target.device, dtype=target.dtype)]
        self._room: list[torch.Tensor | None] = [None]
        self.caches: list[DynamicCache | fast.Entries] = []  # caches[d - 1]: depth d's KV entries, one per state row
        self._grow_in_place = full_attention(self.mtp_config)

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        """hidden (n, H): the target's final hidden states; (n, (1 + F) H) with feature layers."""
        if self.fusion is not None:
            size = self.mtp_config.hidden_size
            hidden = self._fuse(hidden[:, :size], hidden[:, size:])
        self._extend(0, hidden)
        if self.subset is not None:
            self.subset.include(context)  # the request's own tokens can be drafted

    def _add_depth(self) -> None:
        if self.fast is not None:
            cache = fast.Entries()
        elif self._grow_in_place:
            cache = growing_cache()
        else:
            cache = DynamicCache(config=self.mtp_config)
            cache.activate_past_recording()  # sliding-window layers must still allow the crops below
        self.caches.append(cache)
        self.states.append(self.states[0][:0])
        self._room.append(None)

    def _extend(self, d: int, rows: torch.Tensor) -> None:
        """Append rows to states[d], in place in its buffer (which doubles when full)."""
        n, m = self.states[d].shape[0], rows.shape[0]
        room = self._room[d]
        if room is None or n + m > room.shape[0] or room.dtype != rows.dtype:
            room = rows.new_empty(max(MIN_ROWS, 2 * (n + m)), rows.shape[-1])
            room[:n] = self.states[d]
            self._room[d] = room
        room[n:n + m] = rows
        self.states[d] = room[:n + m]

    def _depth(self, d: int, below: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Depth d over rows of one request: below (q, H) = h^{d-1}, tokens and positions (1, q);
        the rows' entries join depth d's cache. Returns h^d (q, H)."""
        layer = (d - 1) % len(self.mtp.layers)
        if self.fast is not None:
            return self.fast.forward_layer(layer, below[None], positions, self.caches[d - 1], tokens)[0]
        return self.mtp.forward_layer(layer, below[None], positions, self.caches[d - 1], input_ids=tokens)[0]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> float32 logits (..., V) over the target's vocabulary."""
        if self.subset is not None:
            return self.subset.logits(hidden)  # (V,), -inf outside the drafting vocabulary
        logits = self.mtp._project_to_logits(hidden[None])[0].float()  # (..., V')
        if logits.shape[-1] != self.vocab:  # pad/cut to the target's vocabulary
            logits = torch.nn.functional.pad(logits, (0, max(0, self.vocab - logits.shape[-1])), value=-1e9)
        return logits[..., : self.vocab]

    @torch.inference_mode()
    def draft(
        self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator, stop: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k tokens drafted depth by depth: ids (k',) and their draft_probs (k', V). With
        stop > 0 the chain ends after a draft whose own probability is below it (each depth
        finishes its bookkeeping first, so a shorter chain leaves the caches as a full one would
        up to its depth)."""
        n = len(context) - 2  # the last position with a target hidden state (it chose context[-1])
        drafts: list[int] = []
        probs = []
        # the previous depth's hidden states at positions 0..n: its settled rows, then the rows
        # that still depend on a draft (none at depth 0)
        settled_below, transient = self.states[0], self.states[0][:0]
        for d in range(1, k + 1):
            if len(self.caches) < d:
                self._add_depth()
            start = self.states[d].shape[0]  # depth d's settled rows
            if start <= settled_below.shape[0]:  # (only the rows from start on are read)
                below = torch.cat([settled_below[start:], transient]) if transient.shape[0] else settled_below[start:]
            else:
                below = transient[start - settled_below.shape[0]:]
            seq = context + drafts
            tokens = torch.tensor([[seq[i + d] for i in range(start, n + 1)]], device=below.device)  # (1, q)
            positions = torch.arange(start + d, n + d + 1, device=below.device)[None]  # (1, q)
            out = self._depth(d, below, positions, tokens)  # (q, H)
            logits = self._logits(out[-1])
            p = probs_from_logits(logits, sampling)
            drafts.append(choose(p, logits, sampling, float(torch.rand((), generator=rng))))
            probs.append(p)
            settled = len(context) - d - start  # rows whose token x_{i+d} is in the context
            self._extend(d, out[:settled])
            self.caches[d - 1].crop(settled - out.shape[0])  # drop the transient entries
            settled_below, transient = self.states[d], out[settled:]
            if float(p[drafts[-1]]) < stop:
                break
        return torch.tensor(drafts, dtype=torch.long), torch.stack(probs)

    def _settle(self, context: list[int], depth: int) -> None:
        """Bring depths 1..depth up to date with the context: every row whose token x_{i+d} is in
        the context is computed once and kept (cache and state)."""
        for d in range(1, depth + 1):
            if len(self.caches) < d:
                self._add_depth()
            start, stop = self.states[d].shape[0], len(context) - d  # rows start..stop-1 settle now
            if stop <= start:
                continue
            below = self.states[d - 1][start:stop]  # (q, H): depth d - 1 has its rows up to stop
            tokens = torch.tensor([context[start + d: stop + d]], device=below.device)
            positions = torch.arange(start + d, stop + d, device=below.device)[None]
            self._extend(d, self._depth(d, below, positions, tokens))

    def _branch_cache(self, d: int, copies: int) -> DynamicCache:
        """Depth d's settled KV entries repeated for `copies` branches (a scratch cache)."""
        scratch = DynamicCache(config=self.mtp_config)
        layer = (d - 1) % len(self.mtp.layers)
        layers = self.caches[d - 1].layers
        kept = layers[layer] if layer < len(layers) else None  # (a growing cache makes its layers at their first write)
        if getattr(kept, "keys", None) is not None and kept.keys.numel():
            scratch.update(kept.keys.expand(copies, -1, -1, -1).contiguous(),
                           kept.values.expand(copies, -1, -1, -1).contiguous(), layer)
        return scratch

    def _branches(self, n: int, d: int, nodes: list[tuple[int, ...]], ids: dict, rows_of: dict) -> dict:
        """Depth d + 1 for tree nodes at depth d, as one batch over copies of that depth's
        settled cache; nothing computed here is kept. A node whose path holds tokens t_1..t_d
        runs rows n-d+1..n with those tokens over the previous depth's rows along the same path:
        the settled row n-d+1 and its parent's own rows (rows_of[parent], depth >= 2). Returns
        node -> (its rows at depth d + 1 (d, H), the distribution it gives its children (V,))."""
        device = self.states[0].device
        tokens = torch.tensor([[ids[q[:j + 1]] for j in range(d)] for q in nodes], device=device)  # (B, d)
        rows = torch.stack([torch.cat([self.states[d][n - d + 1: n - d + 2]] + ([] if d == 1 else [rows_of[q[:-1]]]))
                            for q in nodes])  # (B, d, H)
        positions = torch.arange(n + 2, n + d + 2, device=device)[None].expand(len(nodes), -1)
        if self.fast is not None:  # every branch reads depth d + 1's settled entries where they lie
            out = self.fast.forward_layer(d % len(self.mtp.layers), rows, positions, self.caches[d], tokens, keep=False)
        else:
            out = self.mtp.forward_layer(d % len(self.mtp.layers), rows, positions, self._branch_cache(d + 1, len(nodes)),
                                         input_ids=tokens)  # (B, d, H) at depth d + 1
        probs = torch.softmax(self._logits(out[:, -1]), -1)  # (B, V)
        return {q: (out[b], probs[b]) for b, q in enumerate(nodes)}

    @torch.inference_mode()
    def draft_tree(self, context: list[int], paths: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """A tree of drafts given as paths of ranks (engine/mtp/trees.yaml): node (0, 2) is the
        third likeliest token after the likeliest first draft, each node ranked in its own
        parent's distribution (every branch is its own MTP rollout, EAGLE-style). Greedy.
        All nodes of one depth run as one batch (_branches). Returns ids (nodes,) and each
        node's draft distribution (nodes, V)."""
        n = len(context) - 2
        depth = max(len(p) for p in paths)
        self._settle(context, depth)
        root = self._logits(self.states[1][n])
        ranks_of: dict[tuple[int, ...], list[int]] = {}  # a node's path -> its children's ranks
        for path in paths:
            ranks_of.setdefault(path[:-1], []).append(path[-1])
        # level: path -> (its rows at the next depth (d, H), or None for the root; its children's probs)
        level = {(): (None, torch.softmax(root, -1))}
        ids, probs = {}, {}
        for d in range(1, depth + 1):
            children = []
            for path, (_, p) in level.items():
                ranks = ranks_of.get(path)
                if not ranks:
                    continue
                top = torch.topk(p, max(ranks) + 1).indices.tolist()
                for r in ranks:
                    children.append(path + (r,))
                    ids[path + (r,)], probs[path + (r,)] = top[r], p
            nodes = [q for q in children if q in ranks_of]  # only nodes with children of their own run on
            if d == depth or not nodes:
                break
            level = self._branches(n, d, nodes, ids, {q: rows for q, (rows, _) in level.items()})
        missing = [p for p in paths if p not in ids]
        if missing:
            raise InputError(f"tree path {missing[0]} has no parent in the tree")
        return torch.tensor([ids[p] for p in paths], dtype=torch.long), torch.stack([probs[p] for p in paths])

    @torch.inference_mode()
    def draft_dynamic(self, context: list[int], depth: int, nodes: int, beam: int
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[tuple[int, ...], ...]]:
        """A tree grown from this step's own probabilities (EAGLE-2, Li et al. 2024): a node's
        score is the product of its path's draft probabilities; each depth offers the `beam`
        likeliest tokens after each of the previous depth's `beam` best-scoring nodes, and the
        tree is the `nodes` best-scoring nodes drafted (a child never outscores its parent, so
        they form a tree). A node that cannot enter the tree (`nodes` nodes already outscore it)
        is not expanded. Greedy. Returns ids (nodes,), each node's draft distribution (nodes, V)
        and the nodes' paths of ranks, in tree order (engine.mtp.tree.order_paths)."""
        n = len(context) - 2
        self._settle(context, depth)
        level = {(): (None, torch.softmax(self._logits(self.states[1][n]), -1))}
        score, ids, probs = {(): 1.0}, {}, {}
        frontier = [()]
        for d in range(1, depth + 1):
            for path in frontier:
                p = level[path][1]
                top = torch.topk(p, beam)
                for r, (prob, token) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                    q = path + (r,)
                    score[q], ids[q], probs[q] = score[path] * prob, token, p
            if d == depth:
                break
            ranked = sorted(ids, key=lambda q: (-score[q], len(q), q))
            floor = score[ranked[nodes - 1]] if len(ranked) >= nodes else -1.0  # the tree's weakest so far
            frontier = [q for q in sorted((q for q in ids if len(q) == d), key=lambda q: (-score[q], q))[:beam]
                        if score[q] > floor]
            if not frontier:
                break
            level = self._branches(n, d, frontier, ids, {q: rows for q, (rows, _) in level.items()})
        paths = order_paths(sorted(ids, key=lambda q: (-score[q], len(q), q))[:nodes])
        return (torch.tensor([ids[p] for p in paths], dtype=torch.long), torch.stack([probs[p] for p in paths]), paths)
