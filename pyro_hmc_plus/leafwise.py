"""NUTS and HMC one leapfrog step at a time, so that a batch of chains never waits for its
slowest member.

:mod:`pyro_hmc_plus.nuts` builds a whole doubling per call, which suits one chain: but in a
batch, a chain whose tree has stopped would sit idle until every other chain's tree stops
(lock-step, as ``vmap``-ed samplers do). Here each chain's transition is a small state
machine that advances by exactly one leaf per call of :func:`nuts_advance`, for every chain
at once:

1. one leapfrog step from the chain's last leaf (forward or backward, per chain);
2. the leaf's energy, weight and acceptance statistic; the subtree's proposal is updated by
   progressive sampling (the leaf replaces it with probability ``w_leaf / w_subtree``, which
   gives the same multinomial distribution as Stan's recursion);
3. Stan's U-turn checks for every sub-subtree that this leaf completes (sizes 2, 4, ...),
   with its two extra checks across the halves, vectorised over the sizes: the begin and end
   momenta and the running momentum sums of the open blocks are kept as checkpoints, one row
   per block size (a binary counter over the leaf index, as in NumPyro's iterative NUTS);
4. when the subtree is complete, or turned or diverged, it is merged into the tree by
   :func:`pyro_hmc_plus.nuts.extend_tree` (biased progressive sampling, the U-turn check across
   the join, the stopping rule);
5. a chain whose transition is over emits its draw and updates its own step size by dual
   averaging (warmup); its next transition (new momentum, new tree) starts at the beginning
   of the next call, whose first leaf it builds alongside the other chains' leaves. (Starting
   it there rather than here lets the host change a chain's metric between calls.)

A transition is therefore exactly Stan's (same tree depth, number of steps, acceptance
statistic and divergences for the same momentum and directions); only the random numbers
are consumed in a different order. Chains that are *paused* (waiting for the host to update
their metric at the end of an adaptation window, or finished) keep their state unchanged.

:func:`hmc_advance` does the same for static-length HMC: a chain's trajectory of
``num_steps = trajectory_length / step_size`` steps (its own adapted step size) ends with
the Metropolis test, and the next trajectory starts in the same call.

Every function is pure and batch-shaped, with leading dimension C (chains); traced, one call
is one program whose cost does not depend on how the chains' trajectories interleave.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import nuts
from .nuts import select
from .adaptation import DualAveragingState, dual_averaging_init, dual_averaging_update
from .hmc import MAX_ENERGY_ERROR, HMCState, hmc_step, metropolis
from .integrator import IntegratorState, leapfrog
from .metric import Metric, kinetic_energy, momentum, velocity

# Columns of the per-call draw record ``(C, D + NUM_STATS)``: the draw ``z`` then these.
STAT_COLUMNS = ("potential_energy", "energy", "acceptance_rate", "diverging", "accepted",
                "step_size", "n_steps", "tree_depth")
NUM_STATS = len(STAT_COLUMNS)


class Schedule(NamedTuple):
    """The per-chain settings a call needs, all ``(C,)``."""

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


class NUTSChains(NamedTuple):
    """Every chain's NUTS transition in progress, batch shape ``(C,)``."""

    position: HMCState  # the chain's current draw
    starting: torch.Tensor  # bool: the next call starts a new transition at ``position``
    tree: nuts.Tree  # the tree before the subtree under construction
    forward: torch.Tensor  # bool: direction of the subtree under construction
    leaf: IntegratorState  # the last leaf built (the start of the next leapfrog step)
    n_leaves: torch.Tensor  # int64: leaves of the subtree built so far
    rho: torch.Tensor  # (C, D) the subtree's sum of momenta so far
    log_weight: torch.Tensor  # the subtree's log weight so far (-inf before its first leaf)
    proposal: HMCState  # the subtree's proposal so far
    proposal_energy: torch.Tensor
    sum_accept: torch.Tensor  # the subtree's sum of min(1, exp(H0 - H)) so far
    block_begin: torch.Tensor  # (C, K, 3D): v, p, rho-before at the first leaf of the open block of 2**k leaves
    block_end: torch.Tensor  # (C, K, 2D): v, p at the last leaf of the last complete block of 2**k leaves
    step_size: StepSize
    draws: torch.Tensor  # int64: draws made so far (warmup included)


