"""A target's own MTP layers (DeepSeek-V3's design, DeepSeek-AI 2024, section 2.2), used as the
drafter when the target's config declares them (num_mtp_layers / num_nextn_predict_layers).

transformers builds and loads the layers (`MtpModel.from_pretrained(target)`): per layer an
enorm and an hnorm, eh_proj over [enorm(embedding of the next token), hnorm(previous hidden
state)], one decoder block of the target's own kind, and the target's embedding and LM head,
shared. This module drives them with its own cache bookkeeping so drafting fits the loop.

Depth d (1-based) at position i reads h^{d-1}_i (d = 1: the target's final hidden state) and
token x_{i+d}, and predicts x_{i+d+1}; depth d runs MTP layer (d - 1) mod L, so a chain longer
than the L layers reuses them (as vLLM does). Each depth keeps a KV cache over positions. An
entry whose token x_{i+d} is still a draft is transient: dropped after the proposal and
recomputed once the target has decided.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from engine.errors import InputError
from engine.models import LoadedModel
from engine.sampling import SamplingConfig, choose, probs_from_logits


def has_mtp_layers(target: LoadedModel) -> bool:
    return bool(getattr(target.model.config.get_text_config(), "num_mtp_layers", None))


class NativeMTP:
    """The target's MTP layers with per-depth caches, fed the target's hidden states."""

    def __init__(self, target: LoadedModel):
        from transformers.modeling_layers import MtpModel

        try:
            self.mtp = MtpModel.from_pretrained(target.model, device_map={"": target.device})
        except (OSError, ValueError, RuntimeError) as err:
            raise InputError(f"could not load the MTP layers of {target.spec!r}: {str(err).splitlines()[0][:160]}") from err
        self.mtp.eval().requires_grad_(False)
        self.mtp_config = target.model.config.get_mtp_config()
        self.vocab = target.vocab_size
        hidden_size = self.mtp_config.hidden_size
        # states[d]: h^d (rows = positions 0..) where it no longer depends on a draft; states[0]
        # holds the target's final hidden states
        self.states = [torch.zeros(0, hidden_size, device=target.device, dtype=target.dtype)]
        self.caches: list[DynamicCache] = []  # caches[d - 1]: depth d's KV entries, one per state row

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.states[0] = torch.cat([self.states[0], hidden])

    def _add_depth(self) -> None:
        cache = DynamicCache(config=self.mtp_config)
        cache.activate_past_recording()  # sliding-window layers must still allow the crops below
        self.caches.append(cache)
        self.states.append(self.states[0][:0])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.mtp._project_to_logits(hidden[None])[0].float()  # (V',)
        if logits.shape[0] != self.vocab:  # pad/cut to the target's vocabulary
            logits = torch.nn.functional.pad(logits, (0, max(0, self.vocab - logits.shape[0])), value=-1e9)
        return logits[: self.vocab]

    @torch.inference_mode()
    def draft(
        self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k tokens drafted depth by depth: ids (k,) and their draft_probs (k, V)."""
        n = len(context) - 2  # the last position with a target hidden state (it chose context[-1])
        drafts: list[int] = []
        probs = []
        below = self.states[0]  # (n + 1, H): the previous depth's hidden states, positions 0..n
        for d in range(1, k + 1):
            if len(self.caches) < d:
                self._add_depth()
            start = self.states[d].shape[0]  # depth d's settled rows
            seq = context + drafts
            tokens = torch.tensor([[seq[i + d] for i in range(start, n + 1)]], device=below.device)  # (1, q)
            positions = torch.arange(start + d, n + d + 1, device=below.device)[None]  # (1, q)
            out = self.mtp.forward_layer(
                (d - 1) % len(self.mtp.layers), below[start:][None], positions, self.caches[d - 1], input_ids=tokens
            )[0]  # (q, H)
            logits = self._logits(out[-1])
            p = probs_from_logits(logits, sampling)
            drafts.append(choose(p, logits, sampling, float(torch.rand((), generator=rng))))
            probs.append(p)
            settled = len(context) - d - start  # rows whose token x_{i+d} is in the context
            self.states[d] = torch.cat([self.states[d], out[:settled]])
            self.caches[d - 1].crop(settled - out.shape[0])  # drop the transient entries
            below = torch.cat([self.states[d], out[settled:]])
        return torch.tensor(drafts, dtype=torch.long), torch.stack(probs)
