"""Typed, frozen records of a run: prefill chunks and target steps, and the trace holding them.

Everything shown or reported (the UI, the CLI JSON, metrics, benchmarks) is derived from these
records. A trace serialises to JSON and loads back for replay without a model; loading checks
types, sizes and finiteness, because trace files come from users.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from engine.acceptance import TokenKind
from engine.errors import InputError

TRACE_VERSION = 1
MAX_TRACE_BYTES = 20_000_000  # a trace upload larger than this is refused before parsing
MAX_ITEMS = 200_000  # no list inside a trace may be longer
MAX_DEPTH = 12  # JSON nesting deeper than the schema can ever be is refused
MAX_OUTPUT_TOKENS = 4096  # no run emits more (engine.decoding.MAX_NEW_TOKENS is this)
MAX_STEP_DRAFTS = 256  # no step of a trace drafts more (chains draft <= 16, the largest shipped tree 64)
MAX_TOKEN_BYTES = 128  # no token's raw_bytes is longer (SmolLM2's longest token is 81 bytes)
TOP_N = 5  # alternatives kept per emitted token (and per MTP head)
MAX_CURVE_POINTS = 64  # a verify curve (RunInfo.verify_ms) measures T = 1..17
STOP_REASONS = ("eos", "max_new_tokens", "context", "stopped")  # "context": the model's context is full


def depths(parents: tuple[int, ...]) -> list[int]:
    """Depth of each draft of a tree given by its parents (Step.draft_parents; a child of the
    root, the last context token, has depth 1). engine.mtp.tree builds and verifies trees.

    >>> depths((-1, 0, -1, 2, 1))
    [1, 2, 1, 2, 3]
    """
    out: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft {i} has parent {p}: parents must come before their children")
        out.append(1 if p < 0 else out[p] + 1)
    return out


@dataclass(frozen=True)
class TopToken:
    token_id: int
    text: str
    prob: float


@dataclass(frozen=True)
class EmittedToken:
    token_id: int
    text: str
    kind: TokenKind
    prob: float  # the target's probability of this token where it was emitted
    top: tuple[TopToken, ...]  # the target's top-5 there (the alternatives)
    special: bool = False  # a control token (<|im_end|>, ...), not text
    # the token's bytes when they are not whole UTF-8 on their own: a byte-level tokenizer splits
    # some characters (an emoji, most CJK) over 2-4 tokens, and `text` of each piece is then U+FFFD.
    # Empty when `text` is exact (and in traces saved before this field existed).
    raw_bytes: tuple[int, ...] = ()

    @property
    def utf8(self) -> bytes:
        """The token's bytes; consecutive tokens' bytes joined decode to their text as a whole.
        (A lone surrogate, which only a hand-made trace holds, passes through and decodes as U+FFFD.)"""
        return bytes(self.raw_bytes) if self.raw_bytes else self.text.encode("utf-8", "surrogatepass")


def decode_tokens(tokens: Iterable[EmittedToken], special: bool = True) -> str:
    """Output tokens' text decoded as a whole, so characters split over byte tokens come out
    whole (`special`: keep the control tokens' text).

    >>> from engine.acceptance import TokenKind
    >>> pieces = [EmittedToken(1, "\ufffd", TokenKind.BONUS, 1.0, (), raw_bytes=(0xE2,)),
    ...           EmittedToken(2, "\ufffd", TokenKind.BONUS, 1.0, (), raw_bytes=(0x9C, 0x93))]
    >>> decode_tokens(pieces + [EmittedToken(3, "<|im_end|>", TokenKind.BONUS, 1.0, (), special=True)], special=False)
    '✓'
    """
    return b"".join(t.utf8 for t in tokens if special or not t.special).decode("utf-8", "replace")


@dataclass(frozen=True)
class PrefillChunk:
    index: int
    start: int  # prompt token range [start, end)
    end: int
    start_s: float  # since the request started
    duration_s: float


@dataclass(frozen=True)
class Step:
    """One target forward. Step 0 is the prefill's first token (k = 0, drafter "prefill")."""

    index: int
    drafter: str
    k: int  # draft length used in this step
    draft_token_ids: tuple[int, ...]
    draft_texts: tuple[str, ...]
    draft_probs: tuple[float, ...]  # drafter's probability of each drafted token (1.0: one-hot)
    target_probs: tuple[float, ...]  # target's probability of each drafted token
    accept_probs: tuple[float, ...]  # min(1, target/draft) per examined drafted token
    accept_uniforms: tuple[float, ...]  # the draws compared with accept_probs (sampling only)
    sample_uniform: float | None  # the draw for the recovered/bonus token (sampling only)
    accepted: int
    emitted: tuple[EmittedToken, ...]  # accepted..., then the recovered or bonus token
    residual_top: tuple[TopToken, ...]  # norm(max(0, target - draft)) top entries at a rejection
    draft_top: tuple[tuple[TopToken, ...], ...]  # drafter's alternatives per drafted position
    kv_len_before: int  # target KV cache length before the verify forward
    kv_len_after: int  # and after the rollback to the accepted length
    draft_s: float
    verify_s: float
    end_s: float  # when its tokens were emitted, since the request started
    # a tree of drafts (MTP tree drafting); all empty for a chain
    draft_parents: tuple[int, ...] = ()  # parent of each draft (-1: the last context token)
    accepted_nodes: tuple[int, ...] = ()  # indices of the accepted drafts, root to leaf
    # each draft's path of ranks: in head_top (MTP heads), or in each node's own draft
    # distribution (an MTP module's tree, whose distributions depend on the path: no head_top)
    draft_ranks: tuple[tuple[int, ...], ...] = ()
    # MTP: each head's top candidates (its proposal first), per draft depth
    head_top: tuple[tuple[TopToken, ...], ...] = ()
    # each draft's EmittedToken.raw_bytes (empty for whole ones); () in traces saved before the field
    draft_raw_bytes: tuple[tuple[int, ...], ...] = ()

    @property
    def emitted_token_ids(self) -> tuple[int, ...]:
        return tuple(t.token_id for t in self.emitted)


@dataclass(frozen=True)
class RunInfo:
    model: str
    method: str
    drafter: str
    k: int
    adaptive: bool
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    prefill_chunk: int  # 0: the prompt is prefilled in one forward
    device: str
    dtype: str
    prompt_text: str
    prompt_token_ids: tuple[int, ...]
    lossy: bool = False
    dtype_reason: str = ""  # why the target runs in this dtype (engine.models.choose_dtype)
    batch_invariant: bool = False  # target logits independent of how many tokens share a forward
    verify_ms: tuple[float, ...] = ()  # this machine's verify curve: ms of one forward over T = 1, 2, ... tokens
    fit_k: bool = False  # each step's draft length fitted to verify_ms, k at most (engine.draft_length)


@dataclass(frozen=True)
class Trace:
    info: RunInfo
    prefill: tuple[PrefillChunk, ...]
    steps: tuple[Step, ...]
    stop_reason: str  # one of STOP_REASONS
    version: int = TRACE_VERSION
    extra: dict = field(default_factory=dict)

    @property
    def output_token_ids(self) -> list[int]:
        return [t.token_id for s in self.steps for t in s.emitted]

    @property
    def text(self) -> str:
        return decode_tokens(t for s in self.steps for t in s.emitted)


def to_jsonable(obj):
    """Records -> plain JSON types (enums by value, tuples as lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def trace_to_json(trace: Trace) -> str:
    return json.dumps(to_jsonable(trace), ensure_ascii=False, allow_nan=False)


def _depth(obj, limit: int, depth: int = 0) -> None:
    if depth > limit:
        raise InputError(f"trace JSON is nested deeper than {limit} levels")
    if isinstance(obj, dict):
        for v in obj.values():
            _depth(v, limit, depth + 1)
    elif isinstance(obj, list):
        if len(obj) > MAX_ITEMS:
            raise InputError(f"trace JSON has a list of {len(obj)} items (limit {MAX_ITEMS})")
        for v in obj:
            _depth(v, limit, depth + 1)


def _build(tp, value, where: str):
    """Check `value` against the annotation `tp` and build the record; errors name the field."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        return _build(next(t for t in options if t is not type(None)), value, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise InputError(f"trace field {where} must be an object")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            if f.name not in value:
                if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING:
                    continue
                raise InputError(f"trace field {where}.{f.name} is missing")
            kwargs[f.name] = _build(hints[f.name], value[f.name], f"{where}.{f.name}")
        return tp(**kwargs)
    if origin is tuple:
        if not isinstance(value, list):
            raise InputError(f"trace field {where} must be a list")
        (item_tp, _) = typing.get_args(tp)
        return tuple(_build(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise InputError(f"trace field {where} must be an object")
        return value
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except ValueError:
            raise InputError(f"trace field {where} has an unknown value {str(value)[:40]!r}") from None
    if tp is bool:
        if not isinstance(value, bool):
            raise InputError(f"trace field {where} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 2**62:
            raise InputError(f"trace field {where} must be an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InputError(f"trace field {where} must be a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise InputError(f"trace field {where} must be a string")
        return value
    raise TypeError(f"no loader for {tp}")


def trace_from_json(text: str | bytes) -> Trace:
    """Parse and validate a trace file; raises InputError with a one-line reason."""
    if len(text) > MAX_TRACE_BYTES:
        raise InputError(f"trace file is {len(text)} bytes (limit {MAX_TRACE_BYTES})")

    def no_constants(name: str):
        raise InputError(f"trace JSON contains {name}, which is not a number")

    try:
        data = json.loads(text, parse_constant=no_constants)
    except InputError:
        raise
    except (ValueError, RecursionError) as err:
        raise InputError(f"trace file is not valid JSON ({str(err).splitlines()[0][:80]})") from None
    _depth(data, MAX_DEPTH)
    if not isinstance(data, dict) or data.get("version") != TRACE_VERSION:
        raise InputError(f"not a Speculative Decoding Lab trace (version {TRACE_VERSION} expected)")
    trace = _build(Trace, data, "trace")
    if trace.stop_reason not in STOP_REASONS:
        raise InputError(f"trace field trace.stop_reason must be one of {', '.join(STOP_REASONS)}")
    if len(trace.output_token_ids) > MAX_OUTPUT_TOKENS:
        raise InputError(f"trace has {len(trace.output_token_ids)} output tokens (limit {MAX_OUTPUT_TOKENS})")
    curve = trace.info.verify_ms
    if len(curve) > MAX_CURVE_POINTS or not all(math.isfinite(ms) and ms > 0 for ms in curve):
        raise InputError(f"trace field trace.info.verify_ms must hold at most {MAX_CURVE_POINTS} positive times")
    for i, step in enumerate(trace.steps):
        problem = _step_problem(step, i)
        if problem:
            raise InputError(f"trace field trace.steps[{i}] is inconsistent ({problem})")
    return trace


def _step_problem(step: Step, position: int) -> str | None:
    """What makes a loaded step impossible for the decoding loop to have recorded, or None. The
    views index these fields by draft position, so a hostile trace must not get past here."""
    k = step.k
    if step.index != position:
        return "steps must be numbered 0, 1, 2, ..."
    if k > MAX_STEP_DRAFTS:
        return f"k must be at most {MAX_STEP_DRAFTS}"
    if not 0 <= step.accepted <= k:
        return "accepted must be in 0..k"
    if any(len(drafts) != k for drafts in (step.draft_token_ids, step.draft_texts, step.draft_probs,
                                          step.target_probs)):
        return "k drafted ids, texts, draft_probs and target_probs"
    # the last step may be cut short by EOS or max_new_tokens, never lengthened
    if not 1 <= len(step.emitted) <= step.accepted + 1:
        return "emits the wrong number of tokens"
    if len(step.draft_raw_bytes) not in (0, k):
        return "draft_raw_bytes per drafted position"
    if any(len(raw) > MAX_TOKEN_BYTES or any(not 0 <= b < 256 for b in raw)
           for raw in (*step.draft_raw_bytes, *(t.raw_bytes for t in step.emitted))):
        return f"a token's raw bytes must be at most {MAX_TOKEN_BYTES}, each 0..255"
    if len(step.accept_probs) > k or len(step.draft_top) not in (0, k):
        return "accept_probs and draft_top per drafted position"
    if len(step.accept_uniforms) != (0 if step.sample_uniform is None else len(step.accept_probs)):
        return "one uniform draw per accept_prob when sampling, none when greedy"
    if step.draft_parents and (len(step.draft_parents) != k
                               or any(not -1 <= p < j for j, p in enumerate(step.draft_parents))):
        return "each draft's parent must be an earlier draft or -1"
    if len(step.accepted_nodes) not in (0, step.accepted) or any(not 0 <= n < k for n in step.accepted_nodes):
        return "accepted_nodes must be accepted draft positions"
    if step.draft_ranks and (len(step.draft_ranks) != k or any(not ranks or min(ranks) < 0 for ranks in step.draft_ranks)):
        return "draft_ranks: one non-empty path of ranks >= 0 per draft"
    if step.draft_ranks and step.draft_parents and [len(r) for r in step.draft_ranks] != depths(step.draft_parents):
        return "draft_ranks: each path as long as its draft's depth"
    if step.draft_ranks and step.head_top and any(  # heads: the ranks index each depth's candidates
            len(ranks) > len(step.head_top) or any(not r < len(step.head_top[d]) for d, r in enumerate(ranks))
            for ranks in step.draft_ranks):
        return "draft_ranks must index head_top"
    timings = (step.draft_s, step.verify_s, step.end_s)
    if any(t < 0 for t in timings):
        return "timings must be >= 0"
    return None
