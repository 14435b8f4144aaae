"""Item response theory: a two-parameter logistic (2PL) model of 300 students answering
20 test questions (simulated, so the truth is known), with crossed effects of students and
questions; why the discriminations need a positive prior, shown by what the checks of a
run say without one; the truth against the 90% intervals; how precisely 20 questions
measure a student's ability; each question's share of correct answers, and the spread of
the students' scores, against replicated tests. NUTS with 4 chains in one process (it warns
if Stan's checks of the run find a problem). About 45 s on 2 cores.

Student ``j`` answers question ``k`` correctly with probability
``sigmoid(a_k (theta_j - b_k))``: ``theta_j`` is the student's ability, ``b_k`` the
question's difficulty (the ability at which half the students answer it correctly), and
``a_k`` its discrimination (how sharply that probability rises with ability). The
abilities live in a ``pyro.plate`` over students (``dim=-2``), the questions' parameters in
one over questions, and the answers, a ``(students, questions)`` table, in both.

**Identification.** The answers see the parameters only through ``a_k (theta_j - b_k)``,
which three changes leave as they are: shifting every ``theta`` and ``b`` by the same
amount, scaling them by ``s`` while dividing every ``a`` by ``s``, and flipping every sign
(``theta, b -> -theta, -b`` with ``a -> -a``). The abilities' prior, ``Normal(0, 1)``, pins
the first two: ability is measured in the population's standard deviations from its mean.
The third needs the discriminations' sign: a prior symmetric around 0 leaves two
mirror-image posteriors, one where better students answer better and one where they answer
worse, equally probable, and each chain settles in one of them. The script first runs that
prior (a normal one) briefly, to show what R-hat and the run's check say when chains
disagree on the sign (expect its ``SamplingWarning``); the model proper gives the
discriminations a log-normal prior: positive, as a question's discrimination is meant.

    python examples/item_response.py [--num-samples N] [--out DIR] [--no-plots]
"""

import argparse
import pathlib

import arviz as az
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import Predictive

from pyro_hmc_plus import MCMC, NUTS

NUM_STUDENTS, NUM_QUESTIONS = 300, 20
TRUTH = {"mean_difficulty": 0.0, "sd_difficulty": 1.0, "sd_log_discrimination": 0.4}


def simulate():
    """``(answers, truth)``: answers ``(NUM_STUDENTS, NUM_QUESTIONS)``, 1.0 where correct, and
    the true abilities ``(NUM_STUDENTS,)``, difficulties and discriminations
    ``(NUM_QUESTIONS,)``; the same every time (a fixed seed)."""
    pyro.set_rng_seed(0)
    ability = torch.randn(NUM_STUDENTS)
    difficulty = TRUTH["mean_difficulty"] + TRUTH["sd_difficulty"] * torch.randn(NUM_QUESTIONS)
    discrimination = (TRUTH["sd_log_discrimination"] * torch.randn(NUM_QUESTIONS)).exp()
    logits = discrimination * (ability[:, None] - difficulty)
    truth = {"ability": ability, "difficulty": difficulty, "discrimination": discrimination}
    return dist.Bernoulli(logits=logits).sample(), truth


