"""The private torch entry points we rely on, so a torch upgrade that moves them is caught."""

import importlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_hmc_plus import _compile


def test_private_entry_points_exist():
    assert callable(getattr(importlib.import_module("torch._inductor"), "compile", None))
    import inspect

    assert "_error_on_data_dependent_ops" in inspect.signature(make_fx).parameters


def test_torchscript_backend_runs_a_traced_graph():
    gm = make_fx(lambda z: (z * z).sum())(torch.randn(3))
    fn = _compile.torchscript(gm, (torch.randn(3),))
    assert torch.allclose(fn(torch.ones(3)), torch.tensor(3.0))


@pytest.mark.slow
def test_inductor_backend_compiles_a_traced_graph():
    gm = make_fx(lambda z: ((z * z).sum(), 2 * z))(torch.randn(3))
    fn = _compile.inductor(gm, (torch.randn(3),))
    U, g = fn(torch.ones(3))
    assert torch.allclose(U, torch.tensor(3.0)) and torch.allclose(g, 2 * torch.ones(3))


AOT_SCRIPT = """
import sys, torch, pyro
from pyro.infer import MCMC
from pyro_hmc_plus import NUTS

def potential(params):
    return 0.5 * (params["x"] ** 2).sum()

pyro.set_rng_seed(0)
kernel = NUTS(potential_fn=potential, step_size=0.5, adapt_step_size=False, adapt_mass_matrix=False,
              max_tree_depth=2, engine=sys.argv[1])
mcmc = MCMC(kernel, num_samples=20, warmup_steps=0, initial_params={"x": torch.zeros(2)}, disable_progbar=True)
mcmc.run()
print(kernel.engine_name, kernel._engine.cached_programs, mcmc.get_samples()["x"].sum().item())
"""


@pytest.mark.slow
def test_aot_cache_compiles_once_and_later_processes_load(tmp_path):
    """engine="aot" compiles into the on-disk cache; a later process (engine="auto") loads
    the programs from it, and its draws equal those of the plain traced engine."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYRO_HMC_PLUS_CACHE": str(tmp_path)}

    def run(engine):
        out = subprocess.run([sys.executable, "-c", AOT_SCRIPT, engine], env=env, capture_output=True,
                             text=True, check=True)
        name, cached, total = out.stdout.split()
        return name, int(cached), float(total)

    name, cached, aot_total = run("aot")
    assert name == "aot" and cached == 0
    packages = list(tmp_path.rglob("*.pt2"))
    assert len(packages) == 2  # the first doubling and the 2-state doubling
    name, cached, warm_total = run("auto")
    assert cached == 2
    _, _, trace_total = run("trace")
    assert abs(warm_total - trace_total) < 1e-4 and abs(aot_total - trace_total) < 1e-4
