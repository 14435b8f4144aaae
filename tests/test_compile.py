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
