"""Writers that fail cleanly: a full disk or a read-only folder is one line the user can act on (exit 2), and
what was being written is removed, not left half-written.

safetensors reports an I/O failure as `SafetensorError("... (os error 28)")`, which no `except OSError` sees: it
would reach the user as a traceback. `as_os_error` turns it back into the OSError it was.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# errno -> what the user does about it: these failures are theirs to fix (exit 2), others (EIO, ...) exit 1
FIXES = {
    errno.ENOSPC: "free some space",
    errno.EDQUOT: "free some space (disk quota)",
    errno.EFBIG: "free some space or raise the file-size limit",
    errno.EROFS: "make it writable or choose another path",
    errno.EACCES: "make it writable or choose another path",
    errno.EPERM: "make it writable or choose another path",
}
_OS_ERROR_CODE = re.compile(r"\(os error (\d+)\)")


def as_os_error(error: BaseException, path: str | Path | None = None) -> BaseException:
    """`error` as the OSError it reports when it is a writer's wrapped one (safetensors: "... (os error 28)");
    otherwise `error` itself."""
    if isinstance(error, OSError) or type(error).__name__ != "SafetensorError":
        return error
    found = _OS_ERROR_CODE.search(str(error))
    if found is None:
        return error
    code = int(found.group(1))
    return OSError(code, os.strerror(code), None if path is None else str(path))


def user_can_fix(error: OSError) -> bool:
    """A full disk, a quota, a read-only or forbidden path: fixed by the user, not a crash (exit 2)."""
    return error.errno in FIXES


def error_line(error: OSError, then: str) -> str:
    """One line: what failed, on which file, what to do, then `then` (what the command's user runs next)."""
    where = f" ({error.filename})" if getattr(error, "filename", None) else ""
    fix = FIXES.get(error.errno, "fix the path")
    return f"{error.strerror or error}{where}: {fix}, {then}"


@contextmanager
def removed_on_failure(path: Path) -> Iterator[Path]:
    """Write into the temporary `path` (a file or a folder) in this block: on any failure (a full disk, Ctrl-C,
    SIGTERM turned into an exception) it is removed and a writer's wrapped I/O error is raised as an OSError."""
    try:
        yield path
    except BaseException as e:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        translated = as_os_error(e, path)
        if translated is e:
            raise
        raise translated from e


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename publishes only what has reached the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
