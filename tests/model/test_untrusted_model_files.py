"""Model files are untrusted input (issue 41): a config that claims 10^6 layers, malformed GGUF headers and
safetensors headers end in one `grpo: error:` line naming the file, exit 2, within 20 s and 4 GB (bounded.py),
and a seeded fuzz of each parser ends every input in a model or a CheckpointError, never another exception."""

import json
import random
import shutil
import struct
import time

import pytest
from bounded import assert_refused, run_probes

from grpo_engine import CheckpointError, load_model
from grpo_engine.model.config import DIM_LIMITS
from grpo_engine.model.gguf_header import parse_gguf
from grpo_engine.model.gguf_io import config_from_gguf, load_gguf_model
from grpo_engine.model.hf_io import config_from_hf, read_json
from grpo_engine.model.transformer import Transformer

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tiny_ckpt_factory, tmp_path_factory):
    from grpo_engine.gguf_export import export_gguf

    out = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return export_gguf(str(tiny_ckpt_factory("qwen2")), str(out), "q8_0")


def small_gguf(path, layers: int):
    """~300 bytes: a llama header with no tensors that claims `layers` layers."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in [(w.add_block_count, layers), (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                       (w.add_head_count, 4), (w.add_context_length, 128), (w.add_vocab_size, 256)]:
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def key_offset(data: bytes, key: str) -> int:
    """Where the value of metadata `key` starts (after its name and its 4-byte type)."""
    return data.index(key.encode()) + len(key) + 4


def patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def hf_copy(src, dst, config_changes=None, safetensors: bytes | None = None):
    shutil.copytree(src, dst)
    if config_changes:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**raw, **config_changes}))
    if safetensors is not None:
        (dst / "model.safetensors").write_bytes(safetensors)
    return dst


def test_hostile_model_files_fail_in_one_line_within_bounds(tmp_path, tiny_ckpt, tiny_gguf):
    """Each probe of the issue, through `grpo generate` (the model loader; the tokenizer from the tiny model)."""
    data, st = tiny_gguf.read_bytes(), (tiny_ckpt / "model.safetensors").read_bytes()
    blocks, types = key_offset(data, "qwen2.block_count"), key_offset(data, "tokenizer.ggml.token_type")
    files = {
        "small-1e6.gguf": lambda p: small_gguf(p, 10**6),
        "layers-1e6.gguf": lambda p: p.write_bytes(patched(data, blocks, "<I", 10**6)),
        "layers-300.gguf": lambda p: p.write_bytes(patched(data, blocks, "<I", 300)),
        "tensor-count.gguf": lambda p: p.write_bytes(patched(data, 8, "<Q", 2**62)),
        "kv-count.gguf": lambda p: p.write_bytes(patched(data, 16, "<Q", 2**62)),
        "key-length.gguf": lambda p: p.write_bytes(patched(data, 24, "<Q", 2**62)),
        "array-length.gguf": lambda p: p.write_bytes(patched(data, types + 4, "<Q", 2**62)),  # gguf's reader: hang
        "value-type.gguf": lambda p: p.write_bytes(patched(data, types - 4, "<I", 77)),
        "truncated.gguf": lambda p: p.write_bytes(data[: len(data) // 3]),
        "hf-1e6": lambda p: hf_copy(tiny_ckpt, p, {"num_hidden_layers": 10**6}),
        "hf-300": lambda p: hf_copy(tiny_ckpt, p, {"num_hidden_layers": 300}),
        "hf-vocab": lambda p: hf_copy(tiny_ckpt, p, {"vocab_size": 10**9}),
        "st-length": lambda p: hf_copy(tiny_ckpt, p, safetensors=struct.pack("<Q", 2**62) + st[8:]),
        "st-json": lambda p: hf_copy(tiny_ckpt, p, safetensors=st[:8] + b"{" * 64 + st[72:]),
    }
    needles = {"small-1e6.gguf": "llama.block_count=1000000", "layers-1e6.gguf": "qwen2.block_count=1000000",
               "layers-300.gguf": "num_hidden_layers=300 but the tensors hold 2", "tensor-count.gguf": "tensor count",
               "kv-count.gguf": "metadata key count", "key-length.gguf": "length of a metadata key",
               "array-length.gguf": "array's length", "value-type.gguf": "value type 77",
               "truncated.gguf": "truncated", "hf-1e6": "num_hidden_layers=1000000",
               "hf-300": "num_hidden_layers=300 but the tensors hold 2", "hf-vocab": "vocab_size=1000000000",
               "st-length": "header length", "st-json": "header is not JSON"}
    for name, make in files.items():
        make(tmp_path / name)
    results = run_probes([["generate", str(tmp_path / name), "hi", "--tokenizer", str(tiny_ckpt), "--device", "cpu"]
                          for name in files])
    for name, result in zip(files, results):
        assert_refused(result, str(tmp_path / name), needles[name])


# ---------------------------------------------------------------------------------------------------- fuzz
def _flip(rng: random.Random, data: bytes, end: int) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        out[rng.randrange(end)] = rng.randrange(256)
    return bytes(out)


HUGE = [2**64 - 1, 2**63, 2**62, 2**32 - 1, 2**31, 10**9, 0]


def _gguf_mutants(rng: random.Random, data: bytes, header: int, count: int):
    """Truncations, byte flips (mostly in the `header` bytes), huge counts and lengths at the header's own count
    offsets, wrong value and tensor types."""
    counts = [8, 16, 24] + [data.index(k.encode()) - 8 for k in ("general.architecture", "qwen2.block_count",
                                                                 "tokenizer.ggml.tokens", "token_embd.weight")]
    counts += [key_offset(data, k) + 4 for k in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")]
    types = [key_offset(data, k) - 4 for k in ("qwen2.block_count", "general.architecture", "tokenizer.ggml.tokens")]
    for i in range(count):
        kind = i % 5
        if kind == 0:
            yield data[: rng.randrange(len(data))]
        elif kind == 1:
            yield _flip(rng, data, header if rng.random() < 0.8 else len(data))
        elif kind == 2:
            yield patched(data, rng.choice(counts), "<Q", rng.choice(HUGE))
        elif kind == 3:
            yield patched(data, rng.choice(types), "<I", rng.choice([9, 8, 12, 13, 77, 2**32 - 1, 0]))
        else:  # a tensor record's type, dimension count or a dimension
            at = data.index(b"blk.0.attn_q.weight") + len("blk.0.attn_q.weight")
            yield patched(data, at + rng.choice([0, 4, 12, 20]), "<I", rng.choice([5, 3, 2**31, 99, 30, 39]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # flipped bytes in tensor data dequantize to inf / nan
def test_gguf_reader_fuzz(tmp_path, tiny_gguf):
    """250 seeded inputs: each ends in a Transformer or a CheckpointError from the GGUF loader, within 30 s."""
    rng, start, outcomes = random.Random(41), time.perf_counter(), {"ok": 0, "error": 0}
    data, header = tiny_gguf.read_bytes(), min(t.data_offset for t in parse_gguf(tiny_gguf)[1])
    for i, mutant in enumerate(_gguf_mutants(rng, data, header, 250)):
        path = tmp_path / f"{i}.gguf"  # its own name: read_gguf caches by path, modification time and size
        path.write_bytes(mutant)
        try:
            assert isinstance(load_gguf_model(path), Transformer)
            outcomes["ok"] += 1
        except CheckpointError as e:
            assert "\n" not in str(e) and str(path) in str(e), (i, str(e))
            outcomes["error"] += 1
        path.unlink()
    assert outcomes["ok"] > 10 and outcomes["error"] > 100, outcomes
    assert time.perf_counter() - start < 30


def test_gguf_metadata_fuzz_of_config_values():
    """Hostile metadata values (wrong types, huge, zero, negative, NaN) end in a ModelConfig or CheckpointError."""
    rng = random.Random(7)
    base = {"general.architecture": "llama", "llama.attention.head_count": 4, "llama.embedding_length": 32,
            "llama.feed_forward_length": 64, "llama.block_count": 2, "llama.vocab_size": 100}
    hostile = [0, -1, 2**64, 10**7, 1.5, float("nan"), "4", [4], None, True, {"a": 1}, b"x"]
    keys = [*base, "llama.attention.head_count_kv", "llama.context_length", "llama.attention.key_length",
            "llama.rope.freq_base", "llama.rope.scaling.type", "llama.rope.scaling.factor",
            "llama.attention.layer_norm_rms_epsilon", "tokenizer.ggml.tokens", "tokenizer.ggml.bos_token_id"]
    for _ in range(300):
        meta = dict(base)
        for key in rng.sample(keys, rng.randint(1, 3)):
            meta[key] = rng.choice(hostile)
        try:
            config_from_gguf(meta, "fuzz.gguf")
        except CheckpointError as e:
            assert str(e).startswith("fuzz.gguf: ")


def test_gguf_header_parse_matches_the_gguf_package(tiny_gguf):
    """The bounded parser reads what gguf's own reader reads: every key's value, every tensor's bytes."""
    meta, tensors = parse_gguf(tiny_gguf)
    theirs = gguf.GGUFReader(str(tiny_gguf))
    expected = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert meta == expected
    assert [(t.name, t.tensor_type, t.shape, t.data.tobytes()) for t in tensors] == \
        [(t.name, t.tensor_type, tuple(int(d) for d in t.shape), t.data.tobytes()) for t in theirs.tensors]


