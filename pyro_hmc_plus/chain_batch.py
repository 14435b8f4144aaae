"""A batch of chains: what the batched samplers share (per-chain settings, step sizes and
their adaptation, the draw record), and static-length HMC for a batch, in rounds.

In a batch whose chains adapt their own step sizes, trajectories of ``trajectory_length``
have as many steps as each chain's step size says. Run as whole trajectories, the batch
would wait for its longest one at every draw (lock-step, as ``vmap``-ed samplers do). Here
each chain's trajectory advances by a *round* of ``ROUND_STEPS`` leapfrog steps per call of
:func:`hmc_round`, for every chain at once; a chain whose trajectory has its ``num_steps =
trajectory_length / step_size`` steps inside the round takes its end from the step where
they are complete, makes the Metropolis test, emits its draw, updates its own step size by
dual averaging (warmup), and starts its next trajectory in the next round. The steps a round
computes for a chain after its trajectory ended are wasted (the batch utilisation counts
them); the bookkeeping (the Metropolis test, the draw, the adaptation, the restart: over a
hundred operations) is paid once per round instead of once per step, which is what costs on a CPU,
where a traced program's operations cost about a microsecond each whatever the batch size.
When every trajectory has the same fixed length (no step-size adaptation), a round is one
whole trajectory. NUTS for a batch of chains is :mod:`pyro_hmc_plus.rounds`.

Chains that are *paused* (waiting for the host to update their metric at the end of an
adaptation window, or finished) keep their state unchanged. Every function is pure and
batch-shaped, with leading dimension C (chains); traced, one call is one program whose cost
does not depend on how the chains' trajectories interleave.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from .nuts import select
from .adaptation import DualAveragingState, dual_averaging_init, dual_averaging_update
from .hmc import MAX_ENERGY_ERROR, HMCState, hmc_step, metropolis
from .integrator import IntegratorState, leapfrog, leapfrog_states, state_at
from .metric import Metric, kinetic_energy, momentum

# Columns of the per-call draw record ``(C, D + NUM_STATS)``: the draw ``z`` then these.
STAT_COLUMNS = ("potential_energy", "energy", "acceptance_rate", "diverging", "accepted",
                "step_size", "n_steps", "tree_depth")
NUM_STATS = len(STAT_COLUMNS)


class Schedule(NamedTuple):
    """The per-chain settings a call needs, all ``(C,)`` (shared with :mod:`pyro_hmc_plus.rounds`)."""

    pause_at: torch.Tensor  # int64: a chain with this many draws stops until the host resumes it
    adapt_until: torch.Tensor  # int64: draws before this index update the step size (warmup)
    target_accept: torch.Tensor  # float: dual averaging's target acceptance statistic
    min_step_size: torch.Tensor
    max_step_size: torch.Tensor


class StepSize(NamedTuple):
    """A chain's step size and its dual-averaging state (``t`` as a float tensor), ``(C,)``."""

    value: torch.Tensor
    dual: DualAveragingState

    @staticmethod
    def start(value: torch.Tensor) -> "StepSize":
        """Step sizes ``value (C,)`` with dual averaging started afresh from them."""
        return StepSize(value, dual_averaging_init(value.log())._replace(t=torch.zeros_like(value)))


def _adapted(step_size: StepSize, accept_prob, adapt, finishing_warmup, schedule: Schedule) -> StepSize:
    """Dual averaging for the chains with ``adapt``; at the end of warmup
    (``finishing_warmup``) the averaged step size is used from then on, as Stan does; each
    within the schedule's bounds."""
    dual = dual_averaging_update(step_size.dual, accept_prob, schedule.target_accept)
    value = torch.where(finishing_warmup, dual.log_step_size_avg, dual.log_step_size).exp()
    value = torch.minimum(torch.maximum(value, schedule.min_step_size), schedule.max_step_size)
    return select(adapt, StepSize(value, dual), step_size)


def draw_row(z: torch.Tensor, info, step_size, n_steps, tree_depth) -> torch.Tensor:
    """A finished transition's draw ``z`` and its statistics (:data:`STAT_COLUMNS`) as one
    ``(C, D + NUM_STATS)`` row per chain: one tensor for the host to read."""
    f = z.dtype
    stats = [info.potential_energy, info.energy, info.acceptance_prob, info.diverging.to(f), info.accepted.to(f),
             step_size, n_steps.to(f), tree_depth.to(f)]
    return torch.cat([z, torch.stack(stats, -1)], -1)


def counted_and_adapted(chains, done, accept_prob, schedule: Schedule):
    """Each chain's draw count after this call's finished transitions, and its step size
    after dual averaging on those that were warmup draws."""
    draws = chains.draws + done.to(torch.int64)
    adapt = done & (chains.draws < schedule.adapt_until)
    return draws, _adapted(chains.step_size, accept_prob, adapt, draws == schedule.adapt_until, schedule)


# Columns of a round's ``uniforms (C, NUM_UNIFORMS)``: the Metropolis test's.
METROPOLIS = 0
NUM_UNIFORMS = 1

ROUND_STEPS = 8  # leapfrog steps per chain in a round of :func:`hmc_round`


class HMCChains(NamedTuple):
    """Every chain's static-length HMC trajectory in progress, batch shape ``(C,)``."""

    position: HMCState  # the chain's current draw, where its trajectory started
    starting: torch.Tensor  # bool: the next call starts a new trajectory at ``position``
    leaf: IntegratorState  # the trajectory's current end
    H0: torch.Tensor  # the Hamiltonian at the start
    n_steps: torch.Tensor  # int64: steps taken in this trajectory
    step_size: StepSize
    draws: torch.Tensor  # int64


