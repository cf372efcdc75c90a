"""`grpo export MODEL|CHECKPOINT|RUN_DIR OUT.gguf --type f16|q8_0|bf16|f32`: a trained model as one GGUF file
that llama.cpp and Ollama run, tokenizer and chat template inside.

Written the way llama.cpp's own converter writes a checkpoint of each family with a GGUF architecture
(model/config.py FAMILIES with a `gguf_arch`; Mistral and Ministral as llama): its metadata keys (Granite's
scales, Phi-3's rotary dims and longrope keys, Gemma 3's), its tensor names (gguf_io.block_names) in the order of
the Hugging Face tensor names, the llama-like families' q/k rows permuted (the inverse of gguf_io.unpermute_qk), Phi-3's
longrope factors as rope_factors_long / rope_factors_short, 1-D tensors (norms, biases) in F32 and the matrices in
the chosen type. Q8_0 packs each
row in blocks of 32 values, so a matrix whose rows are not a multiple of 32 long cannot be Q8_0: it is written
as F16 with a warning, the fallback llama.cpp's converter takes. Checkpoints hold LoRA already merged into
model/, so an adapter run exports like any other.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from .config.trust import add_allow_code_arg
from .model.config import CheckpointError, rope_kind
from .progress import Progress

if TYPE_CHECKING:
    from .model.transformer import Transformer

TYPES = ("f16", "q8_0", "bf16", "f32")  # f32 and bf16: the files benchmarks/generate_vs_llamacpp.py times
FILE_TYPES = {"f16": 1, "q8_0": 7, "bf16": 32, "f32": 0}  # llama.cpp's general.file_type: MOSTLY_F16, MOSTLY_Q8_0,
# MOSTLY_BF16, ALL_F32
def arch_of(model_type: str) -> str:
    from .model.config import FAMILIES

    return FAMILIES[model_type].gguf_arch
Q8_0_BLOCK = 32  # values per Q8_0 block (one scale each); a row must hold a whole number of blocks


def permute_qk(w, heads: int):
    """llama.cpp's Llama q/k row order (w: a numpy array [rows, in]): each head's rows as [2, d/2] pairs
    swapped to [d/2, 2]."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str, model_type: str = "llama") -> str:
    from .model.config import FAMILIES
    from .model.gguf_io import GLOBAL_NAMES, block_names

    glob = {v: k for k, v in GLOBAL_NAMES.items()}
    if hf in glob:
        return glob[hf]
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    block = {v: k for k, v in block_names(FAMILIES[model_type]).items()}
    return f"blk.{layer}.{block[rest]}"


def write_metadata(w, model: Transformer, kind: str, name: str) -> None:
    c = model.config
    w.add_type("model")
    general = dict(c.extra.get("gguf_general", {}))
    w.add_name(str(general.pop("general.name", name)))
    for key, value in general.items():
        w.add_key_value(key, value, _value_type(value))
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_file_type(FILE_TYPES[kind])
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.rotary_dim)
    write_family_metadata(w, c)
    if c.head_dim != c.hidden_size // c.num_attention_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    if rope_kind(c.rope_scaling) == "linear":  # as llama.cpp's converter writes it (gguf_io._rope_scaling reads it)
        from gguf import RopeScalingType

        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(c.rope_scaling["factor"]))


def write_family_metadata(w, c) -> None:
    """Each family's own keys (Granite's scales, Phi-3's longrope, Gemma 3's), under llama.cpp's names (gguf_io reads
    them back)."""
    if c.model_type == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        w.add_attention_scale(c.attention_multiplier if c.attention_multiplier is not None else c.head_dim ** -0.5)
    if c.model_type == "gemma3_text":  # llama.cpp's keys; its gemma3 assumes the pattern and local base written
        if c.sliding_window is not None:
            w.add_sliding_window(c.sliding_window)
            w.add_sliding_window_pattern([c.window(i) is not None for i in range(c.num_hidden_layers)])
        w.add_rope_freq_base_swa(c.rope_local_theta if c.rope_local_theta is not None else c.rope_theta)
    if rope_kind(c.rope_scaling) == "longrope":
        from .model.transformer import rope_attention_factor

        w.add_rope_scaling_orig_ctx_len(int(c.rope_scaling["original_max_position_embeddings"]))
        w.add_rope_scaling_attn_factors(rope_attention_factor(c))


def write_rope_factors(w, c) -> None:
    """Longrope's per-frequency factors as llama.cpp's rope_factors_long / rope_factors_short tensors (F32)."""
    import numpy as np

    if rope_kind(c.rope_scaling) == "longrope":
        for name, key in (("rope_factors_long.weight", "long_factor"), ("rope_factors_short.weight", "short_factor")):
            w.add_tensor(name, np.asarray(c.rope_scaling[key], dtype=np.float32))


