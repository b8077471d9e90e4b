"""The benchmark loop: every method on every prompt, interleaved repeats, one process.

Each (repeat, prompt) round runs every entrant (the engine's methods, then transformers'
variants with --vs-transformers) once, in an order rotated by one place per round, so no
entrant always runs first (or right after the same neighbour) while the machine's state drifts.
Every entrant is warmed up once before the timings (lazy kernels, caches, first-call costs); a
transformers variant that fails there (an architecture its generate() does not support for that
argument) is left out and reported as skipped, with the reason.
Engine runs are timed by the run clock (engine.decoding.RunClock: the request's start to its
last token, prefill included); transformers' generate() is timed around the call, the same span.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from engine.bench.hf import HFMethod, assistant_for, generation_config, hf_generate, hf_methods_for
from engine.bench.methods import DrafterOptions, check_buildable, decode_settings, target_settings
from engine.bench.prompts import Prompt
from engine.decoding import DecodeConfig
from engine.errors import InputError
from engine.models import LoadedModel, load_model
from engine.run import RunRequest, collect, events, prepare
from engine.trace import Trace

MAX_REPEATS = 100
WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class BenchConfig:
    model: str  # preset name, local folder or hub id
    methods: tuple[str, ...]  # baseline first (engine.bench.methods.parse_methods)
    prompts: tuple[Prompt, ...]
    decode: DecodeConfig  # k, sampling, max_new_tokens, prefill chunk; ignore_eos for equal lengths
    options: DrafterOptions = DrafterOptions()
    repeats: int = 3
    vs_transformers: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.repeats, int) or not 1 <= self.repeats <= MAX_REPEATS:
            raise InputError(f"repeats must be in 1..{MAX_REPEATS} (got {self.repeats})")
        if not self.prompts:
            raise InputError("the benchmark has no prompts")


@dataclass(frozen=True)
class RunRecord:
    """One timed run of one entrant on one prompt."""

    method: str  # an engine method, or a transformers variant ("transformers:...")
    implementation: str  # "engine" or "transformers"
    prompt: str  # Prompt.key
    repeat: int
    order: int  # its place in the round (0: ran first)
    prompt_tokens: int
    output_token_ids: tuple[int, ...]
    wall_s: float
    trace: Trace | None = None  # engine runs only

    @property
    def tokens_per_s(self) -> float | None:
        return len(self.output_token_ids) / self.wall_s if self.wall_s > 0 else None


@dataclass(frozen=True)
class Entrant:
    """Something that runs a prompt: an engine method or a transformers variant."""

    method: str
    implementation: str
    run: Callable[[Prompt, DecodeConfig], tuple[list[int], list[int], float, Trace | None]]


def _engine_entrant(cfg: BenchConfig, method: str) -> Entrant:
    settings = decode_settings(method)

    def run(prompt: Prompt, decode: DecodeConfig):
        request = RunRequest(prompt=prompt.text, model=cfg.model, raw=prompt.raw, decode=replace(decode, **settings),
                             drafter=cfg.options.spec(method), **target_settings(method))
        prepared = prepare(request)  # a fresh drafter: no draft cache carried over from the last run
        trace = collect(prepared.info, events(prepared))
        return prepared.prompt_ids, trace.output_token_ids, trace.steps[-1].end_s, trace

    return Entrant(method, "engine", run)


def _hf_entrant(cfg: BenchConfig, method: HFMethod) -> Entrant:
    # transformers' generate() with its own kernels, in the dtype of the engine method it faces
    target = load_model(cfg.model, dtype=method.dtype, kernels="stock")

    def run(prompt: Prompt, decode: DecodeConfig):
        prompt_ids = target.encode(prompt.text, raw=prompt.raw)
        config = generation_config(method, target, decode, cfg.options)
        assistant = assistant_for(method, target, cfg.options)  # loaded once per process (models.load_model)
        ids, wall = hf_generate(target, prompt_ids, config, assistant, decode.sampling.seed)
        return prompt_ids, ids, wall, None

    return Entrant(method.name, "transformers", run)


def entrants(cfg: BenchConfig, target: LoadedModel) -> list[Entrant]:
    for method in cfg.methods:
        check_buildable(target, method, cfg.options)
    out = [_engine_entrant(cfg, m) for m in cfg.methods]
    if cfg.vs_transformers:
        out += [_hf_entrant(cfg, m) for m in hf_methods_for(cfg.methods)]
    return out


def rotated(items: list, shift: int) -> list:
    """items rotated left by shift places.

    >>> rotated([0, 1, 2], 1), rotated([0, 1, 2], 5)
    ([1, 2, 0], [2, 0, 1])
    """
    shift %= len(items)
    return items[shift:] + items[:shift]


@dataclass(frozen=True)
class BenchRun:
    target: LoadedModel
    records: list[RunRecord]
    skipped: dict[str, str]  # transformers variant -> why it was left out


def warm_up(players: list[Entrant], prompt: Prompt, decode: DecodeConfig) -> tuple[list[Entrant], dict[str, str]]:
    """Run each entrant once, untimed. An engine failure is raised; a transformers variant that
    fails is dropped (its generate() does not support this model for that argument)."""
    kept, skipped = [], {}
    for player in players:
        try:
            player.run(prompt, decode)
        except Exception as err:  # transformers' own code: any failure means "not supported here"
            if player.implementation == "engine":
                raise
            skipped[player.method] = f"{err.__class__.__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            continue
        kept.append(player)
    return kept, skipped


def run_bench(cfg: BenchConfig, on_run: Callable[[RunRecord], None] = lambda r: None) -> BenchRun:
    """Run the benchmark; on_run sees each record as it is made (a progress bar)."""
    target = load_model(cfg.model)
    warm = replace(cfg.decode, max_new_tokens=min(WARM_UP_TOKENS, cfg.decode.max_new_tokens))
    players, skipped = warm_up(entrants(cfg, target), cfg.prompts[0], warm)
    records: list[RunRecord] = []
    for repeat in range(cfg.repeats):
        for p, prompt in enumerate(cfg.prompts):
            round_index = repeat * len(cfg.prompts) + p
            for order, player in enumerate(rotated(players, round_index)):
                prompt_ids, output, wall, trace = player.run(prompt, cfg.decode)
                record = RunRecord(player.method, player.implementation, prompt.key, repeat, order,
                                   len(prompt_ids), tuple(output), wall, trace)
                records.append(record)
                on_run(record)
    return BenchRun(target, records, skipped)


def total_runs(cfg: BenchConfig) -> int:
    n = len(cfg.methods) + (len(hf_methods_for(cfg.methods)) if cfg.vs_transformers else 0)
    return n * len(cfg.prompts) * cfg.repeats