def two_parameter_logistic(answers, signed=False):
    """The 2PL model of ``answers (students, questions)``; ``signed``: the discriminations get
    a normal prior (their sign unidentified) instead of a log-normal one."""
    num_students, num_questions = answers.shape
    questions = pyro.plate("questions", num_questions, dim=-1)
    students = pyro.plate("students", num_students, dim=-2)
    mean_difficulty = pyro.sample("mean_difficulty", dist.Normal(0.0, 2.0))
    sd_difficulty = pyro.sample("sd_difficulty", dist.HalfNormal(2.0))
    if not signed:
        sd_log_discrimination = pyro.sample("sd_log_discrimination", dist.HalfNormal(1.0))
    with questions:
        difficulty = pyro.sample("difficulty", dist.Normal(mean_difficulty, sd_difficulty))
        prior = dist.Normal(0.0, 2.0) if signed else dist.LogNormal(0.0, sd_log_discrimination)
        discrimination = pyro.sample("discrimination", prior)
    with students:
        ability = pyro.sample("ability", dist.Normal(0.0, 1.0))  # (students, 1)
    with students, questions:
        return pyro.sample("answers", dist.Bernoulli(logits=discrimination * (ability - difficulty)), obs=answers)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-samples", type=int, default=1000)
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("figures"))
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()
    answers, truth = simulate()
    n = args.num_samples

    # the signed prior: a short run is enough to see the chains disagree
    pyro.set_rng_seed(1)
    signed = MCMC(NUTS(two_parameter_logistic), num_samples=50, warmup_steps=50, num_chains=4, disable_progbar=True)
    signed.run(answers, signed=True)
    mirrored = [c for c, a in enumerate(signed.get_samples(group_by_chain=True)["discrimination"]) if a.mean() < 0]
    rhat = az.rhat(signed.to_inference_data(), var_names=["ability"])["ability"]
    print(f"signed prior: discriminations negative (better students answer worse) in chains {mirrored}, positive "
          f"in the others; R-hat of the abilities up to {float(rhat.max()):.2f}\n")

    pyro.set_rng_seed(1)
    mcmc = MCMC(NUTS(two_parameter_logistic), num_samples=n, warmup_steps=n, num_chains=4)
    mcmc.run(answers)
    draws = mcmc.get_samples()
    idata = mcmc.to_inference_data()
    print(az.summary(idata, var_names=["mean_difficulty", "sd_difficulty", "sd_log_discrimination"], hdi_prob=0.9)[
        ["mean", "sd", "hdi_5%", "hdi_95%", "ess_bulk", "r_hat"]].to_string())
    print(f"(the simulated questions: difficulties with sd {truth['difficulty'].std():.2f}, log discriminations "
          f"with sd {truth['discrimination'].log().std():.2f})")

    def inside(name, true):
        sampled = draws[name].reshape(len(draws[name]), -1)
        low, high = sampled.quantile(0.05, 0), sampled.quantile(0.95, 0)
        return int(((low <= true) & (true <= high)).sum())

    for name in ("difficulty", "discrimination"):
        print(f"{inside(name, truth[name])} of {NUM_QUESTIONS} true {name} values inside the 90% intervals")
    ability = draws["ability"][..., 0]  # (draws, students)
    print(f"{inside('ability', truth['ability'])} of {NUM_STUDENTS} true abilities inside the 90% intervals")
    sd, level = ability.std(0), truth["ability"].abs()
    print(f"posterior sd of an ability: {sd[level < 1].mean():.2f} for students within 1 sd of the average, "
          f"{sd[level > 2].mean():.2f} for those beyond 2 sd")

    # replicated tests, one per draw (uncondition: Predictive would return the observed answers)
    replicated = Predictive(pyro.poutine.uncondition(two_parameter_logistic), draws,
                            return_sites=["answers"])(answers)["answers"]
    shares = replicated.mean(-2)  # (draws, questions)
    low, high = shares.quantile(0.05, 0), shares.quantile(0.95, 0)
    observed = answers.mean(0)
    outside = int(((observed < low) | (observed > high)).sum())
    print(f"questions whose share of correct answers is outside the replicated 90% range: {outside} of {NUM_QUESTIONS}")
    # the spread of the students' scores tests what the shares cannot: that one ability per
    # student ties their answers together (independent answers would give a narrower spread)
    spread = replicated.sum(-1).std(-1)
    print(f"spread of the students' scores (sd of the number of correct answers): observed "
          f"{answers.sum(-1).std():.2f}, replicated {spread.mean():.2f} "
          f"(90% of tests {spread.quantile(0.05):.2f}-{spread.quantile(0.95):.2f})")

    if not args.no_plots:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        args.out.mkdir(parents=True, exist_ok=True)
        fig, (curves, abilities) = plt.subplots(1, 2, figsize=(10, 4))
        grid = torch.linspace(-3, 3, 121)
        for k in range(NUM_QUESTIONS):  # each question's probability of a correct answer, posterior mean
            p = torch.sigmoid(draws["discrimination"][:, k, None] * (grid - draws["difficulty"][:, k, None]))
            curves.plot(grid, p.mean(0), color="C0", alpha=0.5)
        curves.set_xlabel("ability")
        curves.set_ylabel("P(correct)")
        curves.set_title("the questions (posterior means)")
        low, high = ability.quantile(0.05, 0), ability.quantile(0.95, 0)
        abilities.errorbar(truth["ability"], ability.mean(0), yerr=[ability.mean(0) - low, high - ability.mean(0)],
                           fmt="o", markersize=2, alpha=0.4)
        abilities.plot([-3, 3], [-3, 3], color="k", lw=1)
        abilities.set_xlabel("true ability")
        abilities.set_ylabel("posterior mean and 90% interval")
        abilities.set_title("the students")
        fig.tight_layout()
        plt.savefig(args.out / "item_response.png", dpi=80)
        plt.close("all")
        print(f"figures in {args.out}/")


if __name__ == "__main__":
    main()
