"""Statistical tests of pyro_hmc_plus.HMC against exact posteriors and Pyro's own HMC.

Tolerances are multiples of Monte Carlo standard errors computed from ArviZ's ESS; seeds
are fixed, so each test is deterministic.
"""

import contextlib
import math
import pickle
import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC
from pyro.infer import HMC as PyroHMC

import pyro_hmc_plus
from pyro_hmc_plus import HMC, NUTS
from pyro_hmc_plus.models import PROBLEMS, problem
from pyro_hmc_plus.potential import gradient_mismatch

from helpers import assert_mean, assert_variance
from models import (
    PRECISION,
    dirichlet_categorical,
    gamma_poisson,
    gamma_poisson_posterior,
    gauss2d,
    normal_normal,
    normal_normal_posterior,
    site_only_where_positive,
    two_scales,
)


def run(kernel, num_samples=1000, warmup_steps=300, *args, **kw):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True, **kw)
    mcmc.run(*args)
    return mcmc


def test_classic_question_gaussian():
    """The forum thread's target, its sampler settings: step 0.25, 10 leapfrog steps."""
    kernel = HMC(gauss2d, step_size=0.25, num_steps=10, adapt_step_size=False, adapt_mass_matrix=False)
    q = run(kernel, 3000, 0).get_samples()["q"].numpy()
    cov = torch.linalg.inv(PRECISION).numpy()
    assert_mean(q, [0.0, 0.0])
    assert_variance(q, np.diag(cov))
    # the correlation: E[q0 q1] = cov01
    assert_mean(q[:, 0] * q[:, 1], cov[0, 1])
    assert kernel.engine_name == "trace"


def test_badly_scaled_100d_gaussian_needs_and_gets_mass_adaptation():
    scales = torch.logspace(-2, 2, 100)  # 0.01 .. 100

    def model():
        pyro.sample("x", dist.Normal(torch.zeros(100), scales).to_event(1))

    # a trajectory of about a quarter period of the preconditioned dynamics: far from the
    # half and full periods where fixed-length HMC resonates on a Gaussian
    kernel = HMC(model, trajectory_length=1.5)
    x = run(kernel, 1000, 1000).get_samples()["x"].numpy()
    assert_mean(x / scales.numpy(), 0.0)
    assert_variance(x / scales.numpy(), 1.0)
    # the adapted inverse mass is the posterior variance, within sampling error
    ratio = kernel.inverse_mass_matrix[("x",)] / scales**2
    assert ratio.min() > 0.5 and ratio.max() < 2.0


def test_conjugate_normal_normal():
    x = torch.randn(20) + 3.0
    mean, var = normal_normal_posterior(x)
    # trajectory_length: Pyro's default (2 pi) is a full period of the preconditioned dynamics
    # on a Gaussian, where fixed-length HMC resonates (Pyro's own HMC then mixes badly at some
    # seeds, ESS < 10 of 1500); a quarter period mixes well
    mu = run(HMC(normal_normal, trajectory_length=1.5), 1500, 300, x).get_samples()["mu"].numpy()
    assert_mean(mu, mean)
    assert_variance(mu, var)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("runner", ["pyro.infer.MCMC", "sequential", "vectorized"])
def test_runs_inside_no_grad_and_inference_mode(mode, runner):
    """A ``torch.no_grad()`` or ``torch.inference_mode()`` block around the run (as users
    write around predictions) must not take the gradient away: it stopped every kernel, Pyro's
    too, with autograd's "element 0 of tensors does not require grad"."""
    x = torch.randn(20) + 3.0
    mean, var = normal_normal_posterior(x)
    with mode():
        if runner == "pyro.infer.MCMC":
            mcmc = run(NUTS(normal_normal), 600, 300, x)
        else:
            mcmc = pyro_hmc_plus.MCMC(NUTS(normal_normal), num_samples=300, warmup_steps=300, num_chains=2,
                                      chain_method=runner, disable_progbar=True)
            mcmc.run(x)
    mu = mcmc.get_samples()["mu"].numpy()
    assert_mean(mu, mean)
    assert_variance(mu, var)


@pytest.mark.parametrize("runner", ["pyro.infer.MCMC", "sequential"])
def test_data_made_in_inference_mode_and_written_there_between_runs(runner):
    """Data made inside ``torch.inference_mode()`` (loaded and preprocessed there) keep no
    in-place version, which the kernels read to reuse their programs while the data stay the
    same: the run stopped with torch's "Inference tensors do not track version counter". And
    inside that mode the data can be written in place between two runs, which the second
    must see."""
    with torch.inference_mode():
        x = torch.randn(20) + 3.0
        kernel = NUTS(normal_normal)
        if runner == "pyro.infer.MCMC":
            mcmc = MCMC(kernel, num_samples=600, warmup_steps=300, disable_progbar=True)
        else:
            mcmc = pyro_hmc_plus.MCMC(kernel, num_samples=300, warmup_steps=300, num_chains=2,
                                      chain_method=runner, disable_progbar=True)
        for shift in (0.0, -6.0):
            x += shift
            mcmc.run(x)
            mean, var = normal_normal_posterior(x)
            assert_mean(mcmc.get_samples()["mu"].numpy(), mean)


def _sum_with_unknown_noise():
    x = pyro.sample("x", dist.Normal(torch.zeros(2), 1.0).to_event(1))
    noise = pyro.sample("noise", dist.HalfNormal(1.0))
    pyro.sample("y", dist.Normal(x.sum(), noise), obs=torch.tensor(1.0))


@pytest.mark.parametrize("engine, chain_method", [("auto", "sequential"), ("auto", "vectorized"),
                                                  ("eager", "sequential")])
def test_anomaly_detection_around_the_run_changes_no_draw(engine, chain_method):
    """Users turn on ``torch.autograd.set_detect_anomaly`` to find where a NaN comes from.
    Around a run, its NaN check of every gradient made the trace refuse the model (as if
    it read latent values), and the eager path then stopped at the first NaN gradient, which
    a sampler meets by design at the far end of a divergent trajectory (Pyro's NUTS ran on
    this model). The kernels keep it off for their own gradients: the same draws, and it is
    on again after the run."""

    def draws():
        pyro.set_rng_seed(0)
        mcmc = pyro_hmc_plus.MCMC(NUTS(_sum_with_unknown_noise, engine=engine), num_samples=40, warmup_steps=40,
                                  num_chains=2, chain_method=chain_method, disable_progbar=True)
        mcmc.run()
        return mcmc.get_samples()

    expected = draws()
    with torch.autograd.detect_anomaly(), warnings.catch_warnings():
        warnings.simplefilter("error", pyro_hmc_plus.EngineFallbackWarning)
        got = draws()
        assert torch.is_anomaly_enabled()
    for name, values in expected.items():
        assert torch.equal(got[name], values), name


