"""Tests of the ArviZ export and the run diagnostics (pyro_hmc_plus.inference_data)."""

import warnings

import arviz as az
import matplotlib
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer.mcmc.util import initialize_model
from pyro.ops.indexing import Vindex

from pyro_hmc_plus import MCMC, NUTS, SamplingWarning, diagnose, inference_data, to_inference_data
from pyro_hmc_plus.models import eight_schools_non_centered, problem

from models import EIGHT_SCHOOLS_SIGMA, EIGHT_SCHOOLS_Y, eight_schools, eight_schools_centered, gamma_poisson

matplotlib.use("Agg")

STATS = {"lp": np.floating, "energy": np.floating, "diverging": np.bool_, "acceptance_rate": np.floating,
         "step_size": np.floating, "tree_depth": np.integer, "n_steps": np.integer, "reached_max_treedepth": np.bool_}


@pytest.fixture(scope="module")
def schools_run():
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(eight_schools), num_samples=200, warmup_steps=150, num_chains=4, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    return mcmc


def test_export_has_every_group_with_shapes_dtypes_and_plate_dims(schools_run):
    idata = to_inference_data(schools_run, save_warmup=True, constant_data={"sigma": EIGHT_SCHOOLS_SIGMA.numpy()})
    for group in ("posterior", "sample_stats", "warmup_posterior", "warmup_sample_stats", "log_likelihood",
                  "observed_data", "constant_data"):
        assert hasattr(idata, group), group
    post = idata.posterior
    assert post["mu"].shape == (4, 200) and post["tau"].shape == (4, 200)
    assert post["theta_raw"].dims == ("chain", "draw", "schools") and post["theta_raw"].shape == (4, 200, 8)
    assert (post["tau"] > 0).all()
    for group in (idata.sample_stats, idata.warmup_sample_stats):
        for name, kind in STATS.items():
            assert np.issubdtype(group[name].dtype, kind), name
    assert idata.sample_stats["lp"].shape == (4, 200)
    assert idata.warmup_sample_stats["lp"].shape == (4, 150)
    assert idata.warmup_posterior["theta_raw"].shape == (4, 150, 8)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "schools")
    np.testing.assert_array_equal(idata.observed_data["y"], EIGHT_SCHOOLS_Y.numpy())
    np.testing.assert_array_equal(idata.constant_data["sigma"], EIGHT_SCHOOLS_SIGMA.numpy())
    # the exported statistics are the kernel's, chain by chain
    for chain, stats in enumerate(schools_run.kernel.sample_stats[-4:]):
        np.testing.assert_allclose(idata.sample_stats["lp"][chain], stats["lp"][150:])
        np.testing.assert_array_equal(idata.sample_stats["n_steps"][chain], stats["n_steps"][150:])
    # user dims override the plates'
    renamed = to_inference_data(schools_run, dims={"theta_raw": ["school"]}, coords={"school": list("ABCDEFGH")})
    assert renamed.posterior["theta_raw"].dims == ("chain", "draw", "school")


def _schools_exported(model):
    """``(mcmc, its export)``: two short vectorized chains of an eight-schools ``model``."""
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=50, warmup_steps=50, num_chains=2, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    return mcmc, to_inference_data(mcmc)