HOSTILE_JSON = [0, -1, 10**30, 2**63, 1.5, float("inf"), "12", [], {}, None, True, [1, 2], {"x": [1]}]


def _hf_mutants(rng: random.Random, config: dict, st: bytes, count: int):
    """(config.json text, safetensors bytes): hostile config values, truncated or flipped JSON, and safetensors
    files with a flipped, truncated or rewritten header (shape, dtype, offsets) or a wrong header length."""
    (length,) = struct.unpack_from("<Q", st)
    header = json.loads(st[8 : 8 + length])
    names = [n for n in header if n != "__metadata__"]
    for i in range(count):
        text, body, kind = json.dumps(config), st, i % 6
        if kind == 0:
            keys = rng.sample(sorted(config), rng.randint(1, 3))
            text = json.dumps({**config, **{k: rng.choice(HOSTILE_JSON) for k in keys}})
        elif kind == 1:
            text = text[: rng.randrange(len(text))] if rng.random() < 0.5 else _flip(rng, text.encode(), len(text))
        elif kind == 2:
            body = st[: rng.randrange(len(st))]
        elif kind == 3:
            body = _flip(rng, st, 8 + length if rng.random() < 0.5 else len(st))  # the header, or anywhere
        elif kind == 4:
            body = patched(st, 0, "<Q", rng.choice([*HUGE, length - 1, length + 1, len(st)]))
        else:
            entry = dict(header[rng.choice(names)])
            entry[rng.choice(["shape", "dtype", "data_offsets"])] = rng.choice(
                [*HOSTILE_JSON, [10**12], [2, -3], "F99", [0, 10**12], [5, 3], ["a"]])
            new = json.dumps({**header, rng.choice(names): entry}).encode()
            body = struct.pack("<Q", len(new)) + new + st[8 + length :]
        yield text if isinstance(text, str) else text.decode("latin-1"), body


