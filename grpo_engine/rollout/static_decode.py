"""The static decode: generate's rows decoded on the static state (static_cache.py), CHUNK steps at a time; on CUDA
each chunk is one CUDA graph per batch bucket, replayed; elsewhere the same code runs eagerly.

Per wave (`decode_static`):

1. prefill: each distinct prompt once (engine.prefill_prompts: a prefix all prompts share runs once), its keys and
   values copied to its rows of the static cache; the first tokens are drawn from the prefill's logits;
2. a chunk: CHUNK decode steps back to back on the device. A step feeds every row its last token, draws the next
   one with the row's own pre-drawn uniform (Sampler: temperature, top-k / top-p / min-p, the full-softmax and the
   filtered log-prob) and writes it into `hist`: no host sync, no generator call, nothing allocated outside the
   graph's pool;
3. one read per chunk: the host copies `hist` (the one device-to-host sync per CHUNK steps) and each row takes its
   tokens in order until it finishes (stop token, stop string, length); the tokens it sampled after that are
   discarded, as is a finished row's work until it leaves the batch;
4. when the live rows fit a smaller bucket (static_cache.bucket_for) they move to the front and the next chunks run
   at that bucket.

CUDA graphs (`StaticDecoder.run_chunk`): one per (bucket, sampling parameters), captured the first time that pair
runs, after one eager warm-up chunk whose effect on the rows is undone. A graph replays fixed addresses: the
state's buffers, the LM head's logits buffer, the sampler's work buffer, and the model's parameters. The optimizer
and LoRA merges write the weights in place, so graphs stay valid across training steps; what a capture bakes in
beyond weight values (each parameter's storage, module switches such as LoRA merged / adapters on / train mode) is
the model's `signature`, and a change of it, or a larger state, re-captures. The decoder (state, graphs) is kept per
model between calls (`release_static_decode` frees it) and holds no reference to the model.

Randomness: each row's uniforms are drawn before the wave (engine.Draws.table): with per-prompt seeds a prompt's
rows draw from that prompt's generator only, so its samples depend neither on its batch-mates nor on when any row
finishes. This stream differs from the dynamic loop's (which draws one column per step): the same seed gives other
samples than rollout.cuda_graphs=off.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch

from ..config import ConfigError
from ..model.transformer import Transformer
from .decode_kernels import DecodeHead
from .engine import Row, prefill_prompts
from .sampling import NAN_TOKEN, NonFiniteLogits, Sampler, SamplingParams, sampling_dtype, work_buffer
from .static_cache import CHUNK, StaticDecodeState, bucket_for

SLOT_ROUNDING = 64  # slots are allocated in multiples of this, so prompts a little longer reuse the graphs


def cuda_graphs_on(choice: str, device: torch.device | str, compiled: bool = False) -> bool:
    """rollout.cuda_graphs -> whether generate runs the static decode with CUDA graphs: `auto` on CUDA (unless the
    dynamic step is torch.compile'd), `on` (CUDA only), `off` (the eager dynamic loop)."""
    cuda = torch.device(device).type == "cuda"
    if choice == "on" and not cuda:
        raise ConfigError(f"rollout.cuda_graphs=on needs a CUDA device, but the model is on {device}: "
                          "set rollout.cuda_graphs=auto (or off)")
    if choice == "on" and compiled:
        raise ValueError("compile=True runs the dynamic decode loop, not the CUDA graphs of rollout.cuda_graphs=on: "
                         "pick one (cuda_graphs='off' to compile)")
    return choice == "on" or (choice == "auto" and cuda and not compiled)


def model_signature(model: Transformer) -> tuple:
    """What a captured step bakes in beyond the weights' values: each parameter's and buffer's storage, dtype and
    shape, and each module's Python switches (train mode, LoRA merged, adapters on, a decode attention kernel)."""
    tensors = tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in (*model.parameters(), *model.buffers()))
    flags = tuple((m.training, getattr(m, "merged", None), getattr(m, "adapter_enabled", None),
                   id(getattr(m, "decode_attention", None))) for m in model.modules())
    return tensors, flags


