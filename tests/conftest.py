import warnings

import pyro
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed_and_dtype():
    """Every test starts from the same seed and float32, and leaves the default dtype as found."""
    dtype = torch.get_default_dtype()
    pyro.set_rng_seed(0)
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*c-shim.*")
        yield
    torch.set_default_dtype(dtype)
