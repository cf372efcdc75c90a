"""The one decode loop: rows (rows.Row: completions and multi-turn trajectories) decoded on the decode cache
(static_cache.py), CHUNK steps at a time; on CUDA each chunk is one CUDA graph per batch bucket, replayed; on a CPU,
under FSDP2 or with rollout.cuda_graphs=off the same code runs eagerly.

Per wave (`decode_static`):

1. prefill: each distinct prompt once (engine.prefill_prompts: a prefix all prompts share runs once), written into
   the cache and copied to its rows; the first tokens are drawn from the prefill's logits;
2. a chunk: CHUNK decode steps back to back on the device (an eager chunk no more than the live rows may still
   take). A step feeds every row its last token, draws the next
   one with the row's own pre-drawn uniform (TokenSampler: temperature, top-k / top-p / min-p, the full-softmax and the
   filtered log-prob) and writes it into `hist`: no host sync, no generator call, nothing allocated outside the
   graph's pool;
3. one read per chunk: the host copies `hist` (the one device-to-host sync per CHUNK steps) and each row takes its
   tokens in order until it finishes (stop token, stop string, length) or ends a model turn; the tokens it sampled
   after that are discarded, as is a finished row's work until it leaves the batch;
4. a trajectory whose model turn ended is set back to the turn's end and fed its environment's tokens, eagerly,
   before the next chunk (static_turns.py);
5. when the live rows fit a smaller bucket (static_cache.bucket_for) they move to the front and the next chunks run
   at that bucket: finished rows leave the batch by buckets (a bucketed compaction).

Eager or kept: graphs are worth keeping across calls (a capture costs seconds), so a decode with graphs runs on the
model's kept decoder (`static_decoder`, below). An eager decode (no graphs) runs on a decoder of its own, sized to
the call's rows (its first bucket is the row count itself), with the weights packed for it where the kernel plan
says packing pays (decode_kernels.packed_for_decode), and freed when the call ends: the cache is then memory of the
rollout phase alone, as the planner counts it when it plans no kept state (plan/from_config.py
static_decode_planned).

CUDA graphs (`StaticDecoder.run_chunk`): one per (bucket, attended window, sampling parameters; the window is the
live length rounded up, static_cache.window_for), captured the first time that triple runs, after one eager warm-up
chunk, which is also the reference the capture is checked against: the graph is
replayed once from the state the warm-up started from and must give the same tokens and step buffers, and log-probs
within 1e-5 (fp32) or 1e-3 (bf16). A capture that raises or a replay that differs (a driver's, a torch build's or a
card's surprise) ends nothing under rollout.cuda_graphs=auto: one warning line, the rest of the process decodes the
same static state eagerly (still one host read per chunk), and metrics.jsonl's rollout/cuda_graphs_fallback says so;
`on` raises instead (tests, benchmarks). An out-of-memory error in a warm-up or a capture says nothing about the
graphs' correctness, only about that bucket's size: the failed capture's memory is freed (its graph dropped, the
allocator's cache emptied), that bucket and the larger ones decode eagerly, and the next smaller bucket the rows step
down to is captured once more; only its own out-of-memory error makes it eager too (per bucket, never the process).
`auto` is off up front under FSDP2 (graphs_for), and every CUDA call runs
under torch.cuda.device(model.device) on streams of that device (CudaGraphs). A graph replays fixed addresses: the
state's buffers, the LM head's logits buffer, the sampler's work buffer, and the model's parameters. The optimizer
and LoRA merges write the weights in place, so graphs stay valid across training steps; what a capture bakes in
beyond weight values (each parameter's storage, module switches such as LoRA merged / adapters on / train mode) is
the model's `signature`, and a change of it, or a larger state, re-captures. The decoder (state, graphs) is kept per
model between calls (`release_static_decode` frees it) and holds no reference to the model. An evaluation runs
inside `transient_static_decode()`: a call the kept decoder cannot hold (more rows than the rollout's bucket, longer
replies) decodes on a decoder of its own, freed when the evaluation ends, so the kept state and graphs stay the
rollout's (plan/decode_state.py plans the evaluation's as a peak during eval, not as kept memory).

Randomness: each row's uniforms are drawn before the wave (engine.Draws.table): with per-prompt seeds a prompt's
rows draw from that prompt's generator only, so its samples depend neither on its batch-mates nor on when any row
finishes; eager chunks and graphs draw the same tokens.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..config import ConfigError
from ..model.config import rope_kind
from ..model.transformer import Transformer, rope_switch
from .decode_kernels import DecodeHead, PackedWeights
from .engine import prefill_prompts
from .rows import Row
from .sampling import NAN_TOKEN, NonFiniteLogits, SamplingParams, TokenSampler, sampling_dtype, work_buffer
from .static_cache import CHUNK, StaticDecodeState, bucket_for, window_for
from .static_turns import feed_env_turns, prefill_again

SLOT_ROUNDING = 64  # slots are allocated in multiples of this, so prompts a little longer reuse the graphs


def cuda_graphs_on(choice: str, device: torch.device | str) -> bool:
    """rollout.cuda_graphs -> whether the decode runs its chunks in CUDA graphs: `auto` on CUDA, `on` (CUDA only),
    `off` (eager chunks)."""
    cuda = torch.device(device).type == "cuda"
    if choice == "on" and not cuda:
        raise ConfigError(f"rollout.cuda_graphs=on needs a CUDA device, but the model is on {device}: "
                          "set rollout.cuda_graphs=auto (or off)")
    return choice == "on" or (choice == "auto" and cuda)


def graphs_for(model: Transformer, choice: str) -> bool:
    """cuda_graphs_on for this model: `auto` is also off for a model with FSDP units (FSDP2 unshards into new
    storage every phase, so every graph would be captured again every step, and its pre-forward wait forks a side
    stream inside the capture that is never joined, so the capture cannot end); `on` refuses one. Likewise for a
    longrope model (Phi-3 / Phi-4-mini), decoded in eager chunks: its rows are prefilled again between two chunks
    when they pass the original context (static_turns.prefill_again), a path no graph's capture check covers."""
    if not cuda_graphs_on(choice, model.device):
        return False
    if rope_kind(model.config.rope_scaling) == "longrope":
        if choice == "on":
            raise ConfigError("rollout.cuda_graphs=on cannot decode a longrope model (Phi-3 / Phi-4-mini): its rows "
                              "are prefilled again past the original context; set rollout.cuda_graphs=auto (or off)")
        return False
    if fsdp_sharded(model):
        if choice == "on":
            raise ConfigError("rollout.cuda_graphs=on cannot capture a model sharded by FSDP2 "
                              "(distributed.strategy=fsdp2): set rollout.cuda_graphs=auto (or off)")
        return False
    return True


