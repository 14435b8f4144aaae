"""Tests of pyro_hmc_plus.NUTS: the tree against a direct transcription of Stan's recursive
algorithm, the batch form of the core, and statistics against exact posteriors and long runs
of Pyro's own NUTS (tests/reference/). Tolerances are multiples of Monte Carlo standard
errors from ArviZ; seeds are fixed, so each test is deterministic.
"""

import json
import math
import pathlib
import pickle
import warnings

import arviz as az
import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import MCMC

import pyro_hmc_plus
from pyro_hmc_plus import NUTS, nuts
from pyro_hmc_plus.hmc import HMCState
from pyro_hmc_plus.metric import make_metric
from pyro_hmc_plus.models import problem

from helpers import Z, assert_mean, assert_variance
from models import (
    EIGHT_SCHOOLS_SIGMA,
    EIGHT_SCHOOLS_Y,
    PRECISION,
    dirichlet_categorical,
    eight_schools,
    eight_schools_centered,
    failing_potential,
    gamma_poisson,
    gamma_poisson_posterior,
    gauss2d,
    logistic_data,
    logistic_regression,
    normal_normal,
    normal_normal_posterior,
)



def reference(model_name):
    """Posterior summaries from long runs of Pyro's NUTS (tests/reference/make_reference.py)."""
    path = pathlib.Path(__file__).parent / "reference" / "pyro_nuts.json"
    return json.loads(path.read_text())[model_name]


def run(kernel, num_samples=1000, warmup_steps=500, *args, **kw):
    mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup_steps, disable_progbar=True, **kw)
    mcmc.run(*args)
    return mcmc


# ---------------------------------------------------------------------------- the tree

COV = torch.tensor([[1.0, 0.9, 0.0], [0.9, 1.0, 0.3], [0.0, 0.3, 4.0]], dtype=torch.float64)
PREC = torch.linalg.inv(COV)


def gaussian_potential(params):
    x = params["x"]
    return 0.5 * x @ PREC @ x


def stan_tree(z0, r0, step_size, inv_mass, forward_flags, max_depth):
    """Stan's base_nuts transition, transcribed directly (recursive build_tree), tracking
    only what does not depend on the random proposal choices: (depth, n_leapfrog, divergent)."""

    def grad(z):
        return PREC @ z

    def H(z, r):
        return 0.5 * z @ PREC @ z + 0.5 * r @ (inv_mass * r)

    def criterion(p_minus, p_plus, rho):
        return float((inv_mass * p_plus) @ rho) > 0 and float((inv_mass * p_minus) @ rho) > 0

    H0 = H(z0, r0)
    counts = {"n": 0, "divergent": False}

    def build(depth, z, r, eps):
        """-> valid, (z, r) last state, rho, p_begin, p_end"""
        if depth == 0:
            r = r - 0.5 * eps * grad(z)
            z = z + eps * inv_mass * r
            r = r - 0.5 * eps * grad(z)
            counts["n"] += 1
            h = H(z, r)
            if not math.isfinite(h) or h - H0 > 1000:
                counts["divergent"] = True
                return False, (z, r), r, r, r
            return True, (z, r), r, r, r
        ok, (z, r), rho1, p_begin, p_init_end = build(depth - 1, z, r, eps)
        if not ok:
            return False, (z, r), None, None, None
        ok, (z, r), rho2, p_final_begin, p_end = build(depth - 1, z, r, eps)
        if not ok:
            return False, (z, r), None, None, None
        persist = (
            criterion(p_begin, p_end, rho1 + rho2)
            and criterion(p_begin, p_final_begin, rho1 + p_final_begin)
            and criterion(p_init_end, p_end, rho2 + p_init_end)
        )
        return persist, (z, r), rho1 + rho2, p_begin, p_end

    ends = {True: (z0, r0), False: (z0, r0)}
    rho, depth = r0.clone(), 0
    for forward in forward_flags[:max_depth]:
        eps = step_size if forward else -step_size
        ok, end, rho_sub, p_first, p_last = build(depth, *ends[forward], eps)
        if not ok:
            break
        depth += 1
        near, far = ends[forward][1], ends[not forward][1]
        ends[forward] = end
        persist = (
            criterion(far, p_last, rho + rho_sub)
            and criterion(far, p_first, rho + p_first)
            and criterion(near, p_last, rho_sub + near)
        )
        rho = rho + rho_sub
        if not persist:
            break
    return depth, counts["n"], counts["divergent"]


@pytest.mark.parametrize("max_unroll", [16, 2])
@pytest.mark.parametrize("step_size", [0.05, 0.3, 1.2, 3.0])
def test_tree_matches_stan_recursion(step_size, max_unroll):
    """Depth, leapfrog count and divergence of every transition equal those of Stan's
    recursive algorithm from the same point, momentum and directions; ``max_unroll=2``
    exercises the chunked subtrees (and their merges) of the deeper doublings."""
    max_depth = 7
    inv_mass = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    kernel = NUTS(
        potential_fn=gaussian_potential, step_size=step_size, adapt_step_size=False,
        adapt_mass_matrix=False, max_tree_depth=max_depth, max_unroll=max_unroll,
    )
    kernel.initial_params = {"x": torch.tensor([0.5, -0.3, 1.0], dtype=torch.float64)}
    kernel.setup(0)
    kernel._metric = make_metric(inv_mass, dense=False)
    compared = set()
    for seed in range(12):
        z0 = kernel._state.z
        torch.manual_seed(seed)
        r0 = kernel._metric.momentum_scale * torch.randn(3, dtype=torch.float64)
        forward = (torch.rand(max_depth, 3, dtype=torch.float64)[:, 0] < 0.5).tolist()
        expected = stan_tree(z0, r0, step_size, inv_mass, forward, max_depth)
        torch.manual_seed(seed)
        state, stats, _ = kernel._transition(warmup=False)
        assert (stats["tree_depth"], stats["n_steps"], stats["diverging"]) == expected
        compared.add(expected)
        kernel._state = state
    if step_size <= 0.3:
        assert len({depth for depth, _, _ in compared}) > 1  # several depths were exercised
    if step_size == 3.0:
        assert any(divergent for _, _, divergent in compared)