# Columns of a call's ``uniforms (C, NUM_UNIFORMS)``.
START_DIRECTION, LEAF_DRAW, TREE_DRAW, SLICE, NEXT_DIRECTION = range(5)
NUM_UNIFORMS = 5


def _new_transitions(state: HMCState, noise, uniforms, metric: Metric, multinomial: bool):
    """For each chain, the one-state tree at ``state`` with momentum from ``noise`` and the
    direction of its first subtree: ``(tree, forward, leaf)``."""
    log_slice = torch.zeros_like(state.potential_energy) if multinomial else uniforms[..., SLICE].log()
    tree = nuts.init_tree(state, noise, log_slice, metric)
    forward = uniforms[..., START_DIRECTION] < 0.5
    return tree, forward, nuts.fresh_tree_end(tree)


def nuts_init(state: HMCState, metric: Metric, step_size: StepSize, max_tree_depth: int) -> NUTSChains:
    """Every chain about to start its first transition from ``state`` (batch ``(C,)``)."""
    z = state.z
    C, D = z.shape
    K = max_tree_depth
    uniforms = z.new_zeros(C, NUM_UNIFORMS)
    tree, forward, leaf = _new_transitions(state, torch.zeros_like(z), uniforms, metric, True)  # placeholders
    return NUTSChains(
        state, torch.ones(C, dtype=torch.bool, device=z.device), tree, forward, leaf,
        n_leaves=torch.zeros(C, dtype=torch.int64, device=z.device),
        rho=torch.zeros_like(z),
        log_weight=torch.full_like(state.potential_energy, -float("inf")),
        proposal=state,
        proposal_energy=tree.H0,
        sum_accept=torch.zeros_like(state.potential_energy),
        block_begin=z.new_zeros(C, K, 3 * D),
        block_end=z.new_zeros(C, K, 2 * D),
        step_size=step_size,
        draws=torch.zeros(C, dtype=torch.int64, device=z.device),
    )


def _adapted(step_size: StepSize, accept_prob, adapt, finishing_warmup, schedule: Schedule) -> StepSize:
    """Dual averaging for the chains with ``adapt``; at the end of warmup
    (``finishing_warmup``) the averaged step size is used from then on, as Stan does."""
    dual = dual_averaging_update(step_size.dual, accept_prob, schedule.target_accept)
    value = torch.minimum(torch.maximum(dual.log_step_size.exp(), schedule.min_step_size), schedule.max_step_size)
    value = torch.where(finishing_warmup, dual.log_step_size_avg.exp(), value)
    return select(adapt, StepSize(value, dual), step_size)


def _draw_row(z: torch.Tensor, info, step_size, n_steps, tree_depth) -> torch.Tensor:
    """A finished transition's draw ``z`` and its statistics (:data:`STAT_COLUMNS`) as one
    ``(C, D + NUM_STATS)`` row per chain: one tensor for the host to read."""
    f = z.dtype
    stats = [info.potential_energy, info.energy, info.acceptance_prob, info.diverging.to(f), info.accepted.to(f),
             step_size, n_steps.to(f), tree_depth.to(f)]
    return torch.cat([z, torch.stack(stats, -1)], -1)


def _counted_and_adapted(chains, done, accept_prob, schedule: Schedule):
    """Each chain's draw count after this call's finished transitions, and its step size
    after dual averaging on those that were warmup draws."""
    draws = chains.draws + done.to(torch.int64)
    adapt = done & (chains.draws < schedule.adapt_until)
    return draws, _adapted(chains.step_size, accept_prob, adapt, draws == schedule.adapt_until, schedule)


def _level_masks(n: torch.Tensor, K: int):
    """For leaf index ``n (C,)``, which block sizes ``2**k`` (k = 0..K-1) begin at ``n`` and
    which end at it: two ``(C, K)`` bool masks."""
    low_bits = torch.tensor([(1 << k) - 1 for k in range(K)], device=n.device)  # a constant in a trace
    begins = (n.unsqueeze(-1) & low_bits) == 0
    ends = ((n + 1).unsqueeze(-1) & low_bits) == 0
    return begins, ends