def check_exportable(c, src) -> None:
    """What llama.cpp cannot express for this family: refused by name."""
    kind = rope_kind(c.rope_scaling)
    if kind not in ("default", "linear") and not (kind == "longrope" and c.model_type == "phi3"):
        raise CheckpointError(f"{src}: rope scaling {c.rope_scaling} is not written by this exporter "
                              f"(only linear, and phi3's longrope; llama.cpp stores llama3's as a rope_freqs tensor); "
                              f"convert with llama.cpp's converter")
    if not c.family.gguf_arch:
        raise CheckpointError(f"{src}: model_type {c.model_type!r} has no GGUF architecture in this exporter")
    if c.model_type == "smollm3":
        from .model.gguf_io import SMOLLM3_NO_ROPE_STEP

        fixed = tuple((i + 1) % SMOLLM3_NO_ROPE_STEP != 0 for i in range(c.num_hidden_layers))
        if tuple(c.uses_rope(i) for i in range(c.num_hidden_layers)) != fixed:
            raise CheckpointError(f"{src}: no_rope_layers is not every {SMOLLM3_NO_ROPE_STEP}th layer, the only "
                                  f"pattern llama.cpp's smollm3 runs; keep the Hugging Face checkpoint")
    check_windows_exportable(c, src)
    if c.model_type == "phi3" and c.family.gguf_arch and (c.attention_bias or c.mlp_bias):
        raise CheckpointError(f"{src}: phi3 with biases has no llama.cpp tensors; keep the Hugging Face checkpoint")


def check_windows_exportable(c, src) -> None:
    """Windows and Gemma 3's numbers as llama.cpp runs them: its llama architecture (Mistral's, Ministral's) has no
    window, its gemma3 takes every 6th layer full, a local rope base of 10,000, scores scaled by 1/sqrt(head_dim)
    and no final soft-cap; anything else would run differently there, so it is refused by name."""
    from .model.gguf_io import GEMMA_LOCAL_THETA, GEMMA_PATTERN

    keep = "keep the Hugging Face checkpoint"
    if c.family.gguf_arch == "llama" and c.windowed and c.sliding_window < c.max_position_embeddings:
        raise CheckpointError(f"{src}: sliding_window={c.sliding_window} below the context; llama.cpp's llama "
                              f"architecture (which {c.model_type} exports as) attends in full; {keep}")
    if c.model_type != "gemma3_text":
        return
    pattern = tuple((i + 1) % GEMMA_PATTERN != 0 for i in range(c.num_hidden_layers))
    if c.windowed and tuple(c.window(i) is not None for i in range(c.num_hidden_layers)) != pattern:
        raise CheckpointError(f"{src}: layer_types is not every {GEMMA_PATTERN}th layer full, the pattern llama.cpp's "
                              f"gemma3 runs; {keep}")
    if c.rope_local_theta not in (None, GEMMA_LOCAL_THETA) or c.final_logit_softcapping is not None \
            or abs(c.attention_multiplier * c.head_dim ** 0.5 - 1) > 1e-6:
        raise CheckpointError(f"{src}: rope_local_base_freq={c.rope_local_theta}, final_logit_softcapping="
                              f"{c.final_logit_softcapping} or query_pre_attn_scalar != head_dim: llama.cpp's gemma3 "
                              f"runs 10000, none and head_dim; {keep}")


# Qwen3Config's default head_dim: transformers' GGUF loader leaves head_dim at it for every qwen3 file
TRANSFORMERS_QWEN3_HEAD_DIM = 128


def transformers_head_dim(c) -> int:
    """The head size transformers' GGUF loader gives a model of this config (as of transformers 5.24).

    It reads Llama's from rope.dimension_count but ignores attention.key_length for qwen2 (hidden / heads)
    and qwen3 (Qwen3Config's default, 128); llama.cpp reads key_length, so only transformers goes wrong.
    """
    fixed = {"qwen2": c.hidden_size // c.num_attention_heads, "qwen3": TRANSFORMERS_QWEN3_HEAD_DIM}
    return fixed.get(c.model_type, c.head_dim)


def warn_transformers_head_dim(c, source) -> None:
    """Why a warning and not an error: llama.cpp and Ollama (the export's audience) and this engine's own
    reader load the file right; only `from_pretrained(..., gguf_file=...)` does not (size mismatch)."""
    if transformers_head_dim(c) != c.head_dim:
        warnings.warn(f"{source}: head_dim={c.head_dim} is written as {c.model_type}.attention.key_length, which "
                      f"llama.cpp reads but transformers' GGUF loader ignores for {c.model_type} (it assumes "
                      f"{transformers_head_dim(c)}): transformers cannot load the exported file; load the "
                      f"checkpoint directory in transformers instead", stacklevel=3)


def warn_transformers_phi3(c, source) -> None:
    """transformers' GGUF loader reads phi3 files without rope.dimension_count and the rope factor tensors (as of
    transformers 5.25): llama.cpp runs a partial-rotary or longrope export right, transformers does not."""
    if c.model_type == "phi3" and (c.rotary_dim != c.head_dim or rope_kind(c.rope_scaling) == "longrope"):
        warnings.warn(f"{source}: phi3's partial rotary / longrope are written as llama.cpp reads them, but "
                      f"transformers' GGUF loader ignores them: load the checkpoint directory in transformers "
                      f"instead of the exported file", stacklevel=3)


def _value_type(value):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, int):
        return GGUFValueType.UINT32
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, list):
        return GGUFValueType.ARRAY
    return GGUFValueType.STRING