def test_running_again_on_the_same_data_reuses_the_traced_gradient():
    """Pyro's ``MCMC.run`` hands each run a fresh ``detach()`` of the data; keyed by the
    tensors' identity, every run traced and checked the model again."""
    x = torch.randn(20) + 3.0
    kernel = NUTS(normal_normal)
    mcmc = MCMC(kernel, num_samples=20, warmup_steps=20, disable_progbar=True)
    mcmc.run(x)
    engine = kernel._engine
    mcmc.run(x)
    assert kernel._engine is engine
    mcmc.run(x.clone())  # the same values in other memory: traced again, as any other data
    assert kernel._engine is not engine


def test_a_model_with_sparse_data_runs():
    """A sparse matrix among the data (a spatial model's adjacency): the engine's cache keys
    dense tensors by their memory, which a sparse tensor does not have. (Its gradient runs on
    eager autograd: the tracer does not record sparse tensors.)"""
    neighbours = torch.eye(3).to_sparse()

    def model(adjacency, y):
        b = pyro.sample("b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        pyro.sample("y", dist.Normal(torch.sparse.mm(adjacency, b.unsqueeze(-1)).squeeze(-1), 1.0).to_event(1), obs=y)

    with pytest.warns(pyro_hmc_plus.EngineFallbackWarning, match="SparseTensorImpl"):
        b = run(NUTS(model), 1000, 300, neighbours, torch.ones(3)).get_samples()["b"].numpy()
    assert_mean(b, 0.5)  # conjugate: N(y / 2, 1 / 2) for each entry
    assert_variance(b, 0.5)


@pytest.mark.parametrize("change", ["replaced", "written in place"])
def test_running_again_after_the_models_global_data_changed(change):
    """A model that reads its data from a global instead of its arguments: the trace bakes
    the data in, so a second ``run`` after the global changed must trace again (it reused the
    stale gradient before, and sampled the first data's posterior; HMC's adapted number of
    steps grew without bound)."""
    data = {"x": torch.randn(20) + 3.0}

    def model():
        normal_normal(data["x"])

    mcmc = MCMC(NUTS(model), num_samples=500, warmup_steps=300, disable_progbar=True)
    mcmc.run()
    if change == "replaced":
        data["x"] = data["x"] - 6.0
    else:
        data["x"].sub_(6.0)
    mcmc.run()
    mean, var = normal_normal_posterior(data["x"])
    mu = mcmc.get_samples()["mu"].numpy()
    assert_mean(mu, mean)
    assert_variance(mu, var)


def test_positive_site_in_constrained_space():
    y = torch.tensor([3.0, 5.0, 2.0, 4.0, 6.0])
    a, b = gamma_poisson_posterior(y)
    rate = run(HMC(gamma_poisson), 1500, 300, y).get_samples()["rate"].numpy()
    assert (rate > 0).all()
    assert_mean(rate, a / b)
    assert_variance(rate, a / b**2)


def test_simplex_site_in_constrained_space():
    counts = torch.tensor([3.0, 5.0, 2.0])
    alpha = 1.0 + counts
    p = run(HMC(dirichlet_categorical), 1500, 300, counts).get_samples()["p"].numpy()
    assert np.allclose(p.sum(-1), 1.0, atol=1e-5)
    a0 = alpha.sum()
    assert_mean(p, (alpha / a0).numpy())
    assert_variance(p, (alpha * (a0 - alpha) / (a0**2 * (a0 + 1))).numpy())


@pytest.mark.parametrize("full_mass", [True, [("a",)], [("a", "b")]])
def test_dense_and_block_mass_matrices(full_mass):
    cov = torch.tensor([[1.0, 0.9], [0.9, 1.0]])

    def model():
        a = pyro.sample("a", dist.Normal(0.0, 1.0))
        pyro.sample("b", dist.Normal(0.9 * a, (1 - 0.81) ** 0.5))

    kernel = HMC(model, full_mass=full_mass, trajectory_length=2.0)
    mcmc = run(kernel, 1000, 400)
    s = mcmc.get_samples()
    ab = torch.stack([s["a"], s["b"]], -1).numpy()
    assert_mean(ab, [0.0, 0.0])
    assert_variance(ab, [1.0, 1.0])
    # Pyro's format: each dense block, then the other sites' diagonal, keyed by site names
    inv_mass = kernel.inverse_mass_matrix
    pyro_kernel = PyroHMC(model, full_mass=full_mass)
    pyro_kernel.setup(0)
    assert {k: v.shape for k, v in inv_mass.items()} == {k: v.shape for k, v in pyro_kernel.inverse_mass_matrix.items()}
    assert list(inv_mass) == list(pyro_kernel.inverse_mass_matrix)
    if full_mass == [("a",)]:
        assert list(inv_mass) == [("a",), ("b",)]  # b is outside the dense block: no cross term
    else:
        assert inv_mass[("a", "b")][0, 1] > 0.5 * cov[0, 1]


@pytest.mark.parametrize("kernel_class", [HMC, NUTS])
def test_pyros_mass_matrix_adapter_is_an_error_that_names_the_arguments_instead(kernel_class):
    """Code written for Pyro's kernels reads ``kernel.mass_matrix_adapter`` or puts its own
    adapter there (Pyro's epidemiology models assign an ``ArrowheadMassMatrix``); on these
    kernels the assignment was silently ignored. Both are errors that name what to use."""
    from pyro.infer.mcmc.adaptation import ArrowheadMassMatrix

    kernel = kernel_class(normal_normal)
    with pytest.raises(AttributeError, match=r"no mass_matrix_adapter: full_mass= .*inverse_mass_matrix="):
        kernel.mass_matrix_adapter
    assert not hasattr(kernel, "mass_matrix_adapter")
    with pytest.raises(AttributeError, match=r"cannot use a mass matrix adapter \(ArrowheadMassMatrix\).*Pyro's kernel"):
        kernel.mass_matrix_adapter = ArrowheadMassMatrix()


def test_float64_models_run_in_float64():
    torch.set_default_dtype(torch.float64)
    x = torch.randn(10) + 1.0
    mcmc = run(HMC(normal_normal), 500, 200, x)
    mu = mcmc.get_samples()["mu"]
    assert mu.dtype == torch.float64
    mean, var = normal_normal_posterior(x)
    assert_mean(mu.numpy(), mean)


@pytest.mark.parametrize("name", PROBLEMS)
def test_the_example_problems_follow_the_default_dtype(name):
    """``pyro_hmc_plus.models``' problems (the demo's and the benchmarks') under
    ``torch.set_default_dtype(torch.float64)``: their data, constants and exact moments are
    float64, so the model samples in float64 (the classic question's float32 precision
    matrix against float64 draws stopped its first run with a dtype error)."""
    torch.set_default_dtype(torch.float64)
    prob = problem(name)
    assert all(a.dtype in (torch.float64, torch.int64) for a in prob.args)
    assert all(v.dtype == torch.float64 for moments in (prob.exact_mean or {}, prob.exact_sd or {})
               for v in moments.values())
    draws = run(HMC(prob.model, num_steps=3), 3, 3, *prob.args).get_samples()
    assert all(v.dtype == torch.float64 for v in draws.values())


@pytest.mark.parametrize("kernel_class", [HMC, NUTS])
def test_float64_data_with_float32_latents(kernel_class):
    """Data in float64, latent values in the default float32: U comes out float64, as in Pyro
    (which samples such models); the sampler keeps to the latent values' dtype instead of
    failing on a float64 x float32 product. Traced, on one and two (vectorized) chains.

    HMC's trajectory is a quarter turn: with the mass matrix adapted to this Gaussian
    posterior, the default 2 pi is about a whole turn, and its draws barely move (one chain
    here: 7 steps of 0.84, 6.08 rad, a variance of 0.005 against 0.1)."""
    x = torch.randn(10, generator=torch.Generator().manual_seed(0)).double() + 1.0
    mean, var = normal_normal_posterior(x.float())
    options = {"trajectory_length": math.pi / 2} if kernel_class is HMC else {}
    for num_chains in (1, 2):
        pyro.set_rng_seed(0)
        kernel = kernel_class(normal_normal, **options)
        mcmc = pyro_hmc_plus.MCMC(kernel, num_samples=500, warmup_steps=200, num_chains=num_chains,
                                  disable_progbar=True, warn_on_problems=False)
        mcmc.run(x)
        mu = mcmc.get_samples()["mu"]
        assert mu.dtype == torch.float32 and kernel.engine_name == "trace"
        assert_mean(mu.numpy(), mean)
        assert_variance(mu.numpy(), var)


def _normal_and_poisson(y):
    """``x ~ N(mu, 1)`` and ``y ~ Poisson(rate)`` on the same data: ``rate`` 's posterior is
    :func:`gamma_poisson_posterior`'s."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Poisson(rate), obs=y)
        pyro.sample("x", dist.Normal(mu, 1.0), obs=y)


def test_model_with_transforms_for_some_sites_keeps_the_defaults_for_the_rest():
    """``transforms`` with a model override the defaults site by site; Pyro's own kernels
    take the dict as the whole set and fail with ``KeyError: 'mu'``. A name that is not a
    latent site gets a clear error."""
    from torch.distributions.transforms import SoftplusTransform

    model = _normal_and_poisson
    y = torch.tensor([3.0, 5.0, 2.0, 4.0, 6.0])
    softplus = SoftplusTransform().inv  # constrained -> unconstrained, as Pyro's transforms
    kernel = NUTS(model, transforms={"rate": softplus})  # "mu": Pyro's default
    rate = run(kernel, 1000, 300, y).get_samples()["rate"].numpy()
    assert kernel.transforms["rate"] is softplus
    shape, rate_param = gamma_poisson_posterior(y)
    assert_mean(rate, shape / rate_param)
    assert_variance(rate, shape / rate_param**2)
    with pytest.raises(ValueError, match=r"\['rtae'\], which are not continuous latent sites"):
        run(NUTS(model, transforms={"rtae": softplus}), 10, 10, y)


def test_a_transform_given_for_a_site_torch_cannot_transform_is_used():
    """A 1x1 Wishart(5, 1) is a chi-square with 5 degrees of freedom (mean 5, variance 10);
    ``biject_to`` has no transform for its positive-definite support, so the user gives one
    (a log, reshaped to one number), and the kernel must not ask ``biject_to`` for it anyway."""
    from torch.distributions.transforms import ComposeTransform, ExpTransform, ReshapeTransform

    def model():
        pyro.sample("S", dist.Wishart(df=torch.tensor(5.0), covariance_matrix=torch.eye(1)))

    to_unconstrained = ComposeTransform([ExpTransform(), ReshapeTransform((1,), (1, 1))]).inv
    draws = run(NUTS(model, transforms={"S": to_unconstrained}), 2000, 500).get_samples()["S"]
    assert draws.shape == (2000, 1, 1)
    assert_mean(draws.reshape(-1).numpy(), 5.0)
    assert_variance(draws.reshape(-1).numpy(), 10.0)


def _normal_mixture_prior():
    """``x`` ~ 0.3 N(-1, 1) + 0.7 N(1, 1): mean 0.4, variance 1 + 1 - 0.4^2 = 1.84."""
    components = dist.Normal(torch.tensor([-1.0, 1.0]), 1.0)
    pyro.sample("x", dist.MixtureSameFamily(dist.Categorical(torch.tensor([0.3, 0.7])), components))


@pytest.mark.parametrize("transforms", [None, {"x": dist.transforms.AffineTransform(0.0, 0.5)}])
def test_a_mixture_prior_samples_with_its_components_transform_or_a_given_one(transforms):
    """torch has no transform for a ``MixtureSameFamily``'s support, where Pyro's kernels
    stop; the kernel takes its components' (here none: they are real), or the given one, and
    starts the site in that transform's unconstrained space (``init_to_uniform`` asks torch
    for a transform, and fails)."""
    draws = run(NUTS(_normal_mixture_prior, transforms=transforms), 2000, 500).get_samples()["x"].numpy()
    assert_mean(draws, 0.4)
    assert_variance(draws, 1.84)


def test_potential_fn_with_initial_params_and_transforms():
    def potential_fn(params):
        return 0.5 * ((params["x"] - 1.0) ** 2).sum()

    kernel = HMC(potential_fn=potential_fn, step_size=0.5, num_steps=4)
    mcmc = run(kernel, 1500, 300, initial_params={"x": torch.zeros(3)})
    x = mcmc.get_samples()["x"].numpy()
    assert x.shape == (1500, 3)
    assert_mean(x, 1.0)
    assert_variance(x, 1.0)


def test_same_posterior_as_pyro_hmc():
    """The same script with Pyro's kernel and ours: the means agree within joint MCSE."""
    x = torch.randn(20) + 3.0
    ours = run(HMC(normal_normal, step_size=0.1, num_steps=5), 800, 200, x).get_samples()["mu"].numpy()
    pyro.set_rng_seed(1)
    theirs = run(PyroHMC(normal_normal, step_size=0.1, num_steps=5), 800, 200, x).get_samples()["mu"].numpy()
    se = np.sqrt(ours.var() / az.ess(ours[None]) + theirs.var() / az.ess(theirs[None]))
    assert abs(ours.mean() - theirs.mean()) < 4.5 * se
    assert abs(ours.var() / theirs.var() - 1) < 0.35