def nuts_advance(
    value_and_grad: Callable,
    chains: NUTSChains,
    noise: torch.Tensor,
    uniforms: torch.Tensor,
    metric: Metric,
    schedule: Schedule,
    max_tree_depth: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
):
    """One leaf for every chain that is not paused. ``noise (C, D)`` and ``uniforms (C,
    NUM_UNIFORMS)`` are this call's random numbers (momentum, direction and slice variable of
    a transition that starts here; the leaf's multinomial draw; the tree's progressive draw;
    the direction of a subtree that starts after this leaf). Returns ``(chains, draw, done, active)``: ``draw (C, D + NUM_STATS)`` holds the
    finished transitions' draws and statistics (:data:`STAT_COLUMNS`), valid where ``done``;
    ``active`` marks the chains that did work."""
    c = chains
    inv = metric.inverse_mass
    D = c.rho.shape[-1]
    K = max_tree_depth
    active = c.draws < schedule.pause_at
    fresh = _new_transitions(c.position, noise, uniforms, metric, multinomial)
    tree, forward, start = select(c.starting, fresh, (c.tree, c.forward, c.leaf))
    eps = nuts.signed_step_size(c.step_size.value, forward)
    leaf = leapfrog(value_and_grad, start, eps, inv, 1)

    # the leaf's energy, weight, acceptance statistic and divergence
    v = velocity(leaf.r, inv)
    H = leaf.potential_energy + 0.5 * (leaf.r * v).sum(-1)
    delta, log_w, divergent = nuts.leaf_weights(H, tree.H0, tree.log_slice, multinomial, max_energy_error)
    log_weight = torch.logaddexp(c.log_weight, log_w)
    take = uniforms[..., LEAF_DRAW] < torch.exp(log_w - log_weight)
    proposal = select(take, HMCState(leaf.z, leaf.potential_energy, leaf.grad), c.proposal)
    proposal_energy = torch.where(take, H, c.proposal_energy)
    sum_accept = c.sum_accept + torch.exp(delta.clamp(max=0.0))
    rho = c.rho + leaf.r

    # U-turn checks of the blocks of 2, 4, ... leaves that this leaf completes
    n = c.n_leaves
    begins, ends = _level_masks(n, K)
    here = torch.cat([v, leaf.r, c.rho], -1).unsqueeze(-2)  # (C, 1, 3D): rho before this leaf
    block_begin = torch.where(begins.unsqueeze(-1), here, c.block_begin)
    turned = torch.zeros_like(divergent)
    if K > 1:
        v_b0, p_b0, rho_at_mid = block_begin[..., :-1, :].split([D] * 3, -1)  # second half's first leaf
        v_a0, _, rho_at_first = block_begin[..., 1:, :].split([D] * 3, -1)  # the block's first leaf
        v_a1, p_a1 = c.block_end[..., :-1, :].split([D] * 2, -1)  # first half's last leaf
        v_b1 = v.unsqueeze(-2).expand_as(v_b0)
        ok = nuts._joins_without_u_turn(
            v_a0, v_a1, p_a1, rho_at_mid - rho_at_first, v_b0, v_b1, p_b0, rho.unsqueeze(-2) - rho_at_mid
        )  # (C, K - 1): the block of 2**(k+1) leaves ending here
        turned = (ends[..., 1:] & ~ok).any(-1)
    block_end = torch.where(ends.unsqueeze(-1), here[..., : 2 * D], c.block_end)

    # the subtree is over when complete (2**depth leaves) or when it turned or diverged
    failed = divergent | turned
    complete = (n + 1) == (1 << tree.depth)
    subtree_over = failed | complete
    subtree = nuts.Subtree(
        last=leaf, p_first=block_begin[..., -1, D : 2 * D], p_last=leaf.r, rho=rho,
        log_weight=log_weight, proposal=proposal, proposal_energy=proposal_energy,
        n_steps=n + 1, sum_accept=sum_accept, diverging=divergent, valid=~failed,
    )
    grown = nuts.extend_tree(tree, subtree, forward, uniforms[..., TREE_DRAW], inv, max_tree_depth, keep_done=False)
    done = active & subtree_over & grown.done

    # the draw of a finished transition
    info = nuts.info(grown)
    draw = _draw_row(grown.proposal.z, info, c.step_size.value, info.n_steps, info.tree_depth)
    draws, step_size = _counted_and_adapted(c, done, info.acceptance_prob, schedule)

    # what each chain builds next: the same subtree, a new subtree, or (next call) a new
    # transition. A paused chain is always about to start a transition (it pauses right after
    # one ends), which rebuilds its tree and leaf: so only its subtree accumulators must be
    # kept reset, and no select over its whole state is needed.
    new_forward = uniforms[..., NEXT_DIRECTION] < 0.5
    reset = subtree_over | ~active
    advanced = NUTSChains(
        position=select(done, grown.proposal, c.position),
        starting=done | ~active,
        tree=select(subtree_over, grown, tree),
        forward=torch.where(subtree_over, new_forward, forward),
        leaf=select(subtree_over, nuts.subtree_start(grown, new_forward), leaf),
        n_leaves=torch.where(reset, torch.zeros_like(n), n + 1),
        rho=torch.where(reset.unsqueeze(-1), torch.zeros_like(rho), rho),
        log_weight=torch.where(reset, torch.full_like(log_weight, -float("inf")), log_weight),
        proposal=proposal,
        proposal_energy=proposal_energy,
        sum_accept=torch.where(reset, torch.zeros_like(sum_accept), sum_accept),
        block_begin=block_begin,
        block_end=block_end,
        step_size=step_size,
        draws=draws,
    )
    return advanced, draw, done, active


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


