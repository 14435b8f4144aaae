"""Ordinal regression: answers on a 5-point scale (simulated, so the truth is known), a
cumulative-logit model whose cut points get their prior through the probabilities of the
answers, the truth against the 90% intervals, the treatment's effect on the probability
of agreeing, and a check of the answers' shares against replicated data. NUTS with 4
chains in one process (it warns if Stan's checks of the run find a problem). About 17 s on
2 cores.

The data are 300 answers (1 = strongly disagree ... 5 = strongly agree) of people of
different ages (standardised), half of them treated. An answer is the bin of a latent
``x @ beta + noise`` (standard logistic noise) between four cut points, which is Pyro's
``OrderedLogistic(x @ beta, cutpoints)``.

**The cut points' prior.** A prior on the cut points themselves is hard to choose: they
live on the logit scale, and must stay ordered. Two common choices misbehave. An
improper flat prior (``ImproperUniform(constraints.ordered_vector, ...)``) cannot be drawn
from: no prior predictive check, and Pyro's own kernels, which draw from the prior to set
up, stop on it (``NotImplementedError``; ours start such a site at random values). A normal
prior on the ordered transform's unconstrained increments, ``TransformedDistribution(
Normal(0, 5).expand([4]).to_event(1), OrderedTransform())``, is wide in a way nobody meant:
an increment ``exp(x)`` with ``x ~ Normal(0, 5)`` spans 9 orders of magnitude in 95% of the
prior's draws, so in float32 neighbouring cut points drawn from the prior can round to the
same value, and Pyro's set-up fails with "Expected parameter cutpoints ... to satisfy the
constraint OrderedVector()" (for 1 seed of 100 in a trial). Here the prior is put on what
the cut points mean, the probabilities of the five answers of a person whose linear
predictor is 0: a flat Dirichlet on those probabilities, mapped to cut points
``c_k = logit(p_1 + ... + p_k)``
(Betancourt's "induced Dirichlet" prior, from his case study "Ordinal Regression", 2019).
Its density is the Dirichlet's at ``p`` times the Jacobian of the map,
``prod_k sigmoid(c_k) (1 - sigmoid(c_k))``: :class:`InducedDirichlet`, a Pyro distribution
that can be sampled, so the usual set-up works.

    python examples/ordinal_regression.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.distributions import constraints
from pyro.infer import Predictive

from pyro_hmc_plus import MCMC, NUTS

NUM_ANSWERS = 5
TRUTH = {"beta": (0.6, 1.0), "cutpoints": (-2.0, -0.7, 0.5, 1.8)}  # (age, treated); on the logit scale
AGREE = 4  # "agree" and "strongly agree" are answers 4 and 5


class InducedDirichlet(dist.TorchDistribution):
    """Ordered cut points ``c``, shape ``(K - 1,)``, of an ordinal logistic model whose
    answer probabilities at a linear predictor of 0, ``p_k = sigmoid(c_k) - sigmoid(c_{k-1})``
    (``K`` of them), are ``Dirichlet(concentration)``. Density: the Dirichlet's at ``p``
    times the Jacobian ``prod_k sigmoid(c_k) (1 - sigmoid(c_k))`` of ``c -> p``."""

    arg_constraints = {"concentration": constraints.independent(constraints.positive, 1)}
    support = constraints.ordered_vector

    def __init__(self, concentration: torch.Tensor, validate_args=None):
        self.concentration = concentration
        batch_shape, (k,) = concentration.shape[:-1], concentration.shape[-1:]
        super().__init__(batch_shape, torch.Size([k - 1]), validate_args=validate_args)

    def sample(self, sample_shape=torch.Size()):
        p = dist.Dirichlet(self.concentration).sample(sample_shape)
        return torch.logit(p.cumsum(-1)[..., :-1], eps=1e-6)

    def log_prob(self, cutpoints):
        below = torch.sigmoid(cutpoints)  # P(answer <= k) at a linear predictor of 0
        p = torch.cat([below[..., :1], below[..., 1:] - below[..., :-1], 1 - below[..., -1:]], -1)
        jacobian = (F.logsigmoid(cutpoints) + F.logsigmoid(-cutpoints)).sum(-1)
        return dist.Dirichlet(self.concentration, validate_args=False).log_prob(p) + jacobian


def simulate(n: int = 300):
    """``(x, y)``: inputs ``(n, 2)`` (standardised age, treated 0/1) and answers ``(n,)``,
    0-based (answer ``k + 1`` is ``y = k``); the same every time (a fixed seed)."""
    pyro.set_rng_seed(0)
    x = torch.stack([torch.randn(n), (torch.arange(n) % 2).float()], -1)
    latent = x @ torch.tensor(TRUTH["beta"]) + dist.Logistic(0.0, 1.0).sample((n,))
    return x, torch.bucketize(latent, torch.tensor(TRUTH["cutpoints"]))


def ordinal(x, y=None):
    beta = pyro.sample("beta", dist.Normal(0.0, 2.0).expand([x.shape[-1]]).to_event(1))
    cutpoints = pyro.sample("cutpoints", InducedDirichlet(torch.ones(NUM_ANSWERS)))
    with pyro.plate("data", len(x)):
        return pyro.sample("y", dist.OrderedLogistic(x @ beta, cutpoints), obs=y)


def answer_shares(y: torch.Tensor) -> torch.Tensor:
    """The share of each answer over the last dimension: ``(..., n) -> (..., NUM_ANSWERS)``."""
    return F.one_hot(y.long(), NUM_ANSWERS).float().mean(-2)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=500)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    x, y = simulate()
    pyro.set_rng_seed(1)
    mcmc = MCMC(NUTS(ordinal), num_samples=args.num_samples, warmup_steps=args.num_samples, num_chains=4)
    mcmc.run(x, y)
    draws = mcmc.get_samples()
    idata = mcmc.to_inference_data()
    print(az.summary(idata, var_names=["beta", "cutpoints"], hdi_prob=0.9)[
        ["mean", "sd", "hdi_5%", "hdi_95%", "ess_bulk", "r_hat"]].to_string())

    truth = torch.tensor(TRUTH["beta"] + TRUTH["cutpoints"])
    sampled = torch.cat([draws["beta"], draws["cutpoints"]], -1)
    low, high = sampled.quantile(0.05, 0), sampled.quantile(0.95, 0)
    inside = int(((low <= truth) & (truth <= high)).sum())
    print(f"\n{inside} of {len(truth)} true coefficients and cut points inside the 90% intervals")

    # the treatment's effect where it matters to a reader: the probability of agreeing
    # (answer 4 or 5) at the average age, treated against untreated
    treated, untreated = (dist.OrderedLogistic(draws["beta"][:, 1] * t, draws["cutpoints"]).probs[:, AGREE - 1:].sum(-1)
                          for t in (1.0, 0.0))
    effect = treated - untreated
    print(f"P(agree) at the average age: untreated {untreated.mean():.2f}, treated {treated.mean():.2f}; "
          f"difference {effect.mean():.2f} (90% interval {effect.quantile(0.05):.2f} to {effect.quantile(0.95):.2f})")

    # replicated answers, one data set per draw, against the observed shares in each group
    replicated = Predictive(ordinal, draws, return_sites=["y"])(x)["y"]
    print("\nshare of each answer, observed and replicated (mean and 90% of data sets):")
    groups = {"untreated": x[:, 1] == 0, "treated": x[:, 1] == 1}
    outside = 0
    for name, rows in groups.items():
        observed, shares = answer_shares(y[rows]), answer_shares(replicated[:, rows])
        low, high = shares.quantile(0.05, 0), shares.quantile(0.95, 0)
        outside += int(((observed < low) | (observed > high)).sum())
        print(f"  {name:9s} " + "  ".join(f"{k + 1}: {o:.2f} ({m:.2f}, {lo:.2f}-{hi:.2f})" for k, (o, m, lo, hi) in
                                        enumerate(zip(observed, shares.mean(0), low, high))))
    print(f"observed shares outside the replicated 90% ranges: {outside} of {2 * NUM_ANSWERS}")

    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5), sharey=True)
        answers = torch.arange(1, NUM_ANSWERS + 1)
        for ax, (name, rows) in zip(axes, groups.items()):
            shares = answer_shares(replicated[:, rows])
            ax.bar(answers, answer_shares(y[rows]), color="lightgray", label="observed")
            ax.errorbar(answers, shares.mean(0), yerr=[shares.mean(0) - shares.quantile(0.05, 0),
                                                       shares.quantile(0.95, 0) - shares.mean(0)],
                        fmt="o", color="C0", label="replicated (90%)")
            ax.set_title(name)
            ax.set_xlabel("answer")
        axes[0].set_ylabel("share")
        axes[0].legend()
        fig.tight_layout()
        plt.savefig(args.out / "ordinal_regression_ppc.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
