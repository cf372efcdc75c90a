"""GSM8K: grade-school word problems with a numeric final answer.

Rows use the Hugging Face layout: `question`, and `answer` = worked solution ending in "#### N". Files are
read from a local JSONL / parquet file, a directory with train/test files, or a saved `datasets` directory;
`hub_name` loads from the hub as a convenience only.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.fields import option
from .base import ChatTask, ChatTaskOptions, Example, RewardResult, weighted_reward
from .data import DataError, field_error, load_hub, read_records, require_fields, split_source
from .parsing import extract_answer, numeric_equal, parse_number


@dataclass
class GSM8KOptions(ChatTaskOptions):
    instruction: str = option('Solve it step by step, then give the final answer on the last line as '
                              '"Answer: <number>".', "appended to the user message: how to state the answer")
    data_path: str | None = option(None, "file for every split, or dir with train.*/test.* files or a saved dataset")
    hub_name: str = option("openai/gsm8k", "loaded from the hub only when data_path is None (needs network)")
    hub_config: str | None = option("main", "hub dataset configuration name")
    tolerance: float = option(1e-6, "relative tolerance of the numeric comparison (absolute below 1; an integer "
                                    "and its neighbour never match)")


def gold_answer(solution: str) -> str | None:
    """The text after the last '####' of a GSM8K solution, without thousands separators."""
    i = solution.rfind("####")
    if i < 0:
        return None
    return solution[i + 4 :].strip().replace(",", "") or None


def load_gsm8k(rows: list[dict], source: str) -> list[Example]:
    require_fields(rows, ("question", "answer"), source)
    out = []
    for i, row in enumerate(rows):
        gold = gold_answer(str(row["answer"]))
        if gold is None or parse_number(gold) is None:
            raise field_error(source, rows, i, "answer", "a solution ending in '#### <number>'", row["answer"])
        out.append(Example(f"{source}#{i}", str(row["question"]), gold))
    return out


class GSM8KTask(ChatTask):
    name, Options, splits = "gsm8k", GSM8KOptions, None

    def _load(self, split: str) -> list[Example]:
        o = self.options
        if o.data_path is not None:
            source = split_source(o.data_path, split)
            return load_gsm8k(read_records(source), str(source))
        rows = load_hub(o.hub_name, split, o.hub_config)
        if not rows:
            raise DataError(f"{o.hub_name} split {split!r} is empty")
        return load_gsm8k(rows, f"{o.hub_name}:{split}")

    def reward(self, example: Example, completion: str) -> RewardResult:
        found = extract_answer(self.options.prefill + completion, self.options.extractors)
        value = parse_number(found.answer) if found.answer is not None else None
        if value is None:
            return weighted_reward(self.options, completion, 0.0, None, {"reason": "no numeric answer"})
        answer = str(value)  # a Fraction: '47', '-3' or '3/4' (never '47.0'), so equal answers have equal text
        correct = numeric_equal(answer, example.answer, self.options.tolerance)
        info = {"method": found.method or ""}
        return weighted_reward(self.options, completion, float(correct), answer, info)

    def equivalent(self, a: str, b: str) -> bool:
        return numeric_equal(a, b, self.options.tolerance) or (a.strip() == b.strip())
