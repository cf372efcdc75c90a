"""Read task records from local files — JSONL, JSON, parquet or a `datasets.save_to_disk` directory — and
check their fields with errors that name the file, the record and the field.

A record is named as a user finds it in an editor: a JSON-lines file's records by their 1-based physical
line (blank lines count), every other source's (JSON list, parquet, saved dataset, hub) by their 1-based
position ("record 3").

Everything works offline. Loading by hub name (`load_hub`) is only a convenience: it needs the optional
`datasets` package and a network, and says so clearly when either is missing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

Record = dict[str, object]  # one raw row as read from a file; tasks turn rows into typed Examples at once


class DataError(ValueError):
    """A data file is missing, unreadable, or has a row without a required field."""


class Records(list):
    """A file's records (a list of dicts) and, for JSON lines, the physical line each one came from: the
    records' positions skip blank lines, so without the lines an error would point at the wrong line."""

    def __init__(self, rows: Sequence[Record], lines: Sequence[int]):
        super().__init__(rows)
        self.lines = list(lines)  # [len(rows)] 1-based line numbers


def place(rows: Sequence[Record], i: int) -> str:
    """Where rows[i] is in its file: "line 4" for JSON lines, else "record {i + 1}" (1-based)."""
    lines = getattr(rows, "lines", None)
    return f"line {lines[i]}" if lines is not None else f"record {i + 1}"


def read_records(path: str | Path) -> list[Record]:
    """All rows of a .jsonl / .json / .parquet file or of a saved `datasets` directory (one split)."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {p} does not exist; set data_path to a local .jsonl/.parquet file")
    if p.is_dir():
        return _read_saved_dataset(p)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        raise DataError(f"{p}: unknown data format {p.suffix!r}; use {list(readers)} or a datasets dir")
    try:
        return reader(p)
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {e.start}); "
                        f"re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None


def _read_jsonl(p: Path) -> Records:
    rows, lines = [], []
    with p.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{p}: line {line_no} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{p}: line {line_no} is a {type(row).__name__}, expected a JSON object")
            rows.append(row)
            lines.append(line_no)
    return Records(rows, lines)


def _read_json(p: Path) -> list[Record]:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return _read_jsonl(p)  # many ".json" files are really JSON lines
    if not isinstance(data, list):
        raise DataError(f"{p}: is a JSON {type(data).__name__}; expected a JSON list of objects (or JSON lines)")
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            raise DataError(f"{p}: {place(data, i)} of the JSON list is a {type(r).__name__}, expected an object")
    return data


def _pyarrow():
    try:
        import pyarrow  # noqa: F401
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            "reading parquet / arrow files needs pyarrow: pip install 'grpo-engine[data]' (or use JSONL)"
        ) from None
    return pyarrow


def _read_parquet(p: Path) -> list[Record]:
    pa = _pyarrow()
    try:
        return pa.parquet.read_table(p).to_pylist()
    except pa.ArrowException as e:
        raise DataError(f"{p}: cannot read parquet file ({e})") from None


def _read_saved_dataset(d: Path) -> list[Record]:
    """A directory written by `Dataset.save_to_disk`: state.json lists its arrow (IPC stream) files."""
    state = d / "state.json"
    if (d / "dataset_dict.json").exists():
        raise DataError(f"{d} is a DatasetDict; point data_path at one split's subdirectory or its parent")
    if not state.exists():
        raise DataError(f"{d}: not a saved datasets directory (no state.json); pass a .jsonl/.parquet file")
    pa = _pyarrow()
    files = [d / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    rows: list[Record] = []
    for f in files:
        with pa.memory_map(str(f)) as source:
            rows.extend(pa.ipc.open_stream(source).read_all().to_pylist())
    return rows


def split_source(data_path: str | Path, split: str) -> Path:
    """The file (or saved dataset dir) holding `split` under data_path.

    data_path may be a file (used for every split), a saved DatasetDict directory (its `split` subdir), or a
    directory holding e.g. train.jsonl / test-00000-of-00001.parquet (the file whose name starts with split).
    """
    p = Path(data_path)
    if not p.is_dir() or (p / "state.json").exists():
        return p
    if (p / "dataset_dict.json").exists():
        return p / split
    suffixes = (".jsonl", ".json", ".parquet")
    matches = sorted(f for f in p.iterdir() if f.name.startswith(split) and f.suffix.lower() in suffixes)
    if not matches:
        raise DataError(f"{p}: no file for split {split!r} (expected e.g. {split}.jsonl or {split}.parquet)")
    if len(matches) > 1:
        raise DataError(f"{p}: several files for split {split!r}: {[m.name for m in matches]}; keep one")
    return matches[0]


def require_fields(rows: Sequence[Record], fields: Sequence[str], source: str | Path) -> None:
    """Raise DataError naming the file, the record (place()) and the field when a record lacks a field."""
    for i, row in enumerate(rows):
        for name in fields:
            if name not in row or row[name] is None:
                raise DataError(
                    f"{source}: {place(rows, i)} has no field {name!r} (fields present: {sorted(row)}); "
                    f"every record needs {list(fields)}"
                )


def field_error(
    source: str | Path, rows: Sequence[Record], i: int, name: str, expected: str, value: object
) -> DataError:
    """A DataError for field `name` of rows[i] with a wrong type or value, naming the record as place() does."""
    return DataError(f"{source}: {place(rows, i)} field {name!r} must be {expected}, got {value!r:.80}")


def load_hub(name: str, split: str, config: str | None = None) -> list[Record]:
    """Rows of a hub dataset via `datasets` (a convenience; offline use data_path with local files)."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"loading {name!r} by hub name needs the `datasets` package (pip install datasets); "
            "or download the files and set data_path to a local .jsonl/.parquet file"
        ) from None
    try:
        return datasets.load_dataset(name, config, split=split).to_list()
    except Exception as e:  # noqa: BLE001 - network errors come in many types; all mean "cannot fetch"
        raise DataError(
            f"could not load {name!r} (split {split!r}) from the hub: {type(e).__name__}: {e}. "
            "Without network, download the files elsewhere and set data_path to the local file(s)."
        ) from None