def _write_tensor(w, c, hf: str, tensor, kind: str, kept_f16: list[str]) -> None:
    """One tensor into the GGUF writer: norms and biases F32, matrices F16, Q8_0 (rows not a multiple of the
    Q8_0 block stay F16, noted in kept_f16), BF16 (rounded to nearest even, as torch's .bfloat16()) or F32."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from .model.gguf_io import PERMUTED_QK

    t = tensor.float().numpy()  # [out, in] for a matrix: rows of length `in`
    if c.family.norm_offset and hf.endswith("norm.weight"):  # llama.cpp's Gemma norms hold the scale 1 + w
        t = t + np.float32(c.family.norm_offset)
    if c.model_type in PERMUTED_QK and hf.endswith(("q_proj.weight", "k_proj.weight")):
        t = permute_qk(t, c.num_attention_heads if "q_proj" in hf else c.num_key_value_heads)
    name = gguf_name(hf, c.model_type)
    if t.ndim == 1 or kind == "f32":
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    elif kind == "bf16":
        q = quants.quantize(np.ascontiguousarray(t, dtype=np.float32), GGMLQuantizationType.BF16)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.BF16)
    elif kind == "f16" or t.shape[-1] % Q8_0_BLOCK:
        if kind != "f16":
            kept_f16.append(f"{name} {list(t.shape)}")
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float16))
    else:
        q = quants.quantize(np.ascontiguousarray(t, dtype=np.float32), GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=GGMLQuantizationType.Q8_0)


def write_tensors(w, model: Transformer, kind: str) -> None:
    from .model.hf_io import hf_name_table, hf_state_dict

    c = model.config
    state = hf_state_dict(model)
    kept_f16 = []  # (name, shape) of the matrices q8_0 cannot hold
    names = sorted(hf_name_table(c).values())
    write_rope_factors(w, c)
    with Progress(f"GGUF export ({kind})", len(names), stream=sys.stderr) as bar:
        for i, hf in enumerate(names):
            _write_tensor(w, c, hf, state[hf], kind, kept_f16)
            bar.update(i + 1, "tensors")
    if kept_f16:
        shown = ", ".join(kept_f16[:4]) + (f" and {len(kept_f16) - 4} more" if len(kept_f16) > 4 else "")
        warnings.warn(f"--type q8_0: {len(kept_f16)} matri{'x' if len(kept_f16) == 1 else 'ces'} with rows not a "
                      f"multiple of {Q8_0_BLOCK} values written as F16 instead, as llama.cpp's converter does "
                      f"({shown}); the file still runs in llama.cpp and Ollama", stacklevel=3)


def export_gguf(source: str, out: str, kind: str = "f16", *, overwrite: bool = False) -> Path:
    """Write `source` (model dir, .gguf, checkpoint or run dir) to the GGUF file `out` as f16, q8_0, bf16 or f32."""
    import gguf

    from .model.finite import refuse_nonfinite
    from .model.gguf_tokenizer import write_tokenizer
    from .model.loading import load_model, load_tokenizer

    if kind not in TYPES:
        raise CheckpointError(f"--type {kind!r} is not supported; choose one of {', '.join(TYPES)}")
    out_path = Path(out)
    if out_path.is_dir():
        raise CheckpointError(f"{out_path} is a directory; give the .gguf file to write "
                              f"(e.g. {out_path / 'model.gguf'})")
    if out_path.exists() and not overwrite:
        raise CheckpointError(f"{out_path} exists; remove it or pass --overwrite")
    from .checkpoint.store import model_source

    try:
        src = model_source(source)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from None
    model, tok = load_model(src), load_tokenizer(src)
    refuse_nonfinite(model, src)  # a .gguf of NaNs would load in llama.cpp and print garbage
    check_exportable(model.config, src)
    warn_transformers_head_dim(model.config, src)
    warn_transformers_phi3(model.config, src)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")  # written whole, then renamed: no half-written .gguf
    try:
        w = gguf.GGUFWriter(str(tmp), arch_of(model.config.model_type))
        write_metadata(w, model, kind, src.parent.name if src.name == "model" else src.stem)
        write_tokenizer(w, tok, model.config.vocab_size)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_tensors(w, model, kind)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tmp.replace(out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a model, checkpoint or run as one GGUF file (llama.cpp, Ollama)")
    p.add_argument("source", help="HF model dir, .gguf file, checkpoint dir, or run dir (its newest checkpoint)")
    p.add_argument("out", help="output .gguf path")
    p.add_argument("--type", default="f16", choices=TYPES,
                   help="matrix type: f16, q8_0, bf16 or f32 (norms stay F32; with q8_0, a matrix whose rows are "
                        "not a multiple of 32 long stays F16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    add_allow_code_arg(p, "the checkpoint's stored config.yaml")
    p.set_defaults(func=_run)


def _run(args) -> int:
    try:
        path = export_gguf(args.source, args.out, args.type, overwrite=args.overwrite)
    except (CheckpointError, FileNotFoundError) as e:
        print(f"grpo export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB, {args.type})")
    return 0
