"""`grpo` command line: thin parsers that call library functions.

Each subcommand registers itself through an `add_*_parser(subparsers)` function; to add one, write such a
function (in its own module when it grows) and list it in PARSERS.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from .bench import add_bench_parser
from .checkpoint.disk import as_os_error, error_line, user_can_fix
from .config.trust import add_allow_code_arg, allowing_code
from .demo import CONTROLS, add_control_arg, add_demo_parser
from .eval.cli import add_eval_parser, add_generate_parser
from .gguf_export import add_export_parser
from .plan.cli import add_plan_parser


def add_train_parser(sub) -> None:
    p = sub.add_parser("train", help="train with a YAML config and key=value overrides")
    p.add_argument("config", help="YAML config file (see configs/); with --resume also a run directory (its newest "
                                  "checkpoint's config.yaml, stored code run only with --allow-code)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.group_size=16")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="resume from the latest checkpoint of run_dir, or from the given checkpoint dir")
    p.add_argument("--stop-after", type=_at_least_one, default=None, help="stop (with a checkpoint) after N steps")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run_dir that holds a run: the old run is renamed RUN_DIR.prev-<time>")
    p.add_argument("--nproc", type=_at_least_one, default=None,
                   help="data-parallel ranks on this machine: relaunches itself under torchrun --nproc_per_node N")
    add_allow_code_arg(p, "--resume's checkpoint config.yaml (CONFIG is yours and runs as it is)")
    p.add_argument("--allow-data-change", action="store_true",
                   help="with --resume: continue although the task data differs from the data the checkpoint was "
                        "trained on (refused otherwise)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the signal check before step 1 (= check.enabled=false; check.stop=false runs it and goes "
                        "on whatever it finds)")
    add_control_arg(p, ", with its own before_after.json")
    p.set_defaults(func=_train)


def _at_least_one(text: str) -> int:
    """A count flag's value, at least 1: the loop would run a step all the same for --stop-after 0 (or -1)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _train(args) -> int:
    import time

    from .config import ConfigError, check_paths

    t0 = time.perf_counter()
    _override_after_resume(args)
    if args.allow_code and args.resume is None:
        raise ConfigError("--allow-code is for a stored config (a checkpoint's, with --resume): CONFIG is yours and "
                          "its code runs without it; drop --allow-code")
    cfg = _train_config(args)
    args.run_dir = cfg.run_dir  # a write that fails (a full disk) is followed by a hint for this run's state
    check_paths(cfg)  # path problems are reported before torch-heavy imports and the model load
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from .train.distributed import check_layout

        check_layout(cfg, args.nproc)  # one error here, not one per rank under torchrun's traceback
        return _relaunch_under_torchrun(args.nproc, args.argv)
    import torch

    from .demo import record_before, report_train
    from .train.loop import train
    from .train.update import NonFiniteError

    try:
        result = train(cfg, resume=args.resume, stop_after=args.stop_after, overwrite=args.overwrite,
                       allow_data_change=args.allow_data_change, command=_train_command(args),
                       check=not args.no_check, held_out=cfg.eval.before_after,
                       on_before=lambda before: record_before(cfg, before, args.control, args.overwrite))
    except (NonFiniteError, torch.OutOfMemoryError) as e:  # messages name the knobs and the last checkpoint
        print(f"grpo: training stopped: {e}", file=sys.stderr)
        return 1
    if result.after is not None and int(os.environ.get("RANK", "0")) == 0:
        report_train(cfg, result.before, result.after, time.perf_counter() - t0, args.control,
                     overwrite=args.overwrite)
    print(f"done: {result.last_step} steps ({result.stopped_by}); checkpoint: {result.checkpoint}")
    return 0


def _override_after_resume(args) -> None:
    """`--resume key=value`: argparse gives --resume (whose checkpoint is optional) the override as its value; an
    override it is (a dotted key, `=`, and no such checkpoint), and --resume means the latest checkpoint."""
    import re

    value = args.resume
    if value not in (None, "latest") and re.match(r"[A-Za-z_][\w.]*=", value) and not os.path.lexists(value):
        args.overrides = [*args.overrides, value]
        args.resume = "latest"


