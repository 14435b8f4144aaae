"""When did the rate change? British coal-mining disasters per year, 1851-1961, modelled as
Poisson counts at an early rate before a switchpoint year and a late rate from it on (the
change-point model of PyMC's and Stan's manuals). About 13 s on 2 cores.

The switchpoint is discrete, and NUTS needs a continuous posterior. The model marks it for
enumeration; Pyro's potential then sums it out exactly over the 111 candidate years, so
NUTS samples only the two rates (4 chains in one process) and the model needs no change for
the sampler. Two things follow, both printed:

* The posterior is known exactly here (given the year, each rate is a conjugate Gamma, and
  integrating the rates out gives each year's probability), so the draws are set beside it.
* The switchpoint has no draws of its own, but its posterior is still in reach: given a
  draw's rates, each year's conditional probability is a product of Poisson terms; averaged
  over the draws, these conditional probabilities estimate the marginal posterior with less
  noise than sampling a year per draw would (Rao-Blackwellisation). ``pyro.infer.infer_discrete``
  does the sampling for any enumerated model; this model is simple enough to write out.

    python examples/changepoint.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro
import pyro.distributions as dist
import torch

from pyro_hmc_plus import MCMC, NUTS
from pyro_hmc_plus.models import COAL_MINING_DISASTERS, COAL_MINING_FIRST_YEAR, changepoint, changepoint_exact_posterior


def switchpoint_probabilities(early, late, counts):
    """Each year's probability of being the first late year, given each draw's rates:
    ``(N,)`` draws of ``early`` and ``late`` -> ``(N, T)``. With the switchpoint at year
    ``s``, the log likelihood is the early rate's Poisson terms for the years before ``s``
    plus the late rate's from ``s`` on (running sums over the years); the prior is uniform."""
    early_terms = dist.Poisson(early.unsqueeze(-1)).log_prob(counts)  # (N, T)
    late_terms = dist.Poisson(late.unsqueeze(-1)).log_prob(counts)
    zero = early_terms.new_zeros(early_terms.shape[:-1] + (1,))
    before = torch.cat([zero, early_terms.cumsum(-1)[..., :-1]], -1)  # early terms of years < s
    from_s = late_terms.sum(-1, keepdim=True) - torch.cat([zero, late_terms.cumsum(-1)[..., :-1]], -1)
    return torch.softmax(before + from_s, -1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    counts = COAL_MINING_DISASTERS
    years = torch.arange(len(counts)) + COAL_MINING_FIRST_YEAR
    exact_probs, early_mean, early_sd, late_mean, late_sd = changepoint_exact_posterior(counts)

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(changepoint), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
    mcmc.run(counts)
    # one switchpoint for all the years: given the rates they are not independent, so there is
    # no pointwise log likelihood (the export would leave it out with a warning)
    idata = mcmc.to_inference_data(log_likelihood=False)
    table = az.summary(idata, var_names=["early", "late"])[["mean", "sd", "mcse_mean", "ess_bulk", "r_hat"]]
    table["exact mean"] = [early_mean.item(), late_mean.item()]
    table["exact sd"] = [early_sd.item(), late_sd.item()]
    print("disasters per year, early and late rates:")
    print(table.round(3).to_string())

    draws = mcmc.get_samples()
    per_draw = switchpoint_probabilities(draws["early"].double(), draws["late"].double(), counts)
    from_draws = per_draw.mean(0)
    print("\nthe first year of the late rate, most probable years:")
    print("  year  from the draws  exact")
    for i in exact_probs.argsort(descending=True)[:6].tolist():
        print(f"  {years[i].item()}  {from_draws[i].item():14.3f}  {exact_probs[i].item():.3f}")
    total_variation = 0.5 * (from_draws - exact_probs).abs().sum().item()
    print(f"total variation distance between the two distributions over the {len(counts)} years: "
          f"{total_variation:.3f}")

    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        # the expected rate each year: early before the switchpoint, late from it on
        late_by_year = per_draw.cumsum(-1)  # P(switchpoint <= year | the draw's rates)
        rate = (draws["early"].double().unsqueeze(-1) * (1 - late_by_year)
                + draws["late"].double().unsqueeze(-1) * late_by_year).mean(0)
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        top.bar(years, counts, color="0.75", label="disasters")
        top.plot(years, rate, color="C0", label="posterior mean rate")
        top.set_ylabel("disasters per year")
        top.legend()
        bottom.bar(years, from_draws, color="C0", label="from the draws")
        bottom.plot(years, exact_probs, "k.", label="exact")
        bottom.set_ylabel("P(first late year)")
        bottom.set_xlabel("year")
        bottom.legend()
        fig.tight_layout()
        fig.savefig(args.out / "changepoint.png", dpi=70)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
