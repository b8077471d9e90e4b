"""Which methods a benchmark or gate runs, and the drafter options each one reads.

A method is "baseline" (plain decoding) or a registered drafter's name, optionally with variant
settings, each after a colon ("mtp:kind=module:tree=dynamic-8"), so variants of a drafter run
side by side in one run:
"mtp:tree=small" (MTP tree drafting with that shape or dynamic tree; plain "mtp" follows --tree) and
"draft-model:vocab=full" / "mtp:vocab=full" (score every token instead of the shipped drafting
vocabulary), "mtp:kind=heads" / "mtp:kind=module" (Medusa-style heads or the DeepSeek-style MTP
module, where "mtp" takes the module for a chain when one is shipped), "mtp:stop=0.3" (also
draft-model, early-exit: a chain ends after a draft whose own probability is below 0.3),
"mtp:lookup=3" (also draft-model, early-exit: prompt lookup first, where the context's last 3
tokens occurred before; the drafter elsewhere), "mtp:tree=dynamic-64:lookup=2:join=on" (the
lookup's drafts join the module's tree as a branch instead of replacing it), "mtp:int8=off" (a
trained module drafts with its 16-bit weights, not their int8 copies), "mtp:draft=FOLDER" (also
draft-model: other trained weights than the shipped ones, say an earlier module beside a
retrained one; a path without colons). Two variants apply to every method and change the target, not the drafter:
"baseline:dtype=float32" (the target loaded in that dtype instead of the preset's) and
"baseline:kernels=stock" (transformers' own SDPA attention and linears instead of the
batch-invariant ones, engine.invariant). Two change the decoding of a method with a drafter:
"mtp:k=3" (this method's draft length instead of --k) and "mtp:fit=on" (each step's draft length
fitted to the machine's verify curve, the method's k at most; engine.draft_length). Methods are checked before any timing starts: an unregistered drafter, an unknown
variant or an unavailable draft model is one clear line naming the method, never a failure
halfway through a run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.decoding import MAX_K
from engine.drafters import DrafterSpec, build_drafter, drafter_names
from engine.drafters.base import LOOKUP_DRAFTERS, check_lookup, check_stop
from engine.drafters.mtp import MTP_KINDS
from engine.drafters.vocab import check_choice
from engine.errors import InputError
from engine.models import LoadedModel

BASELINE = "baseline"


@dataclass(frozen=True)
class DrafterOptions:
    """The per-drafter options of one command line (each drafter reads its own)."""

    draft: str | None = None  # draft-model: the draft model (preset, folder or hub id)
    mtp_heads: str | None = None  # mtp: a folder of trained heads (default: the shipped ones)
    ngram_max: int = 3
    ngram_min: int = 1
    exit_layer: int = 0  # early-exit: layers used (0: a quarter)
    tree: str | None = None  # mtp: tree shape (None: chain)

    def spec(self, method: str) -> DrafterSpec:
        name, variant = split_method(method)
        draft = {"draft-model": self.draft, "mtp": self.mtp_heads}.get(name)
        spec = DrafterSpec(method=name, draft=draft, ngram_max=self.ngram_max, ngram_min=self.ngram_min,
                           exit_layer=self.exit_layer, tree=self.tree)
        return replace(spec, **variant)


VARIANTS = {"tree": ("mtp",), "vocab": ("draft-model", "mtp"), "kind": ("mtp",),
            "stop": ("mtp", "draft-model", "early-exit"), "lookup": LOOKUP_DRAFTERS,
            "draft": ("mtp", "draft-model"), "join": ("mtp",), "int8": ("mtp",)}  # setting -> the drafters that read it
TARGET_VARIANTS = {"dtype": ("float32", "bfloat16", "float16"), "kernels": ("stock",)}  # any method
DECODE_VARIANTS = {"k": tuple(str(k) for k in range(1, MAX_K + 1)), "fit": ("on",)}  # methods with a drafter


def _variants(method: str) -> tuple[str, list[tuple[str, str]]]:
    """(drafter name, [(variant key, value), ...]): settings after the name, each after a colon."""
    name, *parts = method.split(":")
    pairs = []
    for variant in parts:
        key, _, value = variant.partition("=")
        if not (key in TARGET_VARIANTS and value in TARGET_VARIANTS[key]) and not (
                key in DECODE_VARIANTS and value in DECODE_VARIANTS[key] and name != BASELINE) and (
                key not in VARIANTS or not value or name not in VARIANTS[key]):
            settings = "; ".join([f"{k}= for {', '.join(v)}" for k, v in VARIANTS.items()]
                                 + [f"{k}={'|'.join(v)} for any method" for k, v in TARGET_VARIANTS.items()]
                                 + [f"k=1..{MAX_K}, fit=on for any method but {BASELINE}"])
            raise InputError(f"method {method!r}: unknown variant {variant!r} (variants: {settings})")
        if key in dict(pairs):
            raise InputError(f"method {method!r} sets {key} twice")
        pairs.append((key, value))
    return name, pairs


def _setting(method: str, key: str, value: str) -> dict[str, str | float | None]:
    """One drafter variant as DrafterSpec fields."""
    if key == "tree":
        return {"tree": None if value == "chain" else value}
    if key == "vocab":
        return {"draft_vocab": check_choice(value)}
    if key == "kind":
        if value not in MTP_KINDS:
            raise InputError(f"method {method!r}: kind must be one of {', '.join(MTP_KINDS)}")
        return {"mtp_kind": value}
    if key == "stop":
        try:
            return {"draft_stop": check_stop(float(value))}
        except ValueError:
            raise InputError(f"method {method!r}: stop must be a probability in [0, 1)") from None
    if key == "lookup":
        try:
            return {"lookup_first": check_lookup(int(value))}
        except ValueError:
            raise InputError(f"method {method!r}: lookup must be an n-gram length") from None
    if key == "join":
        if value != "on":
            raise InputError(f"method {method!r}: join takes on (the lookup's drafts join the tree)")
        return {"lookup_join": True}
    if key == "int8":
        if value not in ("on", "off"):
            raise InputError(f"method {method!r}: int8 takes on or off (a trained module's drafting weights)")
        return {"draft_int8": value == "on"}
    if key == "draft":
        return {"draft": value}  # built (and a missing folder reported) before the run: check_buildable
    return {}  # a target variant (target_settings) or a decode variant (decode_settings)


def split_method(method: str) -> tuple[str, dict[str, str | None]]:
    """A method's drafter name and its variants as DrafterSpec fields.

    >>> split_method("mtp:tree=small"), split_method("mtp:tree=chain"), split_method("prompt-lookup")
    (('mtp', {'tree': 'small'}), ('mtp', {'tree': None}), ('prompt-lookup', {}))
    >>> split_method("draft-model:vocab=full"), split_method("baseline:dtype=float32")
    (('draft-model', {'draft_vocab': 'full'}), ('baseline', {}))
    >>> split_method("mtp:stop=0.3"), split_method("mtp:kind=module:tree=dynamic-8")
    (('mtp', {'draft_stop': 0.3}), ('mtp', {'mtp_kind': 'module', 'tree': 'dynamic-8'}))
    >>> split_method("mtp:lookup=3:stop=0.4"), split_method("mtp:draft=runs/module-a")
    (('mtp', {'lookup_first': 3, 'draft_stop': 0.4}), ('mtp', {'draft': 'runs/module-a'}))
    >>> split_method("mtp:tree=dynamic-64:lookup=2:join=on")
    ('mtp', {'tree': 'dynamic-64', 'lookup_first': 2, 'lookup_join': True})
    >>> split_method("mtp:int8=off")
    ('mtp', {'draft_int8': False})
    """
    name, pairs = _variants(method)
    fields: dict = {}
    for key, value in pairs:
        fields |= _setting(method, key, value)
    return name, fields


def target_settings(method: str) -> dict[str, str]:
    """The method's target variants as load_model arguments (dtype, kernels).

    >>> target_settings("baseline:dtype=float32"), target_settings("mtp:kernels=stock"), target_settings("mtp")
    ({'dtype': 'float32'}, {'kernels': 'stock'}, {})
    """
    return {key: value for key, value in _variants(method)[1] if key in TARGET_VARIANTS}


def decode_settings(method: str) -> dict[str, int | bool]:
    """The method's decode variants as DecodeConfig fields (k, fit_k).

    >>> decode_settings("mtp:k=3:fit=on"), decode_settings("mtp:stop=0.4")
    ({'k': 3, 'fit_k': True}, {})
    """
    fields = {"k": "k", "fit": "fit_k"}
    return {fields[key]: int(value) if key == "k" else True
            for key, value in _variants(method)[1] if key in DECODE_VARIANTS}


def base_name(method: str) -> str:
    """The drafter a method runs ("mtp" for "mtp:tree=small")."""
    return method.partition(":")[0]


def parse_methods(text: str) -> tuple[str, ...]:
    """Comma-separated method names, baseline first (added when missing: every speedup is
    measured against it in the same run).

    >>> parse_methods("prompt-lookup, baseline")
    ('baseline', 'prompt-lookup')
    """
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names:
        raise InputError("no method given")
    if len(set(names)) != len(names):
        raise InputError(f"a method is named twice in {text!r}")
    for name in names:
        check_registered(name)
        split_method(name)
    return (BASELINE, *[m for m in names if m != BASELINE])


def check_registered(method: str) -> None:
    if base_name(method) != BASELINE and base_name(method) not in drafter_names():
        raise InputError(
            f"method {method!r} is not available: no drafter is registered under that name "
            f"(available: {BASELINE}, {', '.join(drafter_names())})"
        )


def check_buildable(target: LoadedModel, method: str, options: DrafterOptions) -> None:
    """Build the method's drafter once on the loaded target, so a missing draft model or MTP
    heads are reported before anything runs."""
    try:
        build_drafter(target, options.spec(method))
    except InputError as err:
        raise InputError(f"method {method}: {err}") from None
