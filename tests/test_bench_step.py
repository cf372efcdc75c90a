"""`grpo bench step --json` prints one JSON line with the step time and peak memory."""

import json

from grpo_engine.cli import main


def test_bench_step_json(tiny_ckpt, capsys):
    assert main(["bench", "step", "--model", str(tiny_ckpt), "--prompts", "2", "--group", "2", "--max-new", "4",
                 "--prompt-len", "24", "--steps", "3", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    times = result["step_times"]
    assert len(times) == 3 and result["sec_per_step"] == (times[1] + times[2]) / 2  # median after the first
    assert result["peak_rss_mib"] > 10 and result["max_new_tokens"] == 4 and result["group"] == 2
