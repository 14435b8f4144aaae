"""Tests of many chains in one process: the round-by-round NUTS state machine
(pyro_hmc_plus.rounds) against Stan's recursion, and pyro_hmc_plus.MCMC's vectorized runs
against exact posteriors and against sequential chains (MCSE tolerances, fixed seeds)."""

import functools
import inspect
import re
import sys
import time
import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

from pyro_hmc_plus import HMC, MCMC, NUTS, EngineFallbackWarning, SamplingWarning, chain_batch, rounds, to_inference_data
from pyro_hmc_plus.hmc import HMCState, hmc_step
from pyro_hmc_plus.integrator import leapfrog
from pyro_hmc_plus.metric import make_metric

from helpers import Z, assert_mean, assert_variance, mcse_mean
from models import (
    EIGHT_SCHOOLS_SIGMA,
    EIGHT_SCHOOLS_Y,
    PRECISION,
    dirichlet_categorical,
    eight_schools,
    failing_potential,
    gauss2d,
    normal_normal,
    normal_normal_posterior,
)
from test_nuts import PREC, stan_tree

COV2 = torch.linalg.inv(PRECISION)


def run(kernel, *args, num_chains=4, num_samples=500, warmup_steps=300, **kw):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, num_chains=num_chains,
                disable_progbar=True, **kw)
    mcmc.run(*args)
    return mcmc


# ---------------------------------------------------------------------------- the state machine

def _gaussian_batch(C: int):
    """C chains on a correlated 3-D Gaussian (``test_nuts.PREC``), float64: its batched
    ``value_and_grad``, a diagonal inverse mass ``(3,)`` and its metric for the batch, start
    points and momentum noise ``(C, 3)``."""

    def value_and_grad(z):
        return 0.5 * ((z @ PREC) * z).sum(-1), z @ PREC

    inv_mass = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    metric = make_metric(inv_mass.expand(C, 3).clone(), dense=False)
    z = torch.randn(C, 3, dtype=torch.float64)
    noise = torch.randn(C, 3, dtype=torch.float64)
    return value_and_grad, inv_mass, metric, z, noise


def _one_draw_each(step_size: torch.Tensor) -> chain_batch.Schedule:
    """Every chain pauses after its first draw; step sizes are not adapted."""
    like, C = torch.ones_like(step_size), len(step_size)
    return chain_batch.Schedule(torch.ones(C, dtype=torch.int64), torch.zeros(C, dtype=torch.int64), 0.8 * like,
                                1e-10 * like, 1e10 * like)



def _first_draws(advance, chains):
    """Rounds of ``advance(chains) -> (chains, draw, done, steps)`` until every chain has made
    its first draw (a schedule of :func:`_one_draw_each`): each chain's draw row, and the
    leapfrog steps its rounds reported, summed ``(C,)``."""
    C = len(chains.draws)
    first_draw, steps_used = {}, torch.zeros(C, dtype=torch.int64)
    while len(first_draw) < C:
        chains, draw, done, steps = advance(chains)
        assert (chains.draws <= 1).all()  # paused after one draw
        steps_used += steps
        for c in done.nonzero().flatten().tolist():
            first_draw[c] = draw[c]
    return first_draw, steps_used

@pytest.mark.parametrize("kinds", ["chosen", "mixed"])
@pytest.mark.parametrize("step_size", [0.05, 0.3, 1.2, 3.0])
def test_round_transitions_match_stan_recursion(step_size, kinds):
    """64 chains advanced round by round (a transition's first three doublings fused, then
    chunks of 8 leaves, whose blocks of 2, 4 and 8 chunks need the checkpointed U-turn
    checks at depth 7): every chain's first transition has the tree depth, leapfrog count and
    divergence of Stan's recursive algorithm from the same point, momentum and directions
    (fed through the uniforms each round reads: the fused start's, the fourth doubling's, and
    the next subtree's), and the steps the rounds report add up to the transitions'. Rounds
    of the kind that serves every chain (``chosen``: here mostly chunks only, once the chains
    whose trees stop early have paused) or all of both kinds (``mixed``)."""
    torch.manual_seed(1)
    C, D, K = 64, 3, 7
    value_and_grad, inv_mass, metric, z, noise = _gaussian_batch(C)
    flags = torch.rand(C, K) < 0.5
    direction = torch.where(flags, 0.25, 0.75).to(torch.float64)  # a uniform below 0.5 is forward
    eps = torch.full((C,), step_size, dtype=torch.float64)
    chains = rounds.nuts_init(HMCState(z, *value_and_grad(z)), metric, chain_batch.StepSize.start(eps), K)
    schedule = _one_draw_each(eps)
    def advance(chains):
        u = torch.rand(C, rounds.NUM_UNIFORMS, dtype=torch.float64)
        for j in range(rounds.FUSED_DOUBLINGS):
            u[:, rounds.FIRST_DOUBLINGS + 3 * j] = direction[:, j]
        u[:, rounds.ENTRY_DIRECTION] = direction[:, rounds.FUSED_DOUBLINGS]
        after = torch.where(chains.starting, rounds.FUSED_DOUBLINGS + 1, chains.tree.depth + 1).clamp(max=K - 1)
        u[:, rounds.NEXT_DIRECTION] = direction.gather(1, after.unsqueeze(1)).squeeze(1)
        kind = int(rounds.next_round_kind(chains, schedule)) if kinds == "chosen" else rounds.MIXED
        return rounds.nuts_round(value_and_grad, chains, noise, u, metric, schedule, K, kind=kind)

    first_draw, steps_used = _first_draws(advance, chains)
    col = {name: D + i for i, name in enumerate(chain_batch.STAT_COLUMNS)}
    for c in range(C):
        expected = stan_tree(z[c], noise[c] * inv_mass.rsqrt(), step_size, inv_mass, flags[c].tolist(), K)
        d = first_draw[c]
        assert (int(d[col["tree_depth"]]), int(d[col["n_steps"]]), bool(d[col["diverging"]])) == expected
        assert steps_used[c] == int(d[col["n_steps"]])


def test_hmc_round_transitions_match_one_chain_transitions():
    """Chains whose trajectories take 1 to 40 leapfrog steps, advanced by rounds of 8 steps:
    each chain's first transition is the single-chain transition (:func:`hmc.hmc_step`) with
    its number of steps from the same point, momentum and Metropolis uniform (its end taken
    from the step inside the round where the trajectory is complete), and the steps the
    rounds report add up to it."""
    torch.manual_seed(3)
    C, D = 40, 3
    value_and_grad, inv_mass, metric, z, noise = _gaussian_batch(C)
    uniforms = torch.rand(C, chain_batch.NUM_UNIFORMS, dtype=torch.float64)
    trajectory_length = 2.0
    eps = trajectory_length / (torch.arange(1, C + 1, dtype=torch.float64) + 0.5)  # 1 to C steps
    chains = chain_batch.hmc_init(HMCState(z, *value_and_grad(z)), metric, chain_batch.StepSize.start(eps))
    schedule = _one_draw_each(eps)
    first_draw, steps_used = _first_draws(
        lambda chains: chain_batch.hmc_round(value_and_grad, chains, noise, uniforms, metric, schedule,
                                             trajectory_length),
        chains)
    col = {name: D + i for i, name in enumerate(chain_batch.STAT_COLUMNS)}
    for c in range(C):
        L = c + 1
        state = HMCState(z[c], *value_and_grad(z[c]))
        integrate = functools.partial(leapfrog, value_and_grad, num_steps=L)
        moved, info = hmc_step(lambda s, e, m: integrate(s, e, m), state, noise[c], uniforms[c, 0].log(), eps[c],
                               make_metric(inv_mass, dense=False))
        d = first_draw[c]
        torch.testing.assert_close(d[:D], moved.z)
        assert d[col["acceptance_rate"]].item() == pytest.approx(info.acceptance_prob.item(), rel=1e-9, abs=1e-12)
        assert (int(d[col["n_steps"]]), int(steps_used[c])) == (L, L)


