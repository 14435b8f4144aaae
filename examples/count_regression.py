"""Counts: a Poisson regression and a negative binomial one, checked against the data with
posterior predictive checks and compared by leave-one-out cross-validation (PSIS-LOO).
About 15 s on 2 cores.

The data (simulated, so the truth is known) are 200 counts whose log mean rises with one
input, with more spread than a Poisson has: a negative binomial of concentration 2. Both
models fit the mean; only one can fit the spread. Each is sampled with NUTS (4 chains in one
process), and then:

* **replicated data**: ``pyro.infer.Predictive`` draws a new data set at every posterior
  draw, from the model wrapped in ``pyro.poutine.uncondition`` (``Predictive`` run with the
  observations would return the observed counts themselves), and
  ``to_inference_data(mcmc, posterior_predictive=...)`` puts them beside the observed data;
* **a check**: for the share of zeros and the variance-to-mean ratio, the share of
  replicated data sets at or above the observed value (a posterior predictive p-value:
  near 0 or 1, the model cannot produce data like these). The Poisson regression's
  replicated counts have too few zeros and too little spread; the negative binomial's do
  not;
* **a comparison**: ``az.compare`` of the two exports' pointwise log likelihoods.

    python examples/count_regression.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive

from pyro_hmc_plus import MCMC, NUTS

TRUTH = {"a": 0.5, "b": 0.8, "concentration": 2.0}


def simulate(n: int = 200):
    """``(x, y)``: inputs and counts of a negative binomial regression with log link (the
    same every time: drawn from a fixed seed)."""
    pyro.set_rng_seed(0)
    x = torch.randn(n)
    mean = torch.exp(TRUTH["a"] + TRUTH["b"] * x)
    return x, dist.GammaPoisson(TRUTH["concentration"], TRUTH["concentration"] / mean).sample()


def poisson(x, y):
    a = pyro.sample("a", dist.Normal(0.0, 2.0))
    b = pyro.sample("b", dist.Normal(0.0, 2.0))
    with pyro.plate("data", len(x)):
        pyro.sample("y", dist.Poisson(torch.exp(a + b * x)), obs=y)


def negative_binomial(x, y):
    """Mean ``exp(a + b x)``, variance ``mean + mean**2 / concentration``."""
    a = pyro.sample("a", dist.Normal(0.0, 2.0))
    b = pyro.sample("b", dist.Normal(0.0, 2.0))
    concentration = pyro.sample("concentration", dist.Gamma(2.0, 0.2))
    with pyro.plate("data", len(x)):
        mean = torch.exp(a + b * x)
        pyro.sample("y", dist.GammaPoisson(concentration, concentration / mean), obs=y)


def statistics(y: torch.Tensor) -> dict:
    """The data's features that a check compares, over the last dimension (the counts)."""
    return {"share of zeros": (y == 0).float().mean(-1), "variance / mean": y.var(-1) / y.mean(-1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    x, y = simulate()
    observed = statistics(y)
    print("observed: " + ", ".join(f"{k} {v:.2f}" for k, v in observed.items()))
    exports = {}
    for name, model in (("poisson", poisson), ("negative binomial", negative_binomial)):
        pyro.set_rng_seed(0)
        mcmc = MCMC(NUTS(model), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
        mcmc.run(x, y)
        replicated = Predictive(pyro.poutine.uncondition(model), mcmc.get_samples(), return_sites=["y"])(x, y)
        exports[name] = mcmc.to_inference_data(posterior_predictive=replicated)
        print(f"\n{name}:")
        print(az.summary(exports[name], var_names=list(mcmc.get_samples()))[["mean", "sd", "hdi_3%", "hdi_97%",
                                                                              "r_hat"]].to_string())
        for stat, value in statistics(replicated["y"]).items():
            p = (value >= observed[stat]).float().mean()
            print(f"  {stat}: replicated {value.mean():.2f} (90% of data sets in {value.quantile(0.05):.2f}-"
                  f"{value.quantile(0.95):.2f}), p-value {p:.2f}")
    print(f"\ntruth: {TRUTH}")
    comparison = az.compare(exports)
    print("\nleave-one-out comparison (higher elpd_loo is better):")
    print(comparison[["rank", "elpd_loo", "p_loo", "elpd_diff", "dse"]].to_string())
    print(f"LOO prefers the {comparison.index[0]} regression")
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, (name, idata) in zip(axes, exports.items()):
            az.plot_ppc(idata, kind="cumulative", num_pp_samples=100, ax=ax)  # counts: a density would wiggle
            ax.set_title(name)
            ax.set_xlim(0, float(y.quantile(0.98)))
        fig.tight_layout()
        plt.savefig(args.out / "count_regression_ppc.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
