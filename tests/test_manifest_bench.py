"""benchmarks/manifest_cost.py's plumbing on a tiny model: every load it times runs, and each way does what it
says (a copied checkpoint is hashed, a stamped one and the reference are not)."""

import argparse

from benchmark_scripts import load_benchmark

import grpo_engine.checkpoint.verify as verify_mod
from grpo_engine.checkpoint import stamps


def test_manifest_cost_times_every_way_and_only_copied_checkpoints_are_hashed(tmp_path, monkeypatch):
    bench = load_benchmark("manifest_cost")
    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(stamps, "RACY_NS", -10**18)  # as if written long before they are stamped
    args = argparse.Namespace(vocab=300, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2)
    ckpt = bench.write_checkpoint(tmp_path, args)
    real, hashed = verify_mod.hash_files, []
    monkeypatch.setattr(verify_mod, "hash_files", lambda root, names, *a: hashed.extend(names) or real(root, names, *a))
    for way in bench.WAYS:
        bench.fresh_stamps()
        if way == "stamped":
            verify_mod.check(ckpt)
        hashed.clear()
        bench.resume_load(ckpt, way)
        assert ("model/model.safetensors" in hashed) == (way == "copied"), (way, hashed)
    seconds = bench.measure(ckpt, bench.write_run(tmp_path / "train", args), repeats=1)
    assert set(seconds) == {"eval", "resume", "export", "train --resume"}
    assert set(seconds["export"]) == set(seconds["train --resume"]) == set(bench.WAYS[1:])
    assert all(s > 0 for ways in seconds.values() for s in ways.values())
