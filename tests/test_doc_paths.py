"""Every file and module the docs name exists: `path/to/module.py` (or .yaml / .md) and `room/module.name` in the
package's docstrings and comments, docs/*.md and README.md, and every `grpo_engine.x.y` name there imports.

A path resolves against the repository root, grpo_engine/, tests/ and benchmarks/; one whose first folder is none
of ours (a path inside another project) is not checked. CHANGELOG.md, which names old paths on purpose, is not read.
"""

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = [REPO, REPO / "grpo_engine", REPO / "tests", REPO / "benchmarks"]
OUTPUTS = {"runs", "data", "build", "dist"}  # what commands write (runs/NAME.json) or users download: not ours to check
OURS = {p.name for root in ROOTS for p in root.iterdir()
        if p.is_dir() and not p.name.startswith((".", "__")) and p.name not in OUTPUTS}
ROOMS = {p.name for p in (REPO / "grpo_engine").iterdir() if (p / "__init__.py").is_file()}

FILE_PATH = re.compile(r"(?<![\w./~$<{*-])((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|md))(?![\w/*-])")
MODULE_ATTR = re.compile(r"(?<![\w./~$<{*-])([a-z_]+)/([a-z_]\w*)\.([A-Za-z_]\w*)")  # collect/groups.collect_groups
DOTTED = re.compile(r"(?<![\w.])grpo_engine(?:\.[A-Za-z_]\w*)+")
FILE_TYPES = {"py", "yaml", "md", "json", "jsonl", "safetensors", "gguf", "parquet", "txt", "png", "lock", "tmp"}


def _sources() -> list[Path]:
    return [*sorted((REPO / "grpo_engine").rglob("*.py")), *sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]


def _exists(*names: str) -> bool:
    return any((root / name).exists() for root in ROOTS for name in names)


def _imports(dotted: str) -> bool:
    """grpo_engine.a.b.c: the longest prefix that imports, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for name in parts[i:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def _checked_lines(path: Path):
    """(line number, text) of each line of `path`."""
    yield from enumerate(path.read_text().splitlines(), 1)


def _missing(line: str) -> list[str]:
    missing = []
    for m in FILE_PATH.finditer(line):
        if m.group(1).split("/")[0] in OURS and not _exists(m.group(1)):
            missing.append(m.group(1))
    for m in MODULE_ATTR.finditer(line):
        room, module = m.group(1), m.group(2)
        if m.group(3) in FILE_TYPES or room not in ROOMS:
            continue
        if not _exists(f"grpo_engine/{room}/{module}.py", f"grpo_engine/{room}/{module}"):
            missing.append(m.group(0))
    missing += [m.group(0) for m in DOTTED.finditer(line) if not _imports(m.group(0))]
    return missing


def test_the_patterns_find_what_they_should():
    assert _missing("see train/shared_prompt.py and `rl/overlong.py`") == ["train/shared_prompt.py", "rl/overlong.py"]
    assert _missing("e.g. train/tool_rollouts.generate_tool_groups") == ["train/tool_rollouts.generate_tool_groups"]
    assert _missing("grpo_engine.rl.schedule.lr_factor, grpo_engine.rl.policy_loss") == [
        "grpo_engine.rl.schedule.lr_factor"]
    assert _missing("configs/gpu8gb_qwen2.5-1.5b_qlora.yaml, collect/groups.py: collect_groups, eval/accuracy, "
                    "model/model.safetensors, transformers/models/qwen2/modeling_qwen2.py, "
                    "grpo_engine.config.load_config") == []


def test_every_path_and_module_a_doc_names_exists():
    missing = [f"{path.relative_to(REPO)}:{number}: {name}"
               for path in _sources() for number, line in _checked_lines(path) for name in _missing(line)]
    assert missing == []
