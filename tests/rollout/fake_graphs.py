"""A stand-in for static_decode.CudaGraphs on the CPU (StaticDecoder.backend), able to go wrong as a GPU might."""

from __future__ import annotations

FAULTS = ("raise", "empty", "tokens", "logp", "buffers")


class FakeGraphs:
    """warm_up runs the chunk; capture records it and runs nothing (as a CUDA capture does); the replay runs the
    recorded chunk eagerly. The `at`-th capture (1-based) goes wrong as `fault` says: "raise" (the capture raises,
    as a driver might), "empty" (the replay runs nothing: what a capture on the wrong device records), "tokens",
    "logp" or "buffers" (the replay writes other tokens, log-probs off by `off`, or advanced positions)."""

    def __init__(self, state=None, fault: str | None = None, at: int = 1, off: float = 1e-4):
        assert fault is None or fault in FAULTS, fault
        self.state, self.fault, self.at, self.off = state, fault, at, off
        self.captures = 0  # captures attempted
        self.replays = 0

    @classmethod
    def install(cls, decoder, fault: str | None = None, at: int = 1, off: float = 1e-4) -> FakeGraphs:
        decoder.backend = cls(decoder.state, fault, at, off)
        return decoder.backend

    def warm_up(self, run) -> None:
        run()

    def capture(self, run):
        self.captures += 1
        fault = self.fault if self.captures == self.at else None
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
