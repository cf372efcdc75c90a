"""The task data a run reads, fingerprinted into each checkpoint (data.json), so that resuming on changed data is a
decision and not an accident.

data.json: {"version": 1, "train_examples": 64,
            "files": {"task.options.data_path": {"path": "data.jsonl", "bytes": 1234, "sha256": "<hex>", "rows": 64}}}

Every data file the task reads is listed under the config key that names it (`task.data_path`, `task.options.*path`;
the files of a data directory as `KEY:relative/name`), with its sha256 and its row count (non-blank lines of a text
file, a parquet file's rows; null where neither applies). On resume a changed, added or missing file is refused in one
line unless `grpo train --allow-data-change` says to continue on the new data. A checkpoint without data.json (written
before fingerprints) resumes as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from ..config import Config
from ..tasks.data import DataError

DATA_FILE = "data.json"
VERSION = 1
ALLOW_FLAG = "--allow-data-change"
READ_BYTES = 1 << 20


class DataChangedError(DataError):
    """The task data differs from the data the checkpoint was trained on."""


def data_paths(cfg: Config) -> dict[str, Path]:
    """Config key -> the data file or directory it names (those that exist)."""
    named = {"task.data_path": cfg.task.data_path}
    named.update({f"task.options.{k}": v for k, v in sorted(dict(cfg.task.options).items())
                  if k.endswith("path") and isinstance(v, str)})
    return {key: Path(value) for key, value in named.items() if value and Path(value).exists()}


def _files(key: str, path: Path) -> dict[str, Path]:
    if path.is_file():
        return {key: path}
    found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith((".", "cache-")))
    return {f"{key}:{p.relative_to(path).as_posix()}": p for p in found}  # (datasets' cache-*.arrow: rewritten)


def fingerprint(path: Path) -> dict:
    """{"path", "bytes", "sha256", "rows"} of one data file, in one pass over it."""
    h, rows, carry, text = hashlib.sha256(), 0, b"", path.suffix not in (".parquet", ".arrow")
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            h.update(chunk)
            if text:
                lines = (carry + chunk).split(b"\n")
                carry = lines.pop()
                rows += sum(1 for line in lines if line.strip())
    rows += bool(carry.strip())
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": h.hexdigest(),
            "rows": rows if text else _parquet_rows(path)}


def _parquet_rows(path: Path) -> int | None:
    try:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    except Exception:  # no pyarrow, or not a parquet file: the hash still tells a change
        return None


def data_record(cfg: Config, train_examples: int) -> dict:
    """What data.json holds for this run: every data file it reads, and the size of its training split."""
    files = {}
    for key, path in data_paths(cfg).items():
        files.update({label: fingerprint(p) for label, p in _files(key, path).items()})
    return {"version": VERSION, "train_examples": train_examples, "files": files}


def record_text(record: dict) -> str:
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def _describe(label: str, old: dict | None, new: dict | None) -> str:
    if new is None:
        return f"{old.get('path', label)} ({label}) is no longer read"
    if old is None:
        return f"{new['path']} ({label}) was not read before"
    rows = (f"{old['rows']} -> {new['rows']} rows" if old.get("rows") != new.get("rows") else
            f"same {new['rows']} rows, other content") if new.get("rows") is not None else "other content"
    before = str(old.get("sha256"))[:12]
    return f"{new['path']} ({label}) changed: {rows} (sha256 {before}... -> {new['sha256'][:12]}...)"


def data_changes(stored: dict, current: dict, position: int) -> list[str]:
    """What differs between the stored data record and the current one, one phrase per file."""
    old = {k: v for k, v in stored.get("files", {}).items() if isinstance(v, dict)}
    new = current["files"]
    changed = [_describe(k, old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys())
               if (old.get(k) or {}).get("sha256") != (new.get(k) or {}).get("sha256")]
    before, now = stored.get("train_examples"), current["train_examples"]
    if changed and before != now:
        changed.append(f"the training split has {now} examples, not {before} (the prompt stream is at {position})")
    return changed


def check_data(ckpt: Path, current: dict, *, position: int, allow: bool, message: Callable[[str], None]) -> None:
    """Refuse (DataChangedError, one line) to resume ckpt on data other than the data it was trained on, unless
    `allow` (--allow-data-change): then one warning. A checkpoint without data.json resumes as before."""
    path = ckpt / DATA_FILE
    if not path.is_file():
        return
    try:
        stored = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        stored = f"{e}"
    if not isinstance(stored, dict) or not isinstance(stored.get("files", {}), dict):
        why = stored if isinstance(stored, str) else "not a data record"
        raise DataChangedError(f"--resume {ckpt}: {path} is unreadable ({why}); resume from an earlier checkpoint")
    changes = data_changes(stored, current, position)
    if not changes:
        return
    what = "; ".join(changes)
    if allow:
        message(f"warning: {ALLOW_FLAG}: the task data changed since {ckpt} ({what}); continuing on the new data "
                f"(the prompt order differs from an uninterrupted run's)")
        return
    raise DataChangedError(f"--resume {ckpt}: the task data changed since the checkpoint ({what}); put the original "
                           f"back, or pass {ALLOW_FLAG} to continue on the new data")
