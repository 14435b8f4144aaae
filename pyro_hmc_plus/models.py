"""The example models: what ``pyro-hmc-plus demo --model`` and the scripts in ``examples/``
fit. Each is a plain Pyro model with its data (fixed by a seeded generator), returned as a
:class:`Problem`."""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import pyro
import pyro.distributions as dist
import torch


class Problem(NamedTuple):
    model: Callable
    args: tuple
    description: str
    exact_mean: Optional[dict] = None  # {site: mean} where the posterior is known exactly
    exact_sd: Optional[dict] = None
    truth: Optional[dict] = None  # {site: value} that generated simulated data


CLASSIC_PRECISION = torch.tensor([[10.25, -9.74], [-9.74, 10.25]])  # correlation ~0.95


def classic_gaussian():
    """The forum question's target: a 2-D Gaussian with correlation ~0.95."""
    precision = CLASSIC_PRECISION.to(torch.get_default_dtype())  # float64 too, under torch.set_default_dtype
    pyro.sample("q", dist.MultivariateNormal(torch.zeros(2), precision_matrix=precision))


def eight_schools_centered(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def eight_schools_non_centered(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("school", len(y)):
        theta_raw = pyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        theta = pyro.deterministic("theta", mu + tau * theta_raw)
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


EIGHT_SCHOOLS_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])  # treatment effects
EIGHT_SCHOOLS_SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])  # their standard errors


def logistic_regression(x, y):
    """Bayesian logistic regression with Normal(0, 1) priors on the coefficients and intercept."""
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 1.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 1.0))
    with pyro.plate("data", x.shape[0]):
        pyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def hierarchical_intercepts(x, group, y):
    """Varying intercepts per group (non-centered), a common slope: ``y ~ N(a[group] + beta x, sigma_y)``."""
    num_groups = int(group.max()) + 1
    mu_a = pyro.sample("mu_a", dist.Normal(0.0, 5.0))
    sigma_a = pyro.sample("sigma_a", dist.HalfNormal(2.0))
    beta = pyro.sample("beta", dist.Normal(0.0, 5.0))
    sigma_y = pyro.sample("sigma_y", dist.HalfNormal(2.0))
    with pyro.plate("groups", num_groups):
        a_raw = pyro.sample("a_raw", dist.Normal(0.0, 1.0))
    a = mu_a + sigma_a * a_raw
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(a[group] + beta * x, sigma_y), obs=y)


def gp_regression(x, y):
    """A fully Bayesian Gaussian process (squared-exponential kernel) with one inverse
    lengthscale per input dimension under a half-Cauchy prior: sparsity-inducing, so inputs
    that do not matter get inverse lengthscales near 0 (the model Bayesian-optimisation
    libraries fit with NUTS). Marginal likelihood by Cholesky, ``O(n^3)`` per gradient."""
    n, d = x.shape
    inv_lengthscale = pyro.sample("inv_lengthscale", dist.HalfCauchy(torch.ones(d)).to_event(1))
    outputscale = pyro.sample("outputscale", dist.LogNormal(0.0, 1.0))
    noise = pyro.sample("noise", dist.LogNormal(-2.0, 1.0))
    scaled = x * inv_lengthscale
    sq_dist = (scaled.unsqueeze(-2) - scaled.unsqueeze(-3)).pow(2).sum(-1)
    cov = outputscale * torch.exp(-0.5 * sq_dist) + (noise + 1e-6) * torch.eye(n)
    pyro.sample("y", dist.MultivariateNormal(torch.zeros(n), scale_tril=torch.linalg.cholesky(cov)), obs=y)