# ---------------------------------------------------------------------------- MCMC, vectorized

def badly_scaled():
    pyro.sample("x", dist.Normal(torch.zeros(6), torch.logspace(-1.5, 1.5, 6)).to_event(1))


def test_rounds_of_chunks_only_give_the_same_draws(monkeypatch):
    """Deep trees (a badly scaled Gaussian, whose metric adapts in windows while other chains
    are in the middle of trees): runs whose rounds without a starting chain are served by the
    chunks-only program, or all by rounds of both kinds, give the same draws from the same
    seed; the chunks-only program was built and used."""
    import pyro_hmc_plus.mcmc as mcmc_module

    def draws(threshold):
        monkeypatch.setattr(mcmc_module, "CHUNK_ROUNDS_BEFORE_PROGRAM", threshold)
        pyro.set_rng_seed(5)
        kernel = NUTS(badly_scaled)
        mcmc = run(kernel, num_chains=3, num_samples=30, warmup_steps=80)
        built = {key[3] for key in kernel._programs if key[0] == "chains"}
        return mcmc.get_samples(group_by_chain=True)["x"], mcmc.batch_utilisation, built

    x_chunks, util_chunks, built = draws(0)
    x_mixed, util_mixed, built_mixed = draws(10**9)
    assert rounds.CHUNKS in built and rounds.CHUNKS not in built_mixed
    torch.testing.assert_close(x_chunks, x_mixed, rtol=0, atol=0)
    assert util_chunks == util_mixed


def test_vectorized_nuts_matches_sequential_chains_and_exact_posterior():
    pyro.set_rng_seed(0)
    vectorized = run(NUTS(gauss2d), chain_method="vectorized")
    pyro.set_rng_seed(0)
    sequential = run(NUTS(gauss2d), chain_method="sequential")
    a = vectorized.get_samples()["q"].double().numpy()
    b = sequential.get_samples()["q"].double().numpy()
    assert a.shape == b.shape == (2000, 2)
    for draws in (a, b):
        assert_mean(draws, [0.0, 0.0])
        assert_variance(draws, COV2.diagonal().tolist())
    bound = Z * np.sqrt(mcse_mean(a) ** 2 + mcse_mean(b) ** 2)
    assert (np.abs(a.mean(0) - b.mean(0)) <= bound).all()
    # idle: a starting chain's 8th step in a round with chunks, a fused start's steps after
    # its tree stopped (most of this posterior's trees stop at depth 2 or 3)
    assert 0.6 < vectorized.batch_utilisation <= 1.0


def test_chains_are_independent_and_mix():
    x = torch.randn(20) + 3.0
    pyro.set_rng_seed(1)
    mcmc = run(NUTS(normal_normal), x)
    mu = mcmc.get_samples(group_by_chain=True)["mu"]
    assert mu.shape == (4, 500)
    for i in range(4):
        for j in range(i):
            assert not torch.allclose(mu[i], mu[j])
    corr = np.corrcoef(mu.double().numpy())[np.triu_indices(4, 1)]
    assert np.abs(corr).max() < 0.2  # 500 draws: |r| of independent chains is ~0.05
    assert float(az.rhat(mu.double().numpy())) < 1.02
    mean, var = normal_normal_posterior(x)
    assert_mean(mu.reshape(-1, 1).double().numpy(), mean)
    assert_variance(mu.reshape(-1, 1).double().numpy(), var)


def bimodal_potential(params):
    """Two far-apart modes of very different widths (sd 0.1 at -20, sd 10 at +60): a chain
    never crosses, so each adapts to the scale of the mode it starts in."""
    x = params["x"]
    narrow = dist.Normal(-20.0, 0.1).log_prob(x)
    wide = dist.Normal(60.0, 10.0).log_prob(x)
    return -torch.logaddexp(narrow, wide).sum()


def test_each_chain_adapts_its_own_step_size_and_metric():
    initial = {"x": torch.tensor([[-20.0], [60.0]])}
    pyro.set_rng_seed(0)
    mcmc = run(NUTS(potential_fn=bimodal_potential), num_chains=2, initial_params=initial)
    inv_mass = mcmc.inverse_mass_matrix[:, 0]
    assert 0.005 < inv_mass[0] < 0.02 and 50 < inv_mass[1] < 200  # the modes' variances, 0.01 and 100
    x = mcmc.get_samples(group_by_chain=True)["x"][..., 0]
    assert (x[0] < 0).all() and (x[1] > 0).all()
    pyro.set_rng_seed(0)
    fixed = run(NUTS(potential_fn=bimodal_potential, adapt_mass_matrix=False), num_chains=2, initial_params=initial)
    assert 20 < fixed.step_size[1] / fixed.step_size[0] < 500  # ~100, the ratio of the widths
    stats = fixed.kernel.sample_stats[-2:]
    assert stats[0]["step_size"][-1] == pytest.approx(float(fixed.step_size[0]))


def test_vectorized_hmc_fixed_step_size_takes_the_kernels_number_of_steps():
    """Without step-size adaptation every trajectory has the kernel's ``num_steps``: at most
    ``max_unroll``, a round is one whole trajectory (here with the metric adapted, so chains
    pause at the ends of its windows), and the chains sample the exact posterior; beyond it,
    trajectories run in rounds and keep ``num_steps`` also where the float32 step size would
    make ``trajectory_length / step_size`` round down to 52."""
    pyro.set_rng_seed(0)
    kernel = HMC(gauss2d, step_size=0.25, num_steps=10, adapt_step_size=False)
    q = run(kernel).get_samples()["q"].double().numpy()
    assert {n for stats in kernel.sample_stats[-4:] for n in stats["n_steps"]} == {10}
    assert_mean(q, [0.0, 0.0])
    assert_variance(q, COV2.diagonal().tolist())
    kernel = HMC(gauss2d, step_size=0.01, num_steps=53, adapt_step_size=False)
    assert int(0.01 * 53 / torch.tensor(0.01)) == 52  # trajectory_length / a float32 step size
    run(kernel, num_chains=2, num_samples=5, warmup_steps=5)
    assert {n for stats in kernel.sample_stats[-2:] for n in stats["n_steps"]} == {53}


@pytest.mark.parametrize("kernel_class", [NUTS, HMC])
def test_vectorized_dense_metric_per_chain(kernel_class):
    """``full_mass=True``: each chain's inverse mass is a dense estimate of the posterior
    covariance (correlation 0.95) from its own warmup draws, used batched as ``(C, D, D)``,
    and the chains sample the exact posterior with it."""
    pyro.set_rng_seed(4)
    if kernel_class is NUTS:
        kernel = NUTS(gauss2d, full_mass=True)
    else:
        kernel = HMC(gauss2d, step_size=0.25, num_steps=10, full_mass=True)
    mcmc = run(kernel)
    inv = mcmc.inverse_mass_matrix
    assert inv.shape == (4, 2, 2)
    corr = inv[:, 0, 1] / (inv[:, 0, 0] * inv[:, 1, 1]).sqrt()
    assert (corr > 0.85).all(), corr
    assert not torch.equal(inv[0], inv[1])  # each chain's own
    q = mcmc.get_samples()["q"].double().numpy()
    assert_mean(q, [0.0, 0.0])
    assert_variance(q, COV2.diagonal().tolist())


@pytest.mark.parametrize("max_unroll", [16, 3])
def test_vectorized_hmc_exact_posterior_and_per_chain_steps(max_unroll):
    """Rounds of 8 steps, or of ``max_unroll`` steps where that is fewer."""
    pyro.set_rng_seed(2)
    kernel = HMC(gauss2d, step_size=0.25, num_steps=10, max_unroll=max_unroll)
    mcmc = run(kernel)
    q = mcmc.get_samples()["q"].double().numpy()
    assert_mean(q, [0.0, 0.0])
    assert_variance(q, COV2.diagonal().tolist())
    for chain, stats in enumerate(kernel.sample_stats[-4:]):  # steps follow each chain's step size
        eps = stats["step_size"][-1]
        assert stats["n_steps"][-1] == max(1, int(2.5 / eps))
        assert eps == pytest.approx(float(mcmc.step_size[chain]))


def test_plate_model_statistics_diagnostics_and_arviz():
    pyro.set_rng_seed(3)
    kernel = NUTS(eight_schools)
    mcmc = run(kernel, EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA, num_samples=200, warmup_steps=200)
    samples = mcmc.get_samples(group_by_chain=True)
    assert samples["theta_raw"].shape == (4, 200, 8) and (samples["tau"] > 0).all()
    diagnostics = mcmc.diagnostics()
    assert set(diagnostics["divergences"]) == {f"chain {i}" for i in range(4)}
    stats = kernel.sample_stats[-4:]
    for chain, s in enumerate(stats):
        assert len(s["lp"]) == 400 and sum(s["warmup"]) == 200
        assert max(s["tree_depth"]) <= 10 and all(n >= 1 for n in s["n_steps"])
        divergent = [i - 200 for i, d in enumerate(s["diverging"]) if d and i >= 200]
        assert diagnostics["divergences"][f"chain {chain}"] == divergent
    idata = az.from_pyro(mcmc)
    assert idata.posterior["theta_raw"].shape == (4, 200, 8)
    az.summary(idata)
    mcmc.summary()


def test_vectorized_simplex_model_prints_no_torch_warnings(capfd):
    """The stick-breaking transform's gradient (``log_sigmoid_backward``) under ``vmap``
    made torch's CPU kernel resize its output with a C++ warning at every call: ~1,600 lines
    on stderr for 4 chains x 200 draws of a Dirichlet model. Nothing now; and the posterior
    is Dirichlet(1 + counts)."""
    counts = torch.tensor([3.0, 5.0, 2.0])
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(dirichlet_categorical), num_samples=100, warmup_steps=100, num_chains=4,
                disable_progbar=True, warn_on_problems=False)
    mcmc.run(counts)
    assert "resized" not in capfd.readouterr().err
    concentration = 1 + counts
    mean = concentration / concentration.sum()
    variance = mean * (1 - mean) / (concentration.sum() + 1)
    p = mcmc.get_samples(group_by_chain=True)["p"].numpy()
    for i in range(3):
        assert_mean(p[..., i].reshape(-1), mean[i].item())
        assert_variance(p[..., i].reshape(-1), variance[i].item())


def test_same_seed_same_draws():
    def draws(seed):
        pyro.set_rng_seed(seed)
        return run(NUTS(gauss2d), num_chains=3, num_samples=30, warmup_steps=30).get_samples()["q"]

    a, b, c = draws(5), draws(5), draws(6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_interrupt_keeps_the_draws_made_so_far():
    calls = []

    def hook(kernel, params, stage, i):
        calls.append(stage)
        if len(calls) == 4 * 150:
            raise KeyboardInterrupt

    pyro.set_rng_seed(0)
    with pytest.warns(RuntimeWarning, match="interrupted: draws per chain"):
        mcmc = run(NUTS(gauss2d), num_samples=200, warmup_steps=100, hook_fn=hook)
    q = mcmc.get_samples(group_by_chain=True)["q"]
    assert q.shape[0] == 4 and 0 < q.shape[1] < 200
    assert {s.split(" ")[0] for s in calls} == {"Warmup", "Sample"}
    assert len(mcmc.kernel.sample_stats[-1]["lp"]) >= 100


def test_interrupting_sequential_chains_keeps_the_chains_with_draws():
    """Sequential chains run through Pyro's loop, whose accumulator an interrupt lost (the
    run raised ``KeyboardInterrupt`` and every draw was gone). The finished chain and the
    interrupted one keep as many draws as the shorter has; the export works on them, and the
    next run has every chain again."""
    interrupt = {"at": ("Sample [1]", 30)}

    def hook(kernel, params, stage, i):
        if (stage, i) == interrupt["at"]:
            raise KeyboardInterrupt

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(gauss2d), num_samples=100, warmup_steps=50, num_chains=3, chain_method="sequential",
                hook_fn=hook, disable_progbar=True)
    with pytest.warns(RuntimeWarning, match=r"interrupted in chain 1 of 3: draws per chain \[150, 81\] .* "
                                            r"keeping the first 31 post-warmup draws of chains \[0, 1\]"):
        mcmc.run()
    assert mcmc.get_samples(group_by_chain=True)["q"].shape == (2, 31, 2)
    idata = mcmc.to_inference_data(save_warmup=True)
    assert idata.posterior["q"].shape == (2, 31, 2) and idata.sample_stats["lp"].shape == (2, 31)
    assert idata.warmup_posterior["q"].shape == (2, 50, 2)
    interrupt["at"] = None
    mcmc.run()
    assert mcmc.get_samples(group_by_chain=True)["q"].shape == (3, 100, 2)


def test_a_failing_check_after_the_run_keeps_the_draws(monkeypatch):
    """The checks after a run (Stan's diagnostics, which trace the model for ArviZ) once
    raised from ``run()`` after every draw was made (a prior that cannot be sampled). Any
    failure there is now a warning: ``run()`` returns and the draws are there."""
    import pyro_hmc_plus.mcmc

    def failing(*args, **kwargs):
        raise RuntimeError("no trace")

    monkeypatch.setattr(pyro_hmc_plus.mcmc, "diagnose", failing)
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(gauss2d), num_samples=20, warmup_steps=20, num_chains=2, disable_progbar=True)
    with pytest.warns(RuntimeWarning, match="checking its draws failed .RuntimeError: no trace"):
        mcmc.run()
    assert mcmc.get_samples(group_by_chain=True)["q"].shape == (2, 20, 2)


@pytest.mark.parametrize("engine", ["auto", "eager"])
@pytest.mark.parametrize("kernel_class", [NUTS, HMC])
def test_numerical_failure_in_one_chain_is_a_divergence(engine, kernel_class):
    """Batched (vmapped) traced programs return NaN where the Cholesky fails; the eager batch
    raises, and the call is redone chain by chain with NaN for the failing chain. Either way the
    other chains carry on and the failing leaf is a divergence (HMC: its step size adapted, so
    its chains run in rounds, whose steps after a trajectory's end may fail too). Vectorized
    explicitly: by default an eager gradient's chains run one after another."""
    pyro.set_rng_seed(0)
    if kernel_class is NUTS:
        kernel, warmup = NUTS(potential_fn=failing_potential, step_size=0.5, adapt_step_size=False, engine=engine), 0
    else:
        kernel, warmup = HMC(potential_fn=failing_potential, step_size=0.5, num_steps=6, engine=engine), 30
    mcmc = run(kernel, num_samples=100, warmup_steps=warmup, initial_params={"x": torch.zeros(4, 1)},
               chain_method="vectorized")
    x = mcmc.get_samples()["x"]
    assert (x.abs() < 2).all()
    assert sum(len(v) for v in mcmc.diagnostics()["divergences"].values()) > 0


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
def test_initial_params_per_chain_and_potential_fn(chain_method):
    """Each chain starts where ``initial_params`` says (a leading chain dimension; for one
    chain, as in Pyro, none): the chains stay in the modes they start in."""
    pyro.set_rng_seed(0)
    mcmc = run(HMC(potential_fn=bimodal_potential, num_steps=5), num_chains=2, num_samples=20, warmup_steps=20,
               initial_params={"x": torch.tensor([[-20.0], [60.0]])}, chain_method=chain_method)
    x = mcmc.get_samples(group_by_chain=True)["x"]
    assert (x[0] < 0).all() and (x[1] > 0).all()
    one = run(HMC(potential_fn=bimodal_potential, num_steps=5), num_chains=1, num_samples=20, warmup_steps=20,
              initial_params={"x": torch.tensor([60.0])}, chain_method=chain_method)
    assert (one.get_samples()["x"] > 0).all()


def test_each_chains_first_state_is_the_checked_start():
    """Setting up evaluates the potential and gradient at each chain's start once, in the
    check that the start is valid, with the engine's gradient (checked against Pyro's), and
    that is the chain's first state: what a separate evaluation would give, chain by chain,
    and Pyro's potential and gradient there up to float32 rounding."""
    kernel = NUTS(gauss2d)
    pyro.set_rng_seed(0)
    start = kernel._build_potential((), {}, None, num_chains=3)
    assert start.z.shape == (3, 2) and start.z[0].ne(start.z[1]).all()
    for z, U, g in zip(*start):
        U_engine, g_engine = kernel._engine.value_and_grad(z)
        assert torch.equal(U, U_engine) and torch.equal(g, g_engine)
        U_pyro, g_pyro = kernel._flat.value_and_grad(z)
        assert torch.allclose(U, U_pyro, rtol=1e-5) and torch.allclose(g, g_pyro, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chain_method", [None, "vectorized"])
def test_pyros_potential_runs_only_to_record_and_check_the_traced_gradient(monkeypatch, chain_method):
    """Pyro's potential (one run of the model each: ~0.3 s for a loop of 1,000 sample sites,
    ~0.6 s with its backward) runs once to record the gradient and once at each check
    point; every later potential and gradient is the traced one: the chains' first states,
    the programs' validation inputs and the finite differences that look for a cut gradient.
    (Each program's validation inputs used to take three of Pyro's gradients, or two per
    chain for the vectorized chains' rounds, each chain's first state one more, and the
    differences four potentials: a loop of 1,000 sites took 24.5 -> 20.1 s to its first draw
    for the gradients alone, 4 vectorized chains 34.1 -> 23.2 s for 50 + 50 draws.)"""
    from pyro_hmc_plus.potential import FlatPotential

    calls = []
    pyros = FlatPotential.potential
    monkeypatch.setattr(FlatPotential, "potential", lambda self, z: calls.append(z) or pyros(self, z))
    kernel = NUTS(gauss2d)
    pyro.set_rng_seed(0)
    if chain_method is None:
        pyro.infer.MCMC(kernel, num_samples=30, warmup_steps=30, disable_progbar=True).run()
    else:
        MCMC(kernel, num_samples=30, warmup_steps=30, num_chains=2, chain_method=chain_method,
             disable_progbar=True, warn_on_problems=False).run()
    assert kernel.engine_name == "trace"
    assert len(calls) == 1 + len(kernel._engine.check_points)


def test_as_many_parallel_chains_as_cpus_run_in_worker_processes(monkeypatch):
    """Pyro keeps a CPU for its main process, which takes every draw of every worker: 2
    chains on 2 CPUs ran one after another. Ours mostly waits for the workers' batches."""
    from pyro_hmc_plus.mcmc import _ParallelSampler, _SequentialSampler

    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 2)
    parallel = MCMC(NUTS(gauss2d), num_samples=10, num_chains=2, chain_method="parallel")
    assert isinstance(parallel.sampler, _ParallelSampler)
    with pytest.warns(UserWarning, match="num_chains=3 is more than available_cpu=2. Chains will be drawn sequentially"):
        sequential = MCMC(NUTS(gauss2d), num_samples=10, num_chains=3, chain_method="parallel")
    assert isinstance(sequential.sampler, _SequentialSampler)


def test_sequential_and_parallel_are_pyros():
    pyro.set_rng_seed(0)
    sequential = run(NUTS(gauss2d), num_chains=2, num_samples=50, warmup_steps=50, chain_method="sequential")
    assert sequential.get_samples(group_by_chain=True)["q"].shape == (2, 50, 2)
    assert sequential.batch_utilisation is None
    parallel = run(NUTS(gauss2d), num_chains=1, num_samples=50, warmup_steps=50, chain_method="parallel")
    assert parallel.get_samples()["q"].shape == (50, 2)


def _scales_and_a_positive_site():
    pyro.sample("x", dist.Normal(0.0, torch.tensor([0.1, 1.0, 10.0])).to_event(1))
    pyro.sample("s", dist.HalfNormal(1.0))


def test_parallel_chains_each_start_and_go_on_from_their_own_values(monkeypatch):
    """``chain_method="parallel"`` with worker processes (forced here: Pyro runs the chains
    one after another where there are fewer CPUs than chains). Pyro's workers share one
    kernel, copied into the processes when they all start: every chain started from the last
    chain's ``initial_params``. A model's transforms given for some sites only (the others
    get Pyro's) left the other sites' draws unconstrained (negative values of a positive
    site): this process took the user's transforms for all of them. And the chains' adapted
    step sizes and metrics come back, as from vectorized and sequential chains, for a run
    that goes on from them, each chain from its own."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    starts = {"x": torch.tensor([[-1.0, -5.0, -20.0], [1.0, 5.0, 20.0]]), "s": torch.tensor([-3.0, 0.5])}
    kernel = NUTS(_scales_and_a_positive_site, step_size=1e-3, adapt_step_size=False, max_tree_depth=1,
                  transforms={"x": torch.distributions.transforms.identity_transform})
    pyro.set_rng_seed(0)
    fixed = run(kernel, num_chains=2, num_samples=3, warmup_steps=0, chain_method="parallel",
                initial_params=starts, warn_on_problems=False)
    draws = fixed.get_samples(group_by_chain=True)
    torch.testing.assert_close(draws["x"][:, 0], starts["x"], atol=0.1, rtol=0)
    torch.testing.assert_close(draws["s"][:, 0], starts["s"].exp(), atol=0.01, rtol=0)

    pyro.set_rng_seed(0)
    first = run(NUTS(_scales_and_a_positive_site), num_chains=2, num_samples=10, warmup_steps=50,
                chain_method="parallel", warn_on_problems=False)
    assert first.step_size.shape == (2,) and first.step_size[0] != first.step_size[1]
    assert first.inverse_mass_matrix.shape == (2, 4)
    kernel = NUTS(_scales_and_a_positive_site, step_size=first.step_size, inverse_mass_matrix=first.inverse_mass_matrix,
                  adapt_step_size=False, adapt_mass_matrix=False)
    second = run(kernel, num_chains=2, num_samples=5, warmup_steps=0, chain_method="parallel", warn_on_problems=False)
    assert torch.equal(second.step_size, first.step_size)
    assert torch.equal(second.inverse_mass_matrix, first.inverse_mass_matrix)
    np.testing.assert_array_equal(to_inference_data(second).sample_stats["step_size"].values,
                                  first.step_size[:, None].expand(2, 5).numpy())
    assert "tensor" not in repr(second.diagnostics()["adaptation"])  # printed diagnostics show no matrix


def test_parallel_chains_repeat_a_seeded_run_and_draw_afresh_in_the_next(monkeypatch):
    """Worker processes (forced, as above) seeded from this process's random numbers: the
    same seed gives the same draws, and a second run of the same MCMC draws new ones (Pyro
    seeds chain c with ``torch.initial_seed() + c``: every run of a process repeated them)."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    mcmc = MCMC(NUTS(gauss2d), num_samples=20, warmup_steps=20, num_chains=2, chain_method="parallel",
                disable_progbar=True, warn_on_problems=False)
    draws = []
    for seed in (0, 0, None):
        if seed is not None:
            pyro.set_rng_seed(seed)
        mcmc.run()
        draws.append(mcmc.get_samples(group_by_chain=True)["q"])
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[1], draws[2]) and not torch.equal(draws[2][0], draws[2][1])


CTRL_C_SCRIPT = """
import json, os, signal, warnings
import torch, pyro, pyro.distributions as dist
from pyro_hmc_plus import MCMC, NUTS

torch.multiprocessing.cpu_count = lambda: 8  # worker processes although this machine may have 2 CPUs

def model():
    pyro.sample("q", dist.Normal(torch.tensor([0.0, 3.0]), torch.tensor([1.0, 0.5])).to_event(1))

press = {"at": 40}
all_there = torch.multiprocessing.Barrier(3)

def hook(kernel, params, stage, i):  # in the workers: at draw 40 of every chain, chain 0 presses Ctrl-C
    if stage == "Sample" and i == press["at"]:
        all_there.wait()
        if kernel._chain_of_run[0] == 0:
            os.killpg(os.getpgid(0), signal.SIGINT)  # as a terminal does: this process and its workers

runs = []
for at in (40, None):
    press["at"] = at
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(model), num_samples=300, warmup_steps=50, num_chains=3, chain_method="parallel",
                hook_fn=hook, disable_progbar=True, warn_on_problems=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mcmc.run()
    idata = mcmc.to_inference_data()
    runs.append({"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                 "q": mcmc.get_samples(group_by_chain=True)["q"].tolist(), "warmup": mcmc.warmup_samples["q"].tolist(),
                 "lp": idata.sample_stats["lp"].values.tolist(), "posterior": list(idata.posterior["q"].shape)})
print(json.dumps(runs))
"""


def test_ctrl_c_of_parallel_chains_keeps_the_draws_made_so_far():
    """Ctrl-C in a terminal (SIGINT to the process and its workers) during worker-process
    chains: Pyro's loop raised ``KeyboardInterrupt`` and lost every draw (it holds only chains
    of full length, and sample statistics arrive at a chain's end). Now the workers end their
    chains after the transition they are in and send what they recorded: every chain keeps as
    many post-warmup draws as the one with fewest, the draws the same seed gives without the
    interrupt, with their sample statistics and the warmup draws. In a process of its own,
    whose group the signal goes to."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", CTRL_C_SCRIPT], capture_output=True, text=True, timeout=300,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr
    interrupted, complete = json.loads(out.stdout)
    (warning,) = interrupted["warnings"]
    kept = re.fullmatch(r"sampling interrupted: draws per chain \[(\d+), (\d+), (\d+)\] \(of 350, warmup 50\); "
                        r"keeping the first (\d+) post-warmup draws of every chain", warning)
    assert kept, warning
    *transitions, num_kept = map(int, kept.groups())
    assert all(50 + 40 < t < 350 for t in transitions) and num_kept == min(transitions) - 50
    q, q_complete = torch.tensor(interrupted["q"]), torch.tensor(complete["q"])
    assert q.shape == (3, num_kept, 2) and interrupted["posterior"] == [3, num_kept, 2]
    assert torch.equal(q, q_complete[:, :num_kept])
    assert interrupted["lp"] == [chain[:num_kept] for chain in complete["lp"]]
    assert interrupted["warmup"] == complete["warmup"] and torch.tensor(complete["warmup"]).shape == (3, 50, 2)
    assert complete["warnings"] == [] and q_complete.shape == (3, 300, 2)
    assert "Traceback" not in out.stderr  # no worker's ConnectionResetError


def test_a_hook_that_raises_keyboard_interrupt_in_a_worker_stops_the_run_keeping_the_draws(monkeypatch):
    """``hook_fn`` raising ``KeyboardInterrupt`` stops a run in this process, keeping its
    draws; in a worker process it ended the worker (a traceback, and an error for the lost
    chain). Now it stops the run there too."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    all_there = torch.multiprocessing.Barrier(2)

    def hook(kernel, params, stage, i):
        if stage == "Sample" and i == 20:
            all_there.wait()
            if kernel._chain_of_run[0] == 1:
                raise KeyboardInterrupt

    mcmc = MCMC(NUTS(gauss2d), num_samples=300, warmup_steps=20, num_chains=2, chain_method="parallel",
                hook_fn=hook, disable_progbar=True, warn_on_problems=False)
    with pytest.warns(RuntimeWarning, match=r"sampling interrupted: draws per chain .* \(of 320, warmup 20\)"):
        mcmc.run()
    q = mcmc.get_samples(group_by_chain=True)["q"]
    assert q.shape[0] == 2 and 20 <= q.shape[1] < 300


def test_a_worker_process_that_dies_is_an_error_not_a_wait_for_ever(monkeypatch):
    """A worker process killed mid-run (here by itself; by the kernel's OOM killer in
    life) sends nothing more: Pyro's loop waited for its results for ever."""
    import os
    import signal

    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)

    def hook(kernel, params, stage, i):
        if stage == "Sample" and i == 5 and kernel._chain_of_run[0] == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    mcmc = MCMC(NUTS(gauss2d), num_samples=30, warmup_steps=10, num_chains=2, chain_method="parallel",
                hook_fn=hook, disable_progbar=True, warn_on_problems=False)
    with pytest.raises(RuntimeError, match=r"worker processes of chains \[1\] ended without .*exit codes \[-9\]"):
        mcmc.run()


def test_a_model_that_does_not_pickle_for_spawned_workers_gets_a_clear_error(monkeypatch):
    """The "spawn" start method (the default on macOS and Windows) pickles the kernel and
    its model: a model defined inside a function failed with Python's bare "Can't pickle
    local object"."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)

    def local_model():
        pyro.sample("q", dist.Normal(0.0, 1.0))

    mcmc = MCMC(NUTS(local_model), num_samples=10, warmup_steps=10, num_chains=2, chain_method="parallel",
                mp_context="spawn", disable_progbar=True)
    with pytest.raises(ValueError, match=r"'spawn' start method .* do not pickle .*local_model.* top level of a "
                                         r"module .* chain_method='vectorized'"):
        mcmc.run()


def test_parallel_chains_run_from_a_thread_other_than_the_main_one(monkeypatch):
    """A web app or a GUI runs its work in threads, where Python refuses to set a signal
    handler: Pyro's worker processes failed there (``ValueError: signal only works in main
    thread``), before any chain ran."""
    import threading

    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    mcmc = MCMC(NUTS(gauss2d), num_samples=20, warmup_steps=10, num_chains=2, chain_method="parallel",
                disable_progbar=True, warn_on_problems=False)
    failures = []

    def run_it():
        try:
            mcmc.run()
        except Exception as e:
            failures.append(e)

    thread = threading.Thread(target=run_it)
    thread.start()
    thread.join()
    assert not failures
    assert mcmc.get_samples(group_by_chain=True)["q"].shape == (2, 20, 2)


def _a_notebook_model():
    pyro.sample("q", dist.Normal(0.0, 1.0))


@pytest.mark.parametrize("kernel", [NUTS, pyro.infer.NUTS])
def test_parallel_chains_of_a_model_defined_in_a_notebook_need_workers_that_can_find_it(kernel, monkeypatch):
    """A worker started by "spawn" (the default on macOS and Windows) finds the model by
    importing its module, and a notebook's ``__main__`` is none: Pyro's workers died there
    (their ``AttributeError`` on stderr, which a notebook does not show) and its run waited
    for them for ever. Asked for, ``chain_method="parallel"`` is an error before any worker
    starts; as the default (Pyro's kernels) the chains run one after another, drawing what
    ``chain_method="sequential"`` draws with the same seed."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    notebook = type(sys)("__main__")  # an interactive session's: no file, no module name
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    monkeypatch.setattr(_a_notebook_model, "__module__", "__main__")
    monkeypatch.setattr(notebook, "_a_notebook_model", _a_notebook_model, raising=False)
    settings = dict(num_samples=20, warmup_steps=10, num_chains=2, mp_context="spawn", disable_progbar=True,
                    warn_on_problems=False)
    asked = MCMC(kernel(_a_notebook_model), chain_method="parallel", **settings)
    with pytest.raises(ValueError, match=r"started by 'spawn', .* \['_a_notebook_model'\] are defined in this "
                                         r"interactive session .* define them in a module .* chain_method='sequential'"):
        asked.run()
    if kernel is NUTS:  # this package's kernels run vectorized chains by default: no worker
        return
    pyro.set_rng_seed(0)
    by_default = MCMC(kernel(_a_notebook_model), **settings)
    with pytest.warns(UserWarning, match=r"defined in this interactive session .* the chains run one after another "
                                         r"in this process instead \(chain_method='sequential'\)"):
        by_default.run()
    pyro.set_rng_seed(0)
    sequential = MCMC(kernel(_a_notebook_model), chain_method="sequential", **settings)
    sequential.run()
    assert by_default.chain_method == "sequential"
    assert torch.equal(by_default.get_samples(group_by_chain=True)["q"], sequential.get_samples(group_by_chain=True)["q"])


def test_workers_that_fail_while_starting_are_an_error_that_says_where_to_look(monkeypatch, capfd):
    """A worker started by "spawn" that cannot find what it runs (here a module this process
    made up; in life a model defined under ``if __name__ == "__main__":``, which the worker's
    run of the script skips) dies before this package's code runs in it: the error says so,
    not that it ran out of memory."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    made_up = type(sys)("a_module_only_this_process_has")
    monkeypatch.setitem(sys.modules, made_up.__name__, made_up)

    def model():
        pyro.sample("q", dist.Normal(0.0, 1.0))

    model.__module__, model.__qualname__ = made_up.__name__, "model"
    made_up.model = model
    mcmc = MCMC(NUTS(model), num_samples=10, warmup_steps=10, num_chains=2, chain_method="parallel",
                mp_context="spawn", disable_progbar=True)
    with pytest.raises(RuntimeError, match=r"chains \[0, 1\] ended without .*exit codes \[1, 1\]\): they failed "
                                           r"while starting, each with its traceback on stderr .* outside `if __name__ "
                                           r"== '__main__':`"):
        mcmc.run()
    assert "No module named 'a_module_only_this_process_has'" in capfd.readouterr().err


def test_a_chain_failing_in_its_worker_process_raises_its_error(monkeypatch, capfd):
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)
    starts = {"q": torch.tensor([[0.0, 0.0], [float("nan"), 0.0]])}
    mcmc = MCMC(NUTS(gauss2d), num_samples=30, warmup_steps=10, num_chains=2, chain_method="parallel",
                initial_params=starts, disable_progbar=True)
    with pytest.raises(ValueError, match=r"initial values of sites \['q'\] are not finite"):
        mcmc.run()
    assert "chain 1 failed in its worker process:" in capfd.readouterr().err


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential", "parallel"])
def test_transforms_given_to_mcmc_for_some_sites_leave_the_others_constrained(chain_method, monkeypatch):
    """``MCMC(transforms=...)`` maps the draws of the sites it names; the others take the
    kernel's. Pyro takes the given ones alone: the positive site's draws came back
    unconstrained (the log of the scale: half of them negative)."""
    monkeypatch.setattr(torch.multiprocessing, "cpu_count", lambda: 8)  # worker processes for "parallel"
    pyro.set_rng_seed(0)
    mcmc = run(NUTS(_scales_and_a_positive_site), num_chains=2, num_samples=50, warmup_steps=50,
               chain_method=chain_method, warn_on_problems=False,
               transforms={"x": torch.distributions.transforms.identity_transform})
    assert (mcmc.get_samples()["s"] > 0).all()
    assert set(mcmc.transforms) == {"x", "s"} and mcmc.transforms["x"] is torch.distributions.transforms.identity_transform


def test_sequential_runs_pyros_loop_without_its_per_draw_logging(capsys):
    """Our "sequential" chains make the same kernel calls as pyro.infer.MCMC: the same seed
    gives the same draws and diagnostics, and hook_fn sees the same stages, indices and
    parameters; the progress bar shows the kernel's logging (Pyro sends it through JSON at
    every draw), from "Setup" (tracing the model) to the chain's last values."""
    def run_with(mcmc_class, num_chains, **kw):
        calls = []
        pyro.set_rng_seed(3)
        mcmc = mcmc_class(NUTS(gauss2d), num_samples=30, warmup_steps=20, num_chains=num_chains,
                          hook_fn=lambda k, p, stage, i: calls.append((stage, i, p["q"].clone(), k.logging())), **kw)
        mcmc.run()
        return mcmc, calls

    ours, our_calls = run_with(MCMC, 1, chain_method="sequential", disable_progbar=False, warn_on_problems=False)
    pyros, pyro_calls = run_with(pyro.infer.MCMC, 1, disable_progbar=True)
    assert torch.equal(ours.get_samples()["q"], pyros.get_samples()["q"])
    assert [c[:2] for c in our_calls] == [c[:2] for c in pyro_calls] and len(our_calls) == 50
    assert all(torch.equal(a[2], b[2]) for a, b in zip(our_calls, pyro_calls))
    assert ours.diagnostics()["divergences"] == pyros.diagnostics()["divergences"]
    err = capsys.readouterr().err
    assert "50/50" in err and "step size=" in err and "acc. prob=" in err
    shown = [line for line in err.split("\r") if line.strip()]
    assert shown[0].startswith("Setup") and "0/50" in shown[0]
    final = our_calls[-1][3]  # the bar ends on the chain's last values (a short run shows them once before)
    assert f"step size={final['step size']}, acc. prob={final['acc. prob']}" in shown[-1]

    _, calls = run_with(MCMC, 2, chain_method="sequential", disable_progbar=True, warn_on_problems=False)
    assert calls[0][:2] == ("Warmup [0]", 0) and calls[20][:2] == ("Sample [0]", 0) and calls[-1][:2] == ("Sample [1]", 29)


@pytest.mark.parametrize("chain_method", ["sequential", "vectorized"])
def test_the_progress_bar_counts_from_the_first_draw_and_ends_on_the_last_values(chain_method, capsys):
    """The bar shows "Setup" while the model is traced, then restarts its clock at the first
    draws (its rate and time left are the sampling's, not the tracing's), and ends on the
    chain's last values: not those of its kernel, reset after the chain (acceptance 0)."""
    def slow_gauss2d():  # executed only while setting up (~20 times): the sampler runs its traced gradient
        time.sleep(0.25)
        gauss2d()

    last, first_draw_at = [], []

    def remember(kernel, params, stage, i):
        last[:] = [kernel.logging()]
        if not first_draw_at:
            first_draw_at.append(time.monotonic())

    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(slow_gauss2d), num_samples=20, warmup_steps=100, chain_method=chain_method,
                disable_progbar=False, warn_on_problems=False, hook_fn=remember)
    start = time.monotonic()
    mcmc.run()
    end = time.monotonic()
    assert first_draw_at[0] - start > 2  # the setup
    shown = [line for line in capsys.readouterr().err.split("\r") if line.strip()]
    assert shown[0].startswith("Setup")
    minutes, seconds = shown[-1].split("120/120 [")[1].split("<")[0].split(":")
    assert 60 * int(minutes) + int(seconds) <= end - first_draw_at[0] + 0.5  # the sampling's time only
    if chain_method == "sequential":
        final = last[0]
        assert float(final["acc. prob"]) > 0.5
        assert f"step size={final['step size']}, acc. prob={final['acc. prob']}" in shown[-1]


def _narrow_normal():
    pyro.sample("x", dist.Normal(torch.zeros(3), 0.01).to_event(1))


@pytest.mark.parametrize("kernel_class", [NUTS, HMC])
@pytest.mark.parametrize("chain_method", ["vectorized", "sequential", "pyro"])
def test_without_warmup_the_step_size_is_still_searched(kernel_class, chain_method):
    """With ``warmup_steps=0`` and ``adapt_step_size`` (the default), Pyro's kernels still
    search a reasonable step size at setup; so must ours (the initial 1.0 diverges at every
    transition on a normal of scale 0.01, the searched one ~0.01-0.02 does not)."""
    pyro.set_rng_seed(0)
    kernel = kernel_class(_narrow_normal)
    if chain_method == "pyro":
        mcmc = pyro.infer.MCMC(kernel, num_samples=30, warmup_steps=0, disable_progbar=True)
    else:
        mcmc = MCMC(kernel, num_samples=30, warmup_steps=0, num_chains=2, chain_method=chain_method,
                    disable_progbar=True, warn_on_problems=False)
    mcmc.run()
    idata = to_inference_data(mcmc, log_likelihood=False)
    step_size = np.asarray(idata.sample_stats["step_size"])
    assert (step_size < 0.1).all() and not np.asarray(idata.sample_stats["diverging"]).any()
    assert np.abs(np.asarray(idata.posterior["x"])[:, 10:]).max() < 0.05  # near the mode after the start


def _branching_model():
    """Python control flow on a latent value: the trace engine falls back to eager autograd."""
    mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
    pyro.sample("obs", dist.Normal(mu, 1.0 if mu > 0 else 2.0), obs=torch.tensor(0.5))


def test_a_model_on_eager_autograd_runs_its_chains_one_after_another_unless_asked_to_batch_them():
    """Vectorized chains evaluate an eager gradient chain after chain at every step of a
    round, so by default (no ``chain_method``) such a model's chains run sequentially, with
    the draws that ``chain_method="sequential"`` gives for the seed; asked for, they batch."""
    draws = {}
    for chain_method in (None, "sequential", "vectorized"):
        pyro.set_rng_seed(0)
        mcmc = MCMC(NUTS(_branching_model), num_samples=20, warmup_steps=20, num_chains=2, chain_method=chain_method,
                    disable_progbar=True, warn_on_problems=False)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mcmc.run()
        said = " ".join(str(w.message) for w in caught if issubclass(w.category, EngineFallbackWarning))
        draws[chain_method] = mcmc.get_samples(group_by_chain=True)["mu"]
        assert draws[chain_method].shape == (2, 20)
        assert mcmc.chain_method == chain_method or (chain_method is None and mcmc.chain_method == "sequential")
        assert ("one after another" in said) == (chain_method is None)
        assert ("chain after chain" in said) == (chain_method == "vectorized")
    assert torch.equal(draws[None], draws["sequential"])


@pytest.mark.parametrize("runner", ["pyro.infer.MCMC", "sequential", "vectorized", "default"])
def test_warnings_point_at_the_users_line(runner):
    """The fallback and the checks after the run warn at the user's ``run()`` line, whatever
    the depth of the call below it: fixed ``stacklevel`` s pointed into the kernels, into
    ``mcmc.py`` or at Pyro's ``poutine`` wrapper (``messenger.py:32: return fn(*args,
    **kwargs)``), where ``module=`` filters and a reader's eye look in vain."""
    pyro.set_rng_seed(0)
    if runner == "pyro.infer.MCMC":
        mcmc = pyro.infer.MCMC(NUTS(_branching_model), num_samples=10, warmup_steps=10, disable_progbar=True)
    else:
        mcmc = MCMC(NUTS(_branching_model), num_samples=10, warmup_steps=10, num_chains=1 + (runner != "sequential"),
                    chain_method=None if runner == "default" else runner, disable_progbar=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1  # the next line's number
        mcmc.run()
    ours = [w for w in caught if issubclass(w.category, (EngineFallbackWarning, SamplingWarning))]
    assert {w.category for w in ours} >= ({EngineFallbackWarning} if runner == "pyro.infer.MCMC"
                                          else {EngineFallbackWarning, SamplingWarning})
    assert all((w.filename, w.lineno) == (__file__, line) for w in ours), [(w.filename, w.lineno) for w in ours]


def test_invalid_arguments():
    with pytest.raises(ValueError, match="chain_method"):
        MCMC(NUTS(gauss2d), 10, chain_method="threads")
    with pytest.raises(ValueError, match="needs a pyro_hmc_plus kernel"):
        MCMC(pyro.infer.NUTS(gauss2d), 10, chain_method="vectorized")
    with pytest.raises(ValueError, match=r"\['q'\] \(shapes \[\(2, 2\)\]\) have no chain dimension of 3: with num_chains=3"):
        MCMC(NUTS(gauss2d), 10, num_chains=3, initial_params={"q": torch.zeros(2, 2)})
    with pytest.raises(ValueError, match="hook_fn must be a function"):  # Pyro's: TypeError after the first draw
        MCMC(NUTS(gauss2d), 10, hook_fn="print")
    for num_samples in (0, -5, 2.5):  # Pyro's MCMC: ZeroDivisionError after the warmup
        with pytest.raises(ValueError, match="num_samples must be a positive integer"):
            MCMC(NUTS(gauss2d), num_samples)
    for warmup_steps in (-1, 10.0):  # Pyro's MCMC: no warmup, silently
        with pytest.raises(ValueError, match="warmup_steps must be a non-negative integer"):
            MCMC(NUTS(gauss2d), 10, warmup_steps=warmup_steps)
    mcmc = MCMC(NUTS(gauss2d), np.int64(10), warmup_steps=np.int64(5), num_chains=np.int64(2))
    assert (mcmc.num_samples, mcmc.warmup_steps, mcmc.num_chains) == (10, 5, 2)
    for chain_method in ("vectorized", "sequential"):  # was an IndexError from Pyro's check
        with pytest.raises(ValueError, match=r"\['q'\] \(shapes \[\(\)\]\) have no chain dimension of 3: with num_chains=3"):
            MCMC(NUTS(gauss2d), 10, num_chains=3, initial_params={"q": torch.tensor(0.0)}, chain_method=chain_method)
    with pytest.raises(ValueError, match="not finite"):
        run(NUTS(gauss2d), num_chains=2, initial_params={"q": torch.tensor([[0.0, 0.0], [float("nan"), 0.0]])})
    with pytest.raises(ValueError, match="expected"):
        run(NUTS(gauss2d), num_chains=2, initial_params={"q": torch.zeros(2, 3)})


def test_reading_draws_before_a_run_says_to_run_first():
    """Pyro's MCMC fails with "'NoneType' object has no attribute 'items'" (or a TypeError
    from ``summary()``); the export takes Pyro's MCMC too."""
    mcmc = MCMC(NUTS(gauss2d), 10)
    for read in (mcmc.get_samples, mcmc.diagnostics, mcmc.summary, mcmc.to_inference_data,
                 lambda: to_inference_data(pyro.infer.MCMC(NUTS(gauss2d), 10))):
        with pytest.raises(RuntimeError, match=r"has not run yet: call mcmc.run\(...\) first"):
            read()


def _thirty_one_coordinates():
    pyro.sample("x", dist.Normal(0.0, 1.0).expand([30]).to_event(1))
    pyro.sample("y", dist.Normal(0.0, 1.0))


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
def test_a_dense_metric_with_fewer_warmup_draws_than_dimensions_is_warned_of_before_the_run(chain_method):
    """150 warmup steps estimate the mass matrix from a last window of 25 draws: singular for
    31 coordinates (with 100 dimensions and 100 draws, NUTS took 412 steps a draw against 24
    with 200 draws). 200 steps give 50 draws; a diagonal block, or no adaptation of the mass
    matrix, needs none. The warning names the warmup that gives twice the dimension. Each run
    stops at its first draw (``hook_fn`` raises ``KeyboardInterrupt``, as a Ctrl-C): what is
    warned of before the run is there by then."""

    def stop_the_run(*_):
        raise KeyboardInterrupt

    def warnings_of(warmup_steps, **kernel_args):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            MCMC(NUTS(_thirty_one_coordinates, **kernel_args), 5, warmup_steps, num_chains=2, disable_progbar=True,
                 chain_method=chain_method, warn_on_problems=False, hook_fn=stop_the_run).run()
        assert any("sampling interrupted" in str(w.message) for w in caught)
        return [str(w.message) for w in caught if issubclass(w.category, SamplingWarning)]

    (message, *_) = warnings_of(150, full_mass=True)
    assert re.search(r"dense block of 31 coordinates is estimated from the 25 draws .*warmup_steps=150\).*"
                     r"Use warmup_steps=187 \(its last window has at least 62 draws", message)
    assert warnings_of(200, full_mass=True) == []
    assert warnings_of(150, full_mass=[("y",)]) == []
    assert warnings_of(150, full_mass=True, adapt_mass_matrix=False) == []


def test_progress_bar_shows_phase_divergences_and_step_sizes(capsys):
    pyro.set_rng_seed(0)
    mcmc = MCMC(NUTS(gauss2d), num_samples=40, warmup_steps=40, num_chains=2, disable_progbar=False,
                warn_on_problems=False)
    mcmc.run()
    err = capsys.readouterr().err
    assert err.lstrip("\r").startswith("Setup")  # tracing the model, before the first draw
    assert "Sample" in err and "160/160" in err
    assert "divergences=" in err and "step size=" in err


def test_draws_are_split_by_chain_in_the_order_each_chain_made_them(monkeypatch):
    """The vectorized loop keeps each call's ``(T, C, ...)`` block of slots and splits it
    into per-chain rows only when asked (and every few calls): rows must come out per chain
    in the order made, and the post-warmup divergences counted once each."""
    from pyro_hmc_plus.mcmc import _Rows

    monkeypatch.setattr(_Rows, "FLUSH_EVERY", 3)
    D, C, T, W = 1, 3, 2, 2
    div = D + chain_batch.STAT_COLUMNS.index("diverging")
    rows = _Rows(C, W, torch.zeros(0, D + chain_batch.NUM_STATS))
    gen = torch.Generator().manual_seed(0)
    expected = [[] for _ in range(C)]
    for call in range(7):
        draws = torch.zeros(T, C, D + chain_batch.NUM_STATS)
        done = torch.rand(T, C, generator=gen) < 0.6
        for t in range(T):
            for c in range(C):
                draws[t, c, 0] = 100 * call + 10 * t + c  # which slot made it
                draws[t, c, div] = float((call + t + c) % 2)
                if done[t, c]:
                    expected[c].append(draws[t, c].clone())
        rows.add(draws, done)
        if call == 4:
            assert torch.equal(rows.of_chain(1), torch.stack(expected[1]))
    divergent = sum(int(r[div]) for e in expected for r in e[W:])
    assert rows.divergences() == divergent > 0
    for c in range(C):
        assert torch.equal(rows.of_chain(c), torch.stack(expected[c]) if expected[c] else torch.zeros(0, D + chain_batch.NUM_STATS))
    assert rows.divergences() == divergent  # asking again counts nothing twice


@pytest.mark.parametrize("max_tree_depth", [1, 2, 4])
def test_vectorized_nuts_at_small_depth_limits(max_tree_depth):
    """Depth limits at and below the fused start's three doublings (every tree ends in its
    first round; at 1, a round is one leaf: Static Runtime corrupted memory running the fused
    start's bookkeeping for one doubling of a batch) and just above it (one chunk)."""
    pyro.set_rng_seed(0)
    mcmc = run(NUTS(gauss2d, max_tree_depth=max_tree_depth), num_chains=3, num_samples=200, warmup_steps=100,
               warn_on_problems=False)
    depth = mcmc.to_inference_data().sample_stats.tree_depth.values
    assert depth.max() == max_tree_depth and depth.min() >= 1
    assert torch.isfinite(mcmc.get_samples()["q"]).all()
