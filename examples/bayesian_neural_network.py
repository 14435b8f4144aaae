"""A Bayesian neural network written as a ``PyroModule`` (as in Pyro's tutorials), sampled
with NUTS: one hidden layer of tanh units with standard-normal priors on every weight and
bias, fitted to 40 noisy points of ``sin(2x)`` with no data between x = -0.5 and 0.5. The
posterior predictive follows the data where there are data and widens in the gap, which a
point estimate cannot show. The network's output at each input is recorded with
``pyro.deterministic``, so its draws are in the ArviZ export's posterior.

The weights themselves are not identifiable (swapping two hidden units, or flipping the
signs of one unit's weights, gives the same function), so their R-hat is high across chains
and the run warns about it: judge the predictions (the ``f`` rows of the summary), not the
weights. About a minute and a half on 2 cores: the trees are deep (hundreds of leapfrog steps a draw).

    python examples/bayesian_neural_network.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib
import time

import arviz as az
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive
from pyro.nn import PyroModule, PyroSample

from pyro_hmc_plus import MCMC, NUTS


class BayesianMLP(PyroModule):
    """``y ~ Normal(f(x), sigma)``, ``f`` a one-hidden-layer tanh network with ``Normal(0, 1)``
    priors on its weights and biases; ``sigma ~ HalfNormal(1)``. ``x``: ``(N, 1)``."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.hidden = PyroModule[torch.nn.Linear](1, hidden)
        self.hidden.weight = PyroSample(dist.Normal(0.0, 1.0).expand([hidden, 1]).to_event(2))
        self.hidden.bias = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.out = PyroModule[torch.nn.Linear](hidden, 1)
        self.out.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, hidden]).to_event(2))
        self.out.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x, y=None):
        sigma = pyro.sample("sigma", dist.HalfNormal(1.0))
        f = self.out(torch.tanh(self.hidden(x))).squeeze(-1)  # samples the weights: outside the plate
        with pyro.plate("data", x.shape[0]):
            pyro.deterministic("f", f)
            return pyro.sample("y", dist.Normal(f, sigma), obs=y)


def data(num_points: int = 40, noise: float = 0.1):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.linspace(-2.0, -0.5, num_points // 2), torch.linspace(0.5, 2.0, num_points // 2)])
    y = torch.sin(2 * x) + noise * torch.randn(num_points, generator=g)
    return x.unsqueeze(-1), y


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=300)
    parser.add_argument("--chains", type=int, default=2)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    x, y = data()
    model = BayesianMLP()
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=args.chains)
    start = time.perf_counter()
    mcmc.run(x, y)
    print(f"{args.chains} chains x {2 * args.num_samples} draws in {time.perf_counter() - start:.1f} s")
    idata = mcmc.to_inference_data()
    print(az.summary(idata, var_names=["sigma", "f"], coords={"data": [0, 19, 20, 39]}).to_string())

    # the posterior predictive on a grid across the gap: Pyro's Predictive with our draws
    grid = torch.linspace(-2.5, 2.5, 11).unsqueeze(-1)
    predicted = Predictive(model, mcmc.get_samples(), return_sites=["f"])(grid)["f"]
    low, mid, high = torch.quantile(predicted, torch.tensor([0.05, 0.5, 0.95]), dim=0)
    print("posterior predictive of f (median and 90% interval) against the truth sin(2x):")
    for xi, lo, me, hi in zip(grid.squeeze(-1).tolist(), low.tolist(), mid.tolist(), high.tolist()):
        where = "gap" if abs(xi) < 0.5 else ("outside the data" if abs(xi) > 2 else "data")
        print(f"  x = {xi:+.1f} ({where:>16}): {me:+.2f} [{lo:+.2f}, {hi:+.2f}]  truth {torch.sin(torch.tensor(2 * xi)):+.2f}")
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        fine = torch.linspace(-2.5, 2.5, 101).unsqueeze(-1)
        draws = Predictive(model, mcmc.get_samples(), return_sites=["f"])(fine)["f"]
        band = torch.quantile(draws, torch.tensor([0.05, 0.5, 0.95]), dim=0)
        plt.fill_between(fine.squeeze(-1), band[0], band[2], alpha=0.3, label="90% of f")
        plt.plot(fine.squeeze(-1), band[1], label="median of f")
        plt.plot(fine.squeeze(-1), torch.sin(2 * fine.squeeze(-1)), "k--", label="sin(2x)")
        plt.scatter(x.squeeze(-1), y, s=10, c="k", label="data")
        plt.legend()
        plt.savefig(args.out / "bnn_predictive.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