def ar1_loop(y):
    """AR(1) latent states ``x_t ~ N(phi x_{t-1}, s)`` observed as ``y_t ~ N(x_t, 0.3)``,
    written as Pyro's time-series tutorials write models: a Python loop with one sample site
    per time step (the tracer vectorizes the repeated ops, see ``docs/how-it-works.md``)."""
    s = pyro.sample("s", dist.HalfNormal(1.0))
    phi = pyro.sample("phi", dist.Uniform(-1.0, 1.0))
    x = torch.tensor(0.0)
    for t in pyro.markov(range(len(y))):
        x = pyro.sample(f"x_{t}", dist.Normal(phi * x, s))
        pyro.sample(f"y_{t}", dist.Normal(x, 0.3), obs=y[t])


def sequential_plate_regression(x, y):
    """A linear regression ``y_i ~ N(a + b x_i, s)`` written as Pyro's introductory tutorials
    write it: one observation site per row, in a sequential plate (the tracer makes the sums
    over the observations one op each, so the gradient's cost does not grow with their
    number; see ``docs/how-it-works.md``)."""
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b = pyro.sample("b", dist.Normal(0.0, 10.0))
    s = pyro.sample("s", dist.HalfNormal(2.0))
    for i in pyro.plate("data", len(y)):
        pyro.sample(f"obs_{i}", dist.Normal(a + b * x[i], s), obs=y[i])


# British coal-mining disasters per year, 1851-1961 (Jarrett, Biometrika 66(1):191-193, 1979)
COAL_MINING_DISASTERS = torch.tensor([
    4, 5, 4, 0, 1, 4, 3, 4, 0, 6, 3, 3, 4, 0, 2, 6, 3, 3, 5, 4, 5, 3, 1, 4, 4, 1, 5, 5, 3, 4, 2, 5,
    2, 2, 3, 4, 2, 1, 3, 2, 2, 1, 1, 1, 1, 3, 0, 0, 1, 0, 1, 1, 0, 0, 3, 1, 0, 3, 2, 2, 0, 1, 1, 1,
    0, 1, 0, 1, 0, 0, 0, 2, 1, 0, 0, 0, 1, 1, 0, 2, 3, 3, 1, 1, 2, 1, 1, 1, 1, 2, 4, 2, 0, 0, 1, 4,
    0, 0, 0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 0, 1,
], dtype=torch.float)
COAL_MINING_FIRST_YEAR = 1851


def changepoint(counts):
    """Counts per year ``counts (T,)`` at an ``early`` rate before a ``switchpoint`` year and
    a ``late`` rate from it on, both rates ``Exponential(1)``; the switchpoint (the index of
    the first late year, uniform over the ``T`` years) is a discrete latent site that Pyro's
    potential sums out by enumeration, so NUTS samples only the two rates. Enumerated, its
    value has shape ``(T, 1)``, left of the years' plate, and the comparison broadcasts to
    ``(T, T)``: one row of rates per candidate year."""
    T = counts.shape[-1]
    early = pyro.sample("early", dist.Exponential(1.0))
    late = pyro.sample("late", dist.Exponential(1.0))
    switchpoint = pyro.sample("switchpoint", dist.Categorical(torch.ones(T) / T), infer={"enumerate": "parallel"})
    with pyro.plate("years", T):
        rate = torch.where(torch.arange(T) < switchpoint, early, late)
        pyro.sample("disasters", dist.Poisson(rate), obs=counts)


def changepoint_exact_posterior(counts):
    """The exact posterior of :func:`changepoint`, by conjugacy: given the switchpoint ``s``,
    each rate is ``Gamma(1 + its years' total count, 1 + its number of years)``, and
    integrating the rates out gives ``p(s | counts)`` up to a constant. Returns ``(p_s (T,),
    early_mean, early_sd, late_mean, late_sd)``, the rates' moments mixed over ``p_s``."""
    counts = counts.double()
    T = counts.shape[-1]
    s = torch.arange(T, dtype=torch.float64)
    early_total = torch.cat([counts.new_zeros(1), counts.cumsum(-1)[:-1]])  # years before s
    late_total = counts.sum() - early_total
    shape_e, rate_e, shape_l, rate_l = 1 + early_total, 1 + s, 1 + late_total, 1 + T - s
    log_evidence = (torch.lgamma(shape_e) - shape_e * rate_e.log()) + (torch.lgamma(shape_l) - shape_l * rate_l.log())
    p_s = torch.softmax(log_evidence, -1)

    def mixed_moments(shape, rate):
        mean = (p_s * shape / rate).sum()
        second = (p_s * (shape / rate**2 + (shape / rate) ** 2)).sum()
        return mean, (second - mean**2).sqrt()

    return (p_s, *mixed_moments(shape_e, rate_e), *mixed_moments(shape_l, rate_l))