def test_pyro_mcmc_protocol_hook_save_params_summary_diagnostics_arviz(capsys):
    x = torch.randn(10)
    calls = []

    def model(x):
        mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
        sigma = pyro.sample("sigma", dist.HalfNormal(5.0))
        with pyro.plate("data", len(x)):
            pyro.sample("x", dist.Normal(mu, sigma), obs=x)

    kernel = HMC(model, step_size=0.1, num_steps=8)
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=100, disable_progbar=True,
                hook_fn=lambda k, p, stage, i: calls.append(stage), save_params=["mu"])
    mcmc.run(x)
    assert len(calls) == 300 and calls[0] == "Warmup" and calls[-1] == "Sample"
    assert set(mcmc.get_samples()) == {"mu"}
    mcmc.summary()
    assert "Number of divergences" in capsys.readouterr().out
    diag = mcmc.diagnostics()
    assert set(diag["divergences"]) == {"chain 0"} and 0 < diag["acceptance rate"]["chain 0"] <= 1
    idata = az.from_pyro(mcmc)
    assert "diverging" in idata.sample_stats
    stats = kernel.sample_stats[0]
    assert len(stats["lp"]) == 300 and sum(stats["warmup"]) == 100
    assert set(stats) >= {"lp", "energy", "acceptance_rate", "diverging", "step_size", "n_steps"}
    assert all(n == max(1, int(kernel.trajectory_length / s)) for n, s in zip(stats["n_steps"], stats["step_size"]))
    assert kernel.step_size == stats["step_size"][-1] != 0.1  # as Pyro: the adapted step size after the run


