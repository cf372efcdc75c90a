"""A stand-in for static_decode.CudaGraphs on the CPU (StaticDecoder.backend), able to go wrong as a GPU might."""

from __future__ import annotations

import torch

FAULTS = ("raise", "empty", "tokens", "logp", "buffers")
OUT_OF_MEMORY = ("oom_warm_up", "oom_capture")  # the allocator's error in a warm-up or in a capture


class FakeGraphs:
    """warm_up runs the chunk; capture records it and runs nothing (as a CUDA capture does); the replay runs the
    recorded chunk eagerly. The `at`-th capture (1-based) goes wrong as `fault` says: "raise" (the capture raises,
    as a driver might), "empty" (the replay runs nothing: what a capture on the wrong device records), "tokens",
    "logp" or "buffers" (the replay writes other tokens, log-probs off by `off`, or advanced positions), or
    "oom_warm_up" / "oom_capture" (torch.OutOfMemoryError from that warm-up or capture; `at` may then be a tuple of
    attempts)."""

    def __init__(self, state=None, fault: str | None = None, at: int | tuple[int, ...] = 1, off: float = 1e-4):
        assert fault is None or fault in FAULTS + OUT_OF_MEMORY, fault
        self.state, self.fault, self.off = state, fault, off
        self.at = at if isinstance(at, tuple) else (at,)
        self.captures = 0  # captures attempted
        self.warm_ups = 0
        self.replays = 0
        self.released = 0  # release_failed calls

    @classmethod
    def install(cls, decoder, fault: str | None = None, at: int = 1, off: float = 1e-4) -> FakeGraphs:
        decoder.backend = cls(decoder.state, fault, at, off)
        return decoder.backend

    def warm_up(self, run) -> None:
        self.warm_ups += 1
        if self.fault == "oom_warm_up" and self.warm_ups in self.at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\n(a second line)")
        run()

    def release_failed(self) -> None:
        self.released += 1

    def capture(self, run):
        self.captures += 1
        fault = self.fault if self.captures in self.at else None
        if fault == "oom_capture":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB\n(a second line)")
        if fault == "raise":
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\n(a second line)")
        state = self.state

        def replay() -> None:
            self.replays += 1
            if fault != "empty":
                run()
            if fault == "tokens":
                state.hist[0, :, -1] += 1
            elif fault == "logp":
                state.hist[1, :, 3] -= self.off
            elif fault == "buffers":
                state.positions.add_(1)

        return replay
