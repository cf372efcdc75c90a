"""The run-directory contract: nothing a user wrote is deleted without their word.

- A new run refuses a run_dir that already holds a run (checkpoints/ or metrics.jsonl): resume it with
  --resume, or start over with --overwrite, which renames the old run to RUN_DIR.prev-<UTC time> (nothing is
  deleted).
- --resume from a checkpoint older than the newest moves the later checkpoints and the later lines of
  metrics.jsonl / samples.jsonl into RUN_DIR/superseded-<UTC time>/ before training continues.
- A lock file (RUN_DIR/.lock: host and pid) keeps a second process out; a lock whose process is gone (same
  host) is stale and taken over with a warning.

`plan_run_dir` only decides (and refuses); `RunDirPlan.apply` moves things, and the set-up calls it once the
config, task and data have passed their checks and the model has loaded.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ..config import ConfigError
from .run_files import holds_run, refuse_foreign

LOCK = ".lock"
STEP_PREFIX = "step-"
STEP_NAME = re.compile(r"step-(\d+)")  # a published checkpoint; "step-000010 copy" (a user's backup) is not one
TMP_PREFIX = ".tmp-"
STATE = "trainer_state"  # trainer_state.json + trainer_state.safetensors (checkpoint/state_io.py: no pickles)
LEGACY_STATE = "trainer_state.pt"  # the pickled format of grpo-engine before 0.1: refused with a clear error


def has_trainer_state(ckpt_dir: Path) -> bool:
    return (ckpt_dir / f"{STATE}.json").is_file() or (ckpt_dir / LEGACY_STATE).is_file()


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def tmp_dir_for(ckpt_root: str | Path, step: int) -> Path:
    """Where checkpoint `step` is written before it is published by a rename."""
    return Path(ckpt_root) / (TMP_PREFIX + step_dir_name(step))


def step_dirs(ckpt_root: str | Path) -> list[Path]:
    """Every step-<digits> folder, complete or not, oldest first (temp dirs are never listed): a newest one that
    lost its trainer state is a damaged checkpoint, not one to skip silently (checkpoint/verify.py)."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and STEP_NAME.fullmatch(p.name)]
    return sorted(found, key=checkpoint_step)


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temp dirs are never listed)."""
    return [p for p in step_dirs(ckpt_root) if has_trainer_state(p)]


def checkpoint_step(path: Path | None) -> int | None:
    return None if path is None else int(path.name[len(STEP_PREFIX) :])


def utc_stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime())


@dataclass
class RunDirPlan:
    run_dir: Path
    move_aside: bool = False  # --overwrite of an existing run: rename it to RUN_DIR.prev-<stamp>
    supersede_after: int | None = None  # --resume from step N < newest: move later steps aside
    applied: bool = False
    replace_files: bool = False  # --overwrite: files of the engine's names it did not write are replaced

    def apply(self, message=print, lock: RunLock | None = None) -> None:
        """lock: this process's lock of run_dir, held again in the (new) run_dir after a rename."""
        if self.move_aside and self.run_dir.exists():
            target = self.run_dir.with_name(f"{self.run_dir.name}.prev-{utc_stamp()}")
            os.rename(self.run_dir, target)
            _drop_own_lock(target)  # this process's lock moved with it; a live other holder's stays
            message(f"--overwrite: the previous run in {self.run_dir} is now {target} (nothing deleted)")
            if lock is not None:
                lock.moved_to(self.run_dir)
        if self.supersede_after is not None:
            supersede(self.run_dir, self.supersede_after, message)
        self.applied = True