def _train_config(args):
    """CONFIG with its overrides, and with --control the control's changes (which win) in RUN_DIR-<control>."""
    import dataclasses

    from .config import ConfigError, load_config

    if Path(args.config).is_dir() and args.resume is not None:  # a run directory (one made from Python too)
        from .api.trainer import run_dir_config

        return run_dir_config(args.config, args.overrides)
    cfg = load_config(args.config, [*args.overrides, *CONTROLS.get(args.control or "", ())])
    if args.control == "no-tools" and not load_config(args.config, args.overrides).tools.enabled:
        raise ConfigError("--control no-tools is the control of a run with tools (tools.enabled): this config has none")
    if args.control is not None:
        cfg = dataclasses.replace(cfg, run_dir=f"{cfg.run_dir}-{args.control}")
    return cfg


def _train_command(args) -> str:
    """This `grpo train` command without --resume: an error about a damaged checkpoint names it + `--resume OTHER`."""
    import shlex

    ranks = args.nproc or int(os.environ.get("WORLD_SIZE", "1"))
    words = ["grpo", "train", args.config, *args.overrides, *(["--nproc", str(ranks)] if ranks > 1 else [])]
    for allowed in args.allow_code:
        words += ["--allow-code", allowed]
    words += ["--control", args.control] if args.control else []
    return shlex.join(words + (["--allow-data-change"] if args.allow_data_change else []))


def _relaunch_under_torchrun(nproc: int, argv: list[str]) -> int:
    """`grpo train ... --nproc N` = `torchrun --standalone --nproc_per_node N -m grpo_engine.cli train ...`.
    argv: the arguments main() was given (not sys.argv: main may be called from Python)."""
    if "--nproc" in argv:  # drop "--nproc N" / "--nproc=N": the children are the ranks
        i = argv.index("--nproc")
        argv = argv[:i] + argv[i + 2 :]
    argv = [a for a in argv if not a.startswith("--nproc=")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "grpo_engine.cli", *argv]
    return _run_forwarding_signals(cmd)


def _run_forwarding_signals(cmd: list[str]) -> int:
    """Run torchrun in its own session and pass the SIGINT / SIGTERM this process gets to the ranks themselves,
    then wait for torchrun, which exits on its own once they have finished their step, written a checkpoint and
    exited.

    Why not to torchrun: its agent gives the ranks `--shutdown_timeout` (30 s) after passing a signal on, then
    kills them, cutting a step + checkpoint that takes longer, and it reports the signal with a traceback and
    exit 1. Why its own session: the terminal's Ctrl-C reaches this process alone, so each rank gets a signal
    once, from here. subprocess.call would kill torchrun 0.25 s after a Ctrl-C, and a SIGTERM to this process
    would end it alone, leaving torchrun and the ranks training on. Before torchrun has started its ranks,
    a signal goes to torchrun."""
    proc = subprocess.Popen(cmd, start_new_session=True)

    def forward(signum, frame):
        ranks = _child_pids(proc.pid)
        for pid in ranks:  # each rank leads its own process group (torchrun starts them in new sessions)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signum)
        if not ranks:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; none where it cannot be read)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)": state, ppid, ...
        except (OSError, IndexError):
            continue  # exited meanwhile
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def add_check_parser(sub) -> None:
    p = sub.add_parser("check", help="the signal check alone: sample a few groups of the training split with the "
                                     "config's settings and say whether GRPO has anything to learn from them")
    p.add_argument("config", help="YAML config file (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.max_new_tokens=64")
    p.set_defaults(func=_check)


def _check(args) -> int:
    """Exit 0 when the check finds a learning signal, 2 when it finds none or too little (its last line says why and
    what to change)."""
    from .config import load_config
    from .train.setup import check_config

    fit = check_config(load_config(args.config, args.overrides))
    print("\n".join(fit.lines()), flush=True)
    return 0 if fit.report.verdict.ok else 2


def add_config_parser(sub) -> None:
    p = sub.add_parser("config", help="inspect configs")
    csub = p.add_subparsers(dest="config_command", required=True)
    show = csub.add_parser("show", help="print the resolved config tree")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    show.add_argument("--resolved", action="store_true", help="print what this machine would decide for it: device, "
                      "precision, the memory settings left to the engine, the warm start's model (resolved.yaml)")
    show.set_defaults(func=_config_show)


def _config_show(args) -> int:
    from .config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    if not args.resolved:
        print(to_yaml(cfg), end="")
        return 0
    from .model.loading import pick_device
    from .plan.resolved import resolve_settings

    print(resolve_settings(cfg, pick_device(cfg.model.device, 0)).to_yaml(), end="")
    return 0