def _located_and_scaled():
    pyro.sample("mu", dist.Normal(10.0, 1.0))
    pyro.sample("s", dist.HalfNormal(0.1))


@pytest.mark.parametrize("mcmc_class, kernel_class, num_chains", [
    (MCMC, NUTS, 1), (pyro_hmc_plus.MCMC, NUTS, 1), (pyro_hmc_plus.MCMC, NUTS, 2),
    (pyro_hmc_plus.MCMC, pyro.infer.NUTS, 1),
], ids=["pyro.infer.MCMC", "one chain", "vectorized", "pyro.infer.NUTS"])
def test_save_params_in_any_order_keep_each_sites_draws(mcmc_class, kernel_class, num_chains):
    """Pyro's ``MCMC`` flattens each draw in the order of ``save_params`` and reads the draws
    back in sorted order: with ``save_params=["s", "mu"]`` the draws of ``mu`` (~10) came back
    as ``s``'s (~35,000, the exponential of ``mu``'s) and those of ``s`` as ``mu``'s, with
    Pyro's kernels and ours alike. A name that is no latent site failed with a bare
    ``KeyError`` after the first transition."""
    pyro.set_rng_seed(0)
    extra = {"warn_on_problems": False} if mcmc_class is pyro_hmc_plus.MCMC else {}
    mcmc = mcmc_class(kernel_class(_located_and_scaled), num_samples=100, warmup_steps=100, num_chains=num_chains,
                      save_params=["s", "mu"], disable_progbar=True, **extra)
    mcmc.run()
    draws = mcmc.get_samples()
    assert abs(draws["mu"].mean() - 10.0) < 0.5 and 0 < draws["s"].mean() < 0.2
    if kernel_class is NUTS:
        with pytest.raises(ValueError, match=r"save_params names \['sigma'\], .* latent sites .* \['mu', 's'\]"):
            mcmc_class(kernel_class(_located_and_scaled), num_samples=5, warmup_steps=5, num_chains=num_chains,
                       save_params=["sigma"], disable_progbar=True, **extra).run()


def test_potential_fn_after_a_run_scores_draws_as_pyros():
    # users score draws with `mcmc.kernel.potential_fn(params)`, which Pyro's kernel sets up
    x = torch.randn(10) + 2.0
    kernel, pyro_kernel = HMC(normal_normal, num_steps=5), PyroHMC(normal_normal)
    assert kernel.potential_fn is None  # as Pyro's before setup: the model is what was given
    run(kernel, 20, 20, x)
    pyro_kernel.setup(0, x)
    for mu in (-1.0, 0.5, 3.0):
        params = {"mu": torch.tensor(mu)}
        assert torch.allclose(kernel.potential_fn(params), pyro_kernel.potential_fn(params))
    user_fn = lambda params: (params["mu"] ** 2).sum() / 2  # noqa: E731
    assert HMC(potential_fn=user_fn).potential_fn is user_fn


def test_two_chains_sequential_and_initial_params_per_chain():
    x = torch.randn(10) + 2.0
    kernel = HMC(normal_normal, step_size=0.2, num_steps=5)
    with pytest.warns(UserWarning, match="sequentially"):
        mcmc = MCMC(kernel, num_samples=300, warmup_steps=100, num_chains=2, disable_progbar=True,
                    initial_params={"mu": torch.tensor([-5.0, 5.0])})
    mcmc.run(x)
    mu = mcmc.get_samples(group_by_chain=True)["mu"]
    assert mu.shape == (2, 300)
    assert not torch.equal(mu[0], mu[1])
    assert len(kernel.sample_stats) == 2


def test_kernel_pickles_before_and_after_setup():
    """Pyro's multiprocess chains pickle the kernel; a copy, made before or after a run,
    samples exactly as the original does for the same seed."""
    def draws(kernel, seed):
        pyro.set_rng_seed(seed)
        return run(kernel, 50, 20).get_samples()["q"]

    kernel = HMC(gauss2d, step_size=0.25, num_steps=10)
    clone = pickle.loads(pickle.dumps(kernel))
    assert torch.equal(draws(clone, 1), draws(kernel, 1))
    again = pickle.loads(pickle.dumps(kernel))
    assert torch.equal(draws(again, 2), draws(kernel, 2))


def test_non_finite_energy_is_a_divergence_not_a_crash():
    def potential_fn(p):
        x = p["x"]
        # undefined (nan) beyond |x| > 3, like a model leaving its support
        return torch.where(x.abs() < 3, 0.5 * x**2, torch.full_like(x, float("nan"))).sum()

    kernel = HMC(potential_fn=potential_fn, step_size=1.5, num_steps=4, adapt_step_size=False)
    mcmc = run(kernel, 300, 0, initial_params={"x": torch.zeros(1)})
    assert len(mcmc.diagnostics()["divergences"]["chain 0"]) > 0
    assert torch.isfinite(mcmc.get_samples()["x"]).all()


CORRELATED_PAIRS = torch.randn(20, 2, generator=torch.Generator().manual_seed(0)) @ torch.tensor([[1.0, 0.0], [0.5, 0.87]]).T


def _correlation(y):
    """A 2x2 correlation ``r`` whose Cholesky factorisation fails for ``|r| >= 1``."""
    r = pyro.sample("r", dist.Normal(0.0, 0.1))
    one = torch.ones(())
    scale_tril = torch.linalg.cholesky(torch.stack([torch.stack([one, r]), torch.stack([r, one])]))
    pyro.sample("y", dist.MultivariateNormal(torch.zeros(2), scale_tril=scale_tril).expand([len(y)]).to_event(1), obs=y)


@pytest.mark.parametrize("engine", ["auto", "eager"])
@pytest.mark.parametrize("adapt_step_size", [False, True])
def test_model_failing_numerically_mid_trajectory_is_a_divergence(engine, adapt_step_size):
    """A potential that raises beyond |x| = 2 (eager autograd raises there; a traced program
    may return NaN instead), reached inside trajectories of 4 steps of 0.9: each such
    transition is rejected and reported as a divergence, in warmup (whose step size is
    adapted: the trajectory is integrated block by block) and after it (one fused program
    per transition where the step size is fixed), and the run carries on."""
    from models import failing_potential

    pyro.set_rng_seed(0)
    kernel = HMC(potential_fn=failing_potential, step_size=0.9, num_steps=4, adapt_step_size=adapt_step_size,
                 engine=engine)
    mcmc = run(kernel, 200, 100, initial_params={"x": torch.zeros(1)})
    x = mcmc.get_samples()["x"]
    assert (x.abs() < 2).all() and x.std() > 0.5
    diverging = kernel.sample_stats[0]["diverging"]
    assert any(diverging[:100]) and any(diverging[100:])
    assert mcmc.diagnostics()["divergences"]["chain 0"] == [i - 100 for i, d in enumerate(diverging) if d and i >= 100]


