"""The task data a run reads, fingerprinted into each checkpoint (data.json), so that resuming on changed data is a
decision and not an accident.

data.json: {"version": 1, "train_examples": 64,
            "files": {"task.options.data_path": {"path": "data.jsonl", "bytes": 1234, "sha256": "<hex>", "rows": 64}},
            "roots": {"task.options.data_path": "/home/me/exp/data.jsonl"}}

Every data file the task reads is listed under the config key that names it (`task.data_path`, `task.options.*path`;
the files of a data directory as `KEY:relative/name`), with its sha256 and its row count (non-blank lines of a text
file, a parquet file's rows; null where neither applies). On resume a changed, added or missing file is refused in one
line unless `grpo train --allow-data-change` says to continue on the new data. A checkpoint without data.json (written
before fingerprints) resumes as before.

`roots` holds each config key's absolute path as the run saw it: `grpo eval RUN_DIR` (which reads the run's own task)
looks for the data there, not against the directory eval runs in, and uses it only when its fingerprints are the
recorded ones (`eval_data_paths`); otherwise it refuses in one line naming --data. A data path is read only as a
regular file (config/paths.py): one that became a link to /dev/zero or a FIFO is refused, not hashed forever.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..config import Config
from ..config.paths import data_keys, open_regular, read_regular, regular_path
from ..tasks.data import FILE_OPTION, MAX_FILE_MIB, DataError
from .stamps import remember, trusted

DATA_FILE = "data.json"
VERSION = 1
ALLOW_FLAG = "--allow-data-change"
READ_BYTES = 1 << 20
MAX_RECORD_BYTES = 64 << 20  # data.json: a line per data file
EVAL_DATA_FLAG = "--data"


class DataChangedError(DataError):
    """The task data differs from the data the checkpoint was trained on."""


def named_paths(cfg: Config) -> dict[str, str]:
    """Config key -> the data path it names, as written (every key that names one: config/paths.py data_keys)."""
    return data_keys(cfg)


def data_paths(cfg: Config) -> dict[str, Path]:
    """Config key -> the data file or directory it names (those that exist)."""
    return {key: Path(value) for key, value in named_paths(cfg).items() if os.path.lexists(value)}


def _files(key: str, path: Path) -> dict[str, Path]:
    """Label -> file of the data `key` names: the file itself, or every file of a directory (`KEY:relative/name`);
    anything but a regular file or a directory is refused (DataError), not read."""
    regular_path(path, f"{key}=", error=DataError, directory=True, fix="point it at a local data file or directory")
    if not path.is_dir():
        return {key: path}
    found = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith((".", "cache-")))
    return {f"{key}:{p.relative_to(path).as_posix()}": p for p in found}  # (datasets' cache-*.arrow: rewritten)


def data_budget(options) -> int:
    """The bytes a data file of a task with these options may hold (task.options.max_data_file_mib; a value that is
    no positive integer: the default), checked before it is hashed."""
    mib = dict(options).get("max_data_file_mib", MAX_FILE_MIB)
    return (mib if isinstance(mib, int) and not isinstance(mib, bool) and mib > 0 else MAX_FILE_MIB) << 20


def fingerprint(path: Path, max_bytes: int = MAX_FILE_MIB << 20) -> dict:
    """{"path", "bytes", "sha256", "rows"} of one data file, in one pass over it (a regular file of at most
    max_bytes: a larger one is a DataError naming task.options.max_data_file_mib before a byte is read)."""
    h, rows, carry, text = hashlib.sha256(), 0, b"", path.suffix not in (".parquet", ".arrow")
    with open_regular(path, "data file", max_bytes=max_bytes, option=FILE_OPTION, error=DataError) as f:
        while chunk := _read(f, path):
            h.update(chunk)
            if text:
                lines = (carry + chunk).split(b"\n")
                carry = lines.pop()
                rows += sum(1 for line in lines if line.strip())
    rows += bool(carry.strip())
    return {"path": str(path), "bytes": path.stat().st_size, "sha256": h.hexdigest(),
            "rows": rows if text else _parquet_rows(path)}


def _read(f, path: Path) -> bytes:
    try:
        return f.read(READ_BYTES)
    except OSError as e:  # a regular file by its stat that reads as none (/proc/self/mem)
        raise DataError(f"data file {path} cannot be read ({e.strerror or e})") from None


def _parquet_rows(path: Path) -> int | None:
    try:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    except Exception:  # no pyarrow, or not a parquet file: the hash still tells a change
        return None


def data_record(cfg: Config, train_examples: int) -> dict:
    """What data.json holds for this run: every data file it reads, and the size of its training split."""
    files, roots = {}, {}
    for key, path in data_paths(cfg).items():
        files.update({label: fingerprint(p, data_budget(cfg.task.options)) for label, p in _files(key, path).items()})
        roots[key] = os.path.abspath(path)
    return {"version": VERSION, "train_examples": train_examples, "files": files, "roots": roots}


def record_text(record: dict) -> str:
    return json.dumps(record, indent=1, sort_keys=True) + "\n"


def _describe(label: str, old: dict | None, new: dict | None) -> str:
    if new is None:
        return f"{old.get('path', label)} ({label}) is no longer read"
    if old is None:
        return f"{new['path']} ({label}) was not read before"
    if new.get("sha256") is None:  # its size differs from the record: not hashed (_fingerprint_once)
        return f"{new['path']} ({label}) changed: {new['bytes']:,} bytes, the record says {old.get('bytes')}"
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
    stored = stored_record(ckpt, "--resume", "resume from an earlier checkpoint")
    if stored is None:
        return
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


def stored_record(ckpt: Path, command: str, fix: str) -> dict | None:
    """ckpt's data.json, or None when it has none (written before fingerprints); an unreadable one (not a regular
    file, too large, not a record) is a DataChangedError naming `command`, the file and `fix`."""
    path = ckpt / DATA_FILE
    if not os.path.lexists(path):
        return None
    try:
        stored = json.loads(read_regular(path, "the file", max_bytes=MAX_RECORD_BYTES, option="a smaller record",
                                         error=DataError))
    except (ValueError, OSError, RecursionError) as e:
        stored = f"{e}".splitlines()[0] if f"{e}" else type(e).__name__
    if not isinstance(stored, dict) or not isinstance(stored.get("files", {}), dict):
        why = stored if isinstance(stored, str) else "not a data record"
        raise DataChangedError(f"{command} {ckpt}: {path} is unreadable ({why}); {fix}")
    return stored


def eval_data_paths(ckpt: Path, cfg: Config, keys: set[str], max_bytes: int = MAX_FILE_MIB << 20) -> dict[str, str]:
    """Config key (of `keys`) -> the path `grpo eval` reads the run's data from: where the run saw it (data.json's
    `roots`: an absolute path, never resolved against the directory eval runs in), used only when every file there
    has its recorded sha256. Else DataChangedError in one line naming --data. A checkpoint without data.json: a
    stored absolute path as it is, a relative one refused (nothing says what it was relative to). max_bytes: the
    data budget of the user's options (a stored config is data: its own budget is not taken), checked with the
    recorded size before a byte is hashed."""
    fix = f"pass {EVAL_DATA_FLAG} FILE to evaluate on data you choose"
    record = stored_record(ckpt, "grpo eval", fix)
    out, seen = {}, {}  # seen: a file named by two keys (data_path and test_path) is hashed once
    for key, value in named_paths(cfg).items():
        if key not in keys:
            continue
        if record is None:
            if not Path(value).is_absolute():
                raise DataChangedError(f"grpo eval {ckpt}: its config.yaml names {key}={value!r}, a relative path, "
                                       f"and it has no {DATA_FILE} recording where that was; {fix}")
            out[key] = value
            continue
        root = record.get("roots", {}).get(key) if isinstance(record.get("roots"), dict) else None
        where = Path(root) if isinstance(root, str) else Path(value)  # data.json before roots: the path as stored
        problem = _not_as_recorded(key, where, record["files"], seen, max_bytes)
        if problem:
            raise DataChangedError(f"grpo eval {ckpt}: the run's data {problem}; {fix}")
        out[key] = str(where)
    return out


def _not_as_recorded(key: str, where: Path, files: dict, seen: dict[str, dict], max_bytes: int) -> str | None:
    """What differs between the data at `where` (config key `key`) and its record, or None; seen: real path ->
    fingerprint of the files hashed so far."""
    stored = {k: v for k, v in files.items() if (k == key or k.startswith(key + ":")) and isinstance(v, dict)}
    if not os.path.lexists(where):
        return f"{where} ({key}) is not there any more"
    try:
        current = {label: _fingerprint_once(p, stored.get(label), seen, max_bytes)
                   for label, p in _files(key, where).items()}
    except DataError as e:
        return f"cannot be read ({e})"
    if not stored:
        return f"{where} ({key}) has no fingerprint in the checkpoint"
    changed = [_describe(k, stored.get(k), current.get(k)) for k in sorted(stored.keys() | current.keys())
               if (stored.get(k) or {}).get("sha256") != (current.get(k) or {}).get("sha256")]
    return "; ".join(changed) or None


def _fingerprint_once(path: Path, recorded: dict | None, seen: dict[str, dict], max_bytes: int) -> dict:
    """fingerprint(path), hashed once per process (seen) and not at all when this machine found the file as
    `recorded` before and it has not changed since (checkpoint/stamps.py, keyed by the file itself). Sizes come
    first: a file whose size is not the recorded one has changed, and is not hashed (sha256 None); one over
    max_bytes is refused (fingerprint) before a byte is read, whatever a forged record says."""
    real = os.path.realpath(path)
    size = os.stat(real).st_size
    wanted = recorded.get("bytes") if isinstance(recorded, dict) else None
    if isinstance(wanted, int) and wanted != size:
        return {"path": str(path), "bytes": size, "sha256": None, "rows": None}
    sha = recorded.get("sha256") if isinstance(recorded, dict) else None
    if real not in seen and isinstance(sha, str) and trusted(Path(real), [""], sha):
        seen[real] = recorded
    if real not in seen:
        seen[real] = fingerprint(path, max_bytes)
        if seen[real]["sha256"] == sha:
            remember(Path(real), [""], sha)  # name "": the stamp's root is the file itself
    return {**seen[real], "path": str(path)}
