"""The kernels with the model's tensors on a CUDA device, as Pyro users put them there: data
moved to the GPU, or ``torch.set_default_device("cuda")``. Skipped where torch sees no GPU
(CI); run where one is with ``pytest tests/test_cuda.py``.

Each test checks the draws against the exact posterior (MCSE tolerances) and that the
gradient was traced (no fallback to eager autograd): on the GPU the engine records the same
programs and runs them with TorchScript's interpreter (Static Runtime is CPU-only)."""

import warnings

import arviz as az
import pyro
import pyro.distributions as dist
import pytest
import torch

import pyro_hmc_plus
from pyro_hmc_plus import HMC, NUTS, EngineFallbackWarning

from helpers import assert_mean, assert_variance

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PRIOR_SCALE = 10.0


def _normal_mean(y):
    """mu ~ N(0, 10^2), y_i ~ N(mu, 1): the prior's tensors on the data's device."""
    mu = pyro.sample("mu", dist.Normal(torch.zeros((), device=y.device), PRIOR_SCALE))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _normal_mean_float_prior(y):
    """The same model with the prior written in Python numbers (its tensors on the CPU), the
    data on the GPU: the latent is a CPU scalar, the likelihood runs on the GPU, as in Pyro."""
    mu = pyro.sample("mu", dist.Normal(0.0, PRIOR_SCALE))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _data(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return (1.5 + torch.randn(40, generator=g, dtype=dtype)).cuda()


def _exact(y):
    """Posterior mean and variance of mu."""
    precision = PRIOR_SCALE**-2 + len(y)
    return y.sum().item() / precision, 1.0 / precision


def _kernel(kernel_class):
    """NUTS, or HMC with a trajectory of the posterior's scale (~0.16) a few times over."""
    return kernel_class(_normal_mean) if kernel_class is NUTS else kernel_class(_normal_mean, trajectory_length=1.0)


def _run_traced(mcmc, *args):
    """``mcmc.run(*args)`` with a fallback to eager autograd as an error: the GPU path traces."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", EngineFallbackWarning)
        mcmc.run(*args)
    return mcmc


def _check(samples, y):
    mean, var = _exact(y)
    assert_mean(samples.cpu().numpy(), mean)
    assert_variance(samples.cpu().numpy(), var)


@pytest.mark.parametrize("kernel_class", [HMC, NUTS])
def test_model_with_data_on_the_gpu(kernel_class):
    y = _data()
    kernel = _kernel(kernel_class)
    mcmc = _run_traced(pyro.infer.MCMC(kernel, num_samples=800, warmup_steps=300, disable_progbar=True), y)
    assert kernel._engine.name == "trace"
    mu = mcmc.get_samples()["mu"]
    assert mu.device.type == "cuda"
    _check(mu, y)


def test_data_on_the_gpu_latents_on_the_cpu():
    y = _data()
    kernel = NUTS(_normal_mean_float_prior)
    mcmc = _run_traced(pyro.infer.MCMC(kernel, num_samples=800, warmup_steps=300, disable_progbar=True), y)
    _check(mcmc.get_samples()["mu"], y)


@pytest.mark.parametrize("kernel_class", [HMC, NUTS])
def test_vectorized_chains_on_the_gpu(kernel_class):
    y = _data()
    kernel = _kernel(kernel_class)
    mcmc = _run_traced(pyro_hmc_plus.MCMC(kernel, num_samples=600, warmup_steps=300, num_chains=4,
                                          chain_method="vectorized", disable_progbar=True), y)
    mu = mcmc.get_samples(group_by_chain=True)["mu"]
    assert mu.shape == (4, 600) and mu.device.type == "cuda"
    for chain in mu:
        _check(chain, y)
    assert "diverging" in az.from_pyro(mcmc).sample_stats
    data = pyro_hmc_plus.to_inference_data(mcmc)  # replays the model for the log likelihood
    assert float(az.rhat(data)["mu"]) < 1.05
    assert {"diverging", "energy", "step_size", "lp"} <= set(data.sample_stats.data_vars)
    assert data.sample_stats["energy"].shape == (4, 600)
    assert data.log_likelihood["y"].shape == (4, 600, len(y))
    assert 0.2 < float(az.bfmi(data).min())


def test_default_device_cuda_correlated_gaussian():
    """``torch.set_default_device("cuda")``: every tensor the model and Pyro make is on the GPU."""
    precision = [[10.25, -9.74], [-9.74, 10.25]]

    def model():
        pyro.sample("q", dist.MultivariateNormal(torch.zeros(2), precision_matrix=torch.tensor(precision)))

    torch.set_default_device("cuda")
    try:
        mcmc = _run_traced(pyro_hmc_plus.MCMC(NUTS(model), num_samples=1000, warmup_steps=400, num_chains=2,
                                              chain_method="sequential", disable_progbar=True, warn_on_problems=False))
    finally:
        torch.set_default_device(None)
    q = mcmc.get_samples()["q"]
    assert q.device.type == "cuda"
    cov = torch.linalg.inv(torch.tensor(precision, dtype=torch.float64))
    assert_mean(q.cpu().numpy(), [0.0, 0.0])
    assert_variance(q.cpu().numpy(), cov.diagonal().numpy())


def test_potential_fn_float64_on_the_gpu():
    """A ``potential_fn`` over float64 CUDA tensors, as Pyro's kernels take one."""
    y = _data(torch.float64)

    def potential_fn(params):
        mu = params["mu"]
        return 0.5 * (mu / PRIOR_SCALE) ** 2 + 0.5 * ((y - mu) ** 2).sum()

    kernel = NUTS(potential_fn=potential_fn)
    mcmc = _run_traced(pyro.infer.MCMC(kernel, num_samples=800, warmup_steps=300, disable_progbar=True,
                                       initial_params={"mu": torch.zeros((), dtype=torch.float64, device="cuda")}))
    mu = mcmc.get_samples()["mu"]
    assert mu.dtype == torch.float64 and mu.device.type == "cuda"
    _check(mu, y)