def add_plot_parser(sub) -> None:
    p = sub.add_parser("plot", help="draw a run's metrics.jsonl as PNG curves")
    p.add_argument("run_dir", help="run directory written by `grpo train` (holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/curves.png, redrawn each time)")
    p.add_argument("--overwrite", action="store_true", help="replace the file --out names when it exists")
    p.set_defaults(func=_plot)


def _plot(args) -> int:
    from .plot import plot_run

    try:
        print(plot_run(args.run_dir, args.out, overwrite=args.overwrite))
    except ValueError as e:  # a metrics file with nothing to plot; a missing one is a FileNotFoundError
        print(f"grpo plot: error: {e}", file=sys.stderr)
        return 2
    return 0


PARSERS = [add_demo_parser, add_train_parser, add_check_parser, add_eval_parser, add_generate_parser, add_plot_parser,
           add_config_parser, add_plan_parser, add_bench_parser, add_export_parser]


class AnyOrderParser(argparse.ArgumentParser):
    """A parser whose options and positionals may come in any order (`grpo config show C --resolved k=v`).

    Why: plain argparse fills `config` and `overrides` from the first run of positionals it meets, so an override
    after an option would be "unrecognized" although the usage line shows `[--resolved] config [overrides ...]`. Every
    subcommand's parser is of this class (argparse builds subparsers of their parent's class); a parser that
    chooses a subcommand (its positional is the subcommand's name and the rest) parses as argparse does."""

    _intermixing = False

    def parse_known_args(self, args=None, namespace=None):
        positionals = self._get_positional_actions()
        if self._intermixing or any(a.nargs in (argparse.PARSER, argparse.REMAINDER) for a in positionals):
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args parses through this method twice
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    parser = AnyOrderParser(prog="grpo", description="GRPO training engine (add --debug anywhere to "
                                                               "see tracebacks instead of one-line errors)")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in PARSERS:
        add(sub)
    return parser


# Errors a user can fix from the message alone: one line, exit 2. Config, data and checkpoint errors are
# ValueErrors (ConfigError, DataError, CheckpointError, StateFormatError).
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


class Terminated(BaseException):
    """SIGTERM outside a training's loop, raised where the process is, so that what is being written (a .gguf, a
    report, a checkpoint) is removed on the way out as on Ctrl-C: by default SIGTERM ends the process at once."""


@contextlib.contextmanager
def _sigterm_raises(command: str):
    """SIGTERM raises Terminated during `command`; `grpo train` keeps its own handling (the loop finishes the
    step and checkpoints; under torchrun the ranks are signalled)."""
    if command == "train" or threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _after_write_failure(args) -> str:
    """The hint after a failed write: for `grpo train`, the flag that works in the run's state now
    (checkpoint/run_dir.py after_write_failure); `then run it again` elsewhere (no --resume outside train)."""
    if args.command != "train" or getattr(args, "run_dir", None) is None:
        return "then run it again"
    from .checkpoint.run_dir import after_write_failure

    return after_write_failure(args.run_dir)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done; 1 a run stopped (non-finite updates, out of memory, an I/O error); 2 bad input or a
    failure the user fixes (a full disk, a read-only folder); 130 Ctrl-C before a run started; 143 SIGTERM outside
    a training. `--debug` shows the traceback instead of the one-line message."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    args.debug, args.argv = debug, argv
    try:
        with allowing_code(getattr(args, "allow_code", None) or ()), _sigterm_raises(args.command):
            return args.func(args)
    except INPUT_ERRORS as e:
        if args.debug:
            raise
        raw = isinstance(e, OSError) and e.errno and str(e).startswith("[Errno")  # the OS's words: add path and fix
        print(f"grpo: error: {error_line(e, _after_write_failure(args)) if raw else e}", file=sys.stderr)
        return 2
    except Exception as e:  # an OSError, or a writer's wrapped one (safetensors): a full disk, a read-only folder
        error = as_os_error(e)
        if args.debug or not isinstance(error, OSError):
            raise
        then = _after_write_failure(args)
        print(f"grpo: error: {error_line(error, then)}", file=sys.stderr)
        return 2 if user_can_fix(error) else 1
    except KeyboardInterrupt:
        print("grpo: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("grpo: terminated (SIGTERM)", file=sys.stderr)
        return 143


if __name__ == "__main__":
    sys.exit(main())
