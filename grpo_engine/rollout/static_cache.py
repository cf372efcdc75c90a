"""The decode cache: one preallocated KV cache and per-row step buffers that a decode step reads and updates in
place, so the same step can run again and again with nothing allocated and nothing read back to the host (and, on
CUDA, be captured once as a graph and replayed: rollout/static_decode.py). It is the one decode cache: the prefill
writes the prompts into it (PromptCache), a decode step reads and writes it (BucketCache), a trajectory's
environment tokens go into it (FeedCache); each of those is a view of its buffers that the model's forward takes as
its cache (model/transformer.py KVCacheLike), not storage of its own.

Buffers, for a capacity of B rows and S slots plus one scratch slot:

    k[l], v[l]  [B, H_kv, S + 1, D]  zeroed once: a masked slot must hold finite values (its weight, 0, multiplies
                                     its value, and 0 * NaN is NaN)
    key_mask    [B, S + 1] bool      the slots a row attends to: its prompt's real tokens, the tokens it has fed
    ids         [B, 1] long          the token each row feeds next (its last sampled one)
    positions   [B, 1] long          that token's position (the count of the row's real tokens before it)
    write       [B] long             the slot that token goes to: every row has its own length
    col         [B] long             the row's next column of `uniforms`
    uniforms    [B, U] fp32          the row's uniforms, drawn ahead: column t draws its t-th token
    hist        [3, B, 1 + CHUNK]    per step: token (as a float), full-softmax log-prob, filtered log-prob

A batch of b rows (a bucket: 1, 2, 4, ... rows) runs on the views [:b] of every buffer, so all buckets share one
allocation and rows move to a smaller bucket by a copy to the front (`move_rows`).

Why the scratch slot: the model's forward (model/transformer.py) takes one `cache.start` for the whole batch and
lets the query at slot `start` always see that slot. Here `start` is the chunk's window W for every row: the new
key/value goes to the scratch slot W (what the query sees of itself) and to the row's own slot `write[r]`, masked
during this step and unmasked after it, when it becomes history. So each row attends exactly to its own tokens,
whatever its length.

The window: a chunk attends over slots [0, W] only, W = window_for(the largest write slot at the chunk's start),
the live length plus the chunk's CHUNK steps rounded up to WINDOW_ROUNDING (at most S, where the scratch slot is the
state's last): the keys and values a step reads grow with the rows instead of being all S + 1 slots from the first
step (at 512 prompt + 512 new slots about a third fewer). Slot W is past every slot a row writes in the chunk, so it
can be the scratch: a later, wider window finds it masked until its row writes it (its stale values are finite).
One graph per (bucket, window).

Per-layer storage (`layer_slots`): k and v are lists with one tensor per layer, each of its own width. A full layer
holds all S + 1 slots. A sliding layer keeps a ring of R = window + CHUNK entries instead when that is narrower,
indexed by position, not slot: a row's token at position q lives at entry q mod R (positions count a row's real
tokens, so its last R positions fill the ring whatever its padding and holes). Attention does not care about the
keys' order once RoPE is applied, so the layer attends over its ring under a mask by position (`ring_mask`): entry i
holds the newest position q_i of the row that is i mod R, seen by a query at p when p - window < q_i. Why CHUNK
entries beyond the window: a row can go on from a position after a chunk wrote up to CHUNK positions past it (a
multi-turn row set back to its turn's end, static_turns.py; a graph's capture check replaying the chunk its warm-up
ran, static_decode.py), and those writes overwrite only entries older than the window (R = window + CHUNK - 1 is
the least that holds: tests/rollout/test_sliding_cache.py fails at one less).
A forward of one token (a decode step) writes its ring entry first and attends over the ring; a forward of more
(the prefill, environment feeds) attends over the ring as it was and its own new keys, then writes the newest R of
them. The model asks a cache with rings for those layers' masks (`ring_masks`, model/transformer.py KVCacheLike).
"""

from __future__ import annotations

import torch

from ..model.transformer import ModelConfig
from .sampling import Draw

