"""Read task records from local files — JSONL, JSON, CSV / TSV, parquet or a `datasets.save_to_disk` directory — and
check their fields with errors that name the file, the record and the field.

A record is named as a user finds it in an editor: a JSON-lines or CSV file's records by their 1-based physical
line (blank lines count), every other source's (JSON list, parquet, saved dataset, hub) by their 1-based
position ("record 3").

Everything works offline. Loading by hub name (`load_hub`) is only a convenience: it needs the optional
`datasets` package and a network, and says so clearly when either is missing.

A data file may come with a run someone handed over, so it is read as untrusted input: only a regular file (a link
to /dev/zero or a FIFO is refused by a stat, before anything is opened), under a size budget checked before a byte
is read (`Limits.file_mib`), JSON lines one at a time under a per-line budget (`Limits.line_kib`: a 300 MB row is
found after reading 1 MiB of it). A row that is not text (a lone surrogate such as "\\ud800", which no tokenizer
takes) or that nests deeper than the JSON reader can follow is one line naming the file and the line.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from ..config.paths import open_regular, read_regular, regular_path

Record = dict[str, object]  # one raw row as read from a file; tasks turn rows into typed Examples at once
MAX_FILE_MIB = 1024  # GSM8K's train split is 4 MiB, MATH's 20 MiB: a gigabyte of rows is a deliberate choice
MAX_LINE_KIB = 1024  # a row is a problem and its answer; the chat template refuses a prompt over 1 MiB anyway
MAX_FIELD_CHARS = 1 << 20  # a chat template renders at most this many characters (model/template_budget.py MAX_OUTPUT)
FILE_OPTION, LINE_OPTION = "task.options.max_data_file_mib", "task.options.max_data_line_kib"
READ_BYTES = 1 << 20  # one read of a file searched for its first byte that is not UTF-8
TEXT_ENCODING = "utf-8-sig"  # UTF-8, with a byte-order mark at the start of a file skipped


@dataclass(frozen=True)
class Limits:
    """How much of a data file is read: the file's size and (JSON lines) one line's, checked before reading.
    Raised by the task options max_data_file_mib / max_data_line_kib (FILE_OPTION, LINE_OPTION)."""

    file_mib: int = MAX_FILE_MIB
    line_kib: int = MAX_LINE_KIB


_LIMITS: ContextVar[Limits | None] = ContextVar("data_limits", default=None)


@contextmanager
def data_limits(limits: Limits) -> Iterator[None]:
    """Read every data file under `limits` inside the block: a task's options set them once around its loading
    (ChatTask.examples), so each task's reader need not pass them down."""
    token = _LIMITS.set(limits)
    try:
        yield
    finally:
        _LIMITS.reset(token)


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


def read_records(path: str | Path, limits: Limits | None = None, key: str = "data_path") -> list[Record]:
    """All rows of a .jsonl / .json / .csv / .tsv / .parquet file or of a saved `datasets` directory (one split), read
    under `limits` (default: those data_limits set, else Limits()); anything but a regular file or a directory is
    refused before it is opened. key: the option that names the file, which an error tells the user to set."""
    p, limits = Path(path), limits or _LIMITS.get() or Limits()
    if not p.exists() and not p.is_symlink():
        raise DataError(f"data file {p} does not exist; set {key} to a local .jsonl/.parquet file")
    regular_path(p, "data file", error=DataError, directory=True, fix=f"set {key} to a local .jsonl/.parquet file")
    if p.is_dir():
        return _read_saved_dataset(p, limits)
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".csv": _read_csv, ".tsv": _read_tsv,
               ".parquet": _read_parquet}
    reader = readers.get(p.suffix.lower())
    if reader is None:
        raise DataError(f"{p}: unknown data format {p.suffix!r}; use {list(readers)} or a datasets dir")
    try:
        return reader(p, limits)
    except UnicodeDecodeError as e:
        raise DataError(f"{p}: {_not_utf8(e, 0)}") from None
    except OSError as e:  # stats as a regular file, reads as none: a link to /proc/self/mem (Input/output error)
        raise DataError(f"data file {p} cannot be read ({e.strerror or e}); set {key} to a local .jsonl/.parquet "
                        f"file") from None


def _not_utf8(e: UnicodeDecodeError, offset: int) -> str:
    """What a UnicodeDecodeError means, the byte and its offset in the file (the text began at `offset`)."""
    return (f"not UTF-8 text (byte {e.object[e.start:e.start + 1]!r} at offset {offset + e.start}); "
            f"re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)")


def _open_data(p: Path, limits: Limits):
    return open_regular(p, "data file", max_bytes=limits.file_mib << 20, option=FILE_OPTION, error=DataError)


