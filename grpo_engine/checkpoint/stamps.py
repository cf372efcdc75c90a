"""Verified stamps: which files of a checkpoint were last found to match its manifest, and as what (size, inode,
device, modification and change time), so that a file that has not changed since is not hashed again (git's index
does the same). A checkpoint this machine wrote or already verified is then checked in milliseconds; a file
rewritten since, or a checkpoint from elsewhere, is hashed in full.

Stamps live in the user's cache (GRPO_CACHE_DIR or ~/.cache/grpo-engine/verified/, one small JSON file per
checkpoint), never in the run directory: a run directory someone hands you carries no stamp of yours. A file whose
change time is within RACY_NS of when it was stamped may change again without its times moving (file times tick
coarsely), so it is hashed again, as are stamps of a manifest whose content changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from ..kernels.select import cache_path

RACY_NS = 100_000_000  # 0.1 s
MAX_STAMPS = 1000  # past this many, stamps of checkpoints that no longer exist are dropped

_memory: dict[Path, dict] = {}  # this process's stamps by stamp file (also when the cache cannot be written)


def _key(ckpt: Path) -> str:
    return str(Path(ckpt).resolve())


def _file_of(key: str) -> Path:
    return cache_path().parent / "verified" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _stat(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


def _load(key: str) -> dict:
    stamp = _memory.get(_file_of(key))
    if stamp is None:
        try:
            stamp = json.loads(_file_of(key).read_text())
        except (OSError, ValueError):
            return {}
    ok = isinstance(stamp, dict) and stamp.get("path") == key and isinstance(stamp.get("files"), dict)
    return stamp if ok else {}


def trusted(ckpt: Path, names: list[str], manifest_sha256: str) -> set[str]:
    """The names whose files are as they were when last found to match this manifest (not racily so)."""
    stamp = _load(_key(ckpt))
    if stamp.get("manifest") != manifest_sha256:
        return set()
    files = stamp["files"]

    def unchanged(name: str) -> bool:
        entry, now = files.get(name), _stat(ckpt / name)
        return isinstance(entry, list) and now is not None and entry[:5] == now and now[4] < entry[5] - RACY_NS

    return {name for name in names if unchanged(name)}


def remember(ckpt: Path, names: list[str], manifest_sha256: str, *, as_path: Path | None = None) -> None:
    """Stamp ckpt's `names` as matching the manifest (whose sha256 is given) now; as_path: the folder they will be
    in (a checkpoint stamped in its temp folder, before the rename that publishes it: the files keep their stats)."""
    key = _key(as_path or ckpt)
    stamp = _load(key)
    files = dict(stamp["files"]) if stamp.get("manifest") == manifest_sha256 else {}
    at = time.time_ns()
    for name in names:
        stat = _stat(Path(ckpt) / name)
        if stat is not None:
            files[name] = [*stat, at]
    stamp = {"path": key, "manifest": manifest_sha256, "files": files}
    path = _file_of(key)
    _memory[path] = stamp
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, path)
        _prune(path.parent)
    except OSError:
        pass  # a read-only cache: this process still remembers


def _prune(folder: Path) -> None:
    stamps = list(folder.glob("*.json"))
    if len(stamps) <= MAX_STAMPS:
        return
    for path in stamps:
        try:
            if not Path(json.loads(path.read_text()).get("path", "")).exists():
                path.unlink()
        except (OSError, ValueError, AttributeError):
            path.unlink(missing_ok=True)