def test_deterministic_sites_are_in_the_posterior_not_the_data():
    """``pyro.deterministic`` is an observed ``Delta`` site to Pyro: it was exported as
    observed data (one draw's value) with a log likelihood of zeros, so ``az.loo(idata)``
    asked which of two log likelihoods to use. Its value at every draw belongs in the
    posterior."""

    def model(y, sigma):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        tau = pyro.sample("tau", dist.HalfCauchy(5.0))
        pyro.deterministic("tau_squared", tau**2)  # outside every plate: (chains, draws)
        pyro.deterministic("scale", sigma.max())  # from the data alone: the same at every draw
        with pyro.plate("schools", len(y)):
            theta_raw = pyro.sample("theta_raw", dist.Normal(0.0, 1.0))
            theta = pyro.deterministic("theta", mu + tau * theta_raw)
            pyro.sample("y", dist.Normal(theta, sigma), obs=y)

    mcmc, idata = _schools_exported(model)
    post = idata.posterior
    assert post["theta"].dims == ("chain", "draw", "schools")
    np.testing.assert_allclose(post["theta"], post["mu"] + post["tau"] * post["theta_raw"], rtol=1e-5)
    np.testing.assert_allclose(post["tau_squared"], post["tau"] ** 2, rtol=1e-5)
    assert post["scale"].shape == (2, 50) and (post["scale"] == 18.0).all()
    assert list(idata.observed_data.data_vars) == ["y"]
    assert list(idata.log_likelihood.data_vars) == ["y"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pareto k warnings on 8 observations
        assert np.isfinite(az.loo(idata).elpd_loo)  # one log likelihood: no var_name needed
    assert "theta" in to_inference_data(mcmc, log_likelihood=False).posterior
    assert "theta" not in to_inference_data(mcmc, deterministic=False).posterior
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run's checks look at the sampled sites only: no
        assert diagnose(mcmc).num_draws == 50  # R-hat of the constant "scale" (numpy's all-NaN warning)


def test_a_reparametrized_site_is_in_the_posterior_computed_from_the_sampled_one():
    """``poutine.reparam`` with ``LocScaleReparam`` samples ``theta_decentered`` and records
    ``theta`` as an observed ``Delta``, as ``pyro.deterministic`` does: it was exported as data
    with a log likelihood of zeros, and, where the export replays the model, computed from
    the init strategy's values instead of from the draw (so it held noise around 0)."""
    from pyro.infer.reparam import LocScaleReparam

    reparametrized = pyro.poutine.reparam(eight_schools_centered, config={"theta": LocScaleReparam(0.0)})
    _, idata = _schools_exported(reparametrized)
    post = idata.posterior
    assert post["theta"].dims == ("chain", "draw", "schools")
    np.testing.assert_allclose(post["theta"], post["mu"] + post["tau"] * post["theta_decentered"], rtol=1e-5)
    assert list(idata.observed_data.data_vars) == ["y"]
    assert list(idata.log_likelihood.data_vars) == ["y"]


def test_a_run_that_saved_some_sites_exports_no_values_computed_from_the_others():
    """With ``save_params``, the draws lack the other latent sites; a replay of the model would
    take them from their priors (``Predictive`` samples what it is not given) and give a log
    likelihood and deterministic values of prior draws, with no sign of it."""
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(eight_schools_non_centered), num_samples=20, warmup_steps=20, disable_progbar=True, save_params=["mu"],
                warn_on_problems=False)
    mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    with pytest.warns(UserWarning, match=r"no values of the latent sites \['tau', 'theta_raw'\]"):
        idata = to_inference_data(mcmc)
    assert list(idata.posterior.data_vars) == ["mu"]
    assert "log_likelihood" not in idata.groups()
    assert list(idata.observed_data.data_vars) == ["y"]