def plan_run_dir(run_dir: str | Path, *, resume_step: int | None, newest_step: int | None,
                 overwrite: bool, writes: tuple[str, ...] = ()) -> RunDirPlan:
    """What starting this run does to run_dir; a ConfigError (exit 2) when it would clobber an existing run, or
    replace a file of one of the names it `writes` (kernels.json, before_after.json) that the engine did not write
    (checkpoint/run_files.py) without --overwrite."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run_dir={str(run_dir)!r} is a file, not a directory: choose another run_dir")
    if resume_step is not None and overwrite:  # contradictory: refused rather than one of them ignored
        raise ConfigError("--resume and --overwrite together: --resume continues a run, --overwrite starts a new one "
                          "in place of the old; pass one of them (to continue a checkpoint elsewhere, choose a new "
                          "run_dir)")
    if not overwrite:
        refuse_foreign(run_dir, writes, "move it out of the run directory" + (
            "" if resume_step is not None else ", or pass --overwrite to replace it (a link is replaced, never its "
                                              "target)"))
    if resume_step is not None:
        later = newest_step is not None and newest_step > resume_step
        return RunDirPlan(run_dir, supersede_after=resume_step if later else None)
    if holds_run(run_dir) and not overwrite and not list_checkpoints(run_dir / "checkpoints"):
        raise ConfigError(f"run_dir={str(run_dir)!r} holds a run that saved no checkpoint (it stopped before its "
                          f"first), so --resume has nothing to continue: start over with --overwrite (the partial run "
                          f"is renamed, not deleted), or choose another run_dir")
    if holds_run(run_dir) and not overwrite:
        raise ConfigError(f"run_dir={str(run_dir)!r} already holds a run (checkpoints/ or metrics.jsonl): continue "
                          f"it with --resume, or start over with --overwrite (the old run is renamed, not deleted), "
                          f"or choose another run_dir")
    move_aside = overwrite and holds_run(run_dir)
    if move_aside and holds_working_dir(run_dir):
        raise ConfigError(f"run_dir={str(run_dir)!r} is the directory this command runs in (or holds it): "
                          f"starting over (--overwrite, or grpo demo again) renames the old run away and this "
                          f"process would follow it; run from its parent with run_dir={run_dir.resolve().name}, or "
                          f"choose another run_dir")
    return RunDirPlan(run_dir, move_aside=move_aside, replace_files=overwrite)


def holds_working_dir(run_dir: Path) -> bool:
    """Whether run_dir (resolved: `.` has no name to rename) is the current directory or one above it."""
    here = Path.cwd().resolve()
    return run_dir.resolve() in (here, *here.parents)


def nothing_saved(ckpt_root: Path, command: str) -> str:
    """`--resume` where no checkpoint was completed (a kill -9 before the first): what was saved (nothing) and the
    command that starts over, which is `command` itself (the user's without --resume) or, when the partial run
    left its logs, `command --overwrite`."""
    run_dir = ckpt_root.parent
    again = f"`{command} --overwrite` (the partial run is renamed, not deleted)" if holds_run(run_dir) else \
        f"`{command}`"
    return (f"--resume: nothing was saved: no complete checkpoint under {ckpt_root} (the run stopped before its "
            f"first); start over with {again}")


def after_write_failure(run_dir: str | Path) -> str:
    """What `grpo train` says to run after a write failed (a full disk): --resume continues from a complete
    checkpoint; with none (the first checkpoint failed) --resume has nothing to continue, and --overwrite starts
    the run again (the partial one renamed, nothing deleted); with no run there at all, the same command."""
    run_dir = Path(run_dir)
    if list_checkpoints(run_dir / "checkpoints"):
        return "then continue with --resume (the checkpoints written are intact)"
    if holds_run(run_dir):
        return ("then start again with --overwrite (no checkpoint was completed, so --resume has nothing to continue; "
                "the partial run is renamed, not deleted)")
    return "then run it again"


def superseded_dir(run_dir: str | Path) -> Path:
    """RUN_DIR/superseded-<UTC time>/: where the engine moves what a run no longer uses (later checkpoints and log
    lines on a resume, a file it cannot read), so nothing is deleted. Not created here: a move of nothing leaves no
    empty folder."""
    return Path(run_dir) / f"superseded-{utc_stamp()}"


def move_unreadable(path: Path) -> Path:
    """Move the file `path` (torn or edited) to superseded_dir(its folder)/NAME.unreadable; returns where it is now."""
    dest = unreadable_to(superseded_dir(path.parent) / path.name)
    dest.parent.mkdir(exist_ok=True)
    os.replace(path, dest)
    return dest


def supersede(run_dir: Path, step: int, message=print) -> Path:
    """Move checkpoints after `step` and metrics / samples lines after it into superseded_dir(run_dir)."""
    dest = superseded_dir(run_dir)
    (dest / "checkpoints").mkdir(parents=True, exist_ok=True)
    for ckpt in step_dirs(run_dir / "checkpoints"):  # incomplete ones too: a later save of that step replaced them
        if checkpoint_step(ckpt) > step:
            os.rename(ckpt, dest / "checkpoints" / ckpt.name)
    splits = [split_jsonl(run_dir / name, dest / name, step) for name in ("metrics.jsonl", "samples.jsonl")]
    unreadable, torn = sum(s.unreadable for s in splits), sum(s.torn for s in splits)
    also = (f"; {unreadable} unreadable log line(s) moved there too (*.unreadable)" if unreadable else "") + \
        (f"; {torn} torn (half-written) last line(s) dropped" if torn else "")
    message(f"resuming from step {step}: later checkpoints and log lines moved to {dest}{also}")
    return dest


class LogSplit(NamedTuple):
    moved: int  # lines of steps after the split, moved to `later_to`
    torn: int  # a torn last line (half-written: no newline at its end), dropped
    unreadable: int  # other lines that are not a record with a step (e.g. a note someone added), moved aside


def unreadable_to(later_to: Path) -> Path:
    """Where split_jsonl moves the unreadable lines of a log whose later lines go to `later_to`."""
    return later_to.with_name(later_to.name + ".unreadable")


def split_jsonl(path: Path, later_to: Path, step: int) -> LogSplit:
    """Keep the lines of `path` up to `step`; the later ones go to `later_to`, the lines that are not a JSON record
    with a numeric step to `unreadable_to(later_to)` (nothing a user wrote vanishes); a torn last line is dropped."""
    if not path.is_file():
        return LogSplit(0, 0, 0)
    lines = path.read_text(errors="replace").split("\n")  # a torn multi-byte character: not an error
    tail = lines.pop()  # "" when the file ends with a newline; else its last line, torn unless it parses
    torn = int(bool(tail.strip()) and parse_line(tail) is None)
    if tail.strip() and not torn:
        lines.append(tail)
    keep, later, unreadable = [], [], []
    for line in lines:
        record = parse_line(line)
        at = record.get("step", 0) if record is not None else None
        if not isinstance(at, (int, float)) or isinstance(at, bool):
            unreadable += [line] if line.strip() else []
        else:
            (keep if at <= step else later).append(line)
    _append_lines(later_to, later)  # appended: a second split into the same folder (within the same second)
    _append_lines(unreadable_to(later_to), unreadable)  # must not replace the first
    if later or torn or unreadable:  # untouched otherwise: every resume rewrote the whole log
        replace_text(path, "".join(ln + "\n" for ln in keep))
    return LogSplit(len(later), torn, len(unreadable))


def _append_lines(path: Path, lines: list[str]) -> None:
    if lines:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write("".join(ln + "\n" for ln in lines))


def replace_text(path: Path, text: str) -> None:
    """Replace `path`'s content through a temporary file and a rename: a crash or a full disk midway leaves the old
    file whole (writing in place would truncate it first, and a full disk would then lose the log)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def parse_line(line: str) -> dict | None:
    """One JSONL record, or None for a blank or torn (half-written) line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record if isinstance(record, dict) else None


# ----------------------------------------------------------------------------------------------------
# The lock


class RunLock:
    """RUN_DIR/.lock holding host and pid while a training runs there."""

    def __init__(self, run_dir: str | Path, message=print):
        self.path = Path(run_dir) / LOCK
        self.message = message
        self.held = False

    def acquire(self) -> RunLock:
        """The lock, run_dir created first; a run_dir that cannot be created or written (a read-only folder, one
        under /sys or /proc) is one line naming run_dir (ConfigError, exit 2)."""
        me = {"host": socket.gethostname(), "pid": os.getpid()}
        while True:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale()
                continue
            except OSError as e:
                raise ConfigError(f"run_dir={str(self.path.parent)!r} cannot be written ({e.strerror or e}"
                                  f"{f': {e.filename}' if e.filename else ''}); choose a run_dir in a folder you "
                                  f"can write") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return self

    def _take_over_if_stale(self) -> None:
        holder = parse_line(self.path.read_text()) if self.path.exists() else None
        if holder is None:  # torn or vanished: the other writer is mid-write or gone
            time.sleep(0.05)
            if self.path.exists() and parse_line(self.path.read_text()) is None:
                self.path.unlink(missing_ok=True)
            return
        same_host = holder.get("host") == socket.gethostname()
        if same_host and not _alive(int(holder.get("pid", -1))):
            self.message(f"warning: taking over the stale lock {self.path} of process {holder.get('pid')} "
                         f"(no longer running)")
            self.path.unlink(missing_ok=True)
            return
        raise ConfigError(f"{self.path.parent} is in use by process {holder.get('pid')} on {holder.get('host')}: "
                          f"two trainings in one run_dir would mix their logs and checkpoints; wait for it, "
                          f"or choose another run_dir")

    def release(self) -> None:
        if self.held:
            self.path.unlink(missing_ok=True)
            self.held = False

    def moved_to(self, run_dir: Path) -> None:
        """After the run dir was renamed away under us: hold a lock in the (new) run dir."""
        self.held = False
        self.path = Path(run_dir) / LOCK
        self.acquire()


def _drop_own_lock(run_dir: Path) -> None:
    """Remove run_dir's lock when this process holds it (it was renamed along with the folder)."""
    path = run_dir / LOCK
    holder = parse_line(path.read_text(errors="replace")) if path.is_file() else None
    if holder is not None and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
