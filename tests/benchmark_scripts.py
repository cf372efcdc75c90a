"""The scripts of benchmarks/ as modules, for tests of their arithmetic and plumbing (importable from any test:
pyproject sets pytest's pythonpath to tests/). They are plain scripts, not a package, so they load by path."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str):
    """benchmarks/<name>.py, executed as a fresh module named `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