def test_batch_of_chains_equals_one_chain_at_a_time():
    """The core is batch-shaped: 5 chains in lock-step (done chains frozen) give exactly
    the trees each chain gives alone."""
    C, D, max_depth = 5, 3, 6
    torch.manual_seed(0)
    prec = PREC.float()

    def value_and_grad(z):
        return 0.5 * ((z @ prec) * z).sum(-1), z @ prec

    z = torch.randn(C, D)
    U, g = value_and_grad(z)
    noise = torch.randn(C, D)
    rands = torch.rand(max_depth, C, 3)
    step_size = torch.tensor([0.1, 0.3, 0.5, 0.8, 1.5])
    metric = make_metric(torch.rand(C, D) + 0.5, dense=False)
    log_slice = torch.zeros(C)

    def transition(idx):
        sl = (lambda x: x[idx]) if idx is not None else (lambda x: x)
        tree = nuts.init_tree(HMCState(sl(z), sl(U), sl(g)), sl(noise), sl(log_slice), nuts.Metric(*map(sl, metric)))
        for depth in range(max_depth):
            tree = nuts.doubling(
                value_and_grad, tree, sl(rands[depth]) if idx is not None else rands[depth], sl(step_size),
                sl(metric.inverse_mass), 1 << depth, max_depth,
            )
        return nuts.info(tree), tree.proposal.z

    batch_info, batch_z = transition(None)
    for c in range(C):
        info, zc = transition(c)
        for a, b in zip(info, batch_info):
            torch.testing.assert_close(a, b[c])
        torch.testing.assert_close(zc, batch_z[c])
    assert len(set(batch_info.tree_depth.tolist())) > 1  # the chains really did stop at different depths


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("multinomial", [True, False])
def test_first_doublings_at_once_equal_doubling_by_doubling(dense, multinomial):
    """``nuts.first_doublings`` (a transition's first K doublings, their bookkeeping
    vectorised) gives the tree that ``init_tree`` and K ``doubling`` calls give from the
    same uniforms: every field, on one chain and a batch, through U-turns, divergences
    (a quartic potential blows up at large steps) and the depth limit."""
    D = 3
    gen = torch.Generator().manual_seed(1 + 2 * dense + multinomial)
    a = torch.randn(D, D, generator=gen)
    prec = a @ a.T + 0.5 * torch.eye(D)

    def value_and_grad(z):
        return 0.5 * ((z @ prec) * z).sum(-1) + 0.3 * (z**4).sum(-1), z @ prec + 1.2 * z**3

    outcomes = set()
    for trial in range(48):
        K, batch = 2 + trial % 2, () if trial % 3 else (4,)
        max_depth = 10 if trial % 8 else 1 + trial % 3
        z = torch.randn(batch + (D,), generator=gen)
        U, g = value_and_grad(z)
        if dense:
            b = 0.3 * torch.randn(batch + (D, D), generator=gen)
            inverse_mass = b @ b.mT + torch.eye(D)
        else:
            inverse_mass = torch.rand(batch + (D,), generator=gen) + 0.5
        metric = make_metric(inverse_mass, dense)
        step_size = torch.full(batch, [0.05, 0.3, 0.8, 2.0][trial % 4])
        noise = torch.randn(batch + (D,), generator=gen)
        log_slice = torch.zeros(batch) if multinomial else torch.rand(batch, generator=gen).log()
        uniforms = torch.rand(batch + (K, 3), generator=gen)
        state = HMCState(z, U, g)
        expected = nuts.init_tree(state, noise, log_slice, metric)
        for j in range(K):
            expected = nuts.doubling(value_and_grad, expected, uniforms[..., j, :], step_size, inverse_mass, 1 << j,
                                     max_depth, multinomial)
        actual = nuts.first_doublings(value_and_grad, state, noise, log_slice, uniforms, step_size, metric, K,
                                      max_depth, multinomial)
        for x, y in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
            assert x.dtype == y.dtype
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4, equal_nan=True)
        outcomes |= set(zip(expected.depth.reshape(-1).tolist(), expected.diverging.reshape(-1).tolist(),
                            expected.done.reshape(-1).tolist()))
    depths = {depth for depth, _, _ in outcomes}
    assert {0, 1, 2, 3} <= depths and any(not done for _, _, done in outcomes)  # stopped at every depth, or not
    assert any(diverging for _, diverging, _ in outcomes)


def test_tree_depth_limit_is_respected():
    kernel = NUTS(gauss2d, step_size=0.01, adapt_step_size=False, adapt_mass_matrix=False, max_tree_depth=3)
    run(kernel, 50, 0)
    stats = kernel.sample_stats[0]
    assert max(stats["tree_depth"]) == 3 and max(stats["n_steps"]) == 7
    assert [d == 3 for d in stats["tree_depth"]] == stats["reached_max_treedepth"]
    assert sum(stats["reached_max_treedepth"]) > 40  # tiny steps: almost every tree hits the limit


@pytest.mark.parametrize("cheap", [True, False])
def test_fused_start_runs_where_it_pays(cheap, monkeypatch):
    """The first three doublings run as one program at every transition where the gradient
    is cheap; where it is costly, only after a transition whose tree reached depth 3, so
    that shallow trees do not pay for leapfrog steps they would not take. Counted on a
    1-D normal with steps long enough for trees of depth 1-4."""
    from pyro_hmc_plus import GradientEngine

    # as if traced: a gradient touching 100 or a million tensor elements
    monkeypatch.setattr(GradientEngine, "gradient_elements", property(lambda self: 100 if cheap else 10**6))
    calls = []
    kernel = NUTS(potential_fn=lambda p: 0.5 * (p["x"] ** 2).sum(), step_size=0.4, adapt_step_size=False,
                  adapt_mass_matrix=False, engine="eager")
    fused_start = kernel._first_doublings_program

    def counted():
        program = fused_start()
        return type(program)(lambda *leaves: calls.append(1) or program.flat(*leaves), program._out_structure)

    monkeypatch.setattr(kernel, "_first_doublings_program", counted)
    run(kernel, 60, 0, initial_params={"x": torch.zeros(1)})
    depths = kernel.sample_stats[0]["tree_depth"]
    assert {1, 2, 3} <= set(depths)
    expected = len(depths) if cheap else 1 + sum(depth >= 3 for depth in depths[:-1])
    assert len(calls) == expected and (cheap or expected < len(depths) / 2)


# ---------------------------------------------------------------------------- statistics


def test_one_dimensional_draws_follow_the_density():
    """Detailed balance, checked on the histogram: the fraction of draws in each of 8 bins of
    a standard normal matches the bin's probability (indicator means, MCSE tolerance)."""

    def model():
        pyro.sample("x", dist.Normal(0.0, 1.0))

    kernel = NUTS(model, step_size=0.9, adapt_step_size=False, adapt_mass_matrix=False)
    x = run(kernel, 6000, 0).get_samples()["x"].numpy()
    edges = np.array([-np.inf, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, np.inf])
    cdf = torch.distributions.Normal(0.0, 1.0).cdf(torch.tensor(edges[1:-1])).numpy()
    probs = np.diff(np.concatenate([[0.0], cdf, [1.0]]))
    indicators = (x[:, None] >= edges[None, :-1]) & (x[:, None] < edges[None, 1:])
    assert_mean(indicators.astype(float), probs)


def test_correlated_gaussian():
    """The classic question's target: correlation 0.95, with the adapted diagonal metric."""
    kernel = NUTS(gauss2d)
    q = run(kernel, 2000, 500).get_samples()["q"].numpy()
    cov = torch.linalg.inv(PRECISION).numpy()
    assert_mean(q, [0.0, 0.0])
    assert_variance(q, np.diag(cov))
    assert_mean(q[:, 0] * q[:, 1], cov[0, 1])
    assert kernel.engine_name == "trace"


def test_badly_scaled_gaussian_with_dense_mass():
    scales = torch.tensor([0.01, 1.0, 100.0])
    L = torch.tensor([[1.0, 0.0, 0.0], [0.8, 0.6, 0.0], [0.3, -0.5, 0.81]])
    cov = scales[:, None] * (L @ L.T) * scales[None, :]

    def model():
        pyro.sample("x", dist.MultivariateNormal(torch.zeros(3), covariance_matrix=cov))

    kernel = NUTS(model, full_mass=True)
    x = run(kernel, 1500, 600).get_samples()["x"].numpy()
    assert_mean(x / scales.numpy(), 0.0)
    assert_variance(x / scales.numpy(), np.diag(L @ L.T))
    ratio = kernel.inverse_mass_matrix[("x",)].diagonal() / cov.diagonal()
    assert ratio.min() > 0.5 and ratio.max() < 2.0


def _three_scales():
    pyro.sample("x", dist.Normal(0.0, torch.tensor([0.01, 1.0, 100.0])).to_event(1))
    pyro.sample("y", dist.Normal(0.0, 1.0))


def test_a_run_goes_on_from_another_runs_adapted_metric_and_last_draw():
    """Stan's ``inv_metric`` and NumPyro's ``inverse_mass_matrix``: a second run without warmup
    starts from the first run's adapted metric, step size and last draw. With the identity
    metric, a step size fit for the scale-1 coordinates diverges on the 0.01 one."""
    pyro.set_rng_seed(0)
    first = NUTS(_three_scales)
    mcmc = run(first, 300, 300)
    last = {name: mcmc.transforms[name](v[-1]) for name, v in mcmc.get_samples().items()}
    adapted = first.inverse_mass_matrix
    second = NUTS(_three_scales, inverse_mass_matrix=adapted, step_size=first.step_size,
                  adapt_step_size=False, adapt_mass_matrix=False)
    x = run(second, 1500, 0, initial_params=last).get_samples()["x"].numpy()
    assert torch.equal(second.inverse_mass_matrix[("x", "y")], adapted[("x", "y")])
    assert_mean(x / [0.01, 1.0, 100.0], 0.0)
    assert_variance(x / [0.01, 1.0, 100.0], 1.0)
    assert max(second.sample_stats[-1]["tree_depth"]) <= 4 and not any(second.sample_stats[-1]["diverging"])


def test_a_starting_metric_per_chain_and_in_dense_blocks():
    pyro.set_rng_seed(0)
    vectorized = pyro_hmc_plus.MCMC(NUTS(_three_scales), 20, 20, num_chains=3, disable_progbar=True, warn_on_problems=False)
    vectorized.run()
    fixed = pyro_hmc_plus.MCMC(NUTS(_three_scales, inverse_mass_matrix=vectorized.inverse_mass_matrix, adapt_mass_matrix=False),
                               20, 20, num_chains=3, disable_progbar=True, warn_on_problems=False)
    fixed.run()
    assert torch.equal(fixed.inverse_mass_matrix, vectorized.inverse_mass_matrix)
    blocks = {("y",): torch.tensor([[2.0]]), ("x",): torch.tensor([1e-4, 1.0, 1e4])}  # y's block dense, x diagonal
    kernel = NUTS(_three_scales, full_mass=[("y",)], inverse_mass_matrix=blocks, adapt_mass_matrix=False)
    run(kernel, 10, 10)
    assert list(kernel.inverse_mass_matrix) == [("y",), ("x",)]
    assert all(torch.equal(kernel.inverse_mass_matrix[k], v) for k, v in blocks.items())


@pytest.mark.parametrize("chain_method", ["vectorized", "sequential"])
@pytest.mark.parametrize("kernel_class, options", [(NUTS, {}), (pyro_hmc_plus.HMC, {"trajectory_length": 1.0})])
def test_a_run_goes_on_from_each_chains_adapted_step_size(kernel_class, options, chain_method):
    """As Stan takes a step size per chain: a second run takes the first's adapted step sizes
    (``mcmc.step_size``) and metrics (``mcmc.inverse_mass_matrix``), each chain its own,
    whether the chains run vectorized or one after another. HMC's chains share the
    trajectory length, as after adaptation, and each takes ``trajectory_length / its step
    size`` steps."""
    pyro.set_rng_seed(0)
    first = pyro_hmc_plus.MCMC(kernel_class(_three_scales, **options), 50, 100, num_chains=3, disable_progbar=True,
                               warn_on_problems=False, chain_method=chain_method)
    first.run()
    assert first.step_size.shape == (3,) and len(set(first.step_size.tolist())) == 3
    assert first.inverse_mass_matrix.shape == (3, 4) and len(set(first.inverse_mass_matrix[:, 0].tolist())) == 3
    kernel = kernel_class(_three_scales, step_size=first.step_size, inverse_mass_matrix=first.inverse_mass_matrix,
                          adapt_step_size=False, adapt_mass_matrix=False, **options)
    second = pyro_hmc_plus.MCMC(kernel, 20, 0, num_chains=3, disable_progbar=True, warn_on_problems=False,
                                chain_method=chain_method)
    second.run()
    assert torch.equal(second.step_size, first.step_size)
    assert torch.equal(second.inverse_mass_matrix, first.inverse_mass_matrix)
    for chain, stats in enumerate(kernel.sample_stats[-3:]):
        assert set(stats["step_size"]) == {float(first.step_size[chain])}
        if kernel_class is not NUTS:
            assert set(stats["n_steps"]) == {max(1, int(torch.floor(1.0 / first.step_size[chain])))}
    with pytest.raises(ValueError, match="a chain run on its own"):  # the run's chain is not kept after it
        run(kernel, 5, 5)


def test_a_chain_run_on_its_own_goes_on_from_a_run_of_one_chain():
    """``pyro_hmc_plus.MCMC`` with one chain gives ``step_size`` ``(1,)`` and
    ``inverse_mass_matrix`` ``(1, D)``, which a chain in ``pyro.infer.MCMC`` takes."""
    pyro.set_rng_seed(0)
    first = pyro_hmc_plus.MCMC(NUTS(_three_scales), 50, 100, disable_progbar=True, warn_on_problems=False)
    first.run()
    assert first.step_size.shape == (1,) and first.inverse_mass_matrix.shape == (1, 4)
    kernel = NUTS(_three_scales, step_size=first.step_size, inverse_mass_matrix=first.inverse_mass_matrix,
                  adapt_step_size=False, adapt_mass_matrix=False)
    run(kernel, 10, 0)
    assert kernel.step_size == first.step_size.item()
    assert torch.equal(kernel.inverse_mass_matrix[("x", "y")], first.inverse_mass_matrix[0])


def _noisy_potential(params):
    """A potential with noise of sd 3 at every call: no step size is accepted at the target
    rate, so dual averaging drives it down without end."""
    return 0.5 * (params["x"] ** 2).sum() + 3.0 * torch.randn(())


def test_the_adapted_step_size_stays_within_its_bounds():
    """``min_stepsize`` bounds the adapted step size, the warmup's average at its end
    included (it was ~1e-8 against a bound of 0.01), for one chain and vectorized chains."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pyro_hmc_plus.EngineFallbackWarning)  # the noise: eager autograd
        pyro.set_rng_seed(0)
        kernel = NUTS(potential_fn=_noisy_potential, max_tree_depth=2, min_stepsize=0.01)
        run(kernel, 5, 100, initial_params={"x": torch.zeros(2)})
        chains = pyro_hmc_plus.MCMC(NUTS(potential_fn=_noisy_potential, max_tree_depth=2, min_stepsize=0.01), 5, 100,
                                    num_chains=2, chain_method="vectorized", initial_params={"x": torch.zeros(2, 2)},
                                    disable_progbar=True, warn_on_problems=False)
        chains.run()
    assert kernel.step_size == 0.01
    assert (chains.step_size == torch.tensor(0.01)).all()


def test_a_step_size_per_chain_that_does_not_fit_the_run_gets_a_clear_error():
    steps = torch.tensor([0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="step_size holds 3 values, one per chain, but the run has num_chains=2"):
        pyro_hmc_plus.MCMC(NUTS(_three_scales, step_size=steps), 5, 5, num_chains=2, disable_progbar=True).run()
    with pytest.raises(ValueError, match="step_size holds 3 values, one per chain, but the run has num_chains=2"):
        pyro_hmc_plus.MCMC(NUTS(_three_scales, step_size=steps), 5, 5, num_chains=2, chain_method="sequential",
                           disable_progbar=True).run()
    with pytest.raises(ValueError, match=r"step_size holds 3 values, one per chain: they are for a run of "
                                         r"pyro_hmc_plus.MCMC with num_chains=3; a chain run on its own"):
        run(NUTS(_three_scales, step_size=steps), 5, 5)
    with pytest.raises(ValueError, match=r"inverse_mass_matrix has shape \(2, 4\).* or \(3, 4\) with one per chain"):
        pyro_hmc_plus.MCMC(NUTS(_three_scales, inverse_mass_matrix=torch.ones(2, 4)), 5, 5, num_chains=3,
                           chain_method="sequential", disable_progbar=True).run()
    with pytest.raises(ValueError, match="give trajectory_length .* instead of num_steps"):
        pyro_hmc_plus.HMC(_three_scales, step_size=steps, num_steps=5)
    for bad in ([0.1, -0.2], [], [[0.1]], "0.1", float("inf")):
        with pytest.raises(ValueError, match="step_size must be a positive finite number, or one per chain"):
            NUTS(_three_scales, step_size=bad)


@pytest.mark.parametrize("given, error", [
    (torch.ones(3), r"has shape \(3,\): over the flat vector of the sites \['x', 'y'\] \(4 entries, full_mass=False\) it is \(4,\)"),
    ({("x",): torch.ones(3)}, r"has the blocks \[\('x',\)\]; with full_mass=False this model's are \[\('x', 'y'\)\]"),
    ({("x", "y"): torch.ones(3)}, r"inverse_mass_matrix\[\('x', 'y'\)\] has shape \(3,\), expected \(4,\)"),
    (torch.tensor([1.0, 1.0, -1.0, 1.0]), "must be finite and positive definite"),
    (torch.ones(2, 4), r"it is \(4,\), or \(1, 4\) with one per chain$"),  # two chains', for a single chain
])
def test_a_starting_metric_that_does_not_fit_the_model_gets_a_clear_error(given, error):
    with pytest.raises(ValueError, match=error):
        run(NUTS(_three_scales, inverse_mass_matrix=given), 5, 5)


_CORRELATED_4 = torch.eye(4) + 0.5 * (torch.ones(4, 4) - torch.eye(4))  # positive definite


@pytest.mark.parametrize("full_mass, given, error", [
    (True, _CORRELATED_4 + 1.5 * (torch.ones(4, 4) - torch.eye(4)), "must be finite and positive definite"),
    ([("x",)], _CORRELATED_4, "has entries outside the dense blocks of full_mass, where they are 0"),
    ([("x",), ("x", "y")], None, "site 'x' appears in two full_mass blocks"),
])
def test_dense_metrics_that_do_not_fit_get_a_clear_error(full_mass, given, error):
    """A symmetric matrix with a positive diagonal can still be indefinite (off-diagonal 2
    against 1: the Cholesky factorisation finds it); a dense block must not reach into the
    diagonal sites; a site belongs to one block."""
    with pytest.raises(ValueError, match=error):
        run(NUTS(_three_scales, full_mass=full_mass, inverse_mass_matrix=given), 5, 5)


def test_conjugate_normal_normal_and_slice_variant():
    x = torch.randn(20) + 3.0
    mean, var = normal_normal_posterior(x)
    for multinomial in (True, False):
        mu = run(NUTS(normal_normal, use_multinomial_sampling=multinomial), 1500, 300, x).get_samples()["mu"].numpy()
        assert_mean(mu, mean)
        assert_variance(mu, var)


def test_constrained_sites():
    y = torch.tensor([3.0, 5.0, 2.0, 4.0, 6.0])
    a, b = gamma_poisson_posterior(y)
    rate = run(NUTS(gamma_poisson), 1000, 300, y).get_samples()["rate"].numpy()
    assert (rate > 0).all()
    assert_mean(rate, a / b)
    assert_variance(rate, a / b**2)

    counts = torch.tensor([5.0, 2.0, 9.0])
    p = run(NUTS(dirichlet_categorical), 800, 300, counts).get_samples()["p"].numpy()
    alpha = (1 + counts).numpy()
    assert np.allclose(p.sum(-1), 1.0, atol=1e-5)
    assert_mean(p, alpha / alpha.sum())


def test_flat_priors_sample_their_posterior():
    """``ImproperUniform`` priors (Pyro's own NUTS stops on them: it cannot draw from them to
    start), the kernel swapped in ``pyro.infer.MCMC`` with no other change: a flat prior on
    a normal mean gives N(mean of y, 1/n); a flat prior on a positive site times a
    ``Gamma(3, 2)`` factor gives that Gamma."""
    y = torch.tensor([0.3, -1.2, 0.8, 2.1, 0.4])

    def flat_priors(y):
        mu = pyro.sample("mu", dist.ImproperUniform(dist.constraints.real, (), ()))
        rate = pyro.sample("rate", dist.ImproperUniform(dist.constraints.positive, (), ()))
        pyro.factor("rate_density", dist.Gamma(3.0, 2.0).log_prob(rate))
        with pyro.plate("n", len(y)):
            pyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    pyro.set_rng_seed(0)
    samples = run(NUTS(flat_priors), 1000, 300, y).get_samples()
    mu, rate = samples["mu"].numpy(), samples["rate"].numpy()
    assert_mean(mu, float(y.mean()))
    assert_variance(mu, 1.0 / len(y))
    assert (rate > 0).all()
    assert_mean(rate, 1.5)
    assert_variance(rate, 0.75)


def test_the_truth_ranks_uniformly_among_the_draws():
    """Simulation-based calibration (Talts et al. 2018) of 4 chains of the default
    ``pyro_hmc_plus.MCMC`` (vectorized, each adapting its own step size and metric): 200
    replications of a normal model with unknown mean and scale (a positive site with a skewed
    posterior), each with its parameters drawn from the prior and 5 observations drawn given
    them, sampled together as one 400-dimensional posterior. If the draws follow each
    replication's posterior, the rank of its true parameter among 100 thinned draws is
    uniform; a chi-square test over 10 bins checks that. Its power, measured: a likelihood
    whose scale is 10% off gives p ~ 1e-5 to 1e-4 for the scale, momenta drawn 30% too large
    p <= 1e-3 (mean and scale together)."""
    from scipy.stats import chisquare

    replications, observations = 200, 5

    def replicated(y):
        with pyro.plate("replication", replications):
            mu = pyro.sample("mu", dist.Normal(0.0, 1.0))
            sigma = pyro.sample("sigma", dist.LogNormal(0.0, 0.5))
            with pyro.plate("observation", observations, dim=-2):
                pyro.sample("y", dist.Normal(mu, sigma), obs=y)

    gen = torch.Generator().manual_seed(0)
    truth = {"mu": torch.randn(replications, generator=gen),
             "sigma": (0.5 * torch.randn(replications, generator=gen)).exp()}
    y = truth["mu"] + truth["sigma"] * torch.randn(observations, replications, generator=gen)
    pyro.set_rng_seed(0)
    mcmc = pyro_hmc_plus.MCMC(NUTS(replicated), num_samples=500, warmup_steps=300, num_chains=4,
                              disable_progbar=True, warn_on_problems=False)
    mcmc.run(y)
    samples = mcmc.get_samples(group_by_chain=True)
    for name, true in truth.items():
        draws = samples[name][:, ::20].reshape(-1, replications)  # 4 x 25 draws, ~independent
        ranks = (draws < true).sum(0).numpy()  # 0 ... 100
        counts = np.bincount(ranks * 10 // (len(draws) + 1), minlength=10)
        assert chisquare(counts).pvalue > 1e-3, f"{name}: ranks of the truth per tenth {counts}"


def test_enumerated_discrete_site_matches_the_exact_posterior():
    """A discrete latent site that Pyro's potential sums out by enumeration (the change-point
    model of the coal-mining disasters, 111 candidate years): the two rates' exact posterior
    is a mixture of Gammas over the switchpoint's exact posterior, for one chain in
    ``pyro.infer.MCMC`` and for vectorized chains."""
    prob = problem("changepoint")
    single = run(NUTS(prob.model), 1000, 300, *prob.args).get_samples()
    vectorized = pyro_hmc_plus.MCMC(NUTS(prob.model), num_samples=500, warmup_steps=300, num_chains=2,
                                    disable_progbar=True)
    vectorized.run(*prob.args)
    for samples in (single, vectorized.get_samples()):
        for site in ("early", "late"):
            assert_mean(samples[site].numpy(), prob.exact_mean[site])
            assert_variance(samples[site].numpy(), prob.exact_sd[site] ** 2)


def assert_matches_reference(samples, reference):
    """Means agree with Pyro's long NUTS run within Z combined MCSEs."""
    for name, ref in reference.items():
        site, _, index = name.partition("[")
        draws = samples[site].reshape(len(samples[site]), -1).numpy()
        x = draws[:, int(index[:-1])] if index else draws[:, 0]
        mcse = float(az.mcse(x[None, :]))
        bound = Z * math.hypot(mcse, ref["mcse_mean"])
        assert abs(x.mean() - ref["mean"]) <= bound, f"{name}: {x.mean():.3f} vs Pyro {ref['mean']:.3f} (±{bound:.3f})"


