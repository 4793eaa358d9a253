"""scripts/placebo_runs.py's plumbing, its training runs replaced: every seed's pair is run, --config.* reaches each
run, and the comparison gets the metrics and training rewards asked for, with the command written to report.md."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts import placebo_runs  # noqa: E402


def test_pairs_per_seed_and_what_reaches_the_comparison(tmp_path, monkeypatch):
    ran, compared = [], []
    monkeypatch.setattr(placebo_runs, "run_one", lambda preset, arm, seed, out, threads, extra: (
        ran.append((preset, arm, seed, threads, tuple(extra))) or (out / arm / f"seed{seed}", 0)))
    monkeypatch.setattr(placebo_runs.seed_gains, "main", lambda argv: compared.append(argv) or "TABLES")
    code = placebo_runs.main(["--preset", "tiny_cpu", "--seeds", "0", "1", "--out", str(tmp_path), "--metric",
                              "eval/cam_score", "--train-reward", "cam_score", "--config.num_epochs=3"])
    assert code == 0
    assert sorted((a, s) for _, a, s, _, _ in ran) == [("grpo", 0), ("grpo", 1), ("placebo", 0), ("placebo", 1)]
    assert all(extra == ("--config.num_epochs=3",) and threads == 1 for *_, threads, extra in ran)
    argv = compared[0]
    assert argv[:2] == [str(tmp_path / "grpo" / "seed0"), str(tmp_path / "grpo" / "seed1")]
    assert argv[argv.index("--placebo") + 1:argv.index("--placebo") + 3] == [str(tmp_path / "placebo" / "seed0"),
                                                                              str(tmp_path / "placebo" / "seed1")]
    assert argv[argv.index("--train-reward") + 1] == "cam_score" and "eval/cam_score" in argv
    assert "--power" not in argv
    code = placebo_runs.main(["--preset", "tiny_cpu", "--seeds", "0", "--out", str(tmp_path), "--power", "0.01"])
    argv = compared[1]  # no --metric: the preset's endpoints, which seed_gains reads from the runs' config.json
    assert code == 0 and "--metric" not in argv and argv[argv.index("--power") + 1] == "0.01"
    report = (tmp_path / "report.md").read_text()
    assert "TABLES" in report and "--power 0.01" in report


def test_an_unfinished_run_fails_and_says_how_to_continue(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(placebo_runs, "run_one", lambda preset, arm, seed, out, threads, extra: (
        out / arm / f"seed{seed}", 3 if arm == "placebo" else 0))
    assert placebo_runs.main(["--preset", "tiny_cpu", "--seeds", "0", "--out", str(tmp_path), "--metric",
                              "eval/cam_score"]) == 1
    assert "placebo/seed0 (exit 3)" in capsys.readouterr().out and not (tmp_path / "report.md").exists()
