"""benchmarks/decode_loops.py: its figures (median, spread, ratio, greedy agreement), its stop tokens, and one
interleaved run end to end at a toy shape."""

from __future__ import annotations

from benchmark_scripts import load_benchmark


def test_stop_ids_and_the_summary():
    bench = load_benchmark("decode_loops")
    assert bench.stop_ids(100, 0.25, [7]) == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63, 67, 71, 75,
                                              79, 83, 87, 91, 95, 99]
    assert bench.stop_ids(100, 0.0, [7, 2]) == [2, 7]  # EOS only
    base = {"seconds": [2.0, 1.0, 4.0], "tokens": [100, 100, 100], "greedy_hash": "a", "greedy_tokens": 9}
    other = {"seconds": [3.0, 3.0, 6.0], "tokens": [90, 90, 90], "greedy_hash": "b", "greedy_tokens": 9}
    row = bench.summary("x", other, base)
    assert (row["median_s"], row["min_s"], row["max_s"], row["tokens_per_s"]) == (3.0, 3.0, 6.0, 30.0)
    assert row["ratio"] == 1.5 and row["greedy_same"] is False
    assert "ratio" not in bench.summary("base", base, None)


def test_one_interleaved_run_at_a_toy_shape(tmp_path, capsys):
    bench = load_benchmark("decode_loops")
    rows = bench.main(["--runs", "2", "--shapes", "tiny", "--workloads", "generate", "--prompts", "2", "--group",
                       "2", "--max-new", "6", "--threads", "1", "--cache", str(tmp_path)])
    assert [(r["shape"], r["workload"], r["loop"]) for r in rows] == [("tiny", "generate", "this:static")]
    assert rows[0]["min_s"] <= rows[0]["median_s"] <= rows[0]["max_s"] and rows[0]["tokens_per_s"] > 0
    assert "this:static" in capsys.readouterr().out
