"""Static-length HMC as a pure transition over flat tensors.

``hmc_step`` draws nothing itself: the caller passes standard normal ``noise`` for the
momentum and ``log_u`` (the log of a uniform draw) for the Metropolis test, so the
function is deterministic, traceable, and the same for one chain and a batch of chains.

The proposal is ``num_steps`` leapfrog steps from ``(z, r)``; it is accepted with
probability ``min(1, exp(-(H' - H)))`` where ``H = U(z) + K(r)``. A non-finite ``H'``
(the trajectory left the region where the model is defined) counts as ``+inf``: the
proposal is rejected and the transition is marked divergent, as is any energy error above
``max_energy_error`` (1000, as in Stan and Pyro).

References: Neal, "MCMC using Hamiltonian dynamics" (2011); Betancourt, "A Conceptual
Introduction to Hamiltonian Monte Carlo" (2017).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .integrator import IntegratorState
from .metric import Metric, kinetic_energy, momentum

MAX_ENERGY_ERROR = 1000.0


class HMCState(NamedTuple):
    z: torch.Tensor  # (..., D)
    potential_energy: torch.Tensor  # (...)
    grad: torch.Tensor  # (..., D)


class HMCInfo(NamedTuple):
    """Per-transition statistics, each of batch shape ``(...)``."""

    potential_energy: torch.Tensor  # U at the returned state (lp = -U)
    energy: torch.Tensor  # Hamiltonian U + K at the returned state (Stan's energy__)
    acceptance_prob: torch.Tensor  # min(1, exp(-delta H))
    diverging: torch.Tensor  # bool: energy error above the threshold or non-finite
    accepted: torch.Tensor  # bool


def hmc_step(
    integrate: Callable[[IntegratorState, torch.Tensor, torch.Tensor], IntegratorState],
    state: HMCState,
    noise: torch.Tensor,
    log_u: torch.Tensor,
    step_size: torch.Tensor,
    metric: Metric,
    max_energy_error: float = MAX_ENERGY_ERROR,
):
    """One HMC transition. ``integrate(state, step_size, inverse_mass)`` runs the trajectory.

    Shapes: ``noise`` like ``z``; ``log_u`` and ``step_size`` of the batch shape.
    Returns ``(HMCState, HMCInfo)``.
    """
    r0 = momentum(noise, metric.momentum_scale)
    H0 = state.potential_energy + kinetic_energy(r0, metric.inverse_mass)
    start = IntegratorState(state.z, r0, state.potential_energy, state.grad)
    end = integrate(start, step_size, metric.inverse_mass)
    return metropolis(state, H0, end, log_u, metric, max_energy_error)


def metropolis(state: HMCState, H0: torch.Tensor, end: IntegratorState, log_u: torch.Tensor,
               metric: Metric, max_energy_error: float = MAX_ENERGY_ERROR):
    """The Metropolis test of a trajectory from ``state`` (Hamiltonian ``H0``) to ``end``:
    returns ``(HMCState, HMCInfo)`` as :func:`hmc_step`."""
    H1 = end.potential_energy + kinetic_energy(end.r, metric.inverse_mass)
    delta = H1 - H0
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, float("inf")), delta)
    acceptance_prob = torch.exp(-delta).clamp(max=1.0)
    accepted = log_u < -delta
    keep = accepted.unsqueeze(-1)
    new_state = HMCState(
        torch.where(keep, end.z, state.z),
        torch.where(accepted, end.potential_energy, state.potential_energy),
        torch.where(keep, end.grad, state.grad),
    )
    info = HMCInfo(
        potential_energy=new_state.potential_energy,
        energy=torch.where(accepted, H1, H0),
        acceptance_prob=acceptance_prob,
        diverging=delta > max_energy_error,
        accepted=accepted,
    )
    return new_state, info


def stat_row(info: HMCInfo) -> torch.Tensor:
    """The transition's statistics ``lp = -U, energy, acceptance probability, diverging,
    accepted`` as one float64 tensor of shape ``(..., 5)``: computed inside the compiled transition, so that the host reads a
    draw's statistics with one conversion instead of five."""
    f = info.energy.dtype
    values = [-info.potential_energy, info.energy, info.acceptance_prob, info.diverging.to(f), info.accepted.to(f)]
    return torch.stack(values, -1).to(torch.float64)

