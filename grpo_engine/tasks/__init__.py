"""Verifiable tasks: prompts in, safe rewards out.

    task = make_task("countdown", n_train=1000, format="partial")
    ex = task.examples("train")[0]
    prompt = task.prompt(ex)                      # Prompt(messages, prefill)
    result = safe_reward(task, ex, completion)    # RewardResult(total, components, answer, info)

`TASKS` maps a name to (options dataclass, task class); `make_task` builds one from keyword options and
rejects unknown option names with the list of valid ones. The trainer's config embeds (name, options).
"""

from __future__ import annotations

import dataclasses
import os
import typing
from typing import NamedTuple

from .arithmetic import ArithmeticOptions, ArithmeticTask
from .base import (
    R1_PREFILL,
    R1_SYSTEM_PROMPT,
    ChatTaskOptions,
    Example,
    Prompt,
    RewardResult,
    Task,
    render_prompt,
    safe_reward,
)
from .countdown import CountdownOptions, CountdownTask
from .custom import CustomOptions, CustomTask
from .data import DataError
from .gsm8k import GSM8KOptions, GSM8KTask
from .math import MathOptions, MathTask


class TaskSpec(NamedTuple):
    options: type  # the task's options dataclass
    task: type  # the task class, constructed as task(options)


TASKS: dict[str, TaskSpec] = {
    "arithmetic": TaskSpec(ArithmeticOptions, ArithmeticTask),
    "countdown": TaskSpec(CountdownOptions, CountdownTask),
    "gsm8k": TaskSpec(GSM8KOptions, GSM8KTask),
    "math": TaskSpec(MathOptions, MathTask),
    "custom": TaskSpec(CustomOptions, CustomTask),
}


def task_options(name: str, **options) -> ChatTaskOptions:
    """The options dataclass of task `name` filled from keyword options (unknown names are an error)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available tasks: {sorted(TASKS)}")
    cls = TASKS[name].options
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {name!r}; valid options: {valid}")
    hints = typing.get_type_hints(cls)
    return cls(**{key: _typed(key, value, hints[key]) for key, value in options.items()})


def _typed(key: str, value, hint):
    """`value` as the scalar type `hint` names (YAML's 3 for a float, its 42 for a str), or a ValueError that
    names the option: the options dataclasses do not check types, so `digits: x` would otherwise crash deep in
    a task and `format_weight: abc` would fail every reward silently. Containers are left to the tasks."""
    optional = type(None) in typing.get_args(hint)
    if value is None and optional:
        return value
    base = next((t for t in typing.get_args(hint) if t is not type(None)), hint) if optional else hint
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if base is bool and isinstance(value, bool):
        return value
    if base is int and number and float(value).is_integer():
        return int(value)
    if base is float and number:
        return float(value)
    if base is str and isinstance(value, str):
        return value  # as it is: a StoredCode (config/trust.py) must stay one
    if base is str and (isinstance(value, os.PathLike) or number):
        return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    if base in (bool, int, float, str):
        wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[base]
        raise ValueError(f"task option {key}={value!r} must be {wanted}" + (" or null" if optional else ""))
    return value


def make_task(name: str, **options) -> Task:
    """Build the task `name` with the given options, e.g. make_task("gsm8k", data_path="gsm8k/")."""
    options_obj = task_options(name, **options)  # validates the name first
    return TASKS[name].task(options_obj)


def build_task(name: str, options: dict, data_path: str | None = None) -> Task:
    """make_task with a data path given apart from the options (a config's task.data_path, `grpo eval --data`);
    a task that generates its problems refuses one. Both spellings (task.data_path, task.options.data_path) name one
    setting: the same file twice is that file, two different files an error. ValueError names the problem."""
    given = options.get("data_path")
    if data_path is not None and given and os.path.realpath(str(given)) != os.path.realpath(str(data_path)):
        raise ValueError(f"task.data_path={data_path!r} and task.options.data_path={given!r} name two files: they are "
                         f"one setting; keep one")
    if data_path is not None:
        if name in TASKS and "data_path" not in {f.name for f in dataclasses.fields(TASKS[name].options)}:
            raise ValueError(f"task {name!r} generates its problems and reads no data file; drop --data / "
                             f"task.data_path ({data_path})")
        options = {**options, "data_path": data_path}
    return make_task(name, **options)


__all__ = [
    "R1_PREFILL",
    "R1_SYSTEM_PROMPT",
    "TASKS",
    "ArithmeticOptions",
    "ArithmeticTask",
    "ChatTaskOptions",
    "CountdownOptions",
    "CountdownTask",
    "CustomOptions",
    "CustomTask",
    "DataError",
    "Example",
    "GSM8KOptions",
    "GSM8KTask",
    "MathOptions",
    "MathTask",
    "Prompt",
    "RewardResult",
    "Task",
    "TaskSpec",
    "build_task",
    "make_task",
    "render_prompt",
    "safe_reward",
    "task_options",
]
