"""Write examples/own_task.ipynb from examples/own_task.py, whose `# %%` lines open its cells (`# %% [markdown]` a
text cell, its lines' leading '# ' removed): the notebook and the script are one source.

    python examples/make_notebook.py        # tests/api/test_notebook.py checks the two agree
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def cells(script: str) -> list[dict]:
    out, kind, lines = [], None, []

    def close() -> None:
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(line.removeprefix("#").removeprefix(" ") for line in text.splitlines())
        if kind is not None and text:
            source = text.splitlines(keepends=True)
            cell = {"cell_type": kind, "id": f"cell-{len(out) + 1}", "metadata": {}, "source": source}
            if kind == "code":
                cell.update(execution_count=None, outputs=[])
            out.append(cell)

    for line in script.splitlines():
        if line.startswith("# %%"):
            close()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    close()
    return out


def notebook(script: str) -> dict:
    return {"cells": cells(script), "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python",
                                                                "name": "python3"},
                                                 "language_info": {"name": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


def notebook_text(script_path: Path = HERE / "own_task.py") -> str:
    return json.dumps(notebook(script_path.read_text()), indent=1, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    out = HERE / "own_task.ipynb"
    out.write_text(notebook_text())
    print(f"wrote {out}", file=sys.stderr)
