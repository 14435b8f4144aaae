"""Warmup adaptation: dual averaging of the step size, Welford estimates of the
posterior covariance, and Stan's windowed schedule. Pure ``init``/``update``/``finalize``
functions over small immutable records.

Dual averaging (Hoffman & Gelman 2014, section 3.2; Nesterov 2009) drives the mean
acceptance statistic to ``target_accept_prob`` by steering ``log(step_size)``; the constants
``t0=10, kappa=0.75, gamma=0.05`` and the prox-centre ``log(10 * step_size)`` are Stan's and
Pyro's. The arithmetic works on Python floats (one chain) and on tensors (one value per
chain) alike.

The inverse mass matrix is the regularised sample covariance of the draws in each slow
window (Stan: ``n/(n+5) * cov + 1e-3 * 5/(n+5) * I``). The schedule is Stan's 75/25/50:
a fast window for the step size, slow windows doubling in length for the metric, and a
final fast window; Pyro's ``WarmupAdapter`` uses the same windows.
"""

from __future__ import annotations

from typing import List, NamedTuple

import torch


# ---------------------------------------------------------------------------- dual averaging
class DualAveragingState(NamedTuple):
    prox_center: object  # log(10 * initial step size)
    log_step_size: object  # x_t, the step size to use next
    log_step_size_avg: object  # the weighted average, the step size after warmup
    grad_avg: object
    t: int


T0, KAPPA, GAMMA = 10.0, 0.75, 0.05


def dual_averaging_init(log_step_size) -> DualAveragingState:
    zero = log_step_size * 0
    return DualAveragingState(log_step_size + 2.302585092994046, log_step_size, zero, zero, 0)


def dual_averaging_update(state: DualAveragingState, accept_stat, target) -> DualAveragingState:
    """One update with the transition's acceptance statistic (float, or tensor per chain)."""
    t = state.t + 1
    w = 1.0 / (t + T0)
    grad_avg = (1.0 - w) * state.grad_avg + w * (target - accept_stat)
    x = state.prox_center - (t**0.5) / GAMMA * grad_avg
    eta = t ** (-KAPPA)
    x_avg = (1.0 - eta) * state.log_step_size_avg + eta * x
    return DualAveragingState(state.prox_center, x, x_avg, grad_avg, t)


# ---------------------------------------------------------------------------- Welford
class WelfordState(NamedTuple):
    count: int
    mean: torch.Tensor  # (..., D)
    m2: torch.Tensor  # (..., D) sum of squared deviations, or (..., D, D) of outer products


def welford_init(like: torch.Tensor, dense: bool) -> WelfordState:
    """An empty estimator for draws shaped like ``like`` (``(..., D)``)."""
    m2 = like.new_zeros(like.shape + like.shape[-1:]) if dense else torch.zeros_like(like)
    return WelfordState(0, torch.zeros_like(like), m2)


def welford_update(state: WelfordState, z: torch.Tensor) -> WelfordState:
    count = state.count + 1
    delta = z - state.mean
    mean = state.mean + delta / count
    if state.m2.dim() > z.dim():
        m2 = state.m2 + delta.unsqueeze(-1) * (z - mean).unsqueeze(-2)
    else:
        m2 = state.m2 + delta * (z - mean)
    return WelfordState(count, mean, m2)


def welford_covariance(state: WelfordState) -> torch.Tensor:
    """Stan's regularised covariance estimate; needs at least two draws."""
    n = state.count
    if n < 2:
        raise ValueError("need at least two draws to estimate a covariance")
    cov = state.m2 / (n - 1) * (n / (n + 5.0))
    shrink = 1e-3 * (5.0 / (n + 5.0))
    if state.m2.dim() > state.mean.dim():
        eye = torch.eye(cov.shape[-1], dtype=cov.dtype, device=cov.device)
        return cov + shrink * eye
    return cov + shrink


# ---------------------------------------------------------------------------- schedule
class Window(NamedTuple):
    start: int  # first warmup iteration of the window (0-based, inclusive)
    end: int  # last (inclusive)


def adaptation_schedule(warmup_steps: int) -> List[Window]:
    """Stan's windows for ``warmup_steps`` iterations (as Pyro builds them).

    The first and last windows adapt only the step size; the ones between also collect
    draws for the metric. Fewer than 20 warmup steps: one window, step size only.
    """
    if warmup_steps <= 0:
        return []
    if warmup_steps < 20:
        return [Window(0, warmup_steps - 1)]
    start_buffer, end_buffer, first_window = 75, 50, 25
    if start_buffer + end_buffer + first_window > warmup_steps:
        start_buffer = int(0.15 * warmup_steps)
        end_buffer = int(0.1 * warmup_steps)
        first_window = warmup_steps - start_buffer - end_buffer
    windows = [Window(0, start_buffer - 1)]
    end_start = warmup_steps - end_buffer
    size, start = first_window, start_buffer
    while start < end_start:
        cur_size = size
        if 3 * size <= end_start - start:
            size = 2 * size
        else:
            cur_size = end_start - start
        windows.append(Window(start, start + cur_size - 1))
        start += cur_size
    windows.append(Window(end_start, warmup_steps - 1))
    return windows


def metric_windows(windows: List[Window]) -> List[Window]:
    """The slow windows of a schedule (:func:`adaptation_schedule`), which collect draws
    for the metric: all but the first and the last."""
    return windows[1:-1]


def metric_window_draws(warmup_steps: int) -> int:
    """The draws of the last slow window of :func:`adaptation_schedule`, which estimate the
    mass matrix that sampling uses: 0 where warmup has no slow window."""
    slow = metric_windows(adaptation_schedule(warmup_steps))
    return slow[-1].end - slow[-1].start + 1 if slow else 0


def warmup_steps_for_metric_draws(draws: int, at_least: int) -> int:
    """The fewest warmup steps from ``at_least`` on whose last slow window has at least
    ``draws`` draws. Not every longer warmup has as many: the last window takes the
    schedule's remainder (300 steps give it 100 draws, 299 give it 149)."""
    warmup_steps = max(at_least, 20)
    while metric_window_draws(warmup_steps) < draws:
        warmup_steps += 1
    return warmup_steps


# ---------------------------------------------------------------------------- initial step size
DIRECTION_THRESHOLD = -0.2231435513142097  # log(0.8), as Pyro


def find_reasonable_step_size(energy_change, step_size: float, min_step_size: float, max_step_size: float) -> float:
    """Double or halve ``step_size`` until one leapfrog step's acceptance crosses 0.8.

    ``energy_change(step_size) -> float`` runs one leapfrog step from the current point with
    fresh momentum and returns ``H_new - H_old`` (``inf`` if not finite). This is Pyro's
    heuristic (Hoffman & Gelman 2014, Algorithm 4); it runs once at the start of warmup and
    after every metric update, so it may synchronise with the host.
    """

    def direction(eps):
        return 1 if DIRECTION_THRESHOLD < -energy_change(eps) else -1

    first = direction(step_size)
    scale = 2.0**first
    while min_step_size < step_size < max_step_size:
        step_size *= scale
        if direction(step_size) != first:
            break
    return min(max(step_size, min_step_size), max_step_size)