def test_a_model_failing_at_a_validation_point_still_gets_its_programs():
    """A program is checked at the current point and at random points near it; the model's
    Cholesky failed at a random point (``|r| >= 1``) while the program was being built
    inside a trajectory, and that was taken for the trajectory's divergence at every
    transition (the program never got built): all 80 transitions divergent, ``r`` stuck at
    its first value (with step-size adaptation the step size then collapsed and the steps
    per transition grew without bound). The current point stands in for such a point."""
    pyro.set_rng_seed(0)
    kernel = HMC(_correlation, step_size=0.05, num_steps=12, adapt_step_size=False, adapt_mass_matrix=False)
    mcmc = run(kernel, 60, 20, CORRELATED_PAIRS, initial_params={"r": torch.tensor(0.3)})
    assert mcmc.diagnostics()["divergences"]["chain 0"] == []
    r = mcmc.get_samples()["r"]
    assert r.unique().numel() > 30 and (r.abs() < 1).all()


def test_vectorized_chains_of_a_model_failing_at_validation_points_run():
    """The same for the round program of many chains: a chain's model failing at its random
    validation point stopped the whole run with the Cholesky's ``LinAlgError``; that chain's
    current state stands in for it."""
    pyro.set_rng_seed(0)
    mcmc = pyro_hmc_plus.MCMC(NUTS(_correlation), num_samples=50, warmup_steps=50, num_chains=4,
                              initial_params={"r": torch.full((4,), 0.3)}, disable_progbar=True,
                              warn_on_problems=False)
    mcmc.run(CORRELATED_PAIRS)
    r = mcmc.get_samples(group_by_chain=True)["r"]
    assert r.shape == (4, 50) and (r.abs() < 1).all()


def test_bad_arguments_get_clear_errors():
    with pytest.raises(ValueError, match="exactly one"):
        HMC()
    with pytest.raises(ValueError, match="step_size"):
        HMC(gauss2d, step_size=-1.0)
    with pytest.raises(ValueError, match="num_steps"):
        HMC(gauss2d, num_steps=0)
    with pytest.raises(ValueError, match="engine"):
        HMC(gauss2d, engine="fast")
    with pytest.raises(TypeError):
        HMC(gauss2d, not_an_argument=1)
    with pytest.raises(ValueError, match="full_mass"):
        run(HMC(gauss2d, full_mass=[("nope",)]), 5, 5)
    with pytest.raises(ValueError, match="max_plate_nesting must be a non-negative integer .* got -1"):
        HMC(gauss2d, max_plate_nesting=-1)  # Pyro's kernel fails at setup with a bare AssertionError
    with pytest.raises(ValueError, match="init_strategy must be a function of a sample site"):
        HMC(gauss2d, init_strategy="median")  # Pyro's: TypeError: 'str' object is not callable, at setup
    with pytest.raises(ValueError, match="trajectory_length must be positive, got 0.0"):
        HMC(gauss2d, trajectory_length=0.0)
    with pytest.raises(ValueError, match=r"target_accept_prob must be in \(0, 1\), got 1.0"):
        HMC(gauss2d, target_accept_prob=1.0)
    with pytest.raises(ValueError, match="need 0 < min_stepsize < max_stepsize, got 1.0 and 0.5"):
        HMC(gauss2d, min_stepsize=1.0, max_stepsize=0.5)
    with pytest.raises(ValueError, match="full_mass must be True, False or a list of tuples of site names, got 'q'"):
        HMC(gauss2d, full_mass="q")
    with pytest.raises(ValueError, match="max_unroll must be at least 1, got 0"):
        HMC(gauss2d, max_unroll=0)


@pytest.mark.parametrize("lengths", [{}, {"num_steps": 5}, {"trajectory_length": 3.0},
                                     {"num_steps": 5, "trajectory_length": 3.0}])
def test_the_trajectory_length_and_number_of_steps_are_pyros(lengths):
    """As in Pyro: ``num_steps`` sets the trajectory length where it is not given, and a
    given ``trajectory_length`` overrides it (ours took 5 steps where Pyro's took 30)."""
    ours, pyros = HMC(gauss2d, step_size=0.1, **lengths), pyro.infer.HMC(gauss2d, step_size=0.1, **lengths)
    assert (ours.trajectory_length, ours.num_steps) == (pytest.approx(pyros.trajectory_length), pyros.num_steps)


def test_non_finite_initial_params_are_rejected():
    with pytest.raises(ValueError, match="not finite"):
        run(HMC(gauss2d), 5, 5, initial_params={"q": torch.tensor([float("inf"), 0.0])})


@pytest.mark.parametrize("with_model", [True, False])
def test_integer_initial_params_start_where_their_float_values_do(with_model):
    """``initial_params={"mu": torch.tensor(0)}`` means 0.0, as torch's distributions take
    integers; it failed deep inside torch ("check_uniform_bounds" not implemented for 'Long';
    Pyro's kernels: only floating point tensors can require gradients). Python numbers and
    lists, which ``pyro.infer.MCMC`` refuses (it calls ``.unsqueeze`` and ``.shape`` on them),
    work in our ``MCMC``."""
    def draws(start, mcmc_class, num_chains=1):
        pyro.set_rng_seed(0)
        if with_model:
            kernel, args = NUTS(_normal_and_poisson), (torch.ones(3),)
        else:
            kernel, args = NUTS(potential_fn=lambda p: 0.5 * (p["mu"] ** 2 + p["rate"] ** 2).sum()), ()
        mcmc = mcmc_class(kernel, num_samples=5, warmup_steps=5, initial_params=start, num_chains=num_chains,
                          disable_progbar=True)
        mcmc.run(*args)
        return mcmc.get_samples()

    as_floats = draws({"mu": torch.tensor(1.0), "rate": torch.tensor(0.0)}, MCMC)
    two_chains = draws({"mu": torch.tensor([1.0, 2.0]), "rate": torch.tensor([0.0, 0.0])}, pyro_hmc_plus.MCMC, 2)
    for start, mcmc_class, num_chains, expected in (
        ({"mu": torch.tensor(1), "rate": torch.tensor(0)}, MCMC, 1, as_floats),
        ({"mu": 1, "rate": 0}, pyro_hmc_plus.MCMC, 1, as_floats),
        ({"mu": [1, 2], "rate": [0, 0]}, pyro_hmc_plus.MCMC, 2, two_chains),  # vectorized
    ):
        as_integers = draws(start, mcmc_class, num_chains)
        for name, value in expected.items():
            assert as_integers[name].dtype == value.dtype
            torch.testing.assert_close(as_integers[name], value)
    if with_model:  # Pyro's chains (worker processes where there are more CPUs than chains)
        pyro.set_rng_seed(0)
        parallel = pyro_hmc_plus.MCMC(NUTS(_normal_and_poisson), num_samples=5, warmup_steps=5, num_chains=2,
                                      chain_method="parallel", initial_params={"mu": [1, 2], "rate": [0, 0]},
                                      disable_progbar=True)
        parallel.run(torch.ones(3))
        assert parallel.get_samples(group_by_chain=True)["mu"].shape == (2, 5)