def fsdp_sharded(model: torch.nn.Module) -> bool:
    """Whether any module of the model is an FSDP2 unit (fully_shard); nothing is unless FSDP2 was imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    unit = getattr(fsdp, "FSDPModule", None)
    return unit is not None and any(isinstance(m, unit) for m in model.modules())


def model_signature(model: Transformer) -> tuple:
    """What a captured step bakes in beyond the weights' values: each parameter's and buffer's storage, dtype and
    shape, each module's Python switches (train mode, LoRA merged, adapters on) and the model's kernels (the decode
    attention among them)."""
    tensors = tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in (*model.parameters(), *model.buffers()))
    flags = tuple((m.training, getattr(m, "merged", None), getattr(m, "adapter_enabled", None))
                  for m in model.modules())
    return tensors, flags, id(model.kernels)


class CaptureCheckFailed(RuntimeError):
    """rollout.cuda_graphs=on and a chunk's graph failed its capture check (StaticDecoder.capture)."""


@dataclass
class GraphHealth:
    """This process's capture checks: how many ran, and the cause once one failed, after which
    rollout.cuda_graphs=auto decodes every later chunk of the process eagerly, on the same static state; and the
    buckets an out-of-memory error left eager (bucket -> cause)."""

    checks: int = 0
    cause: str | None = None
    out_of_memory: dict[int, str] = field(default_factory=dict)


