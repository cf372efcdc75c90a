"""The shape of the code base (docs/architecture.md): small functions and files, config as a leaf package,
`grpo --help` without torch, the model file free of kernels and training code."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "grpo_engine"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Absolute names of the grpo_engine modules `path` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join([*base, node.module] if node.module else base)
            found.add(name)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_function_over_60_lines_and_no_file_over_400():
    long_functions, long_files = [], []
    for path in _sources():
        text = path.read_text()
        if len(text.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {length} lines")
    assert long_functions == [] and long_files == []


def test_config_is_a_leaf():
    """config/ imports nothing from the rest of the engine, and no torch: everything else imports it."""
    for path in sorted((PACKAGE / "config").glob("*.py")):
        ours = {m for m in _imports(path) if m.startswith("grpo_engine") and not m.startswith("grpo_engine.config")}
        assert ours == set(), f"{path.name} imports {ours}"
        assert not any(m == "torch" or m.startswith("torch.") for m in _imports(path)), path.name


def test_model_file_is_architecture_only():
    """transformer.py imports no kernel, training or rollout code (kernels/ applies those from outside)."""
    ours = {m for m in _imports(PACKAGE / "model" / "transformer.py") if m.startswith("grpo_engine")}
    assert ours <= {"grpo_engine.model.config"}, ours


@pytest.mark.parametrize("argv", [["--help"], ["plot", "--help"]])
def test_cli_help_and_plot_load_no_torch(argv):
    code = ("import sys; from grpo_engine.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'")
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
