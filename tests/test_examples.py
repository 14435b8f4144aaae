import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_classic_question_example_runs(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "classic_question.py"), "--num-samples", "100", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=600,
    )
    assert "speed-up" in out.stdout


def test_eight_schools_example_runs_and_saves_figures(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "eight_schools.py"), "--num-samples", "100", "--out", str(tmp_path)],
        capture_output=True, text=True, check=True, timeout=600,
    )
    assert "centered:" in out.stdout and "divergences per chain" in out.stdout
    for name in ("centered", "non_centered"):
        for kind in ("trace", "energy", "pair"):
            assert (tmp_path / f"{name}_{kind}.png").stat().st_size > 0


@pytest.mark.parametrize(
    "script, expected",
    [
        ("logistic_regression.py", "accuracy of the posterior-mean classifier"),
        ("hierarchical.py", "('chain', 'draw', 'groups')"),
        ("gaussian_process.py", "relevant inputs [0, 1]"),
        ("potential_fn.py", "E[s]"),
        ("bayesian_neural_network.py", "(             gap)"),
        ("stochastic_volatility.py", "of the true log-volatility path inside the 90% intervals"),
        ("varying_slopes.py", "true group effects inside the 90% intervals"),
        ("mixture.py", "\nordered locations:"),  # the second run (not "unordered")
        ("changepoint.py", "the first year of the late rate, most probable years:"),
        ("missing_data.py", "of the true missing inputs inside their 90% intervals"),
        ("count_regression.py", "LOO prefers the negative binomial regression"),
        ("hidden_markov.py", "of the days' regimes recovered"),
        ("sparse_regression.py", "inputs whose 90% intervals exclude 0: [0, 1, 2] (true: [0, 1, 2])"),
        ("ordinal_regression.py", "6 of 6 true coefficients and cut points inside the 90% intervals"),
        ("survival.py", "4 of 4 true parameters inside the 90% intervals"),
        ("item_response.py", "share of correct answers is outside the replicated 90% range: 0 of 20"),
        ("circular_regression.py", "3 of 3 true parameters inside the 90% intervals"),
    ],
)
@pytest.mark.filterwarnings("ignore::pyro_hmc_plus.SamplingWarning")  # 100 draws: too few for the run's checks
def test_examples_run_in_fast_mode(script, expected, monkeypatch, capsys):
    """Each script run as ``python examples/SCRIPT --num-samples 100 --no-plots`` would run
    it, but in this process: a fresh Python process spends ~2-5 s importing torch, Pyro and
    ArviZ, a third of some scripts' runs (the scripts import nothing of their own folder, and
    the suite's fixtures reset the seed and the default dtype around each)."""
    path = ROOT / "examples" / script
    monkeypatch.setattr(sys, "argv", [str(path), "--num-samples", "100", "--no-plots"])
    runpy.run_path(str(path), run_name="__main__")
    assert expected in capsys.readouterr().out


def test_demo_command_runs():
    command = [shutil.which("pyro-hmc-plus")] if shutil.which("pyro-hmc-plus") else [sys.executable, "-m", "pyro_hmc_plus.cli"]
    out = subprocess.run(
        [*command, "demo", "--num-samples", "100", "--no-plots"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    assert "speed-up" in out.stdout and "exact mean" in out.stdout and "r_hat" in out.stdout
