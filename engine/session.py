"""A run advanced one step at a time: live on a model, or replayed from a saved trace.

The playground keeps one per browser session (in gr.State); the same object serves Step,
Play and Run to end, and a replayed trace steps exactly like a live run.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from engine.decoding import Event, Finished
from engine.run import RunRequest, events, prepare
from engine.trace import PrefillChunk, RunInfo, Step, Trace


class RunSession:
    def __init__(self, info: RunInfo, stream: Iterator[Event], request: RunRequest | None, replay: bool):
        self.info = info
        self.request = request  # None for a replayed trace
        self.replay = replay
        self.prefill: list[PrefillChunk] = []
        self.steps: list[Step] = []
        self.stop_reason: str | None = None
        self._stop = threading.Event()
        self._advancing = threading.Lock()  # held while the stream runs, so close() never cuts in
        self._stream = stream

    @classmethod
    def live(cls, request: RunRequest) -> RunSession:
        prepared = prepare(request)
        session = cls(prepared.info, iter(()), request, replay=False)
        session._stream = events(prepared, should_stop=session._stop.is_set)
        return session

    @classmethod
    def from_trace(cls, trace: Trace, request: RunRequest | None = None) -> RunSession:
        """Step through a recorded run. Without a request it is a replay (an uploaded trace);
        with one it stands for that request's run (decoded whole elsewhere, e.g. in one ZeroGPU
        call). Either way Stop ends it before its next step, as it ends a live run."""
        session = cls(trace.info, iter(()), request, replay=request is None)
        session._stream = session._recorded(trace)
        return session

    def _recorded(self, trace: Trace) -> Iterator[Event]:
        yield from trace.prefill
        for step in trace.steps:
            if step.index > 0 and self._stop.is_set():  # a live run checks before each step after the first
                yield Finished("stopped")
                return
            yield step
        yield Finished(trace.stop_reason)

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def advance(self) -> Step | None:
        """Run until the next step record (the first call also prefills); None once finished."""
        with self._advancing:
            for event in self._stream:
                if isinstance(event, PrefillChunk):
                    self.prefill.append(event)
                elif isinstance(event, Step):
                    self.steps.append(event)
                    return event
                elif isinstance(event, Finished):
                    self.stop_reason = event.stop_reason
                    self._release()  # a finished run keeps its records, not its KV cache
                    return None
            self.stop_reason = self.stop_reason or "stopped"
            return None

    def stop(self) -> None:
        """Ask a live run to stop before its next step (safe from another thread)."""
        self._stop.set()

    def close(self) -> None:
        """Finish now and release the run's KV cache (safe from another thread). A run that is
        advancing on another thread right now is asked to stop instead: it finishes, and so
        releases its cache, at its next step."""
        self._stop.set()
        if not self._advancing.acquire(blocking=False):
            return
        try:
            self._release()
        finally:
            self._advancing.release()

    def _release(self) -> None:
        getattr(self._stream, "close", lambda: None)()  # a live generator drops its KV cache
        self.stop_reason = self.stop_reason or "stopped"

    def trace(self) -> Trace:
        return Trace(self.info, tuple(self.prefill), tuple(self.steps), self.stop_reason or "stopped")