def test_initial_params_missing_a_site_and_data_without_a_finite_potential_get_clear_errors():
    """Both failed deep inside Pyro: a bare ``KeyError: 'rate'`` from the potential, and
    "Model specification seems incorrect" with nothing about what to check; with given
    initial values, NaN data blamed the initial values."""
    with pytest.raises(ValueError, match=r"no value for \['rate'\]: .* \(\['mu', 'rate'\]\)"):
        run(NUTS(_normal_and_poisson), 5, 5, torch.ones(3), initial_params={"mu": torch.tensor(0.0)})
    with pytest.raises(ValueError, match=r"values for \['rtae'\], which are not continuous latent sites .*\['mu', 'rate'\]\)"):
        run(NUTS(_normal_and_poisson), 5, 5, torch.ones(3), initial_params={"mu": torch.tensor(0.0), "rtae": torch.tensor(0.0)})
    with pytest.raises(ValueError, match=r"not finite at any initial point .*'y' \(observed\): 1 of 2 values are "
                                         r"outside the support of Poisson .*, first at index \(1,\)\. Check the model's data"):
        run(NUTS(_normal_and_poisson), 5, 5, torch.tensor([1.0, -1.0]))  # a Poisson count below 0
    start = {"mu": torch.tensor(0.0), "rate": torch.tensor(0.0)}  # fine: the data are not
    with pytest.raises(ValueError, match=r"initial point is nan; .*'y' \(observed\): 1 of 2 values are NaN, "
                                         r"first at index \(0,\) \(if NaN marks missing values, [^;]*\); 'x' \(observed\): "
                                         r"1 of 2 values are NaN, first at index \(0,\)\. Check"):  # the hint once
        run(NUTS(_normal_and_poisson), 5, 5, torch.tensor([float("nan"), 1.0]), initial_params=start)


def _missing_values(y, observed):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(mu, 1.0), obs=y, obs_mask=observed)


@pytest.mark.parametrize("kernel_class", [HMC, NUTS])
def test_coordinates_the_potential_does_not_depend_on_are_named_before_the_run(kernel_class):
    """Pyro's ``obs_mask`` gives its ``y_unobserved`` site no density at the observed entries:
    the posterior is flat along them, and NUTS runs every tree to its maximum depth. The
    warning names exactly those entries, at setup; with every entry missing, none."""
    y = torch.tensor([0.3, -1.0, 2.0, 0.5, 1.5])
    observed = torch.tensor([True, False, True, True, False])
    with pytest.warns(pyro_hmc_plus.SamplingWarning) as caught:
        kernel_class(_missing_values).setup(0, y, observed)
    assert [str(w.message).split(" (")[0] for w in caught] == [
        "the potential energy does not depend on y_unobserved[0], y_unobserved[2], y_unobserved[3]"
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyro_hmc_plus.SamplingWarning)
        kernel_class(_missing_values).setup(0, y, torch.zeros(5, dtype=torch.bool))


def test_a_model_that_cuts_its_gradient_is_named_before_the_run():
    """A covariance built with ``torch.tensor`` from latent scales is a constant to autograd,
    Pyro's included: the trace disagrees with Pyro's potential and the engine falls back to
    eager autograd, whose gradient misses the likelihood's dependence on the scales as well.
    The fallback does not call that correct, and the kernel says what is wrong, at setup."""
    y = torch.randn(50, 2, generator=torch.Generator().manual_seed(0)) * torch.tensor([2.0, 0.5])
    with pytest.warns(UserWarning) as caught:
        NUTS(two_scales).setup(0, y, "torch.tensor")
    messages = [str(w.message) for w in caught]
    fallback = [m for m in messages if m.startswith("pyro_hmc_plus: cannot use the 'trace' engine")]
    assert len(fallback) == 1 and "correct" not in fallback[0] and "misses part of it" in fallback[0]
    assert any(m.startswith("the gradient of the potential energy does not match its values") for m in messages)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyro_hmc_plus.SamplingWarning)
        NUTS(two_scales).setup(0, y)


@pytest.mark.parametrize("start, change", [(1.0, "does not sample b"), (-1.0, "also samples b")])
def test_a_model_whose_sites_change_with_their_values_gets_a_clear_error(start, change):
    """Started where ``b`` exists, the model lacks it where ``a < 0`` (Pyro's NUTS fails there
    with autograd's "appears to not have been used in the graph"); started where it does
    not, ``b`` comes in where ``a > 0`` (Pyro's NUTS scores a draw of its prior as part of
    the potential). No HMC kernel samples either: the error says so at setup, before any
    engine falls back, and says it again at a second setup."""
    kernel = NUTS(site_only_where_positive,
                  init_strategy=pyro.infer.autoguide.init_to_value(values={"a": torch.tensor(start)}))
    for _ in range(2):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match=f"latent sites change with their values.*it {change}"):
                kernel.setup(0, torch.tensor(0.5))


@pytest.mark.parametrize("start, change", [(3.0, "does not sample b"), (-3.0, "also samples b")])
def test_a_model_whose_sites_change_only_where_the_run_goes_is_stopped_there(start, change):
    """Started 3 from ``a = 0``, the model's sites at the random points that the setup checks
    (within 2 of the start) are those of the start; the first evaluation across 0 (in the
    step-size search or the run) stops the run with the error of that check, where Pyro's
    NUTS would score a prior draw of ``b`` or leave ``b`` to drift, silently."""
    y = torch.tensor(0.5)
    kernel = NUTS(site_only_where_positive,
                  init_strategy=pyro.infer.autoguide.init_to_value(values={"a": torch.tensor(start)}))
    with pytest.warns(pyro_hmc_plus.EngineFallbackWarning):  # the `if` on a latent value
        with pytest.raises(ValueError, match=f"latent sites change with their values.*it {change}"):
            MCMC(kernel, num_samples=100, warmup_steps=100, disable_progbar=True).run(y)


def test_a_model_that_detaches_a_latent_value_is_named_on_the_traced_engine():
    """``.detach()`` of latent scales records as it runs: the trace agrees with Pyro's
    potential and gradient (both cut) and is kept, and the finite differences of its ``U``
    (not Pyro's: no run of the model) find what the gradient misses."""
    y = torch.randn(50, 2, generator=torch.Generator().manual_seed(0)) * torch.tensor([2.0, 0.5])
    kernel = NUTS(two_scales)
    with pytest.warns(pyro_hmc_plus.SamplingWarning, match="the gradient of the potential energy does not match"):
        kernel.setup(0, y, "detach")
    assert kernel.engine_name == "trace"


