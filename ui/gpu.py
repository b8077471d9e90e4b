"""ZeroGPU support: `gpu(fn)` is `spaces.GPU(fn)` where the `spaces` package is installed (every
Hugging Face Space has it) and `fn` itself elsewhere.

spaces.GPU attaches a GPU for the duration of each call on ZeroGPU hardware and is a no-op on
other hardware; it wraps generator functions as generators, so a streaming handler keeps
streaming. On ZeroGPU each call runs in a worker process that pickles the handler's arguments
and results, so only handlers whose inputs and outputs are plain values may carry it: a handler
that keeps a live run (KV cache, generator) in gr.State between clicks cannot (README, "Hosting
on Hugging Face Spaces").
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def gpu(fn: F) -> F:
    """fn, decorated with spaces.GPU when the `spaces` package is importable."""
    if importlib.util.find_spec("spaces") is None:
        return fn
    import spaces

    return spaces.GPU(fn)
