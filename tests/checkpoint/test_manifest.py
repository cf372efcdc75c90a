"""checkpoint/verify.py: the manifest a checkpoint is written with, and what checking it finds."""

import hashlib
import json
import time
from pathlib import Path

import pytest
import xxhash

import grpo_engine.checkpoint.stamps as stamps_mod
import grpo_engine.checkpoint.verify as verify_mod
from grpo_engine.checkpoint.verify import MANIFEST, check, verify, write_manifest


@pytest.fixture
def ckpt(tmp_path, monkeypatch) -> Path:
    """A checkpoint-shaped folder; 4 KiB blocks so that a 10 KiB file has three."""
    monkeypatch.setattr(verify_mod, "BLOCK_BYTES", 4096)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "model.safetensors").write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    write_manifest(tmp_path)
    return tmp_path


def test_the_manifest_lists_every_file_with_plain_sha256_per_block(ckpt):
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["block_bytes"] == 4096 and sorted(manifest["files"]) == [
        "config.yaml", "empty", "model/config.json", "model/model.safetensors", "trainer_state.json"]
    data = (ckpt / "model/model.safetensors").read_bytes()
    assert manifest["files"]["model/model.safetensors"] == {
        "bytes": 10240, "sha256": [hashlib.sha256(data[i:i + 4096]).hexdigest() for i in (0, 4096, 8192)],
        "xxh3_128": [xxhash.xxh3_128(data[i:i + 4096]).hexdigest() for i in (0, 4096, 8192)]}
    assert manifest["files"]["empty"]["sha256"] == [hashlib.sha256(b"").hexdigest()]  # what sha256sum prints
    assert check(ckpt).ok and not check(ckpt).legacy


@pytest.mark.parametrize("damage,problem", [
    (lambda c: _flip(c / "model/model.safetensors", 5000), "model/model.safetensors differs from its manifest "
                                                           "(xxh3_128 of bytes 4,096-8,192)"),
    (lambda c: (c / "model/model.safetensors").write_bytes(b"x"), "has 1 bytes where its manifest says 10,240"),
    (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json is missing"),
    (lambda c: (c / MANIFEST).write_text("{not json"), "manifest.json is unreadable"),
    (lambda c: (c / MANIFEST).write_text(json.dumps({"format": verify_mod.FORMAT, "version": 1, "block_bytes": 4096,
                                                     "files": {"../x": {"bytes": 0, "sha256": ["0"]}}})),
     "outside the checkpoint"),
    (lambda c: (c / MANIFEST).write_text(json.dumps([1] * 10)), "not a version-1"),
])
def test_what_checking_finds(ckpt, damage, problem):
    damage(ckpt)
    verdict = check(ckpt)
    assert not verdict.ok and problem in verdict.problem


def test_a_manifest_without_xxh3_hashes_is_checked_by_its_sha256(ckpt):
    """Manifests written before XXH3 was added list sha256 only: they are checked by it, damage found as before."""
    manifest = json.loads((ckpt / MANIFEST).read_text())
    for entry in manifest["files"].values():
        del entry["xxh3_128"]
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    assert check(ckpt).ok
    _flip(ckpt / "model/model.safetensors", 9000)
    assert "model/model.safetensors differs from its manifest (sha256 of bytes 8,192-10,240)" in check(ckpt).problem
    manifest["files"]["empty"]["xxh3_128"] = []  # one block, no hash
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    assert "its entry for 'empty' is malformed" in check(ckpt).problem


def test_eval_checks_only_what_it_reads_and_a_checkpoint_without_manifest_is_legacy(ckpt):
    _flip(ckpt / "trainer_state.json", 0)
    assert check(ckpt, ("model/", "config.yaml")).ok and not check(ckpt).ok
    (ckpt / MANIFEST).unlink()
    assert verify(ckpt).legacy and check(ckpt).ok


def test_a_stamped_checkpoint_is_not_hashed_again_until_a_file_changes(ckpt, monkeypatch):
    """What this machine wrote (or verified) is checked from the files' stats: no hashing, so resuming costs
    milliseconds; a file rewritten since, even to the same size, is hashed again and caught."""
    write_manifest(ckpt, stamp_as=ckpt)
    real, hashed = verify_mod.hash_files, []
    monkeypatch.setattr(verify_mod, "hash_files", lambda root, names, *a: hashed.append(names) or real(root, names, *a))
    assert check(ckpt).ok and hashed[-1] != []  # just written: racy (same clock tick), so hashed
    monkeypatch.setattr(stamps_mod, "RACY_NS", -10**18)  # as if the files were written long before their stamp
    assert check(ckpt).ok and hashed[-1] == []
    time.sleep(0.05)  # past the clock tick of the stamp: a rewrite moves the file's times (the racy case is below)
    _flip(ckpt / "model/model.safetensors", 9000)  # in place: same size, same inode
    assert "model/model.safetensors differs" in check(ckpt).problem and hashed[-1] == ["model/model.safetensors"]


def test_a_quick_rewrite_after_the_stamp_is_still_caught(ckpt):
    """File times tick coarsely: a file rewritten right after it was stamped may keep its times, so a file changed
    within RACY_NS of its stamp is never trusted from its stats."""
    write_manifest(ckpt, stamp_as=ckpt)
    _flip(ckpt / "model/model.safetensors", 100)
    assert "model/model.safetensors differs" in check(ckpt).problem


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))
