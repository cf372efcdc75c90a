"""The files grpo-engine writes at the top of a run directory (kernels.json, before_after.json, demo.json,
curves.png), and the one way they are written.

A run directory may be handed over, or be a folder of yours that already holds a file of that name. So:
- each file is written whole into a temporary file beside it, fsync'ed, then renamed over the name: a crash or a
  full disk leaves the old file or none, never a torn one, and a link at the name is replaced, never written
  through (its target is untouched);
- the engine records the names it wrote in RUN_DIR/.grpo-files (one a line). A file at one of those names that is
  not in the record, or that is a link, is not the engine's: it is replaced only with the user's word
  (`--overwrite`), and `grpo train` refuses it before the run starts (`foreign_files`, called by plan_run_dir). A
  run directory written before the record existed (checkpoints/ but no record) owns its regular files of those
  names, and the first record written there lists them.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..config import ConfigError
from .disk import fsync_path, removed_on_failure

RECORD = ".grpo-files"
BEFORE_AFTER = "before_after.json"  # grpo train's held-out accuracy before and after (eval.before_after)
RUN_FILES = ("kernels.json", BEFORE_AFTER, "demo.json", "curves.png")  # what the engine writes beside checkpoints/
MAX_RECORD_BYTES = 64 << 10


def holds_run(run_dir: Path) -> bool:
    """Whether run_dir holds a run: checkpoints/ or metrics.jsonl."""
    return (run_dir / "checkpoints").is_dir() or (run_dir / "metrics.jsonl").is_file()


def own_names(run_dir: Path) -> set[str] | None:
    """The names the engine recorded writing into run_dir, or None when there is no record (a record that is a link
    or not a small regular file counts as none)."""
    path = run_dir / RECORD
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RECORD_BYTES:
        return None
    try:
        with open(path, "rb") as f:
            text = f.read(MAX_RECORD_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return None
    return {line.strip() for line in text.splitlines() if line.strip()}


def foreign_files(run_dir: str | Path, names: tuple[str, ...] | list[str]) -> list[str]:
    """Those of `names` present in run_dir that the engine did not write: a link (to anything), anything but a
    regular file, or a regular file the record does not list (with no record: one in a folder that holds no run)."""
    run_dir = Path(run_dir)
    own = own_names(run_dir)
    found = []
    for name in names:
        path = run_dir / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode):
            found.append(f"{path} (a link to {os.path.realpath(path)})")
        elif not stat.S_ISREG(st.st_mode):
            found.append(f"{path} (not a regular file)")
        elif (name not in own) if own is not None else not _before_records(run_dir):
            found.append(str(path))
    return found


def _before_records(run_dir: Path) -> bool:
    """A run directory with checkpoints and no record: written before the record existed, its files are the engine's."""
    return (run_dir / "checkpoints").is_dir() and own_names(run_dir) is None


def refuse_foreign(run_dir: str | Path, names: tuple[str, ...] | list[str], fix: str) -> None:
    """ConfigError (exit 2) naming the files of `names` in run_dir the engine did not write, and `fix`."""
    found = foreign_files(run_dir, names)
    if found:
        raise ConfigError(f"{', '.join(found)}: not written by grpo-engine (a file of yours, or a link), and a run "
                          f"writes its own file of that name there; {fix}")


@contextmanager
def run_file(run_dir: str | Path, name: str, *, overwrite: bool = False) -> Iterator[Path]:
    """A temporary path in run_dir to write `name` into; when the block succeeds it is renamed over run_dir/name and
    the name recorded as the engine's; when it fails it is removed. A file there the engine did not write is
    refused first unless `overwrite`."""
    run_dir = Path(run_dir)
    if not overwrite:
        refuse_foreign(run_dir, [name], "move it out of the run directory, or pass --overwrite to replace it (a "
                                        "link is replaced, never its target)")
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{name}.tmp-{os.getpid()}"
    with removed_on_failure(tmp):
        yield tmp
        fsync_path(tmp)
        os.replace(tmp, run_dir / name)
    _remember(run_dir, name)


def write_run_file(run_dir: str | Path, name: str, text: str, *, overwrite: bool = False) -> Path:
    """`text` as run_dir/name, through run_file: whole or not at all, never through a link."""
    with run_file(run_dir, name, overwrite=overwrite) as tmp:
        _write_new(tmp, text.encode("utf-8"))
    return Path(run_dir) / name


def _write_new(path: Path, data: bytes) -> None:
    """Create `path` (never an existing file, never through a link) and write `data`."""
    if os.path.lexists(path):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _remember(run_dir: Path, name: str) -> None:
    """Add `name` to the record (itself written by a temporary file and a rename)."""
    names = own_names(run_dir) or ({n for n in RUN_FILES if (run_dir / n).is_file() and not (run_dir / n).is_symlink()}
                                   if _before_records(run_dir) else set())
    names |= {name}
    tmp = run_dir / f".{RECORD}.tmp-{os.getpid()}"
    with removed_on_failure(tmp):
        _write_new(tmp, "".join(f"{n}\n" for n in sorted(names)).encode("utf-8"))
        fsync_path(tmp)  # the record outlives a crash as surely as the file it names
        os.replace(tmp, run_dir / RECORD)
        fsync_path(run_dir)