HEALTH = GraphHealth()


def fall_back(cause: str) -> None:
    """From now on this process decodes eagerly; one warning line says why and which setting it concerns."""
    HEALTH.cause = cause
    print(f"warning: rollout.cuda_graphs: capture check failed ({cause}); decoding eagerly", file=sys.stderr,
          flush=True)


def out_of_memory(error: BaseException) -> bool:
    """Whether an error is the allocator's (or the driver's) out-of-memory error."""
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def one_line(error: BaseException, limit: int = 200) -> str:
    """An exception as one short line: its type and the first line of its message."""
    text = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cuda_graphs_fallback() -> int | None:
    """metrics.jsonl's rollout/cuda_graphs_fallback: 1 once a failed capture check made this process decode
    eagerly, 0 while every capture check passed, None before any ran (a CPU run, graphs off)."""
    if HEALTH.cause is not None or HEALTH.out_of_memory:
        return 1
    return 0 if HEALTH.checks else None


class CudaGraphs:
    """The CUDA graph API on one device: every call runs under torch.cuda.device(device), on streams made on that
    device, so a model on cuda:1 (or on a rank that never called set_device) is captured where it lives rather
    than on the current device (where the capture would record nothing)."""

    def __init__(self, device: torch.device):
        self.device, self.pool = device, None  # one memory pool for every graph: they never run at the same time

    def warm_up(self, run: Callable[[], None]) -> None:
        """run() eagerly on a side stream (library handles, lazily made buffers), joined back."""
        with torch.cuda.device(self.device):
            side, main = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                run()
            main.wait_stream(side)

    def capture(self, run: Callable[[], None]) -> Callable[[], None]:
        """run() captured as one graph (nothing runs); returns its replay."""
        with torch.cuda.device(self.device):
            graph = torch.cuda.CUDAGraph()
            self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
            main = torch.cuda.current_stream(self.device)
            try:
                with torch.cuda.graph(graph, pool=self.pool, stream=torch.cuda.Stream(self.device),
                                      capture_error_mode="thread_local"):  # other threads may run
                    run()
            finally:
                torch.cuda.set_stream(main)  # a capture that raised in its exit leaves its own stream current
            torch.cuda.synchronize(self.device)

        def replay() -> None:
            with torch.cuda.device(self.device):
                graph.replay()

        return replay

    def release_failed(self) -> None:
        """After a warm-up or capture that ran out of memory (its graph already dropped): what it allocated goes
        back to the pool, and the allocator's cached blocks back to the card, before the eager chunk runs."""
        gc.collect()
        with torch.cuda.device(self.device):
            torch.cuda.empty_cache()


