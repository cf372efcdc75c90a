"""Checkpoints that prove themselves: a manifest of hashes written with each checkpoint, checked before one is
resumed, evaluated or exported.

manifest.json (written into `.tmp-step-N` after every other file, so the rename publishes both together):

    {"format": "grpo-engine checkpoint manifest", "version": 1, "block_bytes": 16777216,
     "files": {"model/model.safetensors": {"bytes": 363068040, "sha256": ["<bytes 0..16 MiB>", "<16..32 MiB>", ...],
                                           "xxh3_128": [...]},
               "config.yaml": {"bytes": 2140, "sha256": ["<hex>"], "xxh3_128": ["<hex>"]}, ...}}

Every file of the checkpoint but the manifest is listed (paths relative to the checkpoint, `/`-separated) with its
size and two hashes of each 16 MiB block: sha256 (a file of one block has the one `sha256sum` prints) and XXH3-128,
which a check compares. XXH3 finds any accidental change (a bit flip, a torn or overwritten range) as surely as
sha256 does, at about 8 GB/s per core against sha256's 1.1 GB/s, so a checkpoint copied from elsewhere costs a
fraction of its load; neither stops a forger who rewrites the manifest too. A manifest without XXH3 hashes
(written before they were added) is checked by its sha256. Blocks are hashed on every core at once and a mismatch
names the bytes that differ. Sizes are compared before any hashing, so a truncated file is found at once, and a
file stamped as verified and unchanged since (checkpoint/stamps.py: what this machine wrote or already checked) is
not hashed again.

A checkpoint is exactly what its manifest lists: a file under the parts checked that the manifest does not list (a
model.safetensors.index.json mapping the weights to an added shard, a chat_template.jinja, a tokenizer file) would
be read by a loader without anything vouching for it, so it is refused like a changed file.

A checkpoint without a manifest was written before manifests existed: it is used with a one-line warning (nothing
can be verified), when it holds nothing written only alongside manifests (MANIFEST_ERA: such a checkpoint lost its
manifest and is damaged) and has a regular config.yaml (without one, evaluating it would use the task's defaults).
A checkpoint whose manifest, files or trainer state do not check out is never used silently, and nothing is ever
deleted because of it: the error names the newest checkpoint of the run that does verify.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..config.paths import read_regular
from ..model.config import CheckpointError
from ..plan.resolved import RESOLVED_FILE
from .run_dir import LEGACY_STATE, STATE, step_dirs
from .stamps import remember, trusted

MANIFEST = "manifest.json"
FORMAT = "grpo-engine checkpoint manifest"
VERSION = 1
BLOCK_BYTES = 16 << 20  # the unit hashed on one core
READ_BYTES = 1 << 20  # one read of a block (the buffer each hashing thread holds)
MAX_MANIFEST_BYTES = 64 << 20  # about 900k blocks: a 14 TB checkpoint
HASHES = {"sha256": hashlib.sha256, "xxh3_128": xxhash.xxh3_128}  # what a manifest lists per block
CHECKED = "xxh3_128"  # what a check compares, where the manifest has it (else sha256)
REQUIRED = (f"{STATE}.json", "model/config.json")  # what a resumable checkpoint has, manifest or not
# what `grpo eval` / `grpo generate` / `grpo export` read of a checkpoint (eval: data.json, where the run's data is)
MODEL_PARTS = ("model/", "adapter/", "config.yaml", RESOLVED_FILE, "data.json")
MANIFEST_ERA = ("data.json", RESOLVED_FILE)  # written only into checkpoints that carry a manifest


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that is incomplete or does not match its manifest (one line: which file, and what to use)."""


@dataclass(frozen=True)
class Verdict:
    ckpt: Path
    problem: str | None = None  # None: the checkpoint verified (or, legacy, could not be checked)
    legacy: bool = False  # no manifest: written before manifests existed

    @property
    def ok(self) -> bool:
        return self.problem is None