CHUNK = 16  # decode steps between two reads of the sampled tokens by the host (one device-to-host sync)
WINDOW_ROUNDING = 64  # a chunk's attended slots are rounded up to a multiple of this: one graph per rounding


def window_for(frontier: int, slots: int) -> int:
    """The scratch slot W of a chunk whose rows write at most up to slot `frontier` at its start: past every slot
    the chunk writes (frontier + CHUNK - 1), rounded up to WINDOW_ROUNDING, at most `slots` (the state's S)."""
    return min(slots, -(-(frontier + CHUNK) // WINDOW_ROUNDING) * WINDOW_ROUNDING)


def layer_slots(cfg: ModelConfig, full: int) -> list[int]:
    """Each layer's entries per row in a cache whose full layers hold `full` (the state's S + 1; the planner's
    slots): a sliding layer min(full, window + CHUNK) (the module docstring's rings), the one count the state
    allocates and the planner counts (plan/decode_state.py kv_state_bytes)."""
    windows = [cfg.window(i) for i in range(cfg.num_hidden_layers)]
    return [full if w is None else min(full, w + CHUNK) for w in windows]


def ring_mask(positions: torch.Tensor, held: torch.Tensor, ring: int, window: int) -> torch.Tensor:
    """The mask of a sliding layer's ring of `ring` entries: positions [m, T] are the queries', held [m, 1] the
    count of each row's positions the ring holds (the newest `ring` of those before `held`) -> bool [m, 1, T, ring].
    Entry i holds q_i = the newest such position that is i mod ring (q_i < 0: none yet), which the query at p sees
    when p - window < q_i."""
    last = held - 1  # [m, 1]
    q = last - (last - torch.arange(ring, device=held.device)).remainder(ring)  # [m, ring]
    return ((q >= 0)[:, None] & (positions[:, :, None] - q[:, None] < window))[:, None]


def ring_write(ring: torch.Tensor, index: torch.Tensor, new: torch.Tensor, held: torch.Tensor,
               last: torch.Tensor) -> torch.Tensor:
    """A forward's T new keys (or values) of rows `index` [m] into their rings and what the rows attend to.

    ring [B, H_kv, R, D]; new [m, H_kv, T, D], left-padded: a row's real ones are its last, at positions held ..
    last ([m, 1] each; none when last < held) -> [m, H_kv, R + T, D]: the rows' entries as they were (ring_mask
    with `held`), then the new ones. Entry i takes the newest new position that is i mod R, if any (column
    T - 1 - (last - q))."""
    R, T = ring.shape[2], new.shape[2]
    before = ring.index_select(0, index)  # [m, H_kv, R, D]
    q = last - (last - torch.arange(R, device=ring.device)).remainder(R)  # [m, R]: the newest position at entry i
    column = (T - 1 - (last - q)).clamp(0, T - 1)  # [m, R]
    taken = new.gather(2, column[:, None, :, None].expand(*before.shape))  # [m, H_kv, R, D]
    ring[index] = torch.where((q >= held)[:, None, :, None], taken, before)
    return torch.cat([before, new], dim=2)


def fresh_ring_masks(state: StaticDecodeState, positions: torch.Tensor, masks: dict):
    """For a forward of T tokens (the prefill, a feed; positions [m, T]) -> (each ring's mask over what ring_write
    returns: the ring as it was, then the new keys under the window's own slot mask; `held` [m, 1]: each row's
    positions before this forward, the valid slots its last query sees before the forward's own; `last` [m, 1]: the
    position of its last token, a real one, or a pad at held - 1 when it feeds nothing). ({}, None, None) without
    rings."""
    if not state.rings:
        return {}, None, None
    T, slot_mask = positions.shape[1], masks[None]
    assert slot_mask is not None and slot_mask.dim() == 4, "a forward on the rings passes its attention_mask"
    held = slot_mask[:, 0, -1, : slot_mask.shape[-1] - T].sum(-1, keepdim=True)  # [m, 1]
    out = {w: torch.cat([ring_mask(positions, held, R, w), masks[w][..., -T:].expand(-1, -1, T, T)], dim=-1)
           for w, R in state.rings.items()}
    return out, held, positions[:, -1:]


def bucket_for(rows: int) -> int:
    """The batch size a step runs at for `rows` live rows: the next power of two up to 512, then multiples of 512
    (each bucket is one captured graph; a finished row stays in its bucket until the live rows fit a smaller one)."""
    if rows <= 512:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 512) * 512


class PromptCache:
    """The KVCacheLike of the prefill: rows [:rows] of the state, written like a plain cache (each forward's T
    keys/values at slots [start, start + T) of every row, attended over slots [0, start + T))."""

    def __init__(self, state: StaticDecodeState, rows: int, start: int):
        self.state, self.rows, self.start = state, rows, start
        self.index = torch.arange(rows, device=state.device)  # [rows]
        self.held = self.last = None  # [rows, 1] each: set by ring_masks (a state with rings)

    def ring_masks(self, positions: torch.Tensor, masks: dict) -> dict:
        """The masks of the sliding layers kept in rings (module docstring), before the forward's layers run."""
        out, self.held, self.last = fresh_ring_masks(self.state, positions, masks)
        return out

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [rows, H_kv, T, D] -> slots [0, start + T) of the rows, [rows, H_kv, start + T, D] (a ring layer:
        ring_write's [rows, H_kv, R + T, D])."""
        if self.state.ring_of[layer] is not None:
            return tuple(ring_write(buf, self.index, new, self.held, self.last)
                         for buf, new in ((self.state.k[layer], k), (self.state.v[layer], v)))
        end = self.start + k.shape[2]
        out = []
        for buf, new in ((self.state.k[layer], k), (self.state.v[layer], v)):
            buf[: self.rows, :, self.start : end] = new
            out.append(buf[: self.rows, :, :end])
        return out[0], out[1]


class FeedCache:
    """The KVCacheLike of a forward that feeds T tokens to some rows (`index` [m]) at their own slots (`where`
    [m, T]; a pad's is the scratch slot): the rows attend over their slots [0, W) and the T new keys/values, which
    are also written to each row's own slots (static_turns.py)."""

    def __init__(self, state: StaticDecodeState, index: torch.Tensor, window: int, where: torch.Tensor):
        self.state, self.index, self.start, self.where = state, index, window, where
        self.held = self.last = None  # [m, 1] each: set by ring_masks (a state with rings)

    def ring_masks(self, positions: torch.Tensor, masks: dict) -> dict:
        """The masks of the sliding layers kept in rings (module docstring), before the forward's layers run."""
        out, self.held, self.last = fresh_ring_masks(self.state, positions, masks)
        return out

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [m, H_kv, T, D] -> [m, H_kv, W + T, D]: the rows' slots [0, W), then the new ones (a ring layer:
        ring_write's [m, H_kv, R + T, D])."""
        if self.state.ring_of[layer] is not None:
            return tuple(ring_write(buf, self.index, new, self.held, self.last)
                         for buf, new in ((self.state.k[layer], k), (self.state.v[layer], v)))
        out = []
        for buf, new in ((self.state.k[layer], k), (self.state.v[layer], v)):
            out.append(torch.cat([buf[:, :, : self.start].index_select(0, self.index), new], dim=2))
            buf[self.index[:, None], :, self.where] = new.transpose(1, 2)  # [m, T, H_kv, D] at (row, slot)
        return out[0], out[1]


class BucketCache:
    """The KVCacheLike (model/transformer.py) of the first b rows over a window of W + 1 slots: the model writes each
    row's new key/value at the row's own slot `write[r]` and at the scratch slot W, and attends over slots [0, W]
    under the key mask; a ring layer writes it at entry position mod R and attends over its ring (ring_masks)."""

    def __init__(self, state: StaticDecodeState, b: int, window: int):
        self.ring_of, self.rings = state.ring_of, state.rings
        # views: [b, H_kv, W + 1, D] of a full layer, its whole ring [b, H_kv, R, D] of a sliding one
        self.k = [t[:b] if r else t[:b, :, : window + 1] for t, r in zip(state.k, self.ring_of)]
        self.v = [t[:b] if r else t[:b, :, : window + 1] for t, r in zip(state.v, self.ring_of)]
        self.write, self.scratch, self.positions = state.write[:b], window, state.positions[:b, 0]
        self.rows = torch.arange(b, device=state.device)  # [b]: with `write`, each row's (row, slot) to write

    @property
    def start(self) -> int:
        return self.scratch  # the query's slot: start + T == W + 1, the key mask's width

    @start.setter
    def start(self, value: int) -> None:
        pass  # the model advances `start` after a forward; here each row's length is in `write`

    def ring_masks(self, positions: torch.Tensor, masks: dict) -> dict:
        """The masks of the ring layers: each row's query at p sees its ring once entry p mod R holds p (update)."""
        return {w: ring_mask(positions, positions + 1, R, w) for w, R in self.rings.items()}

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v [b, H_kv, 1, D] -> the window's slots [b, H_kv, W + 1, D], the new key/value at write[r] and at W
        (a ring layer: the ring [b, H_kv, R, D], the new key/value at entry position mod R)."""
        ring = self.ring_of[layer]
        if ring is not None:
            at = self.positions % ring  # [b]
            for buf, new in ((self.k[layer], k), (self.v[layer], v)):
                buf[self.rows, :, at] = new[:, :, 0]
            return self.k[layer], self.v[layer]
        for buf, new in ((self.k[layer], k), (self.v[layer], v)):
            buf[self.rows, :, self.write] = new[:, :, 0]  # [b, H_kv, D]: a scatter_ into this strided view would
            buf[:, :, self.scratch :] = new  # copy the whole layer's buffer on the CPU, every step
        return self.k[layer], self.v[layer]


class StaticDecodeState:
    """The buffers above for B rows, S slots and U uniforms per row (see the module docstring)."""

    STEP_BUFFERS = ("key_mask", "ids", "positions", "write", "col")  # what a step advances (step_buffers)

    def __init__(self, cfg: ModelConfig, rows: int, slots: int, columns: int, dtype: torch.dtype,
                 sample_dtype: torch.dtype, device: torch.device):
        assert cfg.vocab_size < 2**24, "token ids travel to the host as floats in `hist`"
        self.layer_slots = layer_slots(cfg, slots + 1)  # each layer's own width (module docstring)
        self.ring_of = [n if n < slots + 1 else None for n in self.layer_slots]  # layer -> its ring's R (None: full)
        self.rings = {cfg.window(i): n for i, n in enumerate(self.ring_of) if n is not None}  # window -> its R
        shapes = [(rows, cfg.num_key_value_heads, n, cfg.head_dim) for n in self.layer_slots]
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]  # [B, H_kv, S + 1 or R, D]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
        self.rows, self.slots, self.columns, self.dtype, self.device = rows, slots, columns, dtype, device
        self.key_mask = torch.zeros(rows, slots + 1, dtype=torch.bool, device=device)
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.write = torch.zeros(rows, dtype=torch.long, device=device)
        self.col = torch.zeros(rows, dtype=torch.long, device=device)
        self.uniforms = torch.zeros(rows, columns, device=device)
        self.hist = torch.zeros(3, rows, 1 + CHUNK, dtype=sample_dtype, device=device)
        self.views: dict[tuple[int, int], BucketCache] = {}

    def fits(self, rows: int, slots: int, columns: int, dtype: torch.dtype, device: torch.device) -> bool:
        return (rows <= self.rows and slots <= self.slots and columns <= self.columns and dtype == self.dtype
                and device == self.device)

    def bucket(self, rows: int) -> int:
        """The bucket `rows` live rows run at in this state: bucket_for(rows), at most the state's rows (an eager
        decode's state holds its call's rows exactly: its first bucket is that count)."""
        return min(bucket_for(rows), self.rows)

    def view(self, b: int, window: int | None = None) -> BucketCache:
        """The cache of rows [:b] over slots [0, window] (None: all S + 1)."""
        key = (b, self.slots if window is None else window)
        if key not in self.views:
            self.views[key] = BucketCache(self, *key)
        return self.views[key]

    def step_buffers(self) -> list[torch.Tensor]:
        """The per-row buffers a step advances (a graph's capture check saves and restores them: static_decode.py)."""
        return [getattr(self, name) for name in self.STEP_BUFFERS]

    def prompts(self, rows: int, start: int = 0) -> PromptCache:
        """The cache the prefill writes `rows` prompts through (rows [:rows], slots from `start`)."""
        return PromptCache(self, rows, start)

    def share_prefix(self, rows: int, length: int) -> None:
        """Slots [0, length) of row 0 (a prefix every prompt shares, prefilled once) copied to rows 1..rows-1 (a
        ring's entries [0, length) too: the prefix's positions, its last R when longer, lie there)."""
        for t in (*self.k, *self.v):
            t[1:rows, :, :length] = t[:1, :, :length]

    def start_rows(self, prompt_mask: torch.Tensor, share: list[int], uniforms: torch.Tensor) -> None:
        """Rows 0..R-1 start from the P prompts the prefill wrote in rows [:P] (slots [0, L)): prompt_mask [P, L]
        (True = real token), share [R] (row -> its prompt), uniforms [R, T]. Rows R.. are pads: they attend to the
        scratch slot only, and what they compute is never read."""
        (P, L), R = prompt_mask.shape, len(share)
        index = torch.tensor(share, dtype=torch.long, device=self.device)  # [R]
        if share != list(range(P)):  # rows other than one a prompt, in order: copy each prompt to its rows
            for t in (*self.k, *self.v):  # a ring's entries [0, L) hold positions 0 .. L - 1, all a prompt has
                t[:R, :, :L] = t[:P, :, :L].index_select(0, index)  # [R, H_kv, L, D] (at most R entries)
        self.key_mask.zero_()
        self.key_mask[:R, :L] = prompt_mask.index_select(0, index)
        self.key_mask[:, self.slots] = True
        self.positions.zero_()
        self.positions[:R, 0] = prompt_mask.sum(dim=1).index_select(0, index)
        self.write.fill_(L)
        self.col.zero_()
        self.col[:R] = 1  # column 0 drew the first token (record_first)
        self.uniforms[:R, : uniforms.shape[1]] = uniforms
        self.ids.zero_()

    def record_first(self, draw: Draw) -> None:
        """The first tokens, drawn from the prefill's logits ([R] each): fed by the next step, read with its chunk."""
        R = draw.tokens.shape[0]
        self.ids[:R, 0] = draw.tokens.clamp(min=0)  # a NaN row's flag (-1) must not index the embedding
        for i, x in enumerate(draw):
            self.hist[i, :R, 0] = x

    def advance(self, b: int, draw: Draw, j: int) -> None:
        """After step j of a chunk: record its draw in column j, and move every row [b] one token on."""
        for i, x in enumerate(draw):
            self.hist[i, :b, j] = x
        self.key_mask[:b].scatter_(1, self.write[:b, None], True)  # the fed token's slot becomes history
        self.write[:b].add_(1).clamp_(max=self.slots - 1)  # finished rows still step until they leave the bucket
        self.positions[:b].add_(1)
        self.ids[:b, 0] = draw.tokens.clamp(min=0)
        self.col[:b].add_(1).clamp_(max=self.columns - 1)

    def read(self, b: int, first: int, last: int = CHUNK) -> torch.Tensor:
        """hist [3, b, columns first..last] on the host (last: the chunk's steps): the one device-to-host copy of a
        chunk."""
        return self.hist[:, :b, first : last + 1].cpu()

    def move_rows(self, slots: list[int]) -> None:
        """Rows at `slots` (live, in order) move to the front, rows 0..len(slots)-1: the batch steps down a bucket."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        n = len(slots)
        for t in (*self.k, *self.v, self.key_mask, self.ids, self.positions, self.write, self.col, self.uniforms):
            t[:n] = t.index_select(0, index)