def hmc_advance(
    value_and_grad: Callable,
    chains: HMCChains,
    noise: torch.Tensor,
    uniforms: torch.Tensor,
    metric: Metric,
    schedule: Schedule,
    trajectory_length: float,
    max_energy_error: float = MAX_ENERGY_ERROR,
):
    """One leapfrog step for every chain that is not paused (a chain starting a trajectory
    draws its momentum from ``noise``); a chain whose trajectory has its ``num_steps`` steps
    makes the Metropolis test (``uniforms[:, LEAF_DRAW]``) and emits its draw. Returns as
    :func:`nuts_advance`."""
    c = chains
    active = c.draws < schedule.pause_at
    fresh = _start_trajectories(c.position, noise, metric)
    start, H0 = select(c.starting, fresh, (c.leaf, c.H0))
    n_steps = torch.where(c.starting, torch.zeros_like(c.n_steps), c.n_steps) + 1
    leaf = leapfrog(value_and_grad, start, c.step_size.value, metric.inverse_mass, 1)
    num_steps = _trajectory_steps(c.step_size.value, trajectory_length)
    done = active & (n_steps >= num_steps)
    moved, info = metropolis(c.position, H0, leaf, uniforms[..., LEAF_DRAW].log(), metric, max_energy_error)
    draw = _draw_row(moved.z, info, c.step_size.value, n_steps, torch.zeros_like(n_steps))
    draws, step_size = _counted_and_adapted(c, done, info.acceptance_prob, schedule)
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
    return advanced, draw, done, active


def hmc_transitions(
    value_and_grad: Callable,
    chains: HMCChains,
    noise: torch.Tensor,
    uniforms: torch.Tensor,
    metric: Metric,
    schedule: Schedule,
    num_steps: int,
    max_energy_error: float = MAX_ENERGY_ERROR,
):
    """A whole trajectory of ``num_steps`` fused leapfrog steps for every chain that is not
    paused, when all chains' trajectories have that length (the step size is not adapted):
    then running them together wastes nothing, and the per-step bookkeeping of
    :func:`hmc_advance` is not needed. Same arguments and results as :func:`hmc_advance`."""
    c = chains
    active = c.draws < schedule.pause_at

    def integrate(start, step_size, inverse_mass):
        return leapfrog(value_and_grad, start, step_size, inverse_mass, num_steps)

    moved, info = hmc_step(integrate, c.position, noise, uniforms[..., LEAF_DRAW].log(), c.step_size.value, metric,
                           max_energy_error)
    steps = torch.full_like(c.draws, num_steps)
    draw = _draw_row(moved.z, info, c.step_size.value, steps, torch.zeros_like(steps))
    return c._replace(position=select(active, moved, c.position), draws=c.draws + active.to(torch.int64)), draw, active, active
