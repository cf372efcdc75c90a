"""Hostile-input probes under bounds: `grpo` commands run in one subprocess whose address space is capped
(RLIMIT_AS) and whose every command must finish within a time limit, so a test of a bomb asserts that it is
refused cheaply, and never hangs the suite or swaps the machine if it is not.

One subprocess runs all the probes of a test (torch is imported once, not once per probe); each probe is
`grpo_engine.cli.main(argv)`, the exit code it returns and what it wrote to stderr.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

MEMORY_BYTES = 4 << 30
SECONDS_EACH = 20
ONE_LINE_ERROR = re.compile(r"grpo( \w+)?: error: .+")

RUNNER = """
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
from grpo_engine.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    err, start = io.StringIO(), time.perf_counter()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # a traceback is a failed probe, reported as such
            code, _ = repr(e), err.write(repr(e))
    results.append({{"code": code, "stderr": err.getvalue(), "seconds": time.perf_counter() - start}})
print(json.dumps(results))
"""


def run_probes(argvs: list[list[str]], cwd: Path | None = None) -> list[dict]:
    """Run each `grpo` argv in one bounded subprocess; [{"code", "stderr", "seconds"}] in order."""
    code = RUNNER.format(memory=MEMORY_BYTES)
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True,
                         cwd=cwd, timeout=15 + SECONDS_EACH * len(argvs))
    assert out.returncode == 0, f"the probe process died (memory over {MEMORY_BYTES >> 30} GB?): {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_refused(result: dict, *needles: str) -> None:
    """Exit 2, within the time limit, with one `grpo: error:` line that contains every needle (the file's name,
    what is wrong)."""
    lines = result["stderr"].strip().splitlines()
    assert result["code"] == 2, result
    assert result["seconds"] < SECONDS_EACH, result
    assert len(lines) == 1 and ONE_LINE_ERROR.fullmatch(lines[0]), result["stderr"]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