def test_a_model_that_does_not_broadcast_over_draws_is_replayed_draw_by_draw():
    """A ``PyroModule`` regression: ``nn.Linear`` does not broadcast over a leading dimension of
    draws, so the vectorised replay fails; the log likelihood and the deterministic site were
    left out (with a warning). They come from replaying the draws one by one instead."""
    from pyro.nn import PyroModule, PyroSample

    class Regression(PyroModule):
        def __init__(self):
            super().__init__()
            self.linear = PyroModule[torch.nn.Linear](2, 1)
            self.linear.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 2]).to_event(2))
            self.linear.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

        def forward(self, x, y=None):
            mean = self.linear(x).squeeze(-1)
            with pyro.plate("data", x.shape[0]):
                pyro.deterministic("mean", mean)
                pyro.sample("y", dist.Normal(mean, 0.5), obs=y)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 2, generator=g)
    y = x @ torch.tensor([1.0, -1.0]) + 0.5 * torch.randn(10, generator=g)
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(Regression()), num_samples=20, warmup_steps=20, num_chains=2, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(x, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing is left out
        idata = to_inference_data(mcmc)
    post = idata.posterior
    weight, bias = post["linear.weight"].values, post["linear.bias"].values  # (2, 20, 1, 2), (2, 20, 1)
    mean = np.einsum("cdij,nj->cdn", weight, x.numpy()) + bias
    np.testing.assert_allclose(post["mean"], mean, rtol=1e-5, atol=1e-6)
    expected = torch.distributions.Normal(torch.as_tensor(mean), 0.5).log_prob(y).numpy()
    np.testing.assert_allclose(idata.log_likelihood["y"], expected, rtol=1e-5, atol=1e-6)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "data")


def test_a_model_that_broadcasts_draws_against_each_other_is_replayed_draw_by_draw():
    """A scalar site times a vector site (``to_event(1)``) without ``unsqueeze``: in the
    vectorised replay the scalar's draws ``(draws, 1)`` meet the vector's ``(draws, 1, n)``
    and every draw is computed with every other draw's scale, without an error. The log
    likelihood came out ``(chains, draws, chains * draws, n)``, each draw's entry mixing
    other draws' values."""

    def random_walk_volatility(returns):
        sigma = pyro.sample("sigma", dist.Exponential(10.0))
        steps = pyro.sample("steps", dist.Normal(0.0, 1.0).expand(returns.shape).to_event(1))
        log_vol = -1.0 + sigma * torch.cumsum(steps, -1)
        with pyro.plate("days", returns.shape[0]):
            pyro.sample("returns", dist.Normal(0.0, torch.exp(log_vol)), obs=returns)

    returns = 0.4 * torch.randn(12, generator=torch.Generator().manual_seed(0))
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(random_walk_volatility), num_samples=15, warmup_steps=15, num_chains=2, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(returns)
    idata = to_inference_data(mcmc)
    post = idata.posterior
    log_vol = -1.0 + post["sigma"].values[..., None] * np.cumsum(post["steps"].values, -1)  # (2, 15, 12)
    expected = torch.distributions.Normal(0.0, torch.as_tensor(np.exp(log_vol))).log_prob(returns).numpy()
    assert idata.log_likelihood["returns"].dims == ("chain", "draw", "days")
    np.testing.assert_allclose(idata.log_likelihood["returns"], expected, rtol=1e-4, atol=1e-5)


def test_a_prior_that_cannot_be_sampled_is_exported():
    """The export traces the model for its plates and observed data. It sampled the prior
    for that, so a model with ``ImproperUniform`` failed at the end of ``run()`` (in the
    diagnostics), after all its draws. It now replays a posterior draw."""
    from pyro.distributions import constraints
    from pyro.infer.autoguide import init_to_value

    y = torch.tensor([[-1.0, 0.5], [-0.5, 1.5], [-1.5, 1.0]])

    def model(y):
        c = pyro.sample("c", dist.ImproperUniform(constraints.ordered_vector, (), (2,)))
        with pyro.plate("n", len(y)):
            pyro.sample("y", dist.Normal(c, 1.0).to_event(1), obs=y)

    pyro.set_rng_seed(0)
    kernel = NUTS(model, init_strategy=init_to_value(values={"c": torch.tensor([-1.0, 1.0])}), max_plate_nesting=1)
    mcmc = MCMC(kernel, num_samples=30, warmup_steps=30, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SamplingWarning)  # 30 draws: too few for ESS
        mcmc.run(y)
    idata = to_inference_data(mcmc)
    assert idata.posterior["c"].shape == (1, 30, 2)
    assert (np.diff(idata.posterior["c"].values, axis=-1) > 0).all()
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "n")
    np.testing.assert_array_equal(idata.observed_data["y"], y.numpy())