def _ordinal_regression(x, y):
    beta = pyro.sample("beta", dist.Normal(0.0, 5.0))
    cutpoints = pyro.sample("cutpoints", dist.TransformedDistribution(
        dist.Normal(0.0, 5.0).expand([3]).to_event(1), dist.transforms.OrderedTransform()))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.OrderedLogistic(beta * x, cutpoints), obs=y)


def test_float32_rounding_at_one_check_point_is_not_called_a_cut_gradient():
    """An ordinal regression whose last check point (seed 1) puts the top class's probability
    below float32's resolution at every observation: there ``U``'s values are flat in that
    term within the differences' steps, which disagree with the gradient (right: float64 gives
    it), and the one-point check is fooled. The other check points agree, and the kernel says
    nothing."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, generator=gen)
    latent = 1.2 * x + torch.logit(torch.rand(200, generator=gen))  # standard logistic noise
    y = torch.bucketize(latent, torch.tensor([-1.0, 0.5, 1.5]))
    pyro.set_rng_seed(1)
    kernel = NUTS(_ordinal_regression)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyro_hmc_plus.SamplingWarning)
        kernel.setup(0, x, y)
    engine = kernel._engine
    assert gradient_mismatch(engine.flat.potential, engine.check_points[-1], engine.check_gradients[-1]) is not None
    assert engine.gradient_mismatch is None


def _bounded_by_a_latent():
    a = pyro.sample("a", dist.Uniform(1.0, 2.0))
    pyro.sample("b", dist.Uniform(0.0, a))


def _bounded_by_a_latent_reparametrised():
    a = pyro.sample("a", dist.Uniform(1.0, 2.0))
    pyro.deterministic("b", a * pyro.sample("u", dist.Uniform(0.0, 1.0)))


def _setup_warnings(model, *args, **kernel_kwargs):
    """The messages of the :class:`SamplingWarning` s that NUTS's setup emits for ``model(*args)``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pyro_hmc_plus.SamplingWarning)
        NUTS(model, **kernel_kwargs).setup(0, *args)
    return [str(w.message) for w in caught if issubclass(w.category, pyro_hmc_plus.SamplingWarning)]


def test_sites_whose_support_moves_with_other_latent_sites_are_named_before_the_run():
    """Pyro's kernels sample ``b ~ Uniform(0, a)`` truncated to ``b < a`` at the initial
    ``a``, without a word (one run: ``E[b]`` 0.57 where it is 0.75); the kernels say so at setup,
    once, and not for the same model written with a fixed support."""
    assert [m.split(" move")[0] for m in _setup_warnings(_bounded_by_a_latent)] == [
        "the supports of the latent sites ['b']"]
    assert _setup_warnings(_bounded_by_a_latent_reparametrised) == []


def _regression(x, y, plate=True):
    w = pyro.sample("w", dist.Normal(0.0, 10.0))
    with pyro.plate("n", len(x)) if plate else contextlib.nullcontext():
        pyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


def test_data_broadcast_against_their_distribution_are_named_before_the_run():
    """A column of data ``(5, 1)`` against a plate of 5 scores 25 pairs (one run with 50
    points: ``w`` 0.01 +- 0.04 where it is 1.93 +- 0.14, Pyro's NUTS the same, without a
    word), and so does a column of covariates, which the plate expands to ``(5, 5)``; the
    kernels say so at setup. No warning for data that are scored once each, under a scalar
    distribution or not, nor for one value observed for a whole plate or batch."""
    x = torch.arange(5.0)
    prefix = "observed data and their distributions broadcast against each other: 'y': "
    assert [m.split(". Each")[0] for m in _setup_warnings(_regression, x, 2 * x[:, None])] == [
        prefix + "data (5, 1) against batch shape (5,) give 25 log densities for 5 values"]
    assert [m.split(". Each")[0] for m in _setup_warnings(_regression, x[:, None], 2 * x)] == [
        prefix + "data (5,) against batch shape (5, 5) give 25 log densities for 5 values"]
    for x_, y, plate in ((x, 2 * x, True), (x, 2 * x, False), (torch.tensor(1.0), 2 * x, False),
                         (x, torch.tensor(1.0), True), (x, torch.tensor(1.0), False)):
        assert _setup_warnings(_regression, x_, y, plate) == []


def _regression_with_optional_data(x, y=None, site="obs"):
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    with pyro.plate("n", len(x)):
        pyro.sample(site, dist.Normal(a * x, 1.0), obs=y)


class _RegressionModule(pyro.nn.PyroModule):
    def forward(self, x, y=None):
        return _regression_with_optional_data(x, y)


def test_data_left_out_of_the_run_are_named_before_the_run():
    """``run(x)`` where the model is ``model(x, y=None)``: ``obs=None`` makes the data a
    latent site, and the other sites follow their prior (Pyro's NUTS on 100 points: 134 s,
    the prior, without a word). The kernels say so at setup for a site named ``obs`` or
    named like the argument, also for a model wrapped in a handler (whose signature is the
    model's), a ``PyroModule`` (its ``forward``'s) or one not given its data by keyword; not
    where the data are given, by position or keyword, nor for a latent site of another name."""
    x = torch.arange(5.0)
    advice = "are sampled as unknowns: the model got no data for them"
    assert [m.split(" are sampled")[0] for m in _setup_warnings(_regression_with_optional_data, x)] == [
        "the latent sites 'obs' (5 values; y is None)"]
    assert [m.split(" are sampled")[0] for m in _setup_warnings(_regression_with_optional_data, x, None, "y")] == [
        "the latent sites 'y' (5 values; y is None)"]
    for given in ((x, 2 * x), (x, 2 * x, "y")):
        assert _setup_warnings(_regression_with_optional_data, *given) == []
    assert _setup_warnings(lambda x, y=None: _regression_with_optional_data(x, y=y), x) != []
    assert _setup_warnings(_regression_with_optional_data, x, None, "z") == []
    assert _setup_warnings(pyro.poutine.scale(_regression_with_optional_data, 1.0), x) != []
    assert _setup_warnings(_RegressionModule(), x) != [] and _setup_warnings(_RegressionModule(), x, 2 * x) == []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", pyro_hmc_plus.SamplingWarning)
        NUTS(_regression_with_optional_data).setup(0, x=x)
    assert [advice in str(w.message) for w in caught] == [True]


def _angle():
    pyro.sample("a", dist.VonMises(0.5, 2.0))


def _angles():
    _angle()
    pyro.sample("b", dist.VonMises(torch.zeros(3), 1.0).to_event(1))
    pyro.sample("s", dist.LogNormal(0.0, 1.0))


def _angle_of_a_direction():
    """The remedy the warning gives: the angle of a 2-vector (whose prior, a function of its
    radius alone, makes it uniform) with the von Mises density as a factor."""
    v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    pyro.factor("v_radius", -50 * (v.norm(dim=-1) - 1) ** 2)
    a = pyro.deterministic("a", torch.atan2(v[..., 1], v[..., 0]))
    pyro.factor("a_density", dist.VonMises(0.5, 2.0).log_prob(a))