def _lines(p: Path, limits: Limits):
    """(1-based line number, text) of each line of p, read as UTF-8 text one line at a time: a line is read up to
    limits.line_kib KiB of characters and no further (the error names the line and the option that raises it).
    A byte-order mark opening the file (what Windows editors and spreadsheet exports write) is skipped."""
    most = limits.line_kib << 10
    with _open_data(p, limits) as raw, io.TextIOWrapper(raw, encoding=TEXT_ENCODING, newline="\n") as f:
        line_no = 0
        try:
            while line := f.readline(most + 1):
                line_no += 1
                if len(line) > most and not line.endswith("\n"):
                    raise line_too_long(f"{p}: line {line_no}", limits)
                yield line_no, line
        except UnicodeDecodeError:
            raise DataError(f"{p}: {_not_utf8_at(p, limits)}") from None


def line_too_long(where: str, limits: Limits) -> DataError:
    """The error for a row over the per-line budget; `where` names the row ("FILE: line 4", "train_data[3]")."""
    return DataError(f"{where} is longer than {limits.line_kib:,} KiB (the limit, {LINE_OPTION}); shorten the row, "
                     f"or raise {LINE_OPTION} if it is meant to be this long")


def _not_utf8_at(p: Path, limits: Limits) -> str:
    """_not_utf8 for the first byte of p that is not UTF-8, with its offset in the file (a second, binary pass: the
    text reader's error counts from its own buffer)."""
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with _open_data(p, limits) as f:
        while block := f.read(READ_BYTES):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                return _not_utf8(e, offset - (len(e.object) - len(block)))  # e.object: held-back bytes + block
            offset += len(block)
    return "not UTF-8 text; re-save the file as UTF-8"


def _read_jsonl(p: Path, limits: Limits = Limits()) -> Records:
    rows, lines = [], []
    for line_no, line in _lines(p, limits):
        if not line.strip():
            continue
        row = _parse(line, p, line_no)
        if not isinstance(row, dict):
            raise DataError(f"{p}: line {line_no} is a {type(row).__name__}, expected a JSON object")
        if "\\u" in line:  # only a \\u escape makes a lone surrogate
            check_text(row, f"{p}: line {line_no}")
        rows.append(row)
        lines.append(line_no)
    return Records(rows, lines)


def _read_csv(p: Path, limits: Limits = Limits(), delimiter: str = ",") -> Records:
    """Rows of a CSV file whose first row names the fields (`prompt,answer`); every value is text. Each record is
    named by the physical line it starts on (a quoted value may span lines; blank lines are skipped). Read line by
    line under the same budgets as JSON lines."""
    where = {"line": 0}  # the physical line the reader has consumed up to

    def numbered() -> Iterator[str]:
        for line_no, line in _lines(p, limits):
            where["line"] = line_no
            yield line

    reader = csv.reader(numbered(), delimiter=delimiter, skipinitialspace=True)
    rows, lines, header, header_line, start = [], [], None, 0, 1
    try:
        for values in reader:
            if values and header is None:
                header, header_line = [name.strip() for name in values], start
                _check_header(header, p, header_line)
            elif values:
                if len(values) != len(header):
                    raise DataError(f"{p}: line {start} has {len(values)} fields, the header (line {header_line}) "
                                    f"names {len(header)}; quote values that hold a {delimiter!r}")
                rows.append(dict(zip(header, values)))
                lines.append(start)
            start = where["line"] + 1
    except csv.Error as e:
        raise DataError(f"{p}: line {where['line']} is not valid CSV ({e})") from None
    return Records(rows, lines)


def _read_tsv(p: Path, limits: Limits = Limits()) -> Records:
    return _read_csv(p, limits, delimiter="\t")


def _check_header(header: list[str], p: Path, line_no: int) -> None:
    """A CSV header names each field once, none of them empty. The error counts the fields and never shows them: the
    first line of a file linked in as data (`/etc/shadow`) is not the user's to print."""
    if "" in header or len(set(header)) != len(header):
        raise DataError(f"{p}: the header (line {line_no}) must name each field once (e.g. prompt,answer); its "
                        f"{len(header)} fields include an empty or repeated name")


