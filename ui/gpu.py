"""Where the model runs: live in this process, or on ZeroGPU in one GPU call per run.

`gpu(fn)` is `spaces.GPU(fn)` where the `spaces` package is installed (every Hugging Face Space
has it) and `fn` itself elsewhere. On ZeroGPU hardware spaces.GPU attaches a GPU for the
duration of each call and runs the call in a worker process, pickling its arguments, its result
and a gr.Error it raises; on other hardware it changes nothing. The gate tab's handler takes and
returns plain values, so it carries the decorator as it is.

A live run keeps its KV cache and generator between Step clicks (in gr.State); that cannot cross
into a worker and back. So on ZeroGPU (`zero_gpu()`) the playground and the chunked-prefill tab
start a run with ONE call of a decorated pure function, `decode_whole` or `serve_whole`: frozen
settings in, frozen records out (traces, serving results), the whole run inside the call and
bounded by the tabs' token caps. The tab then walks the records on the CPU, at the user's pace
(`RunSession.from_trace(trace, request)`: Step, Play, Run, Compare) or at the pace they were
recorded (`paced`: the serving timeline), so the tabs look and behave as with a live run and show the GPU run's own timings.
Elsewhere (CPU, a dedicated GPU) runs stay live.

SPECLAB_ZEROGPU=1 takes the ZeroGPU path without ZeroGPU (tests, a check on a laptop): the
decorated functions then send their arguments, results and errors through pickle as ZeroGPU's
worker does, so whatever could not cross the process boundary fails here too.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import pickle
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TypeVar

import gradio as gr

from engine.models import load_model
from engine.run import RunRequest, run
from engine.serving import RequestRecord, ServeConfig, ServeResult, ServeStep, Workload, run_serve
from engine.trace import Trace
from ui.common import user_errors

F = TypeVar("F", bound=Callable)
_TRUE = ("1", "t", "true")  # the values the spaces package reads as on (spaces.config.boolean)


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in _TRUE


def zero_gpu() -> bool:
    """True on ZeroGPU hardware (SPACES_ZERO_GPU, the variable the spaces package itself reads),
    or where SPECLAB_ZEROGPU=1 asks for the same path."""
    return _flag("SPACES_ZERO_GPU") or _flag("SPECLAB_ZEROGPU")


def gpu(fn: F) -> F:
    """fn, decorated with spaces.GPU when the `spaces` package is importable; under
    SPECLAB_ZEROGPU=1 off ZeroGPU, fn with its calls sent through pickle."""
    if _flag("SPECLAB_ZEROGPU") and not _flag("SPACES_ZERO_GPU"):
        return _pickled(fn)
    if importlib.util.find_spec("spaces") is None:
        return fn
    import spaces

    return spaces.GPU(fn)


def _round_trip(value):
    return pickle.loads(pickle.dumps(value))


def _pickled(fn: F) -> F:
    """fn as if called in ZeroGPU's worker process: arguments, results (each yielded item of a
    generator) and a gr.Error raised go through pickle."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        args, kwargs = _round_trip((args, kwargs))
        try:
            return _round_trip(fn(*args, **kwargs))
        except gr.Error as err:
            raise _round_trip(err) from None

    @functools.wraps(fn)
    def call_generator(*args, **kwargs):
        args, kwargs = _round_trip((args, kwargs))
        try:
            for item in fn(*args, **kwargs):
                yield _round_trip(item)
        except gr.Error as err:
            raise _round_trip(err) from None

    return call_generator if inspect.isgeneratorfunction(fn) else call


@gpu
@user_errors
def decode_whole(requests: tuple[RunRequest, ...]) -> tuple[Trace, ...]:
    """Each request decoded to its end, one after the other (a comparison's baseline, then its
    speculative run: neither slows the other down)."""
    return tuple(run(request) for request in requests)


@gpu
@user_errors
def serve_whole(preset: str, workload: Workload, configs: tuple[ServeConfig, ...]) -> tuple[ServeResult, ...]:
    """The workload served to its end under each config, one after the other."""
    target = load_model(preset)
    return tuple(run_serve(target, workload, cfg) for cfg in configs)


def paced(result: ServeResult) -> Iterator[ServeStep | RequestRecord]:
    """A finished serving run's records in the order engine.serving.serve yielded them, each step
    at its recorded time since the first record was asked for, then the requests it finished."""
    finished_at: dict[float, list[RequestRecord]] = defaultdict(list)
    for request in result.requests:
        finished_at[request.token_times_s[-1]].append(request)  # the end time of its last step
    start = time.perf_counter()
    for step in result.steps:
        time.sleep(max(0.0, step.end_s - (time.perf_counter() - start)))
        yield step
        yield from finished_at.pop(step.end_s, ())