def test_hf_checkpoint_fuzz(tmp_path, tiny_ckpt):
    """250 seeded config.json / safetensors inputs: each ends in a Transformer or a CheckpointError, within 30 s."""
    rng, start, outcomes = random.Random(41), time.perf_counter(), {"ok": 0, "error": 0}
    config = json.loads((tiny_ckpt / "config.json").read_text())
    st = (tiny_ckpt / "model.safetensors").read_bytes()
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for i, (text, body) in enumerate(_hf_mutants(rng, config, st, 250)):
        (ckpt / "config.json").write_text(text, encoding="latin-1")
        (ckpt / "model.safetensors").write_bytes(body)
        try:
            assert isinstance(load_model(ckpt), Transformer)
            outcomes["ok"] += 1
        except CheckpointError as e:
            assert "\n" not in str(e) and str(ckpt) in str(e), (i, str(e))
            outcomes["error"] += 1
    assert outcomes["ok"] > 10 and outcomes["error"] > 100, outcomes
    assert time.perf_counter() - start < 30


def test_config_limits_admit_the_largest_open_models():
    """Llama-3.1-405B's config.json passes the limits (and a ~100B model by far): they stop bombs, not models."""
    raw = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
           "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
           "max_position_embeddings": 131072, "rope_theta": 500000.0}
    assert config_from_hf(raw).num_hidden_layers == 126
    assert all(limit >= 4 * value for limit, value in [(DIM_LIMITS["num_hidden_layers"], 126),
                                                      (DIM_LIMITS["hidden_size"], 16384)])


def test_read_json_refuses_deep_nesting_and_bad_utf8(tmp_path):
    (tmp_path / "deep.json").write_text("[" * 100_000)
    (tmp_path / "latin.json").write_bytes(b'{"a": "\xff"}')
    for name in ("deep.json", "latin.json"):
        with pytest.raises(CheckpointError, match=f"{name} is not valid JSON"):
            read_json(tmp_path / name)
