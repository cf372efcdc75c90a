"""Pre-flight checks of the paths a config names (model, tokenizer, data), before any weights are read; and the
one way to open a file someone else named (`open_regular`, `read_regular`).

A path in a config someone handed over is untrusted input: it may name /dev/zero (reading never ends), a FIFO
(opening it waits forever for a writer) or a socket. Such a path is read only when it resolves (symlinks followed)
to a regular file, or a directory where one is expected. The check is a stat, which never blocks; the file is then
opened with O_NONBLOCK and checked again on the open descriptor, so a path swapped for a FIFO in between cannot
hang either. Sizes are compared with a budget before a byte is read.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from .fields import ConfigError
from .run import Config

TOKENIZER_REQUIRED = ("tokenizer.json",)
KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO (named pipe)",
         stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a broken link"}


def file_kind(mode: int) -> str:
    """What a stat mode names, in words ("a regular file", "a FIFO (named pipe)", ...)."""
    return "a regular file" if stat.S_ISREG(mode) else KINDS.get(stat.S_IFMT(mode), "not a file")


def _named(what: str, path: Path) -> str:
    """"task.data_path='x.jsonl'" for a config key (what ends with "="), else "data file x.jsonl"; with
    " (-> /dev/zero)" when the path is a link, so the error shows what it points at."""
    name = f"{what}{str(path)!r}" if what.endswith("=") else f"{what} {path}"
    return f"{name} (-> {os.path.realpath(path)})" if path.is_symlink() else name


def regular_path(path: str | Path, what: str, *, error: type[ValueError] = ConfigError, directory: bool = False,
                 fix: str = "point it at a regular file") -> Path:
    """`path` if it resolves (symlinks followed) to a regular file, or (directory=True) to a directory; else
    `error` in one line naming `what`, the path, what it is and `fix`. A stat: never opens, never blocks."""
    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise error(f"{_named(what, p)} does not exist; {fix}") from None
    except OSError as e:
        raise error(f"{_named(what, p)} cannot be read ({e.strerror or e}); {fix}") from None
    if stat.S_ISREG(mode) or (directory and stat.S_ISDIR(mode)):
        return p
    expected = "a regular file or a directory" if directory else "a regular file"
    raise error(f"{_named(what, p)} is {file_kind(mode)}, not {expected}; {fix}")


def open_regular(path: str | Path, what: str, *, max_bytes: int, option: str,
                 error: type[ValueError] = ConfigError) -> BinaryIO:
    """`path` opened for binary reading once it is a regular file (regular_path) of at most max_bytes; a larger one
    is one line naming the file, the limit and `option`, the setting that raises it. Opened with O_NONBLOCK and
    checked again on the descriptor: a FIFO swapped in after the stat is refused, not waited on."""
    p = regular_path(path, what, error=error)
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{_named(what, p)} is {file_kind(st.st_mode)}, not a regular file")
        if st.st_size > max_bytes:
            raise error(f"{_named(what, p)} has {st.st_size:,} bytes, over the limit of {max_bytes:,} ({option}); "
                        f"raise {option} if the file is meant to be this large")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, what: str, *, max_bytes: int, option: str,
                 error: type[ValueError] = ConfigError) -> bytes:
    """All bytes of a regular file under max_bytes (open_regular), never more than max_bytes + 1 read even if the
    file grows while it is read."""
    with open_regular(path, what, max_bytes=max_bytes, option=option, error=error) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise error(f"{_named(what, Path(path))} grew past the limit of {max_bytes:,} bytes ({option}) while it "
                    f"was read")
    return data


def readable(path: str | Path, what: str, fix: str) -> None:
    """Read the first byte of the regular file `path`: a file that stats as regular but cannot be read (a link to
    /proc/self/mem: Input/output error) is one line naming `what`, the path and `fix` here, before anything loads."""
    try:
        with open_regular(path, what, max_bytes=1 << 62, option="") as f:
            f.read(1)
    except OSError as e:
        raise ConfigError(f"{_named(what, Path(path))} cannot be read ({e.strerror or e}); {fix}") from None


def data_keys(cfg: Config) -> dict[str, str]:
    """Config key -> the data path it names, as written: task.data_path and each task option ending in `path`
    (data_path, test_path) that is set."""
    named = {"task.data_path": cfg.task.data_path}
    named.update({f"task.options.{k}": v for k, v in sorted(dict(cfg.task.options).items())
                  if k.endswith("path") and isinstance(v, str)})
    return {key: value for key, value in named.items() if value}


def check_paths(cfg: Config) -> None:
    """Model, tokenizer and data paths exist and look right; run before any weights are read."""
    for key, value in data_keys(cfg).items():  # every split's data, also one read only after training (test_path)
        fix = f"set {key} to a local .jsonl / .parquet file or a directory of them"
        if regular_path(value, f"{key}=", directory=True, fix=fix).is_file():
            readable(value, f"{key}=", fix)
    if cfg.warm_start.tiny.arch:
        return  # the warm start builds the model and its tokenizer (sft/warm_start.py)
    if not cfg.model.path:
        raise ConfigError("model.path is empty: set it in the YAML or with model.path=/path/to/hf_checkpoint")
    model = Path(cfg.model.path)
    if model.suffix == ".gguf":
        regular_path(model, "model.path=", fix="point it at a .gguf file or a Hugging Face checkpoint directory")
        if cfg.tokenizer.path is None:
            return  # the GGUF file carries its tokenizer
    elif model.is_file():  # e.g. .../config.json or .../model.safetensors: "does not exist" would be wrong
        raise ConfigError(f"model.path={cfg.model.path!r} is a file: give the checkpoint directory that holds it "
                          f"({str(model.parent)!r}?)")
    elif not model.is_dir():
        if model.exists():  # a device, a FIFO, a socket
            regular_path(model, "model.path=", directory=True, fix="point it at a Hugging Face checkpoint directory")
        raise ConfigError(f"model.path={cfg.model.path!r}: directory does not exist")
    elif (model / "model" / "config.json").is_file() and not (model / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r} is a `grpo train` checkpoint: its weights are in "
                          f"{str(model / 'model')!r}")
    elif not (model / "config.json").is_file():
        raise ConfigError(f"model.path={cfg.model.path!r} has no config.json: is it a Hugging Face checkpoint dir?")
    elif not any(model.glob("*.safetensors")):
        raise ConfigError(f"model.path={cfg.model.path!r} has no *.safetensors weights")
    tok_dir = Path(cfg.tokenizer.path or cfg.model.path)
    if cfg.tokenizer.path:
        regular_path(tok_dir, "tokenizer.path=", directory=True, fix="point it at a directory holding tokenizer.json")
    missing = [n for n in TOKENIZER_REQUIRED if not (tok_dir / n).is_file()]
    if missing:
        raise ConfigError(f"tokenizer directory {str(tok_dir)!r} lacks {', '.join(missing)}; set tokenizer.path")
