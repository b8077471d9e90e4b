"""Tiny random models built by the tests themselves (no downloads): a word-level tokenizer and
Llama-family models small enough to run thousands of steps in seconds."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

WORDS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(62)]  # vocabulary of 64 tokens


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<eos>")


def tiny_llama(folder: Path, seed: int = 0, layers: int = 4, hidden: int = 32, vocab: int = len(WORDS),
               scale: float = 1.0) -> Path:
    """Build, save and return a random Llama with the tiny tokenizer. `scale` multiplies the
    LM head so its next-token distributions are sharper (scale > 1) or flatter."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=0, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder
