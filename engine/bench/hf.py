"""transformers' own generate() on the same model and prompts, for the engine-vs-transformers
comparison: plain, assistant_model= (the same draft model), prompt_lookup_num_tokens= and
assistant_early_exit=, each with transformers' own kernels (SDPA attention, plain linears: the
model as a transformers user loads it), in the preset's dtype or a dtype an engine variant sets.

Each variant is configured like its engine counterpart: the same k (constant, no adaptive
schedule and no confidence cut-off, as the engine drafts exactly k), the same n-gram size for
prompt lookup, the same exit layer, the same sampling settings; with ignore_eos no EOS stops it
(eos_token_id=[]), as the engine runs to max_new_tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

from engine.bench.methods import BASELINE, DrafterOptions, base_name, target_settings
from engine.decoding import DecodeConfig
from engine.models import LoadedModel, load_model, resolve_draft


@dataclass(frozen=True)
class HFMethod:
    name: str  # how the row is labelled: "transformers" or "transformers:<argument>"
    engine_method: str  # the engine method it is compared with
    dtype: str = "auto"  # the target's dtype (the preset's unless the engine method sets one)


HF_METHODS = (
    HFMethod("transformers", BASELINE),
    HFMethod("transformers:assistant_model", "draft-model"),
    HFMethod("transformers:prompt_lookup_num_tokens", "prompt-lookup"),
    HFMethod("transformers:assistant_early_exit", "early-exit"),
)


def hf_methods_for(methods: tuple[str, ...]) -> tuple[HFMethod, ...]:
    """The transformers counterparts of the engine methods being benchmarked: plain generate()
    also in each dtype a "baseline:dtype=..." method runs in; other variants have none.

    >>> [m.name for m in hf_methods_for(("baseline", "baseline:dtype=float32", "mtp"))]
    ['transformers', 'transformers:dtype=float32']
    """
    out = [m for m in HF_METHODS if m.engine_method in methods]
    for method in methods:
        dtype = target_settings(method).get("dtype")
        if base_name(method) == BASELINE and dtype:  # (a method has one variant: never kernels too)
            out.append(HFMethod(f"transformers:dtype={dtype}", method, dtype))
    return tuple(out)


def exit_layers(target: LoadedModel, options: DrafterOptions) -> int:
    """The early-exit depth, as engine.drafters.early_exit chooses it."""
    return options.exit_layer or max(1, target.model.config.num_hidden_layers // 4)


def generation_config(method: HFMethod, target: LoadedModel, decode: DecodeConfig,
                      options: DrafterOptions) -> GenerationConfig:
    s = decode.sampling
    fields = dict(max_new_tokens=decode.max_new_tokens, do_sample=not s.greedy, pad_token_id=_pad_id(target))
    if not s.greedy:
        fields |= dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    if decode.ignore_eos:
        fields["eos_token_id"] = []  # None would fall back to the model's EOS
    drafting = dict(num_assistant_tokens=decode.k, num_assistant_tokens_schedule="constant",
                    assistant_confidence_threshold=0.0)
    if method.engine_method == "draft-model":
        fields |= drafting
    elif method.engine_method == "prompt-lookup":
        fields |= dict(prompt_lookup_num_tokens=decode.k, max_matching_ngram_size=options.ngram_max)
    elif method.engine_method == "early-exit":
        fields |= drafting | dict(assistant_early_exit=exit_layers(target, options))
    return GenerationConfig(**fields)


def _pad_id(target: LoadedModel) -> int:
    pad = target.tokenizer.pad_token_id
    return int(pad) if pad is not None else min(target.eos_token_ids, default=0)


def assistant_for(method: HFMethod, target: LoadedModel, options: DrafterOptions) -> torch.nn.Module | None:
    """The draft model for assistant_model= (the one the engine's draft-model method loads)."""
    if method.engine_method != "draft-model":
        return None
    dtype = str(target.dtype).removeprefix("torch.")
    return load_model(resolve_draft(target.spec, options.draft), device=target.device, dtype=dtype).model


@torch.inference_mode()
def hf_generate(target: LoadedModel, prompt_ids: list[int], config: GenerationConfig,
                assistant: torch.nn.Module | None, seed: int) -> tuple[list[int], float]:
    """One generate() call: the new token ids and its wall-clock seconds (from the call to the
    last token, prefill included, as the engine's run clock counts)."""
    ids = torch.tensor([prompt_ids], device=target.device)  # (1, T)
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # assisted generation warns about its own internal settings
    try:
        _sync(target.device)
        begin = time.perf_counter()
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                    assistant_model=assistant)
        _sync(target.device)
        wall = time.perf_counter() - begin
    finally:
        hf_logging.set_verbosity(verbosity)
    return out[0, len(prompt_ids):].tolist(), wall


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