class StaticDecoder:
    """A model's static state, LM-head buffer, token samplers and captured graphs (no reference to the model itself).

    `backend`: the CUDA graph API on the state's device (CudaGraphs); a test stands in a fake one on the CPU.
    `packs`: the weights an eager decode packed (decode_kernels.packed_for_decode); None for a kept decoder."""

    def __init__(self, model: Transformer, rows: int, slots: int, columns: int, packs: PackedWeights | None = None):
        dtype, device, cfg = model.embed.weight.dtype, model.device, model.config
        self.state = StaticDecodeState(cfg, rows, slots, columns, dtype, sampling_dtype(dtype), device)
        self.work = work_buffer(rows, cfg.vocab_size, sampling_dtype(dtype), device)  # shared by the token samplers
        self.token_samplers: dict[tuple, TokenSampler] = {}
        self.graphs: dict[tuple, Callable[[], None]] = {}  # (bucket, window, sampling key) -> its graph's replay
        self.backend = CudaGraphs(device)
        self.captures, self.capture_seconds = 0, 0.0
        self.slots_read = 0  # key/value slots the chunks' attention read, summed over rows, steps (one layer's K)
        self.chunks: Counter[tuple[int, int]] = Counter()  # (bucket, window) -> chunks run there
        self.eager_from: int | None = None  # the smallest bucket an out-of-memory error left eager (and all above)
        self.signature: tuple | None = None
        self.packs = packs  # an eager decode's packed weights (the LM head's among them), for the call it lasts
        self.head = DecodeHead(model, rows, packs)
        if packs is None:  # a kept decoder: what its graphs bake in of the model (renew; an eager one has none)
            self.renew(model)

    def renew(self, model: Transformer) -> None:
        """Take the model as it is now: drop the graphs if what they baked in changed (model_signature)."""
        signature = model_signature(model)
        if self.signature != signature:
            self.graphs.clear()
            self.signature, self.head = signature, DecodeHead(model, self.state.rows)

    def token_sampler(self, params: SamplingParams) -> TokenSampler:
        key = (params.temperature, params.top_k, params.top_p, params.min_p)
        if key not in self.token_samplers:
            self.token_samplers[key] = TokenSampler(params, work=self.work)
        return self.token_samplers[key]

    def step(self, model: Transformer, b: int, sample: TokenSampler, j: int, window: int | None = None) -> None:
        """Decode step j of a chunk for rows [:b] attending over slots [0, window] (None: all), in place: feed each
        row its last token, draw the next one."""
        state = self.state
        w = state.slots if window is None else window
        hidden = model(state.ids[:b], state.key_mask[:b, : w + 1], cache=state.view(b, w),
                       positions=state.positions[:b], return_hidden=True)[:, -1]  # [b, 1] -> [b, hidden]
        u = state.uniforms[:b].gather(1, state.col[:b, None])  # [b, 1]: each row's next uniform
        state.advance(b, sample(self.head(hidden), None, u), j)

    def chunk(self, model: Transformer, b: int, sample: TokenSampler, window: int | None = None,
              steps: int = CHUNK) -> None:
        """`steps` decode steps (CHUNK: the code a graph captures) of rows [:b] over slots [0, window], in place
        (hist columns 1..steps)."""
        for j in range(1, steps + 1):
            self.step(model, b, sample, j, window)

    def run_chunk(self, model: Transformer, b: int, sample: TokenSampler, graphs: str,
                  window: int | None = None, steps: int = CHUNK) -> int:
        """One chunk at bucket b over slots [0, window] (None: all). graphs `off`, or `auto` after a failed capture
        check in this process: eagerly, `steps` steps (no more than the rows can still take: a graph's fixed CHUNK
        would only step finished rows); else CHUNK steps by the triple's graph, captured and checked the first time
        (`on`: a failed check raises). -> the steps it ran (hist columns 1..steps)."""
        window = self.state.slots if window is None else window
        self.chunks[(b, window)] += 1
        replay = self.graphs.get((b, window, sample.key))
        too_large = self.eager_from is not None and b >= self.eager_from
        if graphs == "off" or (graphs == "auto" and (HEALTH.cause is not None or too_large)):
            self.chunk(model, b, sample, window, steps)
        else:
            steps = CHUNK
            if replay is not None:
                replay()
            else:
                self.capture(model, b, sample, strict=graphs == "on", window=window)
        self.slots_read += steps * b * (window + 1)
        return steps

    def capture(self, model: Transformer, b: int, sample: TokenSampler, strict: bool, window: int) -> None:
        """Capture the chunk at bucket b and check the graph's first replay against the eager warm-up chunk that a
        capture needs anyway (check_capture). A capture that raises or a replay that differs: `strict` raises
        CaptureCheckFailed; otherwise this process decodes eagerly from now on (fall_back), and this chunk runs
        again eagerly from the state it started from. Either way the chunk has run once when this returns."""
        t0 = time.perf_counter()
        before = [t.clone() for t in self.state.step_buffers()]
        oom = False
        try:
            cause = self.check_capture(model, b, sample, before, window)
        except Exception as e:  # noqa: BLE001 - a driver's, a torch build's or a card's surprise: any of them
            cause, oom = one_line(e), out_of_memory(e)
        self.capture_seconds += time.perf_counter() - t0
        HEALTH.checks += 1
        if cause is None:
            return
        if oom and not strict:
            self.bucket_out_of_memory(b, cause)
            self.restore(before)
            self.chunk(model, b, sample, window)
            return
        self.graphs.clear()  # their pool goes with them
        self.backend = CudaGraphs(self.state.device)
        if strict:
            raise CaptureCheckFailed(f"rollout.cuda_graphs=on: capture check failed ({cause}); set "
                                     "rollout.cuda_graphs=auto to decode eagerly after such a failure (or off)")
        fall_back(cause)
        self.restore(before)
        self.chunk(model, b, sample, window)

    def bucket_out_of_memory(self, b: int, cause: str) -> None:
        """Bucket b (and every larger one) decodes eagerly from now on; the failed capture's memory is freed."""
        self.backend.release_failed()
        self.eager_from = b if self.eager_from is None else min(b, self.eager_from)
        HEALTH.out_of_memory[b] = cause
        print(f"warning: rollout.cuda_graphs: out of memory capturing the {b}-row bucket ({cause}); it decodes "
              "eagerly, smaller buckets keep their graphs", file=sys.stderr, flush=True)

    def check_capture(self, model: Transformer, b: int, sample: TokenSampler, before: list[torch.Tensor],
                      window: int) -> str | None:
        """Warm up eagerly (the reference), capture, replay once from the same state and compare: None when the
        replay equals the reference (the graph is kept), else what differs. A replay that writes nothing (an
        empty graph) leaves the poisoned hist and the restored step buffers, and so differs."""
        chunk = lambda: self.chunk(model, b, sample, window)  # noqa: E731
        self.backend.warm_up(chunk)
        reference = self.outcome(b)
        replay = self.backend.capture(chunk)
        self.restore(before)
        self.state.hist[:, :b, 1:].fill_(POISON)
        replay()
        cause = replay_mismatch(self.outcome(b), reference, logp_tolerance(self.state.dtype))
        if cause is None:
            self.graphs[(b, window, sample.key)] = replay
            self.captures += 1
        return cause

    def outcome(self, b: int) -> list[torch.Tensor]:
        """What a chunk at bucket b produced (copies): the rows' step buffers, then hist [3, b, CHUNK]."""
        return [t[:b].clone() for t in self.state.step_buffers()] + [self.state.hist[:, :b, 1:].clone()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for t, s in zip(self.state.step_buffers(), saved):
            t.copy_(s)


POISON = 0.5  # what hist holds before a checked replay: neither a token id nor a log-prob (those are <= 0)


def logp_tolerance(dtype: torch.dtype) -> float:
    """How far a replay's log-probs may be from the eager chunk's: 1e-5 for fp32 / fp64 models, 1e-3 for bf16 /
    fp16 (a graph runs the same kernels, so in practice they are equal)."""
    return 1e-5 if dtype in (torch.float32, torch.float64) else 1e-3


def replay_mismatch(got: list[torch.Tensor], reference: list[torch.Tensor], tol: float) -> str | None:
    """outcome() of a replay vs the eager reference: step buffers and tokens equal, log-probs within tol (one host
    read: a capture's check, not a chunk's). None when they agree, else what differs, in words."""
    for name, x, y in zip(StaticDecodeState.STEP_BUFFERS, got[:-1], reference[:-1]):
        if not torch.equal(x, y):
            return f"the replayed chunk's {name} differ from the eager chunk's"
    hist, ref = got[-1], reference[-1]  # [3, b, CHUNK]: tokens, log-probs, filtered log-probs
    if not torch.equal(hist[0], ref[0]):
        return "the replayed chunk's tokens differ from the eager chunk's"
    if not torch.allclose(hist[1:], ref[1:], rtol=0, atol=tol, equal_nan=True):
        both_nan = hist[1:].isnan() & ref[1:].isnan()  # a NaN row (its token flags it) equals itself
        err = float((hist[1:] - ref[1:]).abs().masked_fill(both_nan, 0).nan_to_num(nan=float("inf")).max())
        return f"the replayed chunk's log-probs differ from the eager chunk's by {err:.3g} > {tol:g}"
    return None


_DECODERS: weakref.WeakKeyDictionary[Transformer, StaticDecoder] = weakref.WeakKeyDictionary()


@dataclass
class TransientScope:
    """Open transient_static_decode scopes (they nest) and the decoders made in them, one per model."""

    depth: int = 0
    decoders: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


TRANSIENT = TransientScope()


@contextmanager
def transient_static_decode() -> Iterator[None]:
    """Within: a call the model's kept decoder cannot hold decodes on a decoder of its own (grown as the kept one
    grows), freed when the outermost scope ends; the kept decoder, its state and its graphs are left as they are.
    The evaluations run in one, so their larger bucket is not kept across training steps and the rollout's graphs
    are not captured again after each evaluation."""
    TRANSIENT.depth += 1
    try:
        yield
    finally:
        TRANSIENT.depth -= 1
        if not TRANSIENT.depth:
            TRANSIENT.decoders.clear()  # its state and graphs (their pool with them)


def static_decoder(model: Transformer, rows: int, slots: int, columns: int) -> StaticDecoder:
    """The model's decoder, kept between calls; a larger one (the union of both sizes) when it does not fit. Inside
    transient_static_decode, a call the kept one cannot hold gets the scope's decoder instead."""
    kept, dtype, device = _DECODERS.get(model), model.embed.weight.dtype, model.device
    if kept is not None and kept.state.fits(rows, slots, columns, dtype, device):
        kept.renew(model)
        return kept
    home = TRANSIENT.decoders if TRANSIENT.depth else _DECODERS
    held = home.get(model)
    if held is not None and held.state.fits(rows, slots, columns, dtype, device):
        held.renew(model)
        return held
    if held is not None and held.state.dtype == dtype and held.state.device == device:
        s = held.state
        rows, slots, columns = max(rows, s.rows), max(slots, s.slots), max(columns, s.columns)
        s = None
    held = None
    home.pop(model, None)  # before the new one is allocated: the two never coexist
    decoder = StaticDecoder(model, bucket_for(rows), -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING, columns)
    home[model] = decoder
    return decoder


def eager_decoder(model: Transformer, rows: int, slots: int, columns: int, packs: PackedWeights) -> StaticDecoder:
    """A decoder for one eager call: its rows exactly (no bucket above them), its slots rounded as a kept decoder's
    (so eager chunks attend over the same windows as graphs), the weights packed for the call; never kept."""
    return StaticDecoder(model, rows, -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING, columns, packs)


def release_static_decode(model: Transformer) -> None:
    """Free the model's static state and graphs, kept and transient (the next static decode allocates and captures
    again)."""
    _DECODERS.pop(model, None)
    TRANSIENT.decoders.pop(model, None)


def static_decode_stats(model: Transformer) -> dict | None:
    """Of the model's decoder (None: it has none): captures so far and their seconds, the state's size, the graphs'
    buckets and windows, the process's fallback cause and its out-of-memory buckets, the key/value slots the
    attention read and the chunks run per (bucket, window)."""
    d = _DECODERS.get(model)
    if d is None:
        return None
    s = d.state
    return {"captures": d.captures, "capture_seconds": d.capture_seconds, "graphs": len(d.graphs), "rows": s.rows,
            "slots": s.slots, "fallback": HEALTH.cause, "eager_from_bucket": d.eager_from,
            "out_of_memory": dict(HEALTH.out_of_memory), "buckets": sorted({b for b, _, _ in d.graphs}),
            "windows": sorted({w for _, w, _ in d.graphs}), "kv_slots_read": d.slots_read,
            "chunks": dict(d.chunks)}


def decode_static(model: Transformer, decoder: StaticDecoder, rows: Sequence[Row], prompts: list[list[int]],
                  share: list[int], sample: TokenSampler, uniforms: torch.Tensor, graphs: str) -> None:
    """Run rows (row i from prompt share[i], uniforms [R, T]) to their ends; the rows record their tokens. graphs:
    `off` (eager chunks), `auto` (CUDA graphs, eager after a failed capture check) or `on` (a failure raises). An
    eager decoder's packed weights follow the batch as it steps down."""
    state, packs = decoder.state, decoder.packs
    mask, logits = prefill_prompts(model, state, prompts)  # key mask [P, L], logits [P, V]
    index = torch.tensor(share, dtype=torch.long, device=model.device)  # [R]
    state.start_rows(mask, share, uniforms)
    R, prompt_slots = len(rows), mask.shape[1]
    state.record_first(sample(logits.index_select(0, index), None, state.uniforms[:R, :1]))
    slots, b, first = list(range(R)), state.bucket(R), 0  # slots[s]: the row in batch slot s
    if packs is not None:
        packs.resize(b, uniforms.shape[1])  # a wave smaller than the one they were packed for
    switch = rope_switch(model.config)  # longrope's original context (None for other ropes)
    if uniforms.shape[1] == 1:  # one token a row: the prefill's draw is all there is
        take_tokens(rows, slots, state.read(b, 0)[:, :, :1], switch)
        return
    frontier = prompt_slots  # the largest write slot of rows [:b] (every row starts writing at the prompts' end)
    while True:
        # the most steps a live row may still take (a bound; before the first chunk its first token is drawn)
        left = max(rows[r].steps_left() for r in slots if not rows[r].finished) - (first == 0)
        ran = decoder.run_chunk(model, b, sample, graphs, window_for(frontier, state.slots), min(CHUNK, max(1, left)))
        frontier = min(frontier + ran, state.slots - 1)  # each step moves every row's write on (clamped there)
        turned = take_tokens(rows, slots, state.read(b, first, ran), switch)
        first = 1
        live = [s for s, r in enumerate(slots) if not rows[r].finished]
        if not live:
            return
        again = [s for s in turned if passes_rope_switch(rows[slots[s]], switch)]
        if again:  # longrope rows past the original context: their whole cache again, with the long factors
            frontier = max(frontier, prefill_again(model, state, [rows[slots[s]] for s in again], again,
                                                   prompt_slots))
            turned = [s for s in turned if s not in again]
        if turned:  # multi-turn rows whose model turn ended: the environment's tokens go in before the next chunk
            fed = feed_env_turns(model, state, [rows[slots[s]] for s in turned], turned, prompt_slots)
            frontier = max(frontier, fed)
        if state.bucket(len(live)) < b:
            state.move_rows(live)
            slots, b = [slots[s] for s in live], state.bucket(len(live))
            if packs is not None:
                packs.resize(b, max(rows[r].steps_left() for r in slots))


def take_tokens(rows: Sequence[Row], slots: list[int], hist: torch.Tensor, switch: int | None = None) -> list[int]:
    """hist [3, b, C] (host): each live row takes its C tokens in order, up to the one that finishes it, ends its
    model turn or takes it past longrope's original context `switch` (the later steps attended to keys rotated by
    the short factors). -> the batch slots of the rows whose turn ended with environment tokens to feed
    (static_turns.py) or that passed the switch (`passes_rope_switch`: their cache is prefilled again)."""
    tokens, logps, filtered = hist[0].long().tolist(), hist[1].tolist(), hist[2].tolist()
    turned = []
    for s, r in enumerate(slots):
        row, turn = rows[r], rows[r].turn_start
        for j, token in enumerate(tokens[s]):
            if row.finished or row.turn_start != turn:
                break
            if token == NAN_TOKEN:
                raise NonFiniteLogits(f"NaN or +inf logits at decode step {row.metrics.model_tokens}: the model's "
                                      "weights or activations blew up")
            row.take(token, logps[s][j], filtered[s][j])
            if passes_rope_switch(row, switch):
                break
        if not row.finished and (row.turn_start != turn or passes_rope_switch(row, switch)):
            turned.append(s)
    return turned


def passes_rope_switch(row: Row, switch: int | None) -> bool:
    """Whether feeding the row's pending tokens takes it past longrope's original context `switch` (None: not a
    longrope model): a forward of a sequence longer than original_max_position_embeddings rotates every position by
    the long factors (model/transformer.py rope_row_inv_freq), so every layer's keys and values cached with the
    short ones no longer hold, and the row is prefilled again whole, as transformers' Phi-3 generate does."""
    if switch is None or row.finished:
        return False
    return len(row.tokens) - len(row.pending) <= switch < len(row.tokens)