def test_angles_with_a_von_mises_density_are_named_before_the_run():
    """torch gives ``VonMises`` the real line as support, so an angle's draws wander over
    many turns (one run: from -2,700 to 1,200) without a word from Pyro; the kernels say so at
    setup, once, and not for the angle sampled as a direction or given a transform."""
    assert [m.split(" are angles")[0] for m in _setup_warnings(_angles)] == ["the latent sites ['a', 'b']"]
    assert _setup_warnings(_angle_of_a_direction) == []
    circle = dist.transforms.ComposeTransform([dist.transforms.SigmoidTransform(),
                                               dist.transforms.AffineTransform(-math.pi, 2 * math.pi)])
    assert _setup_warnings(_angles, transforms={"a": circle.inv, "b": circle.inv}) == []


@pytest.mark.parametrize("model", [_angle, _angle_of_a_direction])
def test_angles_follow_the_von_mises_density_wrapped_or_as_a_direction(model):
    """Both of the warning's remedies: the raw draws wrapped into [-pi, pi), and the angle of
    a direction, give ``E[cos(a - 0.5)] = I1(2) / I0(2)`` and ``E[sin(a - 0.5)] = 0``."""
    mcmc = pyro_hmc_plus.MCMC(NUTS(model), num_samples=1000, warmup_steps=500, num_chains=2,
                              warn_on_problems=False, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pyro_hmc_plus.SamplingWarning)  # the one the test above checks
        mcmc.run()
    raw = torch.as_tensor(mcmc.to_inference_data().posterior["a"].values).reshape(-1)
    a = torch.remainder(raw + math.pi, 2 * math.pi) - math.pi
    assert a.abs().max() <= math.pi
    two = torch.tensor(2.0, dtype=torch.float64)
    assert_mean(torch.stack([(a - 0.5).cos(), (a - 0.5).sin()], -1),
                [(torch.special.i1(two) / torch.special.i0(two)).item(), 0.0])


def _mean_direction(obs, kappa):
    v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    pyro.factor("v_radius", -50 * (v.norm(dim=-1) - 1) ** 2)
    mu = pyro.deterministic("mu", torch.atan2(v[..., 1], v[..., 0]))
    with pyro.plate("n", len(obs)):
        pyro.sample("obs", dist.VonMises(mu, kappa), obs=obs)


def test_a_concentrated_direction_follows_its_exact_posterior_without_divergences():
    """The mean direction of 200 von Mises observations (kappa 5 known, a uniform prior) has
    the posterior ``VonMises(atan2(S, C), kappa R)`` (``C, S`` the sums of the cosines and
    sines, ``R`` their length), here with sd ~0.03: the radius term keeps the trajectories
    away from the origin (without it, 213 divergent transitions in 4 x 1,000 draws)."""
    obs = dist.VonMises(2.8, 5.0).sample((200,))
    C, S = obs.cos().sum().double(), obs.sin().sum().double()
    mode, concentration = torch.atan2(S, C), 5.0 * torch.hypot(C, S)
    mcmc = pyro_hmc_plus.MCMC(NUTS(_mean_direction), num_samples=1000, warmup_steps=500, num_chains=2,
                              disable_progbar=True)
    mcmc.run(obs, 5.0)
    assert sum(len(d) for d in mcmc.diagnostics()["divergences"].values()) == 0
    mu = torch.as_tensor(mcmc.to_inference_data().posterior["mu"].values).reshape(-1).double()
    assert_mean(torch.stack([(mu - mode).cos(), (mu - mode).sin()], -1),
                [(torch.special.i1e(concentration) / torch.special.i0e(concentration)).item(), 0.0])


def test_points_where_the_model_fails_say_nothing_about_flat_coordinates():
    """The model's Cholesky fails at both random check points: only the initial point's
    gradient is left, where c's is 0 (as r's could be at a symmetric starting point), and
    one point is not enough to call c flat."""
    def U(p):
        sign = 1 - 2 * (p["r"] != 0.3).to(p["r"].dtype)
        return torch.linalg.cholesky(sign * torch.eye(2)).diagonal().sum() + p["r"] ** 2 + 0 * p["c"]

    initial = {"r": torch.tensor(0.3), "c": torch.tensor(0.0)}
    engine = pyro_hmc_plus.GradientEngine(pyro_hmc_plus.from_potential_fn(U, initial), "eager")
    assert len(engine.check_gradients) == 1 and engine.check_gradients[0][0] == 0  # (c, r): c's is 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", pyro_hmc_plus.SamplingWarning)
        kernel = HMC(potential_fn=U)
        kernel.initial_params = initial
        kernel.setup(0)


def test_same_seed_same_draws():
    a = run(HMC(gauss2d, step_size=0.25, num_steps=10), 50, 50).get_samples()["q"]
    pyro.set_rng_seed(0)
    b = run(HMC(gauss2d, step_size=0.25, num_steps=10), 50, 50).get_samples()["q"]
    assert torch.equal(a, b)


@pytest.mark.parametrize("dense", [False, True])
def test_leapfrog_matches_pyro_velocity_verlet(dense):
    """The fused trajectory (one kick of eps between steps instead of two half kicks) ends
    where Pyro's velocity Verlet ends, and where the every-state trajectory NUTS uses ends."""
    from pyro.ops.integrator import velocity_verlet

    from pyro_hmc_plus.integrator import IntegratorState, leapfrog, leapfrog_trajectory

    torch.set_default_dtype(torch.float64)
    try:
        precision = PRECISION.double()

        def potential_fn(params):
            q = params["q"]
            return 0.5 * q @ precision @ q

        gen = torch.Generator().manual_seed(4)
        z, r = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
        inverse_mass = torch.tensor([[0.5, 0.1], [0.1, 0.3]]) if dense else torch.tensor([0.5, 0.3])
        eps = torch.tensor(0.15)

        def value_and_grad(q):
            return potential_fn({"q": q}), precision @ q

        U, g = value_and_grad(z)
        start = IntegratorState(z, r, U, g)
        end = leapfrog(value_and_grad, start, eps, inverse_mass, 7)
        every = leapfrog_trajectory(value_and_grad, start, eps, inverse_mass, 7)
        kinetic_grad = (lambda p: {"q": inverse_mass @ p["q"]}) if dense else (lambda p: {"q": inverse_mass * p["q"]})
        z_ref, r_ref, g_ref, U_ref = velocity_verlet(
            {"q": z}, {"q": r}, potential_fn, kinetic_grad, 0.15, 7, {"q": g}
        )
        last = IntegratorState(every.z[-1], every.r[-1], every.potential_energy[-1], every.grad[-1])
        for got in (end, last):
            assert torch.allclose(got.z, z_ref["q"], atol=1e-12)
            assert torch.allclose(got.r, r_ref["q"], atol=1e-12)
            assert torch.allclose(got.grad, g_ref["q"], atol=1e-12)
            assert torch.allclose(got.potential_energy, U_ref, atol=1e-12)
    finally:
        torch.set_default_dtype(torch.float32)