def _parse(text: str, source: Path, line_no: int | None = None):
    """json.loads(text); a malformed or too deeply nested text is a DataError naming `source` (and the line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        problem = f"is not valid JSON ({e.msg})"
    except RecursionError:
        problem = "nests deeper than the JSON reader follows (about 1,000 levels); a row is an object of text fields"
    raise DataError(f"{source}: line {line_no} {problem}" if line_no else f"{source} {problem}")


def check_text(row: Record, where: str) -> None:
    """Refuse a row whose text is not Unicode text: a lone surrogate ("\\ud800" in JSON) parses, then every
    tokenizer rejects it (a TypeError deep inside the rollout). Of a file, only rows with a \\u escape can hold one;
    rows given in Python may hold one anywhere. `where` names the row ("FILE: line 4", "train_data[3]")."""
    for name, value in row.items():
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            bad = e.object[e.start:e.start + 1].encode("unicode_escape").decode()
            raise DataError(f"{where}: field {name!r} holds a lone surrogate ({bad}), which is not text; fix the "
                            f"row's \\u escapes") from None
        except (RecursionError, ValueError):
            raise DataError(f"{where}: field {name!r} nests deeper than the JSON reader follows") from None


def _read_json(p: Path, limits: Limits = Limits()) -> list[Record]:
    raw = read_regular(p, "data file", max_bytes=limits.file_mib << 20, option=FILE_OPTION, error=DataError)
    try:
        data = json.loads(raw.decode(TEXT_ENCODING))
    except json.JSONDecodeError:
        return _read_jsonl(p, limits)  # many ".json" files are really JSON lines
    except RecursionError:
        raise DataError(f"{p} nests deeper than the JSON reader follows (about 1,000 levels)") from None
    if not isinstance(data, list):
        raise DataError(f"{p}: is a JSON {type(data).__name__}; expected a JSON list of objects (or JSON lines)")
    escapes = b"\\u" in raw  # only a \\u escape makes a lone surrogate
    for i, r in enumerate(data):
        if not isinstance(r, dict):
            raise DataError(f"{p}: {place(data, i)} of the JSON list is a {type(r).__name__}, expected an object")
        if escapes:
            check_text(r, f"{p}: {place(data, i)}")
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


def _read_parquet(p: Path, limits: Limits = Limits()) -> list[Record]:
    pa = _pyarrow()
    with _open_data(p, limits) as f:  # a regular file under the size budget, read from the descriptor checked
        try:
            return pa.parquet.read_table(f).to_pylist()
        except pa.ArrowException as e:
            raise DataError(f"{p}: cannot read parquet file ({e})") from None


def _read_saved_dataset(d: Path, limits: Limits = Limits()) -> list[Record]:
    """A directory written by `Dataset.save_to_disk`: state.json lists its arrow (IPC stream) files."""
    state = d / "state.json"
    if (d / "dataset_dict.json").exists():
        raise DataError(f"{d} is a DatasetDict; point data_path at one split's subdirectory or its parent")
    if not state.exists():
        raise DataError(f"{d}: not a saved datasets directory (no state.json); pass a .jsonl/.parquet file")
    pa = _pyarrow()
    listed = _parse(read_regular(state, "data file", max_bytes=limits.line_kib << 10, option=LINE_OPTION,
                                 error=DataError).decode("utf-8"), state)
    try:
        names = [f["filename"] for f in listed["_data_files"]]
    except (TypeError, KeyError):
        raise DataError(f"{state}: no _data_files list of {{'filename': ...}}; re-save the dataset") from None
    files = [d / str(name) for name in names if Path(str(name)).name == name]  # files of d, not ../elsewhere
    if len(files) != len(names):
        raise DataError(f"{state} names a file outside {d}; re-save the dataset")
    rows: list[Record] = []
    for f in files:
        with _open_data(f, limits) as source:
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
    """check_fields for each record, named by the file and its place() in it."""
    for i, row in enumerate(rows):
        check_fields(row, fields, f"{source}: {place(rows, i)}")


def check_fields(row: Record, fields: Sequence[str], where: str) -> None:
    """Raise DataError naming the row (`where`: "FILE: line 4", "train_data[3]") and the field when the row lacks a
    field, holds null or empty text (a row that can never score), or more text than a chat template renders (a row
    that can never be sampled: found here, in the pass that reads the rows, not at the step that first draws it).
    The error says what was expected and how many fields the row has, never their names: a CSV header is the first
    line of whatever file data_path names, which may be a file the user does not mean to print (`/etc/shadow`
    through a link)."""
    for name in fields:
        value = row.get(name)
        if name in row and value is None:
            raise DataError(f"{where} has no field {name!r}: it is null; every record needs a value for each of "
                            f"{list(fields)}")
        if isinstance(value, str) and not value.strip():
            raise DataError(f"{where} field {name!r} is empty: a row without it can never score; every record needs "
                            f"a value for each of {list(fields)}")
        if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
            raise DataError(f"{where} field {name!r} holds {len(value):,} characters, more than a chat template "
                            f"renders ({MAX_FIELD_CHARS:,}): the row can never be sampled; shorten it")
        if name not in row:
            raise DataError(f"{where} has no field {name!r} (it has {len(row)} field{'' if len(row) == 1 else 's'}); "
                            f"every record needs {list(fields)}")


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
