"""`grpo bench generate` runs end to end on a tiny checkpoint and prints one JSON line with tokens_per_s."""

from __future__ import annotations

import json

from grpo_engine.cli import main
from grpo_engine.kernels import cpu_model


def test_bench_generate_json_line(tiny_dir, capsys):
    main(["bench", "generate", "--model", str(tiny_dir), "--prompts", "2", "--group", "2", "--max-new", "5",
          "--ignore-eos", "--json", "--device", "cpu"])
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    result = json.loads(line)
    assert result["tokens_per_s"] > 0 and result["new_tokens"] == 2 * 2 * 5
    assert result["cpu"] == cpu_model()  # recorded figures name the CPU they were measured on
