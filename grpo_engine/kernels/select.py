"""Which GEMM runs each weight shape, which attention a decode step and a forward with a gradient use, and how many
threads: chosen by measuring on the machine that runs them.

Whether oneDNN beats torch's default fp32 GEMM depends on the CPU (about 2x on some AMD EPYC parts, level on some
Intel Xeon parts) and on the shape (call overhead wins for small weights), so nothing is assumed: for every distinct
weight shape of the model, both are timed in turns on a few representative products and the faster one is kept
(`race`); for each weight, whether packing it for a decode loop pays against that GEMM, from how many decode steps
and packed by which library (packing.py, packed.py), whether its training gradient is faster accumulated in place
(`Kernels.weight_grads_in_place`) than made by its GEMM and added, and which GEMM runs the gradient with respect to its
input (a product with the weight transposed, which need not favour the forward's GEMM: on an AVX2-only EPYC oneDNN
wins the decode-sized forward of some weights and loses their input gradient to torch's). The thread count is
measured first (threads.py) and the GEMMs are timed at that count. The plan is cached in a JSON file keyed by (CPU,
torch version, thread count), written into the run folder and every checkpoint, and read back on --resume on the
same CPU and torch, so a resumed run uses the same kernels and threads and repeats the uninterrupted one bit for
bit. GRPO_KERNELS=torch (or GRPO_ONEDNN=0) forces plain torch and its thread count.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from . import attention as attention_kernels
from . import onednn, packed
from . import threads as thread_choice
from .cpu import cpu_model

ROWS = (32, 512)  # products timed per weight: decode-sized and training-sized row counts
PLAN_FILE = "kernels.json"


@dataclass
class KernelPlan:
    """The kernel choices of one run (JSON-serialisable)."""

    cpu: str
    torch: str
    threads: int
    gemm: dict[str, str] = field(default_factory=dict)  # "out x in" of a weight -> "onednn" | "torch"
    source: str = "measured"  # measured | cache | checkpoint | forced
    attention: dict[str, str] = field(default_factory=dict)  # "H/Hkv/D" -> decode attention "sdpa" | "grouped"
    # "out x in" (fp32) or "out x in bfloat16" (packing_key) -> decode steps from which packing the weight for a
    # decode loop pays (packing.py), whichever GEMM its other products use; weights not listed are never packed
    decode_packing: dict[str, int] = field(default_factory=dict)
    # "out x in" -> how a weight's gradient is summed over micro-batches: "inplace" (one GEMM that accumulates
    # into .grad) or its `gemm` backend's name (that product handed to autograd, which adds it)
    weight_grad: dict[str, str] = field(default_factory=dict)
    # "out x in" -> the GEMM of the gradient with respect to the input, grad_y [M, out] @ W [out, in]: "onednn" |
    # "torch"; shapes not listed (plans recorded before it was measured) use their `gemm` backend
    grad_input: dict[str, str] = field(default_factory=dict)
    # "V x D" of the LM head -> the GEMM of the chunked log-prob head's forward, timed as it runs there: "torch"
    # (into one [chunk, V] buffer reused by every chunk) | "onednn" (a fresh output each chunk, page-faulted in);
    # not listed (older plans, other weights): its `gemm` backend
    logprob_head: dict[str, str] = field(default_factory=dict)
    # "out x in" of a weight in decode_packing -> which library packs it: "onednn" | "mkl" (kernels/packed.py);
    # not listed (older plans): oneDNN
    pack_kinds: dict[str, str] = field(default_factory=dict)
    # "V x D" of the LM head -> how the chunked head adds its weight gradient: "inplace" (torch's addmm_) |
    # "blocked" (onednn.blocked_weight_grad); not listed (older plans, other weights): in place
    head_weight_grad: dict[str, str] = field(default_factory=dict)
    # "H/Hkv/D" -> the attention of a forward with a gradient, "sdpa" | "grouped"; not listed (older plans): SDPA
    train_attention: dict[str, str] = field(default_factory=dict)

    def backend(self, weight_shape: tuple[int, ...]) -> str:
        return self.gemm.get(shape_key(weight_shape), "torch")

    def grad_input_backend(self, weight_shape: tuple[int, ...]) -> str:
        return self.grad_input.get(shape_key(weight_shape)) or self.backend(weight_shape)

    def logprob_head_backend(self, weight_shape: tuple[int, ...]) -> str:
        return self.logprob_head.get(shape_key(weight_shape)) or self.backend(weight_shape)

    def head_weight_grad_backend(self, weight_shape: tuple[int, ...]) -> str:
        return self.head_weight_grad.get(shape_key(weight_shape), "inplace")

    def pack_kind(self, weight_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> str:
        return self.pack_kinds.get(packing_key(weight_shape, dtype), "onednn")

    def grad_in_place(self, weight_shape: tuple[int, ...]) -> bool:
        return self.weight_grad.get(shape_key(weight_shape)) == "inplace"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, source: str) -> KernelPlan:
        data = json.loads(text)
        return cls(str(data["cpu"]), str(data["torch"]), int(data["threads"]),
                   {str(k): str(v) for k, v in data["gemm"].items()}, source,
                   {str(k): str(v) for k, v in data.get("attention", {}).items()},  # (older plans: SDPA)
                   {str(k): int(v) for k, v in data.get("decode_packing", {}).items()},  # (older: no packing)
                   {str(k): str(v) for k, v in data.get("weight_grad", {}).items()},  # (older: via autograd)
                   {str(k): str(v) for k, v in data.get("grad_input", {}).items()},  # (older: the forward's GEMM)
                   {str(k): str(v) for k, v in data.get("logprob_head", {}).items()},  # (older: the same)
                   {str(k): str(v) for k, v in data.get("pack_kinds", {}).items()},  # (older: oneDNN)
                   {str(k): str(v) for k, v in data.get("head_weight_grad", {}).items()},  # (older: in place)
                   {str(k): str(v) for k, v in data.get("train_attention", {}).items()})  # (older: SDPA)


def shape_key(weight_shape: tuple[int, ...]) -> str:
    return "x".join(str(int(d)) for d in weight_shape)


def forced_torch() -> bool:
    return os.environ.get("GRPO_KERNELS", "auto") == "torch" or os.environ.get("GRPO_ONEDNN", "1") == "0"


def weight_shapes(model: nn.Module, dtype: torch.dtype = torch.float32) -> list[tuple[int, int]]:
    """Distinct (out, in) shapes of the CPU linear weights of `dtype` whose products the engine runs (the GEMM
    choices are made for fp32 weights; bf16 ones are measured for decode packing only)."""
    shapes = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)
              and m.weight.dtype == dtype and m.weight.device.type == "cpu" and m.weight.dim() == 2}
    return sorted(shapes)


def packing_key(weight_shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> str:
    """The decode-packing key of a weight: "out x in" for fp32 (as plans already name them), "out x in bfloat16"."""
    return shape_key(weight_shape) + ("" if dtype == torch.float32 else " " + str(dtype).removeprefix("torch."))


def best_time(fn, reps: int = 3) -> float:
    """Fastest of `reps` timed calls of fn, after one untimed warm-up call."""
    fn()  # warm-up: first-call allocation and kernel dispatch
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def race(candidates: dict[str, Callable[[], object]], reps: int = 3) -> dict[str, float]:
    """Fastest of `reps` timed calls of each candidate, after one warm-up call each, the candidates taking turns
    (one call of each per round): how the plan times every choice between kernels (GEMMs, packed products, decode
    attention, the head's weight gradient). Timed one after the other, a burst of other work during one candidate's
    calls slows it alone and picks the other for good (the plan is cached); in turns, a burst slows one round of
    each."""
    for fn in candidates.values():
        fn()  # warm-up: first-call allocation and kernel dispatch
    best = dict.fromkeys(candidates, math.inf)
    for _ in range(reps):
        for name, fn in candidates.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measure_shape(out_features: int, in_features: int) -> dict[str, float]:
    """Seconds of x @ W^T for x of each ROWS size, summed, per backend."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g)
    times = {"torch": 0.0, "onednn": 0.0} if onednn.op_works() else {"torch": 0.0}
    for m in ROWS:
        x = torch.randn(m, in_features, generator=g)
        products = {"torch": lambda x=x: x @ w.t(), "onednn": lambda x=x: onednn.onednn_linear(x, w)}
        for name, seconds in race({k: products[k] for k in times}).items():
            times[name] += seconds
    return times


ONEDNN_GAIN = 1.03  # oneDNN must be this much faster to be chosen: where the two are level, plain torch


def faster_gemm(times: dict[str, float]) -> str:
    """The backend of `times` ({"torch": s, "onednn": s}) to run a shape on: oneDNN only when it beats torch by
    ONEDNN_GAIN, so that on a CPU where both are level (timer noise, a busy host) the plan is plain torch and does
    not change from one measurement to the next."""
    return "onednn" if times.get("onednn", math.inf) * ONEDNN_GAIN < times["torch"] else "torch"


def cache_path() -> Path:
    root = os.environ.get("GRPO_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return Path(root) / "grpo-engine" / PLAN_FILE


def _read_cache(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no cache yet, or an unreadable one: measure again


def _write_cache(path: Path, cache: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the plan is still used, just measured again next time


def largest_block_shape(model: nn.Module) -> tuple[int, int] | None:
    """The (out, in) shape of the biggest fp32 CPU projection inside the blocks (not the LM head), or None."""
    layers = getattr(model, "layers", None)
    shapes = weight_shapes(layers) if isinstance(layers, nn.Module) else []
    return max(shapes, key=lambda s: s[0] * s[1]) if shapes else None


def product_time(shape: tuple[int, int]) -> float:
    """Seconds of a training-sized x @ W^T for this weight shape, on the faster GEMM at the current threads."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(shape, generator=g), torch.randn(thread_choice.ROWS, shape[1], generator=g)
    seconds = best_time(lambda: x @ w.t())
    if onednn.op_works():
        seconds = min(seconds, best_time(lambda: onednn.onednn_linear(x, w)))
    return seconds


def choose_threads(model: nn.Module, cache: dict) -> int:
    """The thread count: fixed by the user, cached for this CPU / torch / shape, or measured (into `cache`, unless
    other work was running: thread_choice.others_busy)."""
    fixed = thread_choice.fixed_threads()
    shape = largest_block_shape(model)
    if fixed is not None or shape is None:  # told, or nothing runs on the CPU
        return fixed or torch.get_num_threads()
    available = thread_choice.AVAILABLE
    key = f"threads | {cpu_model()} | torch {torch.__version__} | {available} available | {shape_key(shape)}"
    if key not in cache:
        times = thread_choice.measure(thread_choice.candidates(available), lambda: product_time(shape))
        if thread_choice.others_busy():
            return thread_choice.pick(times)
        cache[key] = {"threads": thread_choice.pick(times), "seconds": {str(n): t for n, t in times.items()}}
    return int(cache[key]["threads"])


def bf16_ratio(hidden: int, intermediate: int) -> float:
    """bf16 seconds over fp32 seconds of a block's products at the current thread count, summed over both MLP
    weight shapes ([intermediate, hidden] and its transpose) and both ROWS sizes, fp32 on its faster GEMM (torch
    or oneDNN, as the kernel plan would run it): what memory.precision=auto weighs on a CPU (plan/precision.py).
    Cached per CPU, torch, thread count and shape (never when other work was running: thread_choice.others_busy),
    so a machine answers the same for every run of the model."""
    threads = torch.get_num_threads()
    key = f"bf16 | {cpu_model()} | torch {torch.__version__} | {threads} threads | {hidden}x{intermediate}"
    path = cache_path()
    cache = _read_cache(path)
    if key in cache:
        return float(cache[key]["ratio"])
    fp32 = bf16 = 0.0
    for shape in ((intermediate, hidden), (hidden, intermediate)):
        times = measure_shape(*shape)
        fp32 += min(times.values())
        bf16 += measure_bf16_shape(*shape)
    ratio = bf16 / fp32
    if not thread_choice.others_busy():
        cache[key] = {"ratio": ratio, "fp32_seconds": fp32, "bf16_seconds": bf16}
        _write_cache(path, cache)
    return ratio


def measure_bf16_shape(out_features: int, in_features: int) -> float:
    """Seconds of x @ W^T in bf16 for x of each ROWS size, summed: the product a bf16 model's nn.Linear runs."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    xs = [torch.randn(m, in_features, generator=g).bfloat16() for m in ROWS]
    return sum(best_time(lambda x=x: x @ w.t()) for x in xs)


def attention_shape(model: nn.Module) -> str | None:
    """The model's decode-attention key ("H/Hkv/D", with its dtype when not fp32: attention.shape_key), or None
    when the model is not on the CPU."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cpu" or not p.is_floating_point() or not hasattr(model, "config"):
        return None
    c = model.config
    return attention_kernels.shape_key(c.num_attention_heads, c.num_key_value_heads, c.head_dim, p.dtype)


def measure_attention(key: str) -> str:
    n_heads, n_kv, head_dim, dtype = attention_kernels.parse_key(key)
    times = attention_kernels.measure(n_heads, n_kv, head_dim, race, dtype)
    return min(times, key=times.get)


def measure_train_attention(key: str) -> str:
    n_heads, n_kv, head_dim, dtype = attention_kernels.parse_key(key)
    times = attention_kernels.measure_training(n_heads, n_kv, head_dim, race, dtype)
    return min(times, key=times.get)


def measure_packing(out_features: int, in_features: int, backend: str,
                    dtype: torch.dtype = torch.float32) -> tuple[int, str]:
    """(decode steps from which packing this weight for a decode loop pays, the kind that packs it): the kind
    (kernels/packed.py: oneDNN, MKL; bf16 weights: oneDNN) whose packed decode-sized product (ROWS[0] rows) is
    fastest, and its pack time over the seconds it saves on each such product against the weight's own GEMM
    (`backend`: "onednn" | "torch"; torch's for bf16); (0, "") when no packed product is at least PACK_GAIN faster
    (then packing never pays). A torch weight may pack too: a GEMM level with torch's on training-sized products
    can still win at decode once it skips its per-call reorder."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(ROWS[0], in_features, generator=g).to(dtype)
    kinds = packed.available(dtype)
    pack_seconds = {k: best_time(lambda k=k: packed.pack(w, ROWS[0], k), 1) for k in kinds}
    packs = {k: packed.pack(w, ROWS[0], k) for k in kinds}
    products = race({"plain": lambda: onednn.product(x, w, backend == "onednn"),  # the packed ones in turns with it
                     **{k: (lambda p=p: p(x)) for k, p in packs.items()}}, 5)
    plain = products.pop("plain")
    kind = min(products, key=products.get, default="")
    saved = plain - products[kind] if kind else 0.0
    return (math.ceil(pack_seconds[kind] / saved), kind) if saved > (1 - 1 / PACK_GAIN) * plain else (0, "")


# the cache entry of decode packing, [steps, kind] per weight, named apart from the older entries (steps alone, for
# oneDNN only), so that caches holding only those are measured again
PACKING_ENTRY = "decode packing per weight and kind"
PACK_GAIN = 1.03  # a packed product must be this much faster to count (timer noise on small weights)


def measure_weight_grad(out_features: int, in_features: int, backend: str) -> str:
    """How a weight's gradient is best summed over micro-batches of ROWS[1] tokens: "inplace" (torch's addmm_ into
    the gradient) when it is at least as fast as `backend`'s product ("onednn" | "torch") followed by an add.
    Small torch weights keep autograd's own path: their gradient temporary is under a megabyte, and in place they
    would leave nn.Linear's native autograd for a Python-level autograd function, whose overhead is not timed here."""
    if backend == "torch" and out_features * in_features < onednn.MIN_WEIGHT_NUMEL:
        return backend
    g = torch.Generator().manual_seed(0)
    x, gy = torch.randn(ROWS[1], in_features, generator=g), torch.randn(ROWS[1], out_features, generator=g)
    acc = torch.zeros(out_features, in_features)
    times = race({"inplace": lambda: acc.addmm_(gy.t(), x),
                  backend: lambda: acc.add_(onednn.product(gy.t(), x.t(), backend == "onednn"))}, 5)  # [N, M] @ [M, K]
    return "inplace" if times["inplace"] <= times[backend] else backend


def measure_grad_input(out_features: int, in_features: int, backend: str) -> str:
    """The GEMM of the gradient with respect to the input, grad_y [ROWS[1], out] @ W [out, in]: oneDNN (on the
    transposed weight) or torch's, by faster_gemm. Small torch weights keep autograd's own path, as in
    measure_weight_grad: their products are short and nothing is timed."""
    if backend == "torch" and out_features * in_features < onednn.MIN_WEIGHT_NUMEL:
        return backend
    g = torch.Generator().manual_seed(0)
    w, gy = torch.randn(out_features, in_features, generator=g), torch.randn(ROWS[1], out_features, generator=g)
    return faster_gemm(race({"torch": lambda: onednn.product(gy, w.t(), False),
                             "onednn": lambda: onednn.product(gy, w.t(), True)}, 5))


HEAD_ROWS = 256  # rows of a log-prob chunk (memory.logprob_chunk_size's default)


def measure_logprob_head(vocab: int, hidden: int, backend: str) -> str:
    """The GEMM of the chunked log-prob head's forward, [HEAD_ROWS, hidden] @ W^T [hidden, vocab], timed as
    rl/logprobs.py runs it: torch's into one reused [rows, vocab] buffer, or oneDNN's (which has no output
    argument) into a fresh tensor per chunk, whose hundreds of megabytes are page-faulted in on every call.
    A head whose GEMM is torch's stays on torch (nothing timed)."""
    if backend == "torch":
        return backend
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(vocab, hidden, generator=g), torch.randn(HEAD_ROWS, hidden, generator=g)
    out = torch.empty(HEAD_ROWS, vocab)
    return faster_gemm(race({"torch": lambda: torch.mm(x, w.t(), out=out),
                             "onednn": lambda: onednn.onednn_linear(x, w)}, 3))


def measure_head_weight_grad(vocab: int, hidden: int, backend: str) -> str:
    """How the chunked log-prob head adds a chunk's weight gradient, grad_w [vocab, hidden] += gz^T h for HEAD_ROWS
    rows: torch's addmm_ ("inplace") or oneDNN's products by vocabulary blocks (onednn.blocked_weight_grad,
    "blocked"), kept only when ONEDNN_GAIN faster. A head whose GEMM is torch's stays in place (nothing timed)."""
    if backend == "torch":
        return "inplace"
    g = torch.Generator().manual_seed(0)
    gz, h = torch.randn(HEAD_ROWS, vocab, generator=g), torch.randn(HEAD_ROWS, hidden, generator=g)
    acc = torch.zeros(vocab, hidden)
    times = race({"torch": lambda: acc.addmm_(gz.t(), h), "onednn": lambda: onednn.blocked_weight_grad(acc, gz, h)})
    return "blocked" if faster_gemm(times) == "onednn" else "inplace"


def head_shape(model: nn.Module, shapes: list[tuple[int, int]]) -> tuple[int, int] | None:
    """(vocab, hidden) of the model's LM head, when it is one of `shapes` (weight_shapes: those the plan covers)."""
    head = getattr(model, "lm_head", None)
    shape = tuple(head.weight.shape) if isinstance(head, nn.Linear) else None
    return shape if shape in shapes else None


# the cache entries of the attention choices, per head shape and dtype (attention_shape)
ATTENTION_ENTRIES = ("decode attention", "training attention")


def _measure_missing(cache: dict, key: str, shapes: list[tuple[int, int]], attention: str | None,
                     threads: int, head: tuple[int, int] | None = None,
                     bf16_shapes: list[tuple[int, int]] = ()) -> bool:
    """Measure into `cache` what its entries under `key` lack for these shapes (and the decode packing of these
    bf16 weight shapes), this attention and this LM head, at `threads`. Returns whether anything was measured."""
    known = cache.setdefault(key, {})
    missing = [s for s in shapes if shape_key(s) not in known]
    attentions = {name: cache.setdefault(f"{name} | {key}", {}) for name in ATTENTION_ENTRIES} if attention else {}
    attentions_missing = [name for name, entries in attentions.items() if attention not in entries]
    packing = cache.setdefault(f"{PACKING_ENTRY} | {key}", {}) if packed.available() else {}
    grads = cache.setdefault(f"weight grad | {key}", {})
    inputs = cache.setdefault(f"grad input | {key}", {})
    head_measures = {"logprob head": measure_logprob_head, "logprob head weight grad": measure_head_weight_grad}
    heads = {name: cache.setdefault(f"{name} | {key}", {}) for name in head_measures}
    heads_missing = [name for name, entries in heads.items() if head is not None and shape_key(head) not in entries]

    def lacking(entries: dict) -> list[tuple[int, int]]:
        return [s for s in shapes if shape_key(s) not in entries]

    bf16 = torch.bfloat16
    bf16_unpacked = [s for s in bf16_shapes if packing_key(s, bf16) not in packing] if packed.available(bf16) else []
    if not (missing or attentions_missing or heads_missing or lacking(grads) or lacking(inputs) or bf16_unpacked
            or (packed.available() and lacking(packing))):
        return False
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # timed at the count the run will use
    try:
        known.update({shape_key(s): faster_gemm(measure_shape(*s)) for s in missing})
        for name, measure in zip(ATTENTION_ENTRIES, (measure_attention, measure_train_attention)):
            if name in attentions_missing:
                attentions[name][attention] = measure(attention)
        for s in lacking(grads):
            grads[shape_key(s)] = measure_weight_grad(*s, known[shape_key(s)])
        for s in lacking(inputs):
            inputs[shape_key(s)] = measure_grad_input(*s, known[shape_key(s)])
        for s in lacking(packing) if packed.available() else []:
            packing[shape_key(s)] = list(measure_packing(*s, known[shape_key(s)]))
        for s in bf16_unpacked:  # against torch's bf16 GEMM, the one bf16 weights run on
            packing[packing_key(s, bf16)] = list(measure_packing(*s, "torch", bf16))
        for name in heads_missing:
            heads[name][shape_key(head)] = head_measures[name](*head, known[shape_key(head)])
    finally:
        torch.set_num_threads(previous)
    return True


def choose_plan(model: nn.Module, path: Path | None = None) -> KernelPlan:
    """The kernel plan for `model` on this machine: the thread count, then the GEMM of every weight shape, the
    decode and training attention, which weights a decode loop packs, how weight gradients are summed, which GEMM
    runs each input gradient and the log-prob head's forward, how that head adds its weight gradient, at that count;
    from the cache when everything is there, else measured (only what is missing) and cached."""
    shapes, attention = weight_shapes(model), attention_shape(model)
    head = head_shape(model, shapes)
    if forced_torch() or not onednn.op_works():
        threads = thread_choice.fixed_threads() or torch.get_num_threads()
        sdpa = {attention: "sdpa"} if attention else {}
        return KernelPlan(cpu_model(), torch.__version__, threads, {shape_key(s): "torch" for s in shapes}, "forced",
                          sdpa, train_attention=sdpa)
    path = path or cache_path()
    cache = _read_cache(path)
    before = json.dumps(cache, sort_keys=True)
    threads = choose_threads(model, cache)
    key = f"{cpu_model()} | torch {torch.__version__} | {threads} threads"
    bf16_shapes = weight_shapes(model, torch.bfloat16)
    measured = _measure_missing(cache, key, shapes, attention, threads, head, bf16_shapes)
    if json.dumps(cache, sort_keys=True) != before:
        _write_cache(path, cache)
    keys = [shape_key(s) for s in shapes]
    packable = keys + [packing_key(s, torch.bfloat16) for s in bf16_shapes]
    gemm = {k: cache[key][k] for k in keys}
    chosen, trained = ({attention: cache[f"{name} | {key}"][attention]} if attention else {}
                       for name in ATTENTION_ENTRIES)
    steps = cache.get(f"{PACKING_ENTRY} | {key}", {})
    packing = {k: int(steps[k][0]) for k in packable if k in steps and steps[k][0]}
    kinds = {k: str(steps[k][1]) for k in packing}
    grads = {k: cache[f"weight grad | {key}"][k] for k in keys}
    inputs = {k: cache[f"grad input | {key}"][k] for k in keys}
    heads = {shape_key(head): cache[f"logprob head | {key}"][shape_key(head)]} if head else {}
    head_grads = {shape_key(head): cache[f"logprob head weight grad | {key}"][shape_key(head)]} if head else {}
    return KernelPlan(cpu_model(), torch.__version__, threads, gemm, "measured" if measured else "cache", chosen,
                      packing, grads, inputs, heads, kinds, head_weight_grad=head_grads, train_attention=trained)


def load_plan(directory: Path) -> KernelPlan | None:
    """The plan recorded in a run folder or checkpoint, or None when it has none (older runs) or it is not a plan
    this version reads: then one warning names the file and this machine's plan is measured, as for a plan
    measured elsewhere. Why not refuse: the file is only a record of timings (no weights, nothing that changes the
    numbers beyond bit-for-bit repetition), and a checkpoint's manifest lists it, so deleting it, the fix a refusal
    would suggest, gets the checkpoint refused as damaged."""
    f = Path(directory) / PLAN_FILE
    if not f.is_file():
        return None
    try:
        return KernelPlan.from_json(f.read_text(errors="replace"), "checkpoint")
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # not JSON, or not a plan's fields
        what = f"missing field {e}" if isinstance(e, KeyError) else (str(e).splitlines() or [type(e).__name__])[0]
        warnings.warn(f"{f}: not a kernel plan ({what}); measuring this machine's kernels instead (the resumed run "
                      f"will not repeat the uninterrupted one bit for bit)", stacklevel=2)
        return None


def measured_here(plan: KernelPlan) -> bool:
    """Whether `plan` was measured on this CPU with this torch: only then can reusing it repeat a run bit for bit,
    and only then is it the fast plan here (a checkpoint moved to another machine would keep the old one's
    thread count and GEMMs). Plans recorded before the CPU was described in full name only the model name."""
    here = cpu_model()
    return plan.torch == torch.__version__ and (plan.cpu == here or here.startswith(f"{plan.cpu} ("))
