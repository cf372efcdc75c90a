"""`grpo plot`: panels drawn only for logged metrics; torn lines tolerated; clear error without metrics."""

import json

import pytest

from grpo_engine.plot import PANELS, moving_average, plot_run, read_metrics, series


def write_run(tmp_path, rows, torn=False):
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    if torn:
        text += '{"step": 99, "reward_me'
    (tmp_path / "metrics.jsonl").write_text(text)
    return tmp_path


def test_series_skips_missing_and_non_finite(tmp_path):
    rows = [{"step": 1, "reward_mean": 0.1}, {"step": 2}, {"step": 3, "reward_mean": float("nan")},
            {"step": 4, "reward_mean": 0.4}]
    assert series(rows, "reward_mean") == ([1, 4], [0.1, 0.4])


def test_torn_last_line_is_skipped(tmp_path):
    run_dir = write_run(tmp_path, [{"step": 1, "reward_mean": 0.5}], torn=True)
    assert read_metrics(run_dir / "metrics.jsonl") == [{"step": 1, "reward_mean": 0.5}]


def test_plot_writes_png_with_panels_for_logged_metrics(tmp_path):
    rows = [{"step": s, "reward_mean": s / 10, "completion_len_mean": 5 + s, "eval/accuracy": s / 20}
            for s in range(1, 6)]
    out = plot_run(write_run(tmp_path, rows))
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    keys = {k for p in PANELS for k in p.keys}
    assert {"reward_mean", "completion_len_mean", "eval/accuracy"} <= keys


def test_out_path_returned_is_the_file_written(tmp_path):
    """--out DIR wrote a sibling DIR.png and --out NAME wrote NAME.png, each printing a path that was not the
    file; --out into a missing folder failed."""
    (tmp_path / "run").mkdir()
    run_dir = write_run(tmp_path / "run", [{"step": 1, "reward_mean": 0.5}])
    folder = tmp_path / "plots"
    folder.mkdir()
    assert plot_run(run_dir, folder) == folder / "curves.png" and (folder / "curves.png").is_file()
    assert plot_run(run_dir, tmp_path / "curves") == tmp_path / "curves.png" and (tmp_path / "curves.png").is_file()
    nested = tmp_path / "new" / "dir" / "c.png"
    assert plot_run(run_dir, nested) == nested and nested.read_bytes()[:4] == b"\x89PNG"


def test_missing_metrics_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl not found"):
        plot_run(tmp_path)


def test_no_plottable_metrics(tmp_path):
    with pytest.raises(ValueError, match="no plottable metrics"):
        plot_run(write_run(tmp_path, [{"step": 1, "something": 2}]))


def test_moving_average_hand_computed():
    ys = [float(v) for v in range(1, 41)]  # window = round(40 * 0.05) = 2
    avg = moving_average(ys)
    assert avg[:3] == [1.0, 1.5, 2.5] and avg[-1] == 39.5 and len(avg) == 40


def test_mismatch_and_correction_panels(tmp_path):
    """The sampler/trainer mismatch metrics (rl/correction.py) each have a panel, drawn when logged."""
    rows = [{"step": s, "mismatch_mean_abs": 0.007, "mismatch_max_abs": 0.04, "mismatch_k3": 4e-5,
             "rollout_correction_frac": 0.01} for s in range(1, 4)]
    drawn = {k for p in PANELS for k in p.keys}
    assert {"mismatch_mean_abs", "mismatch_max_abs", "mismatch_k3", "rollout_correction_frac"} <= drawn
    assert plot_run(write_run(tmp_path, rows)).read_bytes()[:4] == b"\x89PNG"
