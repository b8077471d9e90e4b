"""Trained drafter weights: only the new parameters (safetensors, fp16) plus a JSON card; the
parts shared with the target (embedding, final norm, LM head) are taken from the target at load
time, so what ships stays small. Shipped weights live in engine/weights/<name>/."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.errors import InputError

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
WEIGHTS_FILE = "weights.safetensors"
CARD_FILE = "card.json"


def save_weights(folder: Path, tensors: dict[str, torch.Tensor], card: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in tensors.items()}, folder / WEIGHTS_FILE)
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2) + "\n")


def read_card(folder: Path, kind: str) -> dict:
    path = Path(folder) / CARD_FILE
    try:
        card = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InputError(f"no readable weights card at {path} ({err.__class__.__name__})") from None
    if card.get("kind") != kind:
        raise InputError(f"{folder} holds {card.get('kind')!r} weights, not {kind!r}")
    return card


def read_card_for(folder: Path, kind: str, target, what: str) -> dict:
    """The card of `kind` weights in folder, checked to fit this target (a LoadedModel): the
    same hidden size and vocabulary. `what` names the weights in the error ("MTP heads")."""
    card = read_card(folder, kind)
    hidden = target.model.config.get_text_config().hidden_size
    if card["hidden_size"] != hidden or card["vocab_size"] != target.vocab_size:
        raise InputError(
            f"the {what} in {folder} was trained for hidden size {card['hidden_size']} and vocabulary "
            f"{card['vocab_size']}; this model has {hidden} and {target.vocab_size}"
        )
    return card


def load_weights(folder: Path, device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(device, dtype) for k, v in load_file(Path(folder) / WEIGHTS_FILE).items()}


def find_weights(kind: str, target_spec: str) -> Path | None:
    """The shipped weights of this kind trained for this target, if any."""
    for card_path in sorted(WEIGHTS_DIR.glob(f"*/{CARD_FILE}")):
        card = json.loads(card_path.read_text())
        if card.get("kind") == kind and card.get("target") == target_spec:
            return card_path.parent
    return None


def resolve_weights(name: str) -> Path:
    """A weights folder by name (engine/weights/<name>) or path."""
    folder = Path(name)
    if not folder.is_dir():
        folder = WEIGHTS_DIR / name
    if not (folder / CARD_FILE).is_file():
        raise InputError(f"no trained weights named {name!r} (looked in {folder})")
    return folder