def _trajectory_steps(step_size: torch.Tensor, trajectory_length: float) -> torch.Tensor:
    """Pyro's number of leapfrog steps, ``max(1, int(trajectory_length / step_size))``."""
    return (trajectory_length / step_size).floor().clamp(min=1, max=2**40).to(torch.int64)


def _start_trajectories(state: HMCState, noise, metric: Metric):
    r = momentum(noise, metric.momentum_scale)
    start = IntegratorState(state.z, r, state.potential_energy, state.grad)
    return start, state.potential_energy + kinetic_energy(r, metric.inverse_mass)


def hmc_init(state: HMCState, metric: Metric, step_size: StepSize) -> HMCChains:
    """Every chain about to start its first trajectory from ``state`` (batch ``(C,)``)."""
    leaf, H0 = _start_trajectories(state, torch.zeros_like(state.z), metric)  # placeholders
    zeros = torch.zeros(state.z.shape[:-1], dtype=torch.int64, device=state.z.device)
    return HMCChains(state, torch.ones_like(zeros, dtype=torch.bool), leaf, H0, zeros, step_size, zeros.clone())


def hmc_round(
    value_and_grad: Callable,
    chains: HMCChains,
    noise: torch.Tensor,
    uniforms: torch.Tensor,
    metric: Metric,
    schedule: Schedule,
    trajectory_length: float,
    round_steps: int = ROUND_STEPS,
    num_steps: Optional[int] = None,
    max_energy_error: float = MAX_ENERGY_ERROR,
):
    """One round for every chain that is not paused: ``round_steps`` leapfrog steps of its
    trajectory (a chain starting one draws its momentum from ``noise``). A trajectory has
    ``trajectory_length / step_size`` steps (each chain's own step size), or ``num_steps``
    where given: the kernel's, for step sizes that are not adapted (computed from the given
    step size as a Python float: a float32 step size may round the quotient down by one
    step). A chain whose trajectory has its steps inside the round takes its end from the step
    where they are complete (the round's later steps are wasted on it), makes the
    Metropolis test (``uniforms[:, METROPOLIS]``) and emits its draw; the others carry
    their last step to the next round. Returns ``(chains, draw, done, steps)``: ``draw
    (C, D + NUM_STATS)`` holds the finished transitions' draws and statistics
    (:data:`STAT_COLUMNS`), valid where ``done``; ``steps`` (int64) the leapfrog steps that
    belong to trajectories, for the batch utilisation."""
    c = chains
    if num_steps == round_steps:  # fixed step sizes, every trajectory one round: nothing carried over
        return _whole_trajectories(value_and_grad, c, noise, uniforms, metric, schedule, num_steps, max_energy_error)
    active = c.draws < schedule.pause_at
    fresh = _start_trajectories(c.position, noise, metric)
    start, H0 = select(c.starting, fresh, (c.leaf, c.H0))
    taken_before = torch.where(c.starting, torch.zeros_like(c.n_steps), c.n_steps)
    if num_steps is None:
        remaining = _trajectory_steps(c.step_size.value, trajectory_length) - taken_before
    else:
        remaining = num_steps - taken_before
    taken = remaining.clamp(max=round_steps)
    leaves = leapfrog_states(value_and_grad, start, c.step_size.value, metric.inverse_mass, round_steps)
    leaf = state_at(leaves, taken - 1)
    done = active & (remaining <= round_steps)
    n_steps = taken_before + taken
    moved, info = metropolis(c.position, H0, leaf, uniforms[..., METROPOLIS].log(), metric, max_energy_error)
    draw = draw_row(moved.z, info, c.step_size.value, n_steps, torch.zeros_like(n_steps))
    if num_steps is None:
        draws, step_size = counted_and_adapted(c, done, info.acceptance_prob, schedule)
    else:  # step sizes not adapted
        draws, step_size = c.draws + done.to(torch.int64), c.step_size
    # a paused chain is about to start a trajectory, which rebuilds everything but its position
    advanced = HMCChains(
        position=select(done, moved, c.position),
        starting=done | ~active,
        leaf=leaf,
        H0=H0,
        n_steps=n_steps,
        step_size=step_size,
        draws=draws,
    )
    return advanced, draw, done, taken * active


def _whole_trajectories(value_and_grad, chains: HMCChains, noise, uniforms, metric: Metric, schedule: Schedule,
                        num_steps: int, max_energy_error: float):
    """:func:`hmc_round` where every trajectory has ``num_steps`` steps, the round's length:
    a whole transition per chain, fused, without the state a trajectory carries from round
    to round (its selects, counts and gather cost 5-10% of a 4-chain run, measured)."""
    c = chains
    active = c.draws < schedule.pause_at

    def integrate(start, step_size, inverse_mass):
        return leapfrog(value_and_grad, start, step_size, inverse_mass, num_steps)

    moved, info = hmc_step(integrate, c.position, noise, uniforms[..., METROPOLIS].log(), c.step_size.value, metric,
                           max_energy_error)
    steps = torch.full_like(c.draws, num_steps)
    draw = draw_row(moved.z, info, c.step_size.value, steps, torch.zeros_like(steps))
    advanced = c._replace(position=select(active, moved, c.position), draws=c.draws + active.to(torch.int64))
    return advanced, draw, active, active * num_steps
