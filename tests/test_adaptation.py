import math

import numpy as np
import pytest
import torch
from pyro.infer.mcmc.adaptation import WarmupAdapter
from pyro.ops.dual_averaging import DualAveraging
from pyro.ops.welford import WelfordCovariance

from pyro_hmc_plus import adaptation


@pytest.mark.parametrize("warmup", [1, 10, 19, 20, 100, 150, 151, 500, 1000, 1234])
def test_schedule_matches_pyro(warmup):
    adapter = WarmupAdapter(adapt_step_size=True)
    adapter._warmup_steps = warmup
    expected = [(w.start, w.end) for w in adapter._build_adaptation_schedule()]
    assert [tuple(w) for w in adaptation.adaptation_schedule(warmup)] == expected


def test_dual_averaging_matches_pyro():
    rng = np.random.default_rng(0)
    ref = DualAveraging(prox_center=math.log(10 * 0.3))
    state = adaptation.dual_averaging_init(math.log(0.3))
    for _ in range(50):
        a = float(rng.uniform())
        ref.step(0.8 - a)
        state = adaptation.dual_averaging_update(state, a, 0.8)
        x, x_avg = ref.get_state()
        assert state.log_step_size == pytest.approx(x) and state.log_step_size_avg == pytest.approx(x_avg)


def test_dual_averaging_works_per_chain_on_tensors():
    state = adaptation.dual_averaging_init(torch.log(torch.tensor([0.1, 1.0])))
    state = adaptation.dual_averaging_update(state, torch.tensor([0.2, 0.99]), 0.8)
    assert state.log_step_size.shape == (2,)
    # low acceptance shrinks the step size, high acceptance grows it (relative to the prox centre)
    assert state.log_step_size[0] < state.prox_center[0] and state.log_step_size[1] > 0


@pytest.mark.parametrize("dense", [False, True])
def test_welford_matches_pyro_regularised_covariance(dense):
    x = torch.randn(200, 4, dtype=torch.float64) @ torch.tensor(
        [[1.0, 0.5, 0, 0], [0, 2.0, 0, 0], [0, 0, 0.1, 0], [0, 0, 0, 3.0]], dtype=torch.float64
    )
    ref = WelfordCovariance(diagonal=not dense)
    state = adaptation.welford_init(x[0], dense)
    for row in x:
        ref.update(row)
        state = adaptation.welford_update(state, row)
    assert torch.allclose(adaptation.welford_covariance(state), ref.get_covariance(), rtol=1e-10)


def test_find_reasonable_step_size_brackets_acceptance():
    # energy error of one step grows like step_size**2 on a unit Gaussian
    eps = adaptation.find_reasonable_step_size(lambda e: e**2 * 2.0, 1.0, 1e-10, 1e10)
    # coming down from a too-large step: the first step size whose acceptance exceeds 0.8
    assert math.exp(-2.0 * (2 * eps) ** 2) < 0.8 < math.exp(-2.0 * eps**2)


@pytest.mark.parametrize("warmup, draws", [(10, 0), (20, 15), (150, 25), (187, 62), (299, 149), (300, 100), (1000, 500)])
def test_metric_window_draws_are_the_last_slow_windows(warmup, draws):
    """The last slow window takes the schedule's remainder, so a longer warmup may give it
    fewer draws (299 steps: 149, 300: 100)."""
    assert adaptation.metric_window_draws(warmup) == draws


def test_warmup_steps_for_metric_draws_is_the_fewest_from_the_given_ones():
    for draws, at_least in [(62, 150), (200, 300), (400, 300), (10, 1000)]:
        found = adaptation.warmup_steps_for_metric_draws(draws, at_least)
        assert found >= at_least and adaptation.metric_window_draws(found) >= draws
        assert all(adaptation.metric_window_draws(w) < draws for w in range(at_least, found))
