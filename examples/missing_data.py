"""Missing covariates: a linear regression where 30% of the inputs ``x`` were not recorded
(at random), and NUTS imputes them along with the parameters. About 20 s on 2 cores.

The missing values are latent: a prior for ``x`` (its own mean and scale, learnt from the
recorded values) and the likelihood of ``y``, which also depends on them, give each one a
posterior. Sample *only the missing entries*, as one site of their length, and write them
into the recorded vector: the model stays a function of continuous latents, traced once.

Pyro's ``obs_mask`` does not do this for MCMC: ``pyro.sample("x", d, obs=x, obs_mask=m)``
adds a site ``x_unobserved`` of the full length whose recorded entries are masked out, so
have no density at all. The posterior is flat along them (improper): NUTS runs every
trajectory to its maximum length and those entries drift without bound. ``obs_mask`` is
meant for guides in SVI. This package warns about such coordinates before sampling; the
example prints that warning, then samples the model written the way above. Printed: the
regression's parameters against the simulation's truth; the same regression on the complete
cases only (the rows with ``x``), which here, with values missing completely at random,
gives the parameters about as precisely: what the imputation adds is the missing values
themselves (and every row kept, for models whose other parts use them); and how many of
the missing values fall inside their 90% intervals, against the width of the prior's.

    python examples/missing_data.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib
import warnings

import arviz as az
import pyro
import pyro.distributions as dist
import torch

from pyro_hmc_plus import MCMC, NUTS, SamplingWarning

TRUTH = {"a": 1.0, "b": 2.0, "s": 0.5, "mu_x": 0.5, "s_x": 1.0}


def simulate(n: int = 200, missing_fraction: float = 0.3):
    """``(x, recorded, y, x_true)``: ``x`` with 0 where not ``recorded`` (missing at random)."""
    g = torch.Generator().manual_seed(1)
    x_true = TRUTH["mu_x"] + TRUTH["s_x"] * torch.randn(n, generator=g)
    y = TRUTH["a"] + TRUTH["b"] * x_true + TRUTH["s"] * torch.randn(n, generator=g)
    recorded = torch.rand(n, generator=g) >= missing_fraction
    return torch.where(recorded, x_true, torch.zeros(())), recorded, y, x_true


def regression(x, y):
    a = pyro.sample("a", dist.Normal(0.0, 10.0))
    b = pyro.sample("b", dist.Normal(0.0, 10.0))
    s = pyro.sample("s", dist.HalfNormal(2.0))
    with pyro.plate("data", len(y)):
        pyro.sample("y", dist.Normal(a + b * x, s), obs=y)


def with_imputation(x, recorded, y):
    """The regression, with a prior for ``x`` and one latent site for its missing entries."""
    mu_x = pyro.sample("mu_x", dist.Normal(0.0, 5.0))
    s_x = pyro.sample("s_x", dist.HalfNormal(2.0))
    missing = (~recorded).nonzero().squeeze(-1)  # from the data only: fixed when traced
    with pyro.plate("recorded_x", int(recorded.sum())):
        pyro.sample("x_recorded", dist.Normal(mu_x, s_x), obs=x[recorded])
    with pyro.plate("missing_x", len(missing)):
        x_missing = pyro.sample("x_missing", dist.Normal(mu_x, s_x))
    regression(x.index_put((missing,), x_missing), y)


def with_obs_mask(x, recorded, y):
    """The same prior through ``obs_mask``: ``x_unobserved`` has every entry, the recorded
    ones without density."""
    mu_x = pyro.sample("mu_x", dist.Normal(0.0, 5.0))
    s_x = pyro.sample("s_x", dist.HalfNormal(2.0))
    with pyro.plate("all_x", len(y)):
        x = pyro.sample("x", dist.Normal(mu_x, s_x), obs=x, obs_mask=recorded)
    regression(x, y)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    x, recorded, y, x_true = simulate()
    print(f"{int((~recorded).sum())} of {len(y)} inputs missing")

    pyro.set_rng_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        NUTS(with_obs_mask).setup(0, x, recorded, y)  # the checks only: no sampling
    flat = [w for w in caught if issubclass(w.category, SamplingWarning)]
    print("obs_mask:", str(flat[0].message)[:200] + " ..." if flat else "no warning")

    runs = {}
    for name, model, data in [("imputed", with_imputation, (x, recorded, y)),
                              ("complete cases", regression, (x[recorded], y[recorded]))]:
        pyro.set_rng_seed(0)
        mcmc = MCMC(NUTS(model), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
        mcmc.run(*data)
        runs[name] = mcmc
        names = [n for n in TRUTH if n in mcmc.get_samples()]
        table = az.summary(mcmc.to_inference_data(), var_names=names, hdi_prob=0.9)
        table = table[["mean", "sd", "hdi_5%", "hdi_95%", "ess_bulk", "r_hat"]]
        table["true"] = [TRUTH[n] for n in names]
        print(f"\n{name}:\n{table.to_string()}")

    draws = runs["imputed"].get_samples()["x_missing"]  # (draws, missing)
    low, high = draws.quantile(0.05, dim=0), draws.quantile(0.95, dim=0)
    truth = x_true[~recorded]
    inside = ((truth >= low) & (truth <= high)).float().mean().item()
    print(f"\n{100 * inside:.0f}% of the true missing inputs inside their 90% intervals "
          f"(mean interval width {(high - low).mean().item():.2f}; the prior's alone: "
          f"{2 * 1.645 * TRUTH['s_x']:.2f})")
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        y_missing = y[~recorded]
        plt.scatter(x[recorded], y[recorded], s=8, color="0.6", label="recorded x")
        plt.errorbar(draws.mean(0), y_missing, xerr=torch.stack([draws.mean(0) - low, high - draws.mean(0)]),
                     fmt="o", ms=3, lw=0.8, label="imputed x: posterior mean, 90% interval")
        plt.scatter(truth, y_missing, marker="x", s=20, color="k", label="true x (not recorded)")
        plt.xlabel("x")
        plt.ylabel("y")
        plt.legend(fontsize=8)
        plt.savefig(args.out / "missing_data.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
