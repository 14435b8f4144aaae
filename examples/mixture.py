"""A Gaussian mixture with its discrete assignments summed out: three clusters in 300 points
(simulated, so the truth is known). Each point's cluster is a discrete latent site marked for
enumeration; Pyro's potential sums it out exactly, so NUTS samples only the continuous
parameters (weights, locations, scale) and the model needs no change for it. NUTS with 4
chains in one process, twice: with the locations unordered, then ordered. About 40 s on 2
cores.

A mixture's likelihood does not change when its clusters swap labels, so the posterior of
unordered locations has one mode per labelling (3! = 6 here), and chains started apart
settle in different ones: R-hat far above 1 and pooled means that mix the clusters, though
every chain on its own is fine. Ordering the locations (location 1 < location 2 < location
3) leaves one labelling, and the chains agree.

The ordered prior is Stan's ``ordered[K] locs; locs ~ normal(0, 5)``: the Normal(0, 5)
density of each location, on ordered vectors only (``ImproperUniform`` over
``constraints.ordered_vector``, its density added with ``pyro.factor``). It cannot be
sampled: Pyro's own kernels stop on it (they draw from the prior to set up), unless given
a starting value for the locations and the model's plate nesting (``init_to_value``,
``max_plate_nesting``); ours start it as they start every site, at random values in (-2, 2)
of its unconstrained space, chain by chain, as NumPyro does. Pushing the Normal prior through
``OrderedTransform`` instead (a ``TransformedDistribution``) is another prior: the gaps
between locations are exponentials of Normal(0, 5) draws, tails so heavy that a component
left with few points wanders off. With that prior, in two of five seeds of this script one
chain of four did so (a location in the thousands, 100 divergences; R-hat and the run's
warning said so); with this one, all four chains of all five seeds (0-4, 1000 + 1000
draws) found the clusters.

    python examples/mixture.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro
import pyro.distributions as dist
import torch
from pyro.distributions import constraints

from pyro_hmc_plus import MCMC, NUTS

NUM_POINTS = 300
TRUTH = {"weights": (0.5, 0.3, 0.2), "locs": (-4.0, 0.0, 4.0), "scale": 1.0}
K = len(TRUTH["weights"])


def model(x, ordered=True):
    """``x``: ``(N,)`` points. Latent: ``weights`` ``(K,)`` on the simplex, ``locs`` ``(K,)``
    (increasing where ``ordered``), ``scale``, and each point's ``assignment``, enumerated
    (summed out of the potential), so NUTS never samples it."""
    weights = pyro.sample("weights", dist.Dirichlet(torch.ones(K)))
    if ordered:
        locs = pyro.sample("locs", dist.ImproperUniform(constraints.ordered_vector, (), (K,)))
        pyro.factor("locs_prior", dist.Normal(0.0, 5.0).log_prob(locs).sum(-1))
    else:
        locs = pyro.sample("locs", dist.Normal(0.0, 5.0).expand([K]).to_event(1))
    scale = pyro.sample("scale", dist.HalfNormal(2.0))
    with pyro.plate("points", x.shape[0]):
        assignment = pyro.sample("assignment", dist.Categorical(weights), infer={"enumerate": "parallel"})
        pyro.sample("x", dist.Normal(locs[..., assignment], scale), obs=x)


def simulate(seed: int = 0):
    """``(NUM_POINTS,)`` points drawn from the mixture at ``TRUTH`` (without moving the
    caller's random stream)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        assignment = dist.Categorical(torch.tensor(TRUTH["weights"])).sample((NUM_POINTS,))
        return torch.tensor(TRUTH["locs"])[assignment] + TRUTH["scale"] * torch.randn(NUM_POINTS)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    x = simulate()
    coords, dims = {"cluster": list(range(K))}, {"weights": ["cluster"], "locs": ["cluster"]}
    runs = {}
    for ordered in (False, True):
        name = "ordered" if ordered else "unordered"
        pyro.set_rng_seed(1)
        # unordered: the chains disagree by design here, so the run's own warning is left out
        mcmc = MCMC(NUTS(model), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4,
                    warn_on_problems=ordered)
        mcmc.run(x, ordered)
        # its log likelihood: each point's, with its assignment summed out (for az.loo)
        runs[name] = idata = mcmc.to_inference_data(coords=coords, dims=dims)
        table = az.summary(idata, var_names=["weights", "locs", "scale"])[["mean", "sd", "ess_bulk", "r_hat"]]
        if ordered:
            table["true"] = [*TRUTH["weights"], *TRUTH["locs"], TRUTH["scale"]]
        per_chain = idata.posterior["locs"].mean("draw").values  # (chains, K)
        print(f"\n{name} locations:")
        print(table.round(3).to_string())
        print("each chain's mean locations:", "; ".join(", ".join(f"{v:.1f}" for v in c) for c in per_chain))
    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        for name, idata in runs.items():
            az.plot_trace(idata, var_names=["locs"], compact=False)  # a row per location, a colour per chain
            fig = plt.gcf()
            fig.suptitle(f"{name} locations")
            fig.tight_layout()
            fig.savefig(args.out / f"mixture_{name}_trace.png", dpi=70)
            plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