def test_eight_schools_noncentered_matches_pyro():
    mcmc = run(NUTS(eight_schools), 2000, 1000, EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    assert_matches_reference(mcmc.get_samples(), reference("eight_schools_noncentered"))


def test_logistic_regression_matches_pyro():
    mcmc = run(NUTS(logistic_regression), 1000, 500, *logistic_data())
    assert_matches_reference(mcmc.get_samples(), reference("logistic_regression"))


def test_centered_eight_schools_reports_divergences():
    kernel = NUTS(eight_schools_centered)
    mcmc = run(kernel, 500, 300, EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA)
    divergences = mcmc.diagnostics()["divergences"]["chain 0"]
    assert len(divergences) > 0
    stats = kernel.sample_stats[0]
    flagged = [i - 300 for i, d in enumerate(stats["diverging"]) if d and i >= 300]
    assert flagged == divergences


@pytest.mark.parametrize("engine", ["auto", "eager"])
def test_model_failing_numerically_ends_the_transition_as_a_divergence(engine):
    """A potential that raises beyond |x| = 2 (eager autograd raises there; a traced program
    may return NaN instead): a doubling that fails -- the first or a later one (both happen
    here with the eager engine) -- ends its transition as a divergence that keeps the tree
    built so far, and the run carries on."""
    pyro.set_rng_seed(0)
    kernel = NUTS(potential_fn=failing_potential, step_size=0.5, adapt_step_size=False, engine=engine)
    mcmc = MCMC(kernel, num_samples=200, warmup_steps=0, initial_params={"x": torch.zeros(1)}, disable_progbar=True)
    mcmc.run()
    x = mcmc.get_samples()["x"]
    assert (x.abs() < 2).all() and x.std() > 0.5
    divergences = mcmc.diagnostics()["divergences"]["chain 0"]
    assert len(divergences) > 0
    stats = kernel.sample_stats[0]
    assert [i for i, d in enumerate(stats["diverging"]) if d] == divergences
    assert min(stats["n_steps"]) >= 1


def test_eager_engine_builds_trees_deeper_than_a_program_call():
    """On the eager engine a tree of more leaves than ``max_unroll`` is built chunk by
    chunk by small programs whose results are read back as records; an eager program learns
    its records' structure by running, and reading it before the first run failed with
    ``IndexError``. Steps of 0.05 on a unit Gaussian make trees of ~60 leaves."""
    pyro.set_rng_seed(0)
    kernel = NUTS(potential_fn=lambda p: 0.5 * (p["x"] ** 2).sum(), step_size=0.05, adapt_step_size=False,
                  engine="eager")
    mcmc = MCMC(kernel, num_samples=10, warmup_steps=0, initial_params={"x": torch.zeros(2)}, disable_progbar=True)
    mcmc.run()
    assert max(kernel.sample_stats[0]["n_steps"]) > kernel.max_unroll


def test_a_fused_start_failing_before_its_first_success_is_redone_doubling_by_doubling(monkeypatch):
    """With the eager engine (chosen, or fallen back to) a program knows the records it
    returns only once a call has succeeded: a run whose first fused start failed
    numerically crashed with ``IndexError`` rebuilding the tree of the doubling-by-doubling
    retry. Here that failure is made to happen, once; the retry, at the same momentum and
    directions, is an ordinary transition."""
    kernel = NUTS(potential_fn=lambda p: 0.5 * (p["x"] ** 2).sum(), step_size=0.5, adapt_step_size=False,
                  engine="eager")
    fused_start = kernel._first_doublings_program
    failures = []

    def failing_once():
        program = fused_start()
        if failures:
            return program
        failures.append(True)

        def fail(*leaves):
            raise torch.linalg.LinAlgError("made to fail")

        return type(program)(fail, program._out_structure)

    monkeypatch.setattr(kernel, "_first_doublings_program", failing_once)
    pyro.set_rng_seed(0)
    mcmc = MCMC(kernel, num_samples=50, warmup_steps=0, initial_params={"x": torch.zeros(2)}, disable_progbar=True)
    mcmc.run()
    assert failures and not any(kernel.sample_stats[0]["diverging"])
    assert mcmc.get_samples()["x"].std() > 0.5


# ---------------------------------------------------------------------------- the Pyro protocol


POISSON_COUNTS = torch.tensor([3.0, 5.0, 2.0, 4.0, 6.0])


def gamma_poisson_potential(params):
    """-log p(log rate | y) for the gamma_poisson model, over the unconstrained log rate."""
    log_rate = params["rate"]
    rate = log_rate.exp()
    lp = dist.Gamma(2.0, 1.0).log_prob(rate) + dist.Poisson(rate).log_prob(POISSON_COUNTS).sum() + log_rate
    return -lp


def test_potential_fn_with_transforms_initial_params_and_pickle():
    """Pyro's potential_fn interface: a positive site, with `transforms` mapping it to the
    unconstrained space (as in Pyro, samples come back constrained)."""
    y = POISSON_COUNTS
    kernel = NUTS(potential_fn=gamma_poisson_potential, transforms={"rate": dist.transforms.ExpTransform().inv})
    kernel = pickle.loads(pickle.dumps(kernel))
    mcmc = run(kernel, 1500, 300, initial_params={"rate": torch.tensor(0.0)})
    rate = mcmc.get_samples()["rate"].numpy()
    a, b = gamma_poisson_posterior(y)
    assert (rate > 0).all()
    assert_mean(rate, a / b)
    pickle.dumps(kernel)  # still picklable after a run


def test_sample_stats_diagnostics_and_arviz():
    kernel = NUTS(gauss2d)
    mcmc = run(kernel, 200, 100)
    stats = kernel.sample_stats[0]
    assert set(stats) == set(NUTS.stat_names) | {"warmup"}
    assert len(stats["lp"]) == 300 and sum(stats["warmup"]) == 100
    for n, depth in zip(stats["n_steps"], stats["tree_depth"]):
        assert 2**depth - 1 <= n <= 2 ** (depth + 1) - 1
    assert all(0.0 <= a <= 1.0 for a in stats["acceptance_rate"])
    diagnostics = mcmc.diagnostics()
    assert "divergences" in diagnostics and "acceptance rate" in diagnostics
    idata = az.from_pyro(mcmc)
    assert idata.posterior["q"].shape == (1, 200, 2)
    mcmc.summary()


def test_diagnostics_print_as_pyros_with_the_sample_stats_summarised():
    """``print(mcmc.diagnostics())`` reads as Pyro's (sites' ESS and R-hat, divergences,
    acceptance rates): the per-draw statistics that travel with it, 9 numbers a draw, show as
    one line per chain; they stay a dict of the same lists, and pickle (worker processes)."""
    kernel = NUTS(gauss2d)
    mcmc = run(kernel, 200, 100)
    diagnostics = mcmc.diagnostics()
    stats = diagnostics["sample_stats"]["chain 0"]
    assert stats == kernel.sample_stats[0] and pickle.loads(pickle.dumps(stats)) == stats
    assert repr(stats) == ("<sample stats of 300 draws (100 warmup): lp, energy, acceptance_rate, diverging, "
                           "step_size, n_steps, tree_depth, reached_max_treedepth; "
                           "pyro_hmc_plus.to_inference_data(mcmc) exports them>")
    assert len(repr(diagnostics)) < 1000


def test_invalid_arguments():
    with pytest.raises(ValueError, match="max_tree_depth"):
        NUTS(gauss2d, max_tree_depth=0)
    with pytest.raises(ValueError, match="exactly one"):
        NUTS()


def test_the_weights_of_two_leaves_sum_as_logsumexp_does():
    """The one-op log-sum-exp of two-leaf subtrees agrees with torch's, outside-the-slice
    (``-inf``) weights included."""
    from pyro_hmc_plus.nuts import _log_sum_exp

    inf = float("inf")
    log_w = torch.tensor([[0.3, -1.2], [-inf, 2.0], [-inf, -inf], [50.0, 49.0]])
    assert torch.allclose(_log_sum_exp(log_w, 2), torch.logsumexp(log_w, -1), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_weights_of_more_leaves_sum_to_torchs_logsumexp_exactly(dtype):
    """The log-sum-exp of 4-16 leaves, written as torch's own steps, gives torch's values
    bit for bit: weights of every scale, some ``-inf`` (all of a subtree's, too), ``+inf``."""
    from pyro_hmc_plus.nuts import _log_sum_exp

    g = torch.Generator().manual_seed(0)
    for num_leaves in (4, 8, 16):
        log_w = torch.randn(400, num_leaves, generator=g, dtype=dtype) * torch.logspace(0, 3, 4, dtype=dtype).repeat(100)[:, None]
        log_w[::7, : num_leaves // 2] = -float("inf")
        log_w[::11] = -float("inf")
        log_w[::13, 1] = float("inf")
        expected = torch.logsumexp(log_w, -1)
        assert torch.equal(_log_sum_exp(log_w, num_leaves), expected)
        assert expected.isinf().any() and expected.isfinite().any()


def test_u_turn_checks_of_all_blocks_match_stan_block_by_block():
    """The blocks' U-turn checks, made at once from one matrix of velocity-momentum dot
    products, equal Stan's three criteria evaluated block by block (``stan_tree``'s), and a
    leaf whose momentum is NaN leaves the checks of the blocks before it as they were."""
    from pyro_hmc_plus.nuts import _subtree_blocks, _turned_at

    L, D = 8, 3
    gen = torch.Generator().manual_seed(3)
    inv_mass = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)

    def criterion(p_minus, p_plus, rho):
        return bool((inv_mass * p_plus) @ rho > 0) and bool((inv_mass * p_minus) @ rho > 0)

    def stan_turned(r):
        """How many blocks ending at each leaf turn, block by block as Stan checks them."""
        turned = torch.zeros(L, dtype=torch.float64)
        size = 2
        while size <= L:
            for a0 in range(0, L, size):
                b0, b1 = a0 + size // 2, a0 + size - 1
                rho1, rho2 = r[a0:b0].sum(0), r[b0:b1 + 1].sum(0)
                persist = (criterion(r[a0], r[b1], rho1 + rho2) and criterion(r[a0], r[b0], rho1 + r[b0])
                           and criterion(r[b0 - 1], r[b1], rho2 + r[b0 - 1]))
                turned[b1] += not persist
            size *= 2
        return turned

    # momenta turning through 4.5 radians (the whole block turns), and random ones
    angles = torch.linspace(0, 4.5, L, dtype=torch.float64).unsqueeze(-1)
    r = torch.cat([angles.cos(), angles.sin(), 0.05 * torch.ones_like(angles)], -1)
    r = torch.stack([r, torch.randn(L, D, generator=gen, dtype=torch.float64)])  # two chains
    blocks = _subtree_blocks([L], r.device, r.dtype)
    turned = _turned_at(r, inv_mass * r, blocks)
    for chain in range(2):
        assert torch.equal(turned[chain], stan_turned(r[chain]))
    assert 0 < turned.sum() < 2 * (L - 1)  # both outcomes were exercised

    r[:, 5] = float("nan")  # a leaf that diverged: Stan stops at it, so later blocks do not matter
    with_nan = _turned_at(r, inv_mass * r, blocks)
    assert torch.equal(with_nan[:, :5], turned[:, :5])  # the blocks before it are judged as before
    assert (with_nan[:, 5] == 1).all()  # the block (4, 5) with it turns
