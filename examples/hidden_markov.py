"""Which regime is the series in? A two-state hidden Markov model of a simulated series of
300 days: each day's value is normal around its regime's level (low or high), and the
regime persists from one day to the next with a regime-specific probability. About 30 s on 2
cores.

The regimes are discrete, and NUTS needs a continuous posterior. Pyro's ``DiscreteHMM``
sums them out inside the log density (the forward algorithm, a parallel scan over the days),
so NUTS samples only the five continuous parameters (4 chains in one process). Written as
a Python loop of enumerated sample sites under ``pyro.markov``, one per day, the same model
runs too, but slower: for 100 days, one chain of 500 + 500 draws took 52 s as a loop
against 8 s with ``DiscreteHMM``. Two things are printed:

* The parameters beside the values the series was simulated with. The two levels are
  ordered by construction (``high = low + gap``), which keeps the chains from swapping the
  regimes' labels (see ``examples/mixture.py`` for what label switching does to R-hat).
* Each day's probability of the high regime. The regimes have no draws of their own, but
  given a draw's parameters the forward-backward algorithm gives each day's posterior
  regime probabilities exactly; averaged over the draws, they are the posterior
  probabilities (Rao-Blackwellised, as ``examples/changepoint.py`` does for its year).

    python examples/hidden_markov.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro
import pyro.distributions as dist
import torch

from pyro_hmc_plus import MCMC, NUTS

TRUE = {"low": -1.0, "gap": 2.5, "scale": 0.7, "stay": [0.95, 0.9]}
INITIAL_LOGITS = torch.zeros(2)  # the regime of the day before the first: either, equally


def simulate(num_days: int = 300, seed: int = 0):
    """A series from the model at :data:`TRUE`: ``(values (T,), regimes (T,))``."""
    gen = torch.Generator().manual_seed(seed)
    stay = torch.tensor(TRUE["stay"])
    regimes = [0]
    for _ in range(num_days - 1):
        previous = regimes[-1]
        regimes.append(previous if torch.rand((), generator=gen) < stay[previous] else 1 - previous)
    regimes = torch.tensor(regimes)
    levels = torch.tensor([TRUE["low"], TRUE["low"] + TRUE["gap"]])
    return levels[regimes] + TRUE["scale"] * torch.randn(num_days, generator=gen), regimes


def transition_logits(stay: torch.Tensor) -> torch.Tensor:
    """Log transition matrix from each regime's probability of staying, ``(..., 2)`` ->
    ``(..., 2, 2)``: row = today's regime, column = tomorrow's."""
    leave = 1 - stay
    return torch.stack([torch.stack([stay[..., 0], leave[..., 0]], -1),
                        torch.stack([leave[..., 1], stay[..., 1]], -1)], -2).log()


def model(values):
    low = pyro.sample("low", dist.Normal(0.0, 5.0))
    gap = pyro.sample("gap", dist.HalfNormal(5.0))
    scale = pyro.sample("scale", dist.HalfNormal(2.0))
    stay = pyro.sample("stay", dist.Beta(8.0, 2.0).expand([2]).to_event(1))  # regimes tend to persist
    levels = torch.stack([low, low + gap], -1)
    hmm = dist.DiscreteHMM(INITIAL_LOGITS, transition_logits(stay), dist.Normal(levels, scale))
    pyro.sample("values", hmm, obs=values)


def regime_probabilities(draws: dict, values: torch.Tensor) -> torch.Tensor:
    """Each day's posterior regime probabilities given each draw's parameters, by the
    forward-backward algorithm: ``(N,)`` or ``(N, 2)`` draws -> ``(N, T, 2)``."""
    levels = torch.stack([draws["low"], draws["low"] + draws["gap"]], -1)  # (N, 2)
    emission = dist.Normal(levels.unsqueeze(-2), draws["scale"][:, None, None]).log_prob(values[:, None])  # (N, T, 2)
    trans = transition_logits(draws["stay"])  # (N, 2, 2)
    num_days = len(values)
    day_before = torch.log_softmax(INITIAL_LOGITS, -1).to(trans)
    forward = [emission[:, 0] + torch.logsumexp(day_before.unsqueeze(-1) + trans, -2)]
    for t in range(1, num_days):
        forward.append(emission[:, t] + torch.logsumexp(forward[-1].unsqueeze(-1) + trans, -2))
    backward = [torch.zeros_like(forward[0])]
    for t in range(num_days - 1, 0, -1):
        backward.insert(0, torch.logsumexp(trans + (emission[:, t] + backward[0]).unsqueeze(-2), -1))
    return torch.softmax(torch.stack(forward, 1) + torch.stack(backward, 1), -1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    values, regimes = simulate()

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
    mcmc.run(values)
    idata = mcmc.to_inference_data(log_likelihood=False)  # one sequence: no pointwise terms
    table = az.summary(idata, hdi_prob=0.9)[["mean", "sd", "hdi_5%", "hdi_95%", "ess_bulk", "r_hat"]]
    table["true"] = [TRUE["gap"], TRUE["low"], TRUE["scale"], *TRUE["stay"]]
    print(table.round(3).to_string())
    inside = ((table["hdi_5%"] <= table["true"]) & (table["true"] <= table["hdi_95%"])).sum()
    print(f"{inside} of {len(table)} true values inside the 90% intervals")

    draws = {name: value.double() for name, value in mcmc.get_samples().items()}
    high = regime_probabilities(draws, values.double()).mean(0)[:, 1]  # (T,)
    recovered = ((high > 0.5).long() == regimes).float().mean().item()
    print(f"{recovered:.1%} of the days' regimes recovered (the more probable regime is the true one); "
          f"{int(((high > 0.1) & (high < 0.9)).sum())} days with a regime probability between 0.1 and 0.9")

    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        days = torch.arange(len(values))
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
        top.plot(days, values, color="0.5", lw=0.8)
        top.scatter(days, values, c=regimes, cmap="coolwarm", s=6, label="true regime (colour)")
        top.set_ylabel("value")
        top.legend(loc="upper left")
        bottom.plot(days, high, color="C3", label="P(high regime | data)")
        bottom.plot(days, regimes, color="k", lw=0.6, ls="--", label="true regime")
        bottom.set_ylabel("probability")
        bottom.set_xlabel("day")
        bottom.legend(loc="upper left")
        fig.tight_layout()
        fig.savefig(args.out / "hidden_markov.png", dpi=70)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