class StaticDecoder:
    """A model's static state, LM-head buffer, samplers and captured graphs (no reference to the model itself)."""

    def __init__(self, model: Transformer, rows: int, slots: int, columns: int):
        dtype, device, cfg = model.embed.weight.dtype, model.device, model.config
        self.state = StaticDecodeState(cfg, rows, slots, columns, dtype, sampling_dtype(dtype), device)
        self.work = work_buffer(rows, cfg.vocab_size, sampling_dtype(dtype), device)  # shared by the samplers
        self.samplers: dict[tuple, Sampler] = {}
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None  # one memory pool for every graph: they never run at the same time
        self.captures, self.capture_seconds = 0, 0.0
        self.signature: tuple | None = None
        self.renew(model)

    def renew(self, model: Transformer) -> None:
        """Take the model as it is now: drop the graphs if what they baked in changed (model_signature)."""
        signature = model_signature(model)
        if self.signature != signature:
            self.graphs.clear()
            self.signature, self.head = signature, DecodeHead(model, self.state.rows)

    def sampler(self, params: SamplingParams) -> Sampler:
        key = (params.temperature, params.top_k, params.top_p, params.min_p)
        if key not in self.samplers:
            self.samplers[key] = Sampler(params, work=self.work)
        return self.samplers[key]

    def chunk(self, model: Transformer, b: int, sample: Sampler) -> None:
        """CHUNK decode steps of rows [:b], in place (hist columns 1..CHUNK): the code a graph captures."""
        state, cache = self.state, self.state.view(b)
        for j in range(1, CHUNK + 1):
            hidden = model(state.ids[:b], state.key_mask[:b], cache=cache, positions=state.positions[:b],
                           return_hidden=True)[:, -1]  # [b, 1] -> [b, hidden]
            u = state.uniforms[:b].gather(1, state.col[:b, None])  # [b, 1]: each row's next uniform
            state.advance(b, sample(self.head(hidden), None, u), j)

    def run_chunk(self, model: Transformer, b: int, sample: Sampler, graphs: bool) -> None:
        if not graphs:
            self.chunk(model, b, sample)
            return
        graph = self.graphs.get((b, sample.key))
        if graph is None:
            graph = self.capture(model, b, sample)
        graph.replay()

    def capture(self, model: Transformer, b: int, sample: Sampler) -> torch.cuda.CUDAGraph:
        """Capture the chunk at bucket b: one eager warm-up run first (library handles, lazily made buffers) whose
        advance of the rows is undone (its key/value writes land in slots the replay writes again)."""
        t0 = time.perf_counter()
        saved = [t.clone() for t in self.state.step_buffers()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.chunk(model, b, sample)
        torch.cuda.current_stream().wait_stream(side)
        for t, s in zip(self.state.step_buffers(), saved):
            t.copy_(s)
        graph = torch.cuda.CUDAGraph()
        self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # other threads may run
            self.chunk(model, b, sample)
        torch.cuda.synchronize()
        self.graphs[(b, sample.key)] = graph
        self.captures += 1
        self.capture_seconds += time.perf_counter() - t0
        return graph


_DECODERS: weakref.WeakKeyDictionary[Transformer, StaticDecoder] = weakref.WeakKeyDictionary()


def static_decoder(model: Transformer, rows: int, slots: int, columns: int) -> StaticDecoder:
    """The model's decoder, kept between calls; a larger one (the union of both sizes) when it does not fit."""
    held = _DECODERS.get(model)
    dtype, device = model.embed.weight.dtype, model.device
    if held is not None and held.state.fits(rows, slots, columns, dtype, device):
        held.renew(model)
        return held
    if held is not None and held.state.dtype == dtype and held.state.device == device:
        s = held.state
        rows, slots, columns = max(rows, s.rows), max(slots, s.slots), max(columns, s.columns)
        s = None
    held = None
    release_static_decode(model)  # before the new one is allocated: the two never coexist
    decoder = StaticDecoder(model, bucket_for(rows), -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING, columns)
    _DECODERS[model] = decoder
    return decoder


def release_static_decode(model: Transformer) -> None:
    """Free the model's static state and graphs (the next static decode allocates and captures again)."""
    _DECODERS.pop(model, None)


def static_decode_stats(model: Transformer) -> dict | None:
    """Captures so far and their seconds, and the state's size, of the model's decoder (None: it has none)."""
    d = _DECODERS.get(model)
    if d is None:
        return None
    s = d.state
    return {"captures": d.captures, "capture_seconds": d.capture_seconds, "graphs": len(d.graphs), "rows": s.rows,
            "slots": s.slots}


def decode_static(model: Transformer, decoder: StaticDecoder, rows: Sequence[Row], prompts: list[list[int]],
                  share: list[int], sample: Sampler, uniforms: torch.Tensor, graphs: bool) -> None:
    """Run rows (row i from prompt share[i], uniforms [R, T]) to their ends; the rows record their tokens."""
    state = decoder.state
    prefix, mask, logits = prefill_prompts(model, prompts)  # cache [P, L], mask [P, L], logits [P, V]
    index = torch.tensor(share, dtype=torch.long, device=model.device)  # [R]
    state.start_rows(prefix, mask, index, uniforms)
    del prefix
    R = len(rows)
    state.record_first(sample(logits.index_select(0, index), None, state.uniforms[:R, :1]))
    slots, b, first = list(range(R)), bucket_for(R), 0  # slots[s]: the row in batch slot s
    if uniforms.shape[1] == 1:  # one token a row: the prefill's draw is all there is
        take_tokens(rows, slots, state.read(b, 0)[:, :, :1])
        return
    while True:
        decoder.run_chunk(model, b, sample, graphs)
        take_tokens(rows, slots, state.read(b, first))
        first = 1
        live = [s for s, r in enumerate(slots) if not rows[r].finished]
        if not live:
            return
        if bucket_for(len(live)) < b:
            state.move_rows(live)
            slots, b = [slots[s] for s in live], bucket_for(len(live))


def take_tokens(rows: Sequence[Row], slots: list[int], hist: torch.Tensor) -> None:
    """hist [3, b, C] (host): each live row takes its C tokens in order, up to the one that finishes it."""
    tokens, logps, filtered = hist[0].long().tolist(), hist[1].tolist(), hist[2].tolist()
    for s, r in enumerate(slots):
        row = rows[r]
        for j, token in enumerate(tokens[s]):
            if row.finished:
                break
            if token == NAN_TOKEN:
                raise NonFiniteLogits("NaN or +inf logits in the decode: the model's weights or activations blew up")
            row.take(token, logps[s][j], filtered[s][j])
