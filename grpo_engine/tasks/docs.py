"""docs/tasks.md, generated from the task options' field metadata (`python -m grpo_engine.tasks.docs`)."""

from __future__ import annotations

import dataclasses

from . import TASKS

EXAMPLES = {
    "arithmetic": "task:\n  name: arithmetic\n  options:\n    digits: 2\n    operations: [\"+\"]",
    "countdown": "task:\n  name: countdown\n  data_path: data/countdown/train.parquet  # or none: generated",
    "gsm8k": "task:\n  name: gsm8k\n  data_path: data/gsm8k/main  # train-*.parquet and test-*.parquet",
    "math": "task:\n  name: math\n  data_path: data/math500        # needs grpo-engine[math] (math-verify)",
    "custom": ("task:\n  name: custom\n  options:\n    data_path: my_problems.jsonl  # one {\"prompt\", \"answer\"} "
               "per line\n    verifier: numeric  # or choice | word | exact | math; or reward_fn: my_module:my_reward"),
}

INTRO = """# Tasks

Generated from the task options' field docs (`python -m grpo_engine.tasks.docs > docs/tasks.md`); a test keeps
this file in sync with grpo_engine/tasks/. Options go under `task.options` in a config (or
`--task-option KEY=VALUE` on `grpo eval` / `grpo generate`); `task.data_path` sets `data_path`.

Every built-in task is ready for instruct models by default: the user message states how to give the answer
(`instruction`), the answer is found by a lenient cascade (`extractors`: an answer tag, `\\\\boxed{}`, an
`Answer:` line, "the answer is", and last a number that ends the reply; a completion cut off mid-sentence by
the length limit does not score for a number inside it), and whether the reply used the requested form is a
separate `format` component with its own weight. The `answer` component is 0/1 correctness, the same check in
training, in-loop evaluation and `grpo eval`.

R1-style training (reasoning in `<think>` tags, the answer in `<answer>` tags) is a choice of options:

```yaml
options:
  system_prompt: "A conversation between User and Assistant. ... <think> </think> and <answer> </answer> ..."
  prefill: "Let me solve this step by step.\\n<think>"
  instruction: ""
  format: strict            # or partial: 0.25 per tag, a denser signal early on
  extractors: [answer_tag]
```

Your own task: write a JSONL file with `prompt` and `answer` fields and use the `custom` task with a built-in
verifier (`numeric` for a number, `choice` for an option letter, `word` for a short word, `exact`, `math`; each
reads replies with its own lenient cascade), or name a reward function `module:function` called as
`fn(example, completion) -> float | RewardResult` (it runs through the guarded scorer: an exception or a run
past the timeout scores 0 and is counted). `task.options.data_path` and `task.data_path` are one setting. Without
`test_path` the task holds out a seeded `holdout` share of the data file (10%; a file under 20 rows is both
splits) as its test split and says so, so the held-out accuracy is measured on rows the model never trained on.
A new task class implements the `Task` protocol of grpo_engine/tasks/base.py (`examples`, `prompt`, `reward`,
`equivalent`) and registers in `TASKS`.

Before you train, check that GRPO has something to learn: `grpo check CONFIG` samples `check.groups` (16) prompts
of the training split, each with `rollout.group_size` replies at the run's settings, and reports the reward
distribution, the share of groups whose rewards differ (the only ones GRPO learns from), the share of replies cut
at `rollout.max_new_tokens`, how often the extractor finds an answer, the accuracy, and a verdict that names the
likely cause of a missing signal and the setting that fixes it:

| the check finds | fix |
| --- | --- |
| replies cut at `rollout.max_new_tokens` | raise `rollout.max_new_tokens` |
| answers the extractor cannot find | say how to answer in `instruction`, or widen `extractors` |
| every group all correct | harder data |
| no reply correct | easier data, a warm start, or a larger `rollout.group_size` / `rollout.temperature` |
| a reward that is the same for every reply | the reward function (`reward_fn`, `answer_weight`) |

`grpo train` runs the same check after any warm start and before step 1 (not on `--resume`) and stops in one
line, exit 2, when the signal is absent or below `check.min_spread`; `--no-check` skips it, `check.stop=false`
reports and goes on. It costs about two steps' generation and no update, and leaves the run bit-identical. At the
end `grpo train` prints the held-out accuracy of the starting and the final model (the first `eval.max_examples`
of the test split, at `eval.temperature` and `rollout.max_new_tokens`) as `grpo demo` does, and writes
`RUN_DIR/before_after.json`; `grpo train CONFIG --control random-reward` runs the same recipe with coin-flip
rewards in `RUN_DIR-random-reward`, with its own before_after.json: a gain GRPO earned is one the control lacks.
"""


def tasks_docs_markdown() -> str:
    lines = [INTRO]
    for name, spec in TASKS.items():
        lines += [f"## {name}", ""]
        module_doc = __import__(spec.task.__module__, fromlist=["x"]).__doc__ or ""
        lines += [module_doc.strip().split("\n\n")[0], "", "| option | default | meaning |", "| --- | --- | --- |"]
        for f in dataclasses.fields(spec.options):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = repr(default).replace("|", "/")
            lines.append(f"| `{f.name}` | `{shown}` | {f.metadata.get('help', '').replace('|', '/')} |")
        lines += ["", "```yaml", EXAMPLES[name], "```", ""]
    return "\n".join(lines).replace("\n\n\n", "\n\n")


if __name__ == "__main__":
    print(tasks_docs_markdown(), end="")
