"""Models shared by the tests, with their exact posteriors where known."""

import warnings

import pyro
import pyro.distributions as dist
import torch

PRECISION = torch.tensor([[10.25, -9.74], [-9.74, 10.25]])  # the classic question's target


def gauss2d():
    pyro.sample("q", dist.MultivariateNormal(torch.zeros(2), precision_matrix=PRECISION))


def normal_normal(x):
    """mu ~ N(0, 10^2), x_i ~ N(mu, 1): posterior N(sum(x) / (n + 0.01), 1 / (n + 0.01))."""
    mu = pyro.sample("mu", dist.Normal(0.0, 10.0))
    with pyro.plate("data", len(x)):
        pyro.sample("x", dist.Normal(mu, 1.0), obs=x)


def normal_normal_posterior(x):
    n = len(x)
    precision = n + 0.01
    return float(x.sum() / precision), 1.0 / precision


def gamma_poisson(y):
    """rate ~ Gamma(2, 1), y_i ~ Poisson(rate): posterior Gamma(2 + sum(y), 1 + n)."""
    rate = pyro.sample("rate", dist.Gamma(2.0, 1.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Poisson(rate), obs=y)


def gamma_poisson_posterior(y):
    """The posterior Gamma's (shape, rate), and so its mean shape / rate and variance shape / rate**2."""
    return float(2.0 + y.sum()), 1.0 + len(y)


def dirichlet_categorical(counts):
    """p ~ Dirichlet(1, 1, 1), counts ~ Multinomial(p): posterior Dirichlet(1 + counts)."""
    p = pyro.sample("p", dist.Dirichlet(torch.ones(3)))
    pyro.sample("obs", dist.Multinomial(int(counts.sum()), p), obs=counts)


def eight_schools(y, sigma):
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", len(y)):
        theta_raw = pyro.sample("theta_raw", dist.Normal(0.0, 1.0))
        pyro.sample("y", dist.Normal(mu + tau * theta_raw, sigma), obs=y)


EIGHT_SCHOOLS_Y = torch.tensor([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
EIGHT_SCHOOLS_SIGMA = torch.tensor([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools_centered(y, sigma):
    """The centered parameterisation: a funnel on which HMC diverges."""
    mu = pyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = pyro.sample("tau", dist.HalfCauchy(5.0))
    with pyro.plate("schools", len(y)):
        theta = pyro.sample("theta", dist.Normal(mu, tau))
        pyro.sample("y", dist.Normal(theta, sigma), obs=y)


def logistic_data(n=200, d=3, seed=1):
    """A fixed simulated data set: x (n, d) standard normal, y ~ Bernoulli(sigmoid(x w + 0.5))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.linspace(-1.0, 1.5, d)
    y = torch.bernoulli(torch.sigmoid(x @ w + 0.5), generator=g)
    return x, y


def logistic_regression(x, y):
    w = pyro.sample("w", dist.Normal(torch.zeros(x.shape[1]), 2.0).to_event(1))
    b = pyro.sample("b", dist.Normal(0.0, 2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Bernoulli(logits=x @ w + b), obs=y)


def failing_potential(params):
    """A Gaussian whose potential raises (Cholesky of a non-PD matrix) beyond |x| = 2."""
    x = params["x"]
    m = torch.stack([torch.stack([torch.ones(()), torch.zeros(())]), torch.stack([torch.zeros(()), 4.0 - x[0] ** 2])])
    return 0.5 * (x**2).sum() - torch.linalg.cholesky(m).diagonal().log().sum()


def site_only_where_positive(y):
    """A model whose sites depend on a latent value: ``b`` exists only where ``a > 0``."""
    a = pyro.sample("a", dist.Normal(0.0, 1.0))
    if a > 0:
        pyro.sample("b", dist.Normal(0.0, 1.0))
    pyro.sample("y", dist.Normal(a, 1.0), obs=y)


def two_scales(y, cut=None):
    """Two scales of 2-D observations; ``cut`` builds them the ways that cut the gradient."""
    s1 = pyro.sample("s1", dist.HalfNormal(5.0))
    s2 = pyro.sample("s2", dist.HalfNormal(5.0))
    if cut == "torch.tensor":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's "Converting a tensor with requires_grad=True to a scalar"
            scale = torch.tensor([s1, s2])
    elif cut == "detach":
        scale = torch.stack([s1.detach(), s2])
    else:
        scale = torch.stack([s1, s2])
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(0.0, scale).to_event(1), obs=y)
