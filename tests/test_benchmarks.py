"""The benchmark scripts run end to end with every contender, at sizes that take seconds:
their documented commands differ only in the numbers of draws and repetitions. (The NUTS
script's four-contender command once stopped after its first row: Pyro's ``jit_compile``
run counts no gradients, and the mean over seeds of its ESS per gradient raised.)"""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


def _rows(script, *options):
    """The lines ``script`` prints, run with ``options`` (it must succeed, and say no contender failed)."""
    out = subprocess.run([sys.executable, str(BENCHMARKS / script), *options], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and "failed" not in out.stderr, out.stderr[-3000:]
    return out.stdout.splitlines()


@pytest.mark.slow
def test_the_nuts_benchmark_reports_every_contender():
    contenders = ["pyro", "pyro_jit", "ours"] + (["numpyro"] if importlib.util.find_spec("numpyro") else [])
    lines = _rows("nuts.py", "--models", "gauss2d", "--contenders", *contenders, "--reps", "2",
                  "--warmup", "20", "--samples", "20")
    rows = {line.split()[1]: line.split() for line in lines if line.startswith("gauss2d")}
    assert set(rows) == set(contenders)
    assert all(float(row[2]) > 0 for row in rows.values())  # wall time
    assert rows["ours"][-2] == "+-"  # ESS per gradient: the mean over seeds and its standard error


@pytest.mark.slow
def test_the_hmc_benchmark_reports_every_contender():
    lines = _rows("hmc.py", "--problem", "classic", "--iterations", "40", "--reps", "1")
    printed = " ".join(lines)
    for contender in ("hand_written_backward", "pyro_hmc", "pyro_hmc_jit", "pyro_hmc_potential_fn", "ours_model",
                      "ours_potential_fn", "ours_model_our_mcmc"):
        assert contender in printed


@pytest.mark.slow
def test_the_chains_benchmark_reports_every_contender():
    lines = _rows("chains.py", "--models", "gauss2d", "--kernels", "nuts", "hmc", "--chains", "2", "--reps", "1",
                  "--warmup", "20", "--samples", "20")
    rows = [line.split() for line in lines if line.startswith("gauss2d")]
    assert {(row[1], row[3]) for row in rows} == {(kernel, contender) for kernel in ("nuts", "hmc")
                                                  for contender in ("vectorized", "sequential", "parallel", "pyro_parallel")}