def problem(name: str) -> Problem:
    """The named example problem: ``classic``, ``eight_schools``, ``eight_schools_centered``,
    ``logistic``, ``hierarchical``, ``gp`` or ``changepoint``. Its data and exact moments are
    in torch's default dtype (float64 after ``torch.set_default_dtype(torch.float64)``)."""
    g = torch.Generator().manual_seed(0)
    like = torch.get_default_dtype()
    if name == "classic":
        sd = torch.linalg.inv(CLASSIC_PRECISION.to(like)).diagonal().sqrt()
        return Problem(classic_gaussian, (), "2-D Gaussian, correlation 0.95 (the classic question)",
                       {"q": torch.zeros(2)}, {"q": sd})
    if name == "eight_schools":
        return Problem(eight_schools_non_centered, (EIGHT_SCHOOLS_Y.to(like), EIGHT_SCHOOLS_SIGMA.to(like)),
                       "eight schools, non-centered")
    if name == "eight_schools_centered":
        return Problem(eight_schools_centered, (EIGHT_SCHOOLS_Y.to(like), EIGHT_SCHOOLS_SIGMA.to(like)),
                       "eight schools, centered")
    if name == "logistic":
        n, d = 1000, 10
        x = torch.randn(n, d, generator=g)
        w = torch.randn(d, generator=g) * 0.5
        y = torch.bernoulli(torch.sigmoid(x @ w - 0.3), generator=g)
        return Problem(logistic_regression, (x, y), f"logistic regression, N={n}, D={d}",
                       truth={"w": w, "b": torch.tensor(-0.3)})
    if name == "hierarchical":
        groups, per_group = 40, 10
        group = torch.arange(groups).repeat_interleave(per_group)
        x = torch.randn(groups * per_group, generator=g)
        a = 1.0 + 0.7 * torch.randn(groups, generator=g)
        y = a[group] - 0.6 * x + 0.8 * torch.randn(groups * per_group, generator=g)
        return Problem(hierarchical_intercepts, (x, group, y), f"varying intercepts, {groups} groups",
                       truth={"mu_a": torch.tensor(1.0), "sigma_a": torch.tensor(0.7), "beta": torch.tensor(-0.6),
                              "sigma_y": torch.tensor(0.8)})
    if name == "gp":
        n, d = 40, 4
        x = torch.rand(n, d, generator=g) * 2 - 1
        f = torch.sin(3 * x[:, 0]) + 0.5 * x[:, 1]  # only the first two inputs matter
        y = f + 0.1 * torch.randn(n, generator=g)
        return Problem(gp_regression, (x, y), f"GP regression, n={n}, {d} inputs (2 relevant)",
                       truth={"noise": torch.tensor(0.01)})
    if name == "changepoint":
        _, early_mean, early_sd, late_mean, late_sd = changepoint_exact_posterior(COAL_MINING_DISASTERS)
        return Problem(changepoint, (COAL_MINING_DISASTERS.to(like),),
                       "coal-mining disasters 1851-1961, a change of rate in an enumerated year",
                       {"early": early_mean.to(like), "late": late_mean.to(like)},
                       {"early": early_sd.to(like), "late": late_sd.to(like)})
    raise ValueError(f"unknown example problem {name!r}; choose from {PROBLEMS}")


PROBLEMS = ("classic", "eight_schools", "eight_schools_centered", "logistic", "hierarchical", "gp", "changepoint")
