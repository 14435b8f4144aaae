"""Bayesian logistic regression (N=1,000 observations, 10 coefficients and an intercept) with
NUTS: 4 chains in one process, the posterior against the coefficients that generated the
data, and a trace plot. About 10 s on 2 cores.

    python examples/logistic_regression.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro

from pyro_hmc_plus import MCMC, NUTS
from pyro_hmc_plus.models import problem


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    prob = problem("logistic")
    x, y = prob.args
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(prob.model), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
    mcmc.run(x, y)
    idata = mcmc.to_inference_data()
    table = az.summary(idata, var_names=["w", "b"])[["mean", "sd", "hdi_3%", "hdi_97%", "ess_bulk", "r_hat"]]
    table["true"] = prob.truth["w"].tolist() + [prob.truth["b"].item()]
    print(table.to_string())
    print(f"accuracy of the posterior-mean classifier: "
          f"{((x @ mcmc.get_samples()['w'].mean(0) + mcmc.get_samples()['b'].mean() > 0).float() == y).float().mean():.3f}")
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        az.plot_trace(idata, var_names=["b"])
        plt.savefig(args.out / "logistic_trace.png", dpi=80)
        az.plot_forest(idata, var_names=["w"], combined=True)
        plt.savefig(args.out / "logistic_forest.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