def test_arviz_functions_and_plots_run(schools_run, tmp_path):
    import matplotlib.pyplot as plt

    idata = schools_run.to_inference_data()
    az.summary(idata)
    assert np.all(np.isfinite(az.bfmi(idata)))
    az.ess(idata)
    az.rhat(idata)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pareto k warnings on 8 observations
        loo = az.loo(idata)
    assert np.isfinite(loo.elpd_loo)
    az.plot_trace(idata, var_names=["mu", "tau"])
    az.plot_energy(idata)
    az.plot_pair(idata, var_names=["mu", "tau"], divergences=True)
    plt.savefig(tmp_path / "pair.png")
    plt.close("all")
    assert (tmp_path / "pair.png").stat().st_size > 0


def test_predictive_draws_are_exported_by_chain_and_draw_with_the_plates_dims(schools_run, tmp_path):
    """Posterior predictive, prior and predictions as Predictive returns them: each draw lands
    at its chain and draw, Predictive's padding for the plates is removed, and the plates name
    the dims of the replicated data as they name the observed data's."""
    import matplotlib.pyplot as plt

    samples = schools_run.get_samples()
    replicate = pyro.infer.Predictive(pyro.poutine.uncondition(eight_schools), samples)
    replicated = replicate(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    prior = pyro.infer.Predictive(pyro.poutine.uncondition(eight_schools), num_samples=30)(
        EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    assert prior["mu"].shape == (30, 1)  # Predictive's padding for the plate
    new_sigma = torch.tensor([5.0, 50.0, 500.0])
    new_y = samples["mu"][:, None] + samples["tau"][:, None] * torch.randn(800, 3) * new_sigma
    idata = to_inference_data(
        schools_run, posterior_predictive={**replicated, "mu_again": samples["mu"]}, prior=prior,
        predictions={"y_new": new_y}, predictions_constant_data={"sigma_new": new_sigma.numpy()},
        pred_dims={"y_new": ["new_school"], "sigma_new": ["new_school"]},
    )
    # every value sits at the chain and draw of the posterior draw it was made from
    np.testing.assert_array_equal(idata.posterior_predictive["mu_again"], idata.posterior["mu"])
    assert idata.posterior_predictive["y"].dims == ("chain", "draw", "schools") == idata.log_likelihood["y"].dims
    assert idata.posterior_predictive["y"].shape == (4, 200, 8)
    assert not (idata.posterior_predictive["y"] == EIGHT_SCHOOLS_Y.numpy()).all()
    assert idata.prior["mu"].shape == (1, 30) and idata.prior["theta_raw"].dims == ("chain", "draw", "schools")
    assert set(idata.prior.data_vars) == {"mu", "tau", "theta_raw"}
    assert set(idata.prior_predictive.data_vars) == {"y"} and idata.prior_predictive["y"].shape == (1, 30, 8)
    assert idata.predictions["y_new"].dims == ("chain", "draw", "new_school")
    np.testing.assert_array_equal(idata.predictions["y_new"].values.reshape(800, 3), new_y.numpy())
    np.testing.assert_array_equal(idata.predictions_constant_data["sigma_new"], new_sigma.numpy())
    az.plot_ppc(idata, num_pp_samples=50)
    plt.close("all")
    # leading (chains, draws) is taken as it is
    by_chain = {"y": replicated["y"].reshape(4, 200, 8)}
    np.testing.assert_array_equal(to_inference_data(schools_run, posterior_predictive=by_chain).posterior_predictive["y"],
                                  idata.posterior_predictive["y"])


def test_replicated_data_that_are_the_observed_data_get_a_warning(schools_run):
    """Predictive run with the observations returns them at every draw: a posterior
    predictive check of them would look perfect."""
    copies = pyro.infer.Predictive(eight_schools, schools_run.get_samples())(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    with pytest.warns(UserWarning, match=r"posterior_predictive \['y'\] equal the observed data.*uncondition"):
        to_inference_data(schools_run, posterior_predictive=copies, log_likelihood=False)


def test_predictive_draws_of_another_run_get_a_clear_error(schools_run):
    draws = pyro.infer.Predictive(pyro.poutine.uncondition(eight_schools), num_samples=100)(
        EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    with pytest.raises(ValueError, match=r"posterior_predictive\[.mu.\] has shape \(100, 1\).*4 chains x 200 draws = 800"):
        to_inference_data(schools_run, posterior_predictive=draws, log_likelihood=False)


def _with_factors(prior_term: str, likelihood_term: str):
    """A normal mean whose prior penalty and likelihood are ``pyro.factor`` sites of these
    names: a scalar one, and a pointwise one in the plate ``obs``."""
    def model(y):
        mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
        pyro.factor(prior_term, -0.01 * mu ** 2)
        with pyro.plate("obs", len(y)):
            pyro.factor(likelihood_term, dist.Normal(mu, 1.0).log_prob(y))

    return model


def test_factor_sites_are_no_data_and_only_pointwise_ones_are_likelihood_terms():
    """``pyro.factor``: a scalar prior term (Stan's ``ordered`` locations with a Normal prior)
    is no observation to leave out, a factor in a plate is a custom pointwise likelihood, and
    neither has data (Pyro stores an empty placeholder as its value)."""
    y = torch.tensor([0.5, 1.5, 1.0, 2.0])
    model = _with_factors("penalty", "likelihood")
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=50, warmup_steps=50, num_chains=2, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(y)
    replicated = pyro.infer.Predictive(model, mcmc.get_samples())(y)
    assert replicated["likelihood"].shape == (100, 4, 0)  # Predictive's empty values of the factors
    idata = to_inference_data(mcmc, posterior_predictive={**replicated, "mu_again": mcmc.get_samples()["mu"]})
    assert "observed_data" not in idata.groups()
    assert list(idata.log_likelihood.data_vars) == ["likelihood"]
    assert idata.log_likelihood["likelihood"].dims == ("chain", "draw", "obs")
    mu = idata.posterior["mu"].values[..., None]
    np.testing.assert_allclose(idata.log_likelihood["likelihood"], dist.Normal(torch.tensor(mu), 1.0).log_prob(y).numpy(),
                               rtol=1e-5)
    assert list(idata.posterior_predictive.data_vars) == ["mu_again"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pareto k warnings on 4 observations
        assert np.isfinite(az.loo(idata).elpd_loo)  # one pointwise term: no var_name needed


def test_sites_named_like_sample_statistics_are_exported():
    """``pyro.factor("lp", ...)`` is a common way to add a log density, and ``lp`` is also the
    sample statistic of the log density: the site's dimension names must not be given to the
    statistic, which has none besides chain and draw (ArviZ's dims apply by name in every group)."""
    y = torch.tensor([0.5, 1.5, 1.0, 2.0])
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(_with_factors("lp", "energy")), num_samples=50, warmup_steps=50, num_chains=2, disable_progbar=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the run's checks export the run: they must not fail
        mcmc.run(y)
    idata = to_inference_data(mcmc, save_warmup=True)
    for group in (idata.sample_stats, idata.warmup_sample_stats):
        assert group["lp"].dims == group["energy"].dims == ("chain", "draw")
    assert idata.log_likelihood["energy"].shape == (2, 50, 4)
    mu = idata.posterior["mu"].values[..., None]
    np.testing.assert_allclose(idata.log_likelihood["energy"], dist.Normal(torch.tensor(mu), 1.0).log_prob(y).numpy(),
                               rtol=1e-5)


def test_names_that_are_arvizs_dimensions():
    """ArviZ names its dimensions ``chain`` and ``draw``. A site of that name made ArviZ drop
    the whole posterior without a word (``az.from_pyro`` too), and the run's checks then failed
    on the missing group: now the export says what to rename. A plate of that name gives its
    dimension ArviZ's default name, in the observed data as in the log likelihood."""
    y = torch.tensor([0.5, 1.5, 1.0, 2.0])

    def normal_mean(mean_name, plate_name):
        def model(y):
            mean = pyro.sample(mean_name, dist.Normal(0.0, 5.0))
            with pyro.plate(plate_name, len(y)):
                pyro.sample("y", dist.Normal(mean, 1.0), obs=y)

        return model

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(normal_mean("chain", "obs")), num_samples=20, warmup_steps=20, disable_progbar=True, warn_on_problems=False)
    mcmc.run(y)
    with pytest.raises(ValueError, match=r"sites \['chain'\] are named like ArviZ's dimensions .*rename"):
        to_inference_data(mcmc)
    mcmc = MCMC(NUTS(normal_mean("mu", "draw")), num_samples=20, warmup_steps=20, disable_progbar=True, warn_on_problems=False)
    mcmc.run(y)
    idata = to_inference_data(mcmc)
    assert idata.observed_data["y"].dims == ("y_dim_0",)
    assert idata.log_likelihood["y"].dims == ("chain", "draw", "y_dim_0")


def test_chain_order_with_twelve_chains():
    pyro.set_rng_seed(1)
    mcmc = MCMC(NUTS(eight_schools), num_samples=20, warmup_steps=20, num_chains=12, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    idata = to_inference_data(mcmc)
    stats = mcmc.kernel.sample_stats[-12:]
    for chain in range(12):
        np.testing.assert_allclose(idata.sample_stats["lp"][chain], stats[chain]["lp"][20:])
        np.testing.assert_allclose(idata.posterior["mu"][chain], mcmc.get_samples(group_by_chain=True)["mu"][chain])


def test_lp_is_minus_the_potential_energy_with_jacobian_under_pyro_mcmc():
    """Driven by pyro.infer.MCMC (statistics travel through Pyro's per-chain diagnostics):
    lp of each draw equals -U of Pyro's own potential at the draw's unconstrained value."""
    y = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0])
    pyro.set_rng_seed(2)
    mcmc = pyro.infer.MCMC(NUTS(gamma_poisson), num_samples=50, warmup_steps=50, num_chains=2, disable_progbar=True)
    mcmc.run(y)
    idata = to_inference_data(mcmc)
    _, potential_fn, transforms, _ = initialize_model(gamma_poisson, (y,))
    rate = mcmc.get_samples(group_by_chain=True)["rate"]
    for chain in range(2):
        for draw in (0, 17, 49):
            u = transforms["rate"](rate[chain, draw])
            expected = -potential_fn({"rate": u}).item()
            assert idata.sample_stats["lp"][chain, draw].item() == pytest.approx(expected, rel=1e-4, abs=1e-4)
    assert az.from_pyro(mcmc).sample_stats["diverging"].shape == (2, 50)  # ArviZ's own converter still works
    with pytest.warns(UserWarning, match="does not keep warmup draws"):
        warm = to_inference_data(mcmc, save_warmup=True)
    assert warm.warmup_sample_stats["lp"].shape == (2, 50) and not hasattr(warm, "warmup_posterior")


@pytest.mark.parametrize("chain_method", ["sequential", "parallel"])
def test_sequential_and_parallel_chains_keep_their_warmup_draws(chain_method, monkeypatch):
    """``pyro_hmc_plus.MCMC`` runs sequential chains through Pyro's loop, and Pyro's worker
    processes (forced here) send no warmup draws: ``warmup_posterior`` was missing (with a
    warning that blamed ``pyro.infer.MCMC``). Each warmup draw is where its statistics were
    recorded: lp = -U."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    y = torch.tensor([3.0, 1.0, 4.0, 1.0, 5.0])
    pyro.set_rng_seed(2)
    mcmc = MCMC(NUTS(gamma_poisson), num_samples=20, warmup_steps=30, num_chains=2, chain_method=chain_method,
                disable_progbar=True, warn_on_problems=False)
    mcmc.run(y)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        idata = to_inference_data(mcmc, save_warmup=True)
    rate = idata.warmup_posterior["rate"]
    assert rate.shape == (2, 30)
    _, potential_fn, transforms, _ = initialize_model(gamma_poisson, (y,))
    for chain in range(2):
        for draw in (0, 13, 29):
            u = transforms["rate"](torch.tensor(rate[chain, draw].item()))
            expected = -potential_fn({"rate": u}).item()
            assert idata.warmup_sample_stats["lp"][chain, draw].item() == pytest.approx(expected, rel=1e-4, abs=1e-4)


def test_a_run_that_never_moves_is_reported_without_numpys_warnings():
    """Every transition rejected (a step size far too large, no warmup to fix it): the draws
    are constant, ArviZ's R-hat divides by a zero variance, and the user gets one
    SamplingWarning naming the problems, not numpy's division warnings."""
    def model():
        pyro.sample("x", dist.Normal(torch.zeros(2), 0.01).to_event(1))

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model, step_size=100.0, adapt_step_size=False), num_samples=20, warmup_steps=0, num_chains=2,
                disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run()
    assert [w.category for w in caught] == [SamplingWarning]
    assert "divergent transitions" in str(caught[0].message)


def test_divergences_warning_on_centered_schools_only():
    def run(model, seed, target_accept_prob=0.8):
        pyro.set_rng_seed(seed)
        mcmc = MCMC(NUTS(model, target_accept_prob=target_accept_prob), num_samples=400, warmup_steps=400, num_chains=4, disable_progbar=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mcmc.run(EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
        messages = [str(w.message) for w in caught if issubclass(w.category, SamplingWarning)]
        return mcmc, messages

    centered, messages = run(eight_schools_centered, 0)
    assert len(messages) == 1 and "divergent transitions" in messages[0] and "target_accept_prob" in messages[0]
    report = diagnose(centered)
    flagged = to_inference_data(centered, log_likelihood=False).sample_stats["diverging"].values
    reported = centered.diagnostics()["divergences"]
    for chain in range(4):
        assert np.flatnonzero(flagged[chain]).tolist() == reported[f"chain {chain}"]
    assert report.divergences == [len(reported[f"chain {c}"]) for c in range(4)] and sum(report.divergences) > 0
    assert not report.ok and len(report.ebfmi) == 4

    # Non-centered, the funnel is gone; at the default target 0.8 a divergence still comes in
    # roughly one draw in a thousand (Stan and Pyro alike; Betancourt 2017, "Diagnosing biased
    # inference with divergences"), so a 1,600-draw run may warn. The remedy the warning gives
    # (a higher target) removes them.
    _, messages = run(eight_schools, 0, target_accept_prob=0.9)
    assert not any("divergent" in m for m in messages)


def test_summary_prints_pyro_and_arviz_columns(schools_run, capsys):
    schools_run.summary()
    out = capsys.readouterr().out
    for column in ("mean", "median", "n_eff", "ess_bulk", "ess_tail", "r_hat_rank", "mcse_mean"):
        assert column in out
    assert "theta_raw[7]" in out and "Number of divergences" in out


def test_summary_of_too_few_draws_says_so():
    """Pyro's split R-hat halves each chain: under 4 draws a chain its summary and its
    diagnostics() fail on a bare assertion (pyro.infer.MCMC too; a run interrupted early
    keeps as few); ours say why and what to do."""
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(gamma_poisson), num_samples=3, warmup_steps=10, num_chains=2, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="at least 4 draws per chain; this run kept 3"):
        mcmc.summary()
    with pytest.raises(ValueError, match=r"diagnostics\(\)'s split R-hat .* at least 4 draws per chain; this run kept 3"):
        mcmc.diagnostics()


def test_kernels_without_statistics_get_a_clear_error():
    pyro.set_rng_seed(0)
    mcmc = pyro.infer.MCMC(pyro.infer.NUTS(gamma_poisson), num_samples=10, warmup_steps=10, disable_progbar=True)
    mcmc.run(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="no per-draw sample statistics"):
        to_inference_data(mcmc)


@pytest.mark.parametrize("vectorised", [False, True])
def test_a_model_with_enumerated_discrete_sites_is_exported_and_diagnosed(vectorised, monkeypatch):
    """A mixture whose component labels are summed out by enumeration: the labels are in no
    draw, so the export's run of the model gives them a prior draw (it used to stop at
    Pyro's "Continuous inference cannot handle discrete sample site", and with it the run's
    own check), each observation's log likelihood sums its own label out, as the potential
    did: ``log sum_k w_k N(x_i | loc_k, 1)``, and a deterministic site without the label in
    it is exported. Written ``locs[label]``, the model does not broadcast over a dimension of
    draws and is replayed draw by draw; with ``Vindex`` it is replayed over all draws at once."""
    data = torch.tensor([-2.3, -1.8, -2.1, -1.6, 2.2, 1.7, 2.4, 1.9])

    def mixture(data):
        weights = pyro.sample("weights", dist.Dirichlet(torch.ones(2)))
        locs = pyro.sample("locs", dist.Normal(torch.tensor([-1.0, 1.0]), 5.0).to_event(1))
        pyro.deterministic("gap", locs[..., 1] - locs[..., 0])  # no label in it: exported
        with pyro.plate("data", len(data)):
            label = pyro.sample("label", dist.Categorical(weights), infer={"enumerate": "parallel"})
            loc = Vindex(locs)[..., label] if vectorised else locs[label]
            pyro.sample("obs", dist.Normal(loc, 1.0), obs=data)

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(mixture, max_plate_nesting=1), num_samples=100, warmup_steps=100, num_chains=2,
                disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run(data)
    assert not [w for w in caught if "checking its draws failed" in str(w.message)]
    replays, replay = [], inference_data._enumerated_replay

    def counted(*args):  # records how many draws each enumerated replay took at once (None: one)
        replays.append(args[5] if len(args) > 5 else None)
        return replay(*args)

    monkeypatch.setattr(inference_data, "_enumerated_replay", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        idata = to_inference_data(mcmc)
    assert replays[-1] == (200 if vectorised else None)  # after the two-draw check
    assert idata.posterior["locs"].shape == (2, 100, 2) and "label" not in idata.posterior
    draws = mcmc.get_samples(group_by_chain=True)
    marginal = torch.logsumexp(
        draws["weights"].log().unsqueeze(-2) + dist.Normal(draws["locs"].unsqueeze(-2), 1.0).log_prob(data[:, None]), -1
    )  # (chains, draws, observations)
    assert np.allclose(idata.log_likelihood["obs"].values, marginal.numpy(), atol=1e-5)
    assert np.allclose(idata.posterior["gap"].values, (draws["locs"][..., 1] - draws["locs"][..., 0]).numpy())
    assert idata.observed_data["obs"].shape == (8,)
    assert diagnose(mcmc).num_draws == 100


def test_a_discrete_site_shared_by_observations_leaves_their_log_likelihood_out():
    """A change point's year is one discrete site for all the years' counts: given a draw of
    the rates they are not independent, so there is no pointwise log likelihood to give; the
    export says so and keeps the rest."""
    prob = problem("changepoint")
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(prob.model), num_samples=50, warmup_steps=50, num_chains=2, disable_progbar=True,
                warn_on_problems=False)
    mcmc.run(*prob.args)
    with pytest.warns(UserWarning, match=r"discrete sites switchpoint are summed out by enumeration.*"
                                         r"so disasters are left out"):
        idata = to_inference_data(mcmc)
    assert not hasattr(idata, "log_likelihood") and idata.posterior["early"].shape == (2, 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        to_inference_data(mcmc, log_likelihood=False)