def _hash_block(path: Path, start: int, length: int, kinds: tuple[str, ...]) -> dict[str, str]:
    """kind -> hex digest of bytes [start, start + length) of path, every kind in one read."""
    hashes, buf = [HASHES[kind]() for kind in kinds], bytearray(min(READ_BYTES, max(length, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        f.seek(start)
        while length > 0:
            n = f.readinto(view[: min(len(buf), length)])
            if not n:
                break  # the file shrank under us: the hash differs
            for h in hashes:
                h.update(view[:n])  # both release the GIL: the blocks of a file hash on every core
            length -= n
    return {kind: h.hexdigest() for kind, h in zip(kinds, hashes)}


def hash_files(root: Path, names: Iterable[str], kinds: tuple[str, ...] = (CHECKED,)) -> dict[str, dict[str, list]]:
    """name -> kind -> the digest of each BLOCK_BYTES block of root/name (one for a file of one block or less)."""
    jobs = []
    for name in names:
        size = (root / name).stat().st_size
        jobs += [(name, start, min(BLOCK_BYTES, size - start)) for start in range(0, max(size, 1), BLOCK_BYTES)]
    total = sum(length for _, _, length in jobs)
    workers = min(len(jobs), os.cpu_count() or 1, 16) if total > 4 * READ_BYTES else 1
    run = (lambda job: _hash_block(root / job[0], job[1], job[2], kinds))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="hash") as pool:
            digests = list(pool.map(run, jobs))
    else:
        digests = [run(job) for job in jobs]
    out: dict[str, dict[str, list]] = {}
    for (name, _, _), digest in zip(jobs, digests):
        for kind in kinds:
            out.setdefault(name, {}).setdefault(kind, []).append(digest[kind])
    return out


def files_of(ckpt: Path) -> list[str]:
    """Every file under ckpt but the manifest, as sorted `/`-separated relative paths."""
    found = [p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()]
    return sorted(name for name in found if name != MANIFEST)


def write_manifest(ckpt: Path, *, stamp_as: Path | None = None) -> dict:
    """Hash every file of the (not yet published) checkpoint into ckpt/manifest.json; stamp_as: the folder the
    checkpoint is published as, stamped as verified (checkpoint/stamps.py) so that resuming it hashes nothing."""
    names = files_of(ckpt)
    hashes = hash_files(ckpt, names, tuple(HASHES))
    files = {name: {"bytes": (ckpt / name).stat().st_size, **hashes[name]} for name in names}
    head = json.dumps({"format": FORMAT, "version": VERSION, "block_bytes": BLOCK_BYTES})[:-1]
    lines = ",\n".join(f" {json.dumps(name)}: {json.dumps(entry)}" for name, entry in files.items())
    text = f'{head}, "files": {{\n{lines}\n}}}}\n'  # one line per file
    (ckpt / MANIFEST).write_text(text)
    if stamp_as is not None:
        remember(ckpt, names, hashlib.sha256(text.encode()).hexdigest(), as_path=stamp_as)
    return {"format": FORMAT, "version": VERSION, "block_bytes": BLOCK_BYTES, "files": files}


def _read_manifest(ckpt: Path) -> tuple[int, dict[str, dict], str]:
    """(block size, files, the manifest's own sha256) of ckpt's manifest; ValueError naming what is wrong."""
    path = ckpt / MANIFEST
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"it is over {MAX_MANIFEST_BYTES >> 20} MiB")
    raw = read_regular(path, "the file", max_bytes=MAX_MANIFEST_BYTES, option="a manifest of fewer files")
    data = json.loads(raw)
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"not a version-{VERSION} {FORMAT}")
    block, files = data.get("block_bytes"), data.get("files")
    if not isinstance(block, int) or block < 1 or not isinstance(files, dict):
        raise ValueError("block_bytes / files malformed")
    for name, entry in files.items():
        if Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"it names {name!r}, outside the checkpoint")
        entry = entry if isinstance(entry, dict) else {}
        size = entry.get("bytes")
        blocks = max(1, -(-size // block)) if isinstance(size, int) else -1
        lists = [entry.get("sha256")] + ([entry[CHECKED]] if CHECKED in entry else [])  # CHECKED: not in older ones
        if not all(isinstance(h, list) and len(h) == blocks for h in lists):
            raise ValueError(f"its entry for {name!r} is malformed")
    return block, files, hashlib.sha256(raw).hexdigest()


def _selected(files: dict[str, dict], parts: tuple[str, ...] | None) -> dict[str, dict]:
    if parts is None:
        return files
    return {n: e for n, e in files.items() if any(n == p or (p.endswith("/") and n.startswith(p)) for p in parts)}


def verify(ckpt: Path, parts: tuple[str, ...] | None = None) -> Verdict:
    """Check ckpt's files against its manifest: all of them (parts=None: a resume), or those under `parts` (e.g.
    MODEL_PARTS: eval / export). Sizes first; then the hashes of every file not stamped as verified and unchanged
    since (checkpoint/stamps.py: what this machine wrote or verified is not hashed again)."""
    ckpt = Path(ckpt)
    if not os.path.lexists(ckpt / MANIFEST):
        return _legacy(ckpt)
    try:
        block, files, digest = _read_manifest(ckpt)
    except (OSError, ValueError, AttributeError, RecursionError) as e:
        return Verdict(ckpt, f"its {MANIFEST} is unreadable ({str(e).splitlines()[0] if str(e) else e!r})")
    listed = _selected(files, parts)
    unlisted = sorted(set(_selected(dict.fromkeys(entries_of(ckpt)), parts)) - set(files))
    if unlisted:
        more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
        return Verdict(ckpt, f"{unlisted[0]}{more} is not in its {MANIFEST}: added after the checkpoint was written, "
                             f"it would be read unverified; move it out of the checkpoint")
    for name in sorted(listed):
        path = ckpt / name
        if not path.is_file():
            return Verdict(ckpt, f"{name} is missing (its manifest lists it)")
        if path.stat().st_size != listed[name]["bytes"]:
            return Verdict(ckpt, f"{name} has {path.stat().st_size:,} bytes where its manifest says "
                                 f"{listed[name]['bytes']:,}")
    if block != BLOCK_BYTES:
        return Verdict(ckpt, f"its {MANIFEST} uses {block}-byte blocks; this version writes {BLOCK_BYTES}")
    unsure = sorted(set(listed) - trusted(ckpt, sorted(listed), digest))
    hashes = hash_files(ckpt, [name for name in unsure if CHECKED in listed[name]])
    older = [name for name in unsure if CHECKED not in listed[name]]  # manifests from before XXH3: sha256 only
    if older:
        hashes.update(hash_files(ckpt, older, ("sha256",)))
    verdict = _compare(ckpt, block, {n: listed[n] for n in unsure}, hashes)
    if verdict.ok:
        remember(ckpt, unsure, digest)
    return verdict


def entries_of(ckpt: Path) -> list[str]:
    """Everything under ckpt that is not a directory (files, links, FIFOs, devices) but the manifest, as sorted
    `/`-separated relative paths: what a loader could open."""
    found = [p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_symlink() or not p.is_dir()]
    return sorted(name for name in found if name != MANIFEST)


def _legacy(ckpt: Path) -> Verdict:
    """A checkpoint without a manifest: written before manifests (legacy, used with a warning) when it holds nothing
    of the manifest era and a regular config.yaml; else damaged."""
    era = [name for name in MANIFEST_ERA if os.path.lexists(ckpt / name)]
    if era:
        return Verdict(ckpt, f"it has {era[0]}, which is written only alongside a {MANIFEST}, but no {MANIFEST}: its "
                             f"manifest was removed, so nothing in it can be verified")
    config = ckpt / "config.yaml"
    if not config.is_file():  # follows links: a FIFO, a device or a link to one is not a regular file
        what = "is missing" if not os.path.lexists(config) else "is not a regular file"
        return Verdict(ckpt, f"it has no {MANIFEST} (written before manifests) and its config.yaml {what}, so the "
                             f"settings it was trained with are unknown; copy config.yaml from another checkpoint of "
                             f"the run into it")
    return Verdict(ckpt, legacy=True)


def _compare(ckpt: Path, block: int, listed: dict[str, dict], hashes: dict[str, dict[str, list]]) -> Verdict:
    for name in sorted(listed):
        (kind, got), = hashes[name].items()
        for i, (mine, want) in enumerate(zip(got, listed[name][kind])):
            if mine != want:
                end = min((i + 1) * block, listed[name]["bytes"])
                return Verdict(ckpt, f"{name} differs from its manifest ({kind} of bytes {i * block:,}-{end:,})")
    return Verdict(ckpt)


def check(ckpt: Path, parts: tuple[str, ...] | None = None) -> Verdict:
    """verify() plus what a checkpoint without a manifest can still be checked for: its trainer state and model
    config (a resume, parts=None) or its model config (eval / export) are there."""
    required = REQUIRED if parts is None else ("model/config.json",)
    if parts is None and (ckpt / LEGACY_STATE).is_file():
        required = ("model/config.json",)  # load_trainer_state refuses the pickle in its own words
    missing = [name for name in required if not (ckpt / name).is_file()]
    if missing:
        return Verdict(ckpt, f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing: it is "
                             f"incomplete")
    return verify(ckpt, parts)


def newest_verified(ckpt_root: Path, *, but: Path, parts: tuple[str, ...] | None = None) -> Verdict | None:
    """The newest step-* folder of ckpt_root other than `but` that checks out (legacy ones included), or None."""
    for ckpt in reversed(step_dirs(ckpt_root)):
        if ckpt.resolve() != Path(but).resolve():
            verdict = check(ckpt, parts)
            if verdict.ok:
                return verdict
    return None


def refuse(bad: Verdict, ckpt_root: Path, use: Callable[[Path], str], *, what: str = "",
           parts: tuple[str, ...] | None = None) -> CorruptCheckpointError:
    """The one-line error for a checkpoint that did not check out: what is wrong, that nothing was deleted, and the
    newest checkpoint of the run that does check out with `use(it)` (how to use it: a command, for example)."""
    good = newest_verified(ckpt_root, but=bad.ckpt, parts=parts)
    if good is None:
        tail = f"no other checkpoint in {ckpt_root} checks out"
    else:
        which = "earlier" if _step(good.ckpt) < _step(bad.ckpt) else "other"
        unverified = " (written before manifests, so unverified)" if good.legacy else ""
        tail = f"the newest {which} checkpoint that verifies is {good.ckpt}{unverified}: {use(good.ckpt)}"
    return CorruptCheckpointError(f"{what}{bad.ckpt}: {bad.problem}; nothing was deleted or used; {tail}")


def resume_refused(ckpt: Path, problem: str, command: str) -> CorruptCheckpointError:
    """The one-line error for a checkpoint --resume cannot use (files that do not check out, or that verified but
    whose content cannot be right: NaN/inf, which a run never saves): it names the newest other checkpoint that
    verifies and `command --resume IT`, the command that resumes from it."""
    return refuse(Verdict(ckpt, problem), ckpt.parent, lambda good: f"resume from it: {command} --resume {good}",
                  what="--resume: ")


def _step(ckpt: Path) -> int:
    digits = ckpt.name.rpartition("-")[2]
    return int(digits) if digits.isdigit() else -1


_warned: set[str] = set()


def warn_once(ckpt: Path, message: Callable[[str], None]) -> None:
    """The one-line warning for a checkpoint written before manifests (once per checkpoint and process)."""
    if str(Path(ckpt).resolve()) not in _warned:
        _warned.add(str(Path(ckpt).resolve()))
        message(f"warning: {ckpt} has no {MANIFEST} (written before checkpoint manifests): its files cannot be "
                f"verified; the checkpoints written from now on can be")
