"""Wind directions: a circular regression, where the unknown mean direction is an angle.
About 20 s on 2 cores.

Each day's wind direction (radians) follows a von Mises distribution around a mean
``mu0 + beta x`` that turns with a covariate ``x`` (a standardised pressure difference; here
by less than a quarter turn either way). The truth of the simulation puts ``mu0`` near the
ends of ``[-pi, pi)`` (3.0), where an angle written as a real number wraps around.

An angle with a von Mises prior is the natural way to write ``mu0``, and it fails: torch
gives ``VonMises`` the whole real line as support, where its density repeats every turn, so
the posterior of ``mu0`` has a copy in every turn and the chains settle in different ones
(here around 3.0 and 3.0 - 2 pi). Pyro's kernels sample it without a word; this package
warns before sampling, and the run's checks report an R-hat far above 1. The draws are
right modulo 2 pi only. The example then samples the angle as the direction of a 2-vector,
as Stan's unit vectors do: a prior on the vector that depends on its length alone leaves the
direction uniform, and one that holds the length near 1 keeps the trajectories away from
the origin, where the direction of a concentrated angle turns too fast for the step size.

Printed: the warning; the first fit's chains (their means, R-hat); the second fit's
summary against the truth, with circular statistics for the angle (``az.summary``'s
``circ_var_names``); and a posterior predictive check of the spread of the directions
around their means (the mean resultant length of the residual angles).

    python examples/circular_regression.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import math
import pathlib
import warnings

import arviz as az
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive

from pyro_hmc_plus import MCMC, NUTS, SamplingWarning

TRUTH = {"mu0": 3.0, "beta": 0.4, "kappa": 4.0}


def mean_direction(mu0, beta, x):
    """The mean direction of a day with covariate ``x``: ``mu0`` turned by ``beta x`` radians."""
    return mu0 + beta * x


def simulate(n: int = 150):
    """``(x, directions)``: directions in ``[-pi, pi)`` as a wind vane reports them."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=g)
    pyro.set_rng_seed(3)
    directions = dist.VonMises(mean_direction(TRUTH["mu0"], TRUTH["beta"], x), TRUTH["kappa"]).sample()
    return x, wrapped(directions)


def wrapped(angle):
    """``angle`` in ``[-pi, pi)``, the same direction."""
    return torch.remainder(angle + math.pi, 2 * math.pi) - math.pi


def likelihood(mu0, x, directions):
    beta = pyro.sample("beta", dist.Normal(0.0, 1.0))
    kappa = pyro.sample("kappa", dist.LogNormal(1.0, 1.0))
    with pyro.plate("days", len(x)):
        return pyro.sample("direction", dist.VonMises(mean_direction(mu0, beta, x), kappa), obs=directions)


def angle_as_a_number(x, directions=None):
    """``mu0`` sampled as a real number with a von Mises prior: improper, one mode a turn."""
    return likelihood(pyro.sample("mu0", dist.VonMises(0.0, 0.5)), x, directions)


def angle_as_a_direction(x, directions=None):
    """``mu0`` as the direction of ``v``: the same von Mises prior as a factor on it, and a
    density of ``|v|`` alone (near 1), which leaves the direction's prior as it is."""
    v = pyro.sample("v", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    pyro.factor("v_length", -50 * (v.norm(dim=-1) - 1) ** 2)
    mu0 = pyro.deterministic("mu0", torch.atan2(v[..., 1], v[..., 0]))
    pyro.factor("mu0_prior", dist.VonMises(0.0, 0.5).log_prob(mu0))
    return likelihood(mu0.unsqueeze(-1), x, directions)


def circular_mean(angles, dim=-1):
    """The direction of the mean of ``angles`` as unit vectors, in ``[-pi, pi]``."""
    return torch.atan2(angles.sin().mean(dim), angles.cos().mean(dim))


def resultant_length(angles, dim=-1):
    """The mean resultant length of ``angles``: 1 when they all agree, near 0 when spread."""
    return torch.hypot(angles.cos().mean(dim), angles.sin().mean(dim))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    x, directions = simulate()
    print(f"{len(x)} days; directions from {directions.min():.2f} to {directions.max():.2f} rad")

    pyro.set_rng_seed(0)
    naive = MCMC(NUTS(angle_as_a_number), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SamplingWarning)
        naive.run(x, directions)
    messages = [str(w.message) for w in caught if issubclass(w.category, SamplingWarning)]
    print("\nmu0 as a number:", messages[0][:160] + " ..." if messages else "no warning")
    raw = naive.get_samples(group_by_chain=True)["mu0"]
    naive_idata = naive.to_inference_data()
    print(f"  chains' means of mu0: {[round(m, 2) for m in raw.mean(1).tolist()]}, R-hat "
          f"{float(az.rhat(naive_idata, var_names=['mu0'])['mu0']):.2f}; wrapped into [-pi, pi), their circular "
          f"means: {[round(m, 2) for m in circular_mean(raw, 1).tolist()]}")

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(angle_as_a_direction), num_samples=args.num_samples, warmup_steps=args.num_samples,
                num_chains=4)
    mcmc.run(x, directions)
    idata = mcmc.to_inference_data()
    table = az.summary(idata, var_names=list(TRUTH), circ_var_names=["mu0"], hdi_prob=0.9)
    table = table[["mean", "sd", "hdi_5%", "hdi_95%", "ess_bulk", "r_hat"]]
    table["true"] = list(TRUTH.values())
    print(f"\nmu0 as a direction (mu0's mean, sd and interval are circular):\n{table.to_string()}")
    draws = {name: torch.as_tensor(idata.posterior[name].values).reshape(-1) for name in TRUTH}
    # the 90% arc centred on the draws' circular mean (their interval once turned so that it is 0)
    centre = circular_mean(draws["mu0"])
    turned = wrapped(draws["mu0"] - centre)
    inside = [abs(wrapped(torch.tensor(TRUTH["mu0"]) - centre)) <= turned.abs().quantile(0.9)]
    for name in ("beta", "kappa"):
        inside.append(draws[name].quantile(0.05) <= TRUTH[name] <= draws[name].quantile(0.95))
    print(f"{sum(bool(i) for i in inside)} of {len(inside)} true parameters inside the 90% intervals")

    # replicated days from the posterior: is the spread around the means the observed one?
    samples = {k: v for k, v in mcmc.get_samples().items() if k in ("v", "beta", "kappa")}
    replicated = Predictive(angle_as_a_direction, samples, return_sites=["direction"])(x)["direction"]
    means = mean_direction(draws["mu0"].unsqueeze(-1), draws["beta"].unsqueeze(-1), x)
    observed = resultant_length(directions - means).mean()
    spread = resultant_length(replicated - means)
    low, high = spread.quantile(0.05).item(), spread.quantile(0.95).item()
    print(f"mean resultant length of the days around their means: {observed:.3f} observed, "
          f"{low:.3f}-{high:.3f} replicated (90%): {'inside' if low <= observed <= high else 'outside'}")

    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        grid = torch.linspace(-3, 3, 100)
        curves = wrapped(mean_direction(draws["mu0"].unsqueeze(-1), draws["beta"].unsqueeze(-1), grid))
        plt.scatter(x, directions, s=8, color="0.5", label="days")
        for curve in curves[:: max(1, len(curves) // 50)]:
            plt.plot(grid, curve, ".", ms=0.5, color="C0", alpha=0.3)
        plt.xlabel("x (standardised pressure difference)")
        plt.ylabel("wind direction (rad)")
        plt.title("posterior mean directions (50 draws), wrapped into [-pi, pi)")
        plt.savefig(args.out / "circular_regression.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
