"""NUTS for a batch of chains, round by round, so that no chain waits for another's tree.

In a batch, a chain whose tree has stopped must not sit idle until every other chain's tree
stops (lock-step, as ``vmap``-ed samplers do). Here each chain's transition is a small state
machine that advances by one *round* per call of :func:`nuts_round`, for every chain at once.
In a round, each chain that is not paused does one of:

1. **start** a transition (new momentum from the round's noise) and build its first three
   doublings, fused, as :func:`pyro_hmc_plus.nuts.first_doublings` does (7 leapfrog steps,
   then the bookkeeping of the three doublings at once). Most trees of a well-adapted NUTS
   stop there; the transition ends in this round, and the chain starts its next one in the
   next round. A tree that goes on builds its fourth doubling from the next round.
2. **continue** a deeper tree by the next *chunk* of its current subtree: 8 leapfrog steps
   with the U-turn checks inside the chunk (:func:`pyro_hmc_plus.nuts.subtree_of`), added
   to the subtree by progressive sampling (the chunk's draw replaces the subtree's with
   probability ``w_chunk / w_subtree``, which gives the multinomial distribution of Stan's
   recursion), with Stan's U-turn checks of the blocks of 2, 4, ... chunks that this chunk
   completes, vectorised over the block sizes: the first and last momenta and the momentum
   sums of the open blocks are kept as checkpoints, one row per block size (a binary
   counter over the chunk index, as in NumPyro's iterative NUTS). A complete, turned or
   divergent subtree is merged into the tree by :func:`pyro_hmc_plus.nuts.extend_tree`
   (biased progressive sampling, the U-turn check across the join, the stopping rule).

The round's leapfrog steps are one batched trajectory of 8 steps per chain: a starting
chain's follow the fused start's pattern (each doubling from the end its direction says;
its 8th step is idle), a continuing chain's go straight on from its subtree's last leaf.
Then the bookkeeping of both kinds runs for every chain, and each chain keeps its own. Where
every chain does the same, a round runs its kind alone (:data:`ROUND_KINDS`): ``STARTS``
while no chain is continuing a tree, ``CHUNKS`` while no chain is about to start one (on
deep trees, most rounds: a chunk's leaves and bookkeeping without the fused start's, about
half the operations of a round of both kinds). :func:`next_round_kind` says which.

A chain whose transition ends emits its draw and updates its own step size by dual averaging
(warmup). A transition is therefore exactly Stan's (same tree depth, number of steps,
acceptance statistic and divergences for the same momentum and directions); only the random
numbers are consumed in a different order. Chains that are *paused* (waiting for the host
to update their metric at the end of an adaptation window, or finished) keep their state.

Why rounds and not one leaf per call: a traced program costs about a microsecond per
operation whatever the batch size, and the bookkeeping of a leaf (its U-turn checks, the
merge, the draw, the restart of finished chains) is hundreds of operations; fused over the
seven leaves of a transition's first doublings (or the eight of a chunk), it is paid once per
round instead of once per leaf. The price: both kinds of bookkeeping run for every chain,
and the fused start's steps after a tree stops early are wasted (the batch utilisation
counts them).

Every function is pure and batch-shaped, with leading dimension C (chains).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from . import nuts
from ._compile import static_shape
from .hmc import MAX_ENERGY_ERROR, HMCState
from .integrator import IntegratorState, leapfrog_states, stack_states
from .chain_batch import Schedule, StepSize, counted_and_adapted, draw_row
from .metric import Metric, momentum
from .nuts import select

FUSED_DOUBLINGS = 3  # doublings of a transition's start, fused
CHUNK_DEPTH = 3  # a deeper doubling is built 2**3 leaves per round

# Columns of a round's ``uniforms (C, NUM_UNIFORMS)``: the slice variable, the fused start's
# (direction, draw inside the subtree, progressive draw) for each of its doublings, the
# direction of the fourth doubling, then the chunk's draw, its progressive draw into the
# subtree, the progressive draw of the subtree into the tree, the next subtree's direction.
SLICE = 0
FIRST_DOUBLINGS = 1
ENTRY_DIRECTION = FIRST_DOUBLINGS + 3 * FUSED_DOUBLINGS
CHUNK_DRAW, CHUNK_TAKE, TREE_DRAW, NEXT_DIRECTION = range(ENTRY_DIRECTION + 1, ENTRY_DIRECTION + 5)
NUM_UNIFORMS = NEXT_DIRECTION + 1

# Kinds of round: only transition starts, both kinds of work, only chunks of deeper trees.
STARTS, MIXED, CHUNKS = ROUND_KINDS = (0, 1, 2)


class SubtreeSoFar(NamedTuple):
    """The chunks of the subtree under construction, merged. Batch shape ``(C,)``."""

    rho: torch.Tensor  # (C, D) sum of their momenta
    log_weight: torch.Tensor  # -inf before the first chunk
    proposal: HMCState
    proposal_energy: torch.Tensor
    n_steps: torch.Tensor  # int64
    sum_accept: torch.Tensor


def _no_chunks(proposal: HMCState, proposal_energy: torch.Tensor) -> SubtreeSoFar:
    """A subtree before its first chunk. Its proposal weighs nothing, so it is never taken:
    pass the one it replaces, and selecting between the two skips it."""
    zero = torch.zeros_like(proposal_energy)
    return SubtreeSoFar(torch.zeros_like(proposal.z), torch.full_like(zero, -float("inf")), proposal,
                        proposal_energy, torch.zeros_like(zero, dtype=torch.int64), zero)


class NUTSChains(NamedTuple):
    """Every chain's NUTS transition in progress, batch shape ``(C,)``."""

    position: HMCState  # the chain's current draw
    starting: torch.Tensor  # bool: the next round starts a new transition at ``position``
    tree: nuts.Tree  # the tree before the subtree under construction
    forward: torch.Tensor  # bool: direction of the subtree under construction
    leaf: IntegratorState  # where the subtree's next chunk starts
    n_chunks: torch.Tensor  # int64: chunks of the subtree built so far
    subtree: SubtreeSoFar  # the subtree's chunks so far
    block_begin: torch.Tensor  # (C, L, 3D): v, p, rho-before at the first leaf of the open block of 2**k chunks
    block_end: torch.Tensor  # (C, L, 2D): v, p at the last leaf of the last complete block of 2**k chunks
    step_size: StepSize
    draws: torch.Tensor  # int64: draws made so far (warmup included)


def steps_per_round(max_tree_depth: int, kind: int = MIXED) -> int:
    """Leapfrog steps of one round of ``kind`` per chain (:func:`nuts_round`): the fused
    start's, or a chunk's where trees can be deeper than the fused start."""
    fused = min(FUSED_DOUBLINGS, max_tree_depth)
    if kind != STARTS and max_tree_depth > fused:
        return max((1 << fused) - 1, 1 << CHUNK_DEPTH)
    return (1 << fused) - 1


def next_round_kind(chains: "NUTSChains", schedule: Schedule) -> torch.Tensor:
    """The kind of round (:data:`ROUND_KINDS`, a ``()`` int64 tensor) that serves every chain
    next: ``CHUNKS`` if no chain that may draw is about to start a transition, ``STARTS`` if
    none is in the middle of one, else ``MIXED``. A chain the host resumes after this (at
    the end of an adaptation window) starts a transition: the host makes ``CHUNKS`` a
    ``MIXED`` round then."""
    continuing = (~chains.starting).any().long()
    starting = (chains.starting & (chains.draws < schedule.pause_at)).any().long()
    return continuing * (CHUNKS - starting)  # STARTS, MIXED, CHUNKS = 0, 1, 2 (no scalar `where`:
    # Static Runtime refuses a program with one and the TorchScript interpreter runs it, slower)


def _chunk_levels(max_tree_depth: int) -> int:
    """Block sizes 1, 2, ... chunks up to the largest subtree, ``2**(max_tree_depth - 1)``
    leaves (at least one row: the chains' state has the same fields whatever the limit)."""
    return max(1, max_tree_depth - FUSED_DOUBLINGS)


def nuts_init(state: HMCState, metric: Metric, step_size: StepSize, max_tree_depth: int) -> NUTSChains:
    """Every chain about to start its first transition from ``state`` (batch ``(C,)``)."""
    z = state.z
    C, D = z.shape
    L = _chunk_levels(max_tree_depth)
    tree = nuts.init_tree(state, torch.zeros_like(z), torch.zeros_like(state.potential_energy), metric)  # placeholder
    return NUTSChains(
        state, torch.ones(C, dtype=torch.bool, device=z.device), tree,
        forward=torch.ones(C, dtype=torch.bool, device=z.device),
        leaf=nuts.fresh_tree_end(tree),
        n_chunks=torch.zeros(C, dtype=torch.int64, device=z.device),
        subtree=_no_chunks(state, tree.H0),
        block_begin=z.new_zeros(C, L, 3 * D),
        block_end=z.new_zeros(C, L, 2 * D),
        step_size=step_size,
        draws=torch.zeros(C, dtype=torch.int64, device=z.device),
    )


def _level_masks(n: torch.Tensor, levels: int):
    """For chunk index ``n (C,)``, which block sizes ``2**k`` (k < ``levels``) begin at ``n``
    and which end at it: two ``(C, levels)`` bool masks."""
    low_bits = torch.tensor([(1 << k) - 1 for k in range(levels)], device=n.device)  # traced: a constant + 2 cheap ops
    begins = (n.unsqueeze(-1) & low_bits) == 0
    ends = ((n + 1).unsqueeze(-1) & low_bits) == 0
    return begins, ends


def _blocks_turned(n, chunk: nuts.Subtree, rho_before, inverse_mass, block_begin, block_end, levels: int):
    """Stan's U-turn checks (with its two extra checks across the halves) of the blocks of
    2, 4, ... chunks that chunk ``n`` completes, from the checkpoints of the open blocks
    (``levels`` rows, block sizes ``2**k`` chunks, passed: a recording would follow a shape);
    returns ``(turned, block_begin, block_end)`` with the checkpoints updated."""
    D = static_shape(chunk.rho)[-1]
    v_first, v_last = nuts._velocities(torch.stack([chunk.p_first, chunk.p_last], -2), inverse_mass).unbind(-2)
    begins, ends = _level_masks(n, levels)
    here = torch.cat([v_first, chunk.p_first, rho_before], -1).unsqueeze(-2)
    block_begin = torch.where(begins.unsqueeze(-1), here, block_begin)
    turned = torch.zeros_like(chunk.valid)
    if levels > 1:
        v_b0, p_b0, rho_at_mid = block_begin[..., :-1, :].split([D] * 3, -1)  # second half's first leaf
        v_a0, _, rho_at_first = block_begin[..., 1:, :].split([D] * 3, -1)  # the block's first leaf
        v_a1, p_a1 = block_end[..., :-1, :].split([D] * 2, -1)  # first half's last leaf
        v_b1 = v_last.unsqueeze(-2).expand_as(v_b0)
        rho_after = rho_before + chunk.rho
        ok = nuts._joins_without_u_turn(
            v_a0, v_a1, p_a1, rho_at_mid - rho_at_first, v_b0, v_b1, p_b0, rho_after.unsqueeze(-2) - rho_at_mid
        )  # (C, levels - 1): the block of 2**(k+1) chunks ending here
        turned = (ends[..., 1:] & ~ok).any(-1)
    block_end = torch.where(ends.unsqueeze(-1), torch.cat([v_last, chunk.p_last], -1).unsqueeze(-2), block_end)
    return turned, block_begin, block_end


def _next_chunk(c: NUTSChains, leaves: IntegratorState, uniforms, inv, K: int, multinomial: bool,
                max_energy_error: float):
    """Every chain's next chunk, its ``2**CHUNK_DEPTH`` leapfrog states ``leaves`` (stacked)
    from ``c.leaf``, merged into its subtree so far; a subtree that is over is merged into
    the tree. Returns ``(chains, ended, grown, steps)``: the chains after the chunk (their
    ``starting`` and ``position`` are the caller's to set), whether their tree ended with
    it, the tree it grew into, and the chunk's leapfrog steps as Stan counts them."""
    tree, forward, n, so_far = c.tree, c.forward, c.n_chunks, c.subtree
    chunk = nuts.subtree_of(leaves, tree.H0, tree.log_slice, inv, uniforms[..., CHUNK_DRAW], 1 << CHUNK_DEPTH,
                            multinomial, max_energy_error)
    log_weight = torch.logaddexp(so_far.log_weight, chunk.log_weight)
    take = uniforms[..., CHUNK_TAKE] < torch.exp(chunk.log_weight - log_weight)
    turned, block_begin, block_end = _blocks_turned(n, chunk, so_far.rho, inv, c.block_begin, c.block_end,
                                                    _chunk_levels(K))
    failed = ~chunk.valid | turned
    merged = SubtreeSoFar(
        rho=so_far.rho + chunk.rho, log_weight=log_weight,
        proposal=select(take, chunk.proposal, so_far.proposal),
        proposal_energy=torch.where(take, chunk.proposal_energy, so_far.proposal_energy),
        n_steps=so_far.n_steps + chunk.n_steps, sum_accept=so_far.sum_accept + chunk.sum_accept,
    )
    D = static_shape(chunk.rho)[-1]
    subtree = nuts.Subtree(
        last=chunk.last, p_first=block_begin[..., -1, D : 2 * D], p_last=chunk.p_last, rho=merged.rho,
        log_weight=merged.log_weight, proposal=merged.proposal, proposal_energy=merged.proposal_energy,
        n_steps=merged.n_steps, sum_accept=merged.sum_accept, diverging=chunk.diverging, valid=~failed,
    )
    # the subtree is over when complete (2**depth leaves) or when it turned or diverged
    subtree_over = failed | ((n + 1) << CHUNK_DEPTH == (1 << tree.depth))
    grown = nuts.extend_tree(tree, subtree, forward, uniforms[..., TREE_DRAW], inv, K, keep_done=False)
    # what each chain builds next: the same subtree's next chunk, a new subtree, or (next
    # round) a new transition
    new_forward = uniforms[..., NEXT_DIRECTION] < 0.5
    advanced = c._replace(
        tree=select(subtree_over, grown, tree),
        forward=torch.where(subtree_over, new_forward, forward),
        leaf=select(subtree_over, nuts.subtree_start(grown, new_forward), chunk.last),
        n_chunks=torch.where(subtree_over, torch.zeros_like(n), n + 1),
        subtree=select(subtree_over, _no_chunks(merged.proposal, merged.proposal_energy), merged),
        block_begin=block_begin,
        block_end=block_end,
    )
    return advanced, subtree_over & grown.done, grown, chunk.n_steps


def nuts_round(
    value_and_grad: Callable,
    chains: NUTSChains,
    noise: torch.Tensor,
    uniforms: torch.Tensor,
    metric: Metric,
    schedule: Schedule,
    max_tree_depth: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
    kind: int = MIXED,
):
    """One round for every chain that is not paused. ``noise (C, D)`` and ``uniforms (C,
    NUM_UNIFORMS)`` are this round's random numbers (the momentum and the fused start's
    uniforms of a transition that starts here; those of a chunk). Returns ``(chains, draw, done,
    steps)``: ``draw (C, D + NUM_STATS)`` holds the finished transitions' draws and statistics
    (:data:`pyro_hmc_plus.chain_batch.STAT_COLUMNS`), valid where ``done``; ``steps`` (int64) the
    leapfrog steps each chain used (counted as Stan counts them), for the batch utilisation.
    ``kind`` (:data:`ROUND_KINDS`, as :func:`next_round_kind` says): ``STARTS`` (only where no
    chain is continuing a tree) runs transition starts only, without the chunk's step and
    bookkeeping; ``CHUNKS`` (only where no chain that may draw is starting one) runs chunks
    only."""
    c = chains
    inv = metric.inverse_mass
    K = max_tree_depth
    KS = min(FUSED_DOUBLINGS, K)
    active = c.draws < schedule.pause_at
    step = c.step_size.value
    if kind == CHUNKS and K > KS:
        continuing = active & ~c.starting
        leaves = stack_states(leapfrog_states(value_and_grad, c.leaf, nuts.signed_step_size(step, c.forward), inv,
                                              1 << CHUNK_DEPTH))
        advanced, ended, grown, chunk_steps = _next_chunk(c, leaves, uniforms, inv, K, multinomial, max_energy_error)
        done = continuing & ended
        steps = torch.where(continuing, chunk_steps, torch.zeros_like(chunk_steps))
        return _emitted(c, advanced._replace(starting=done | ~active), done, nuts.info(grown), grown.proposal,
                        schedule) + (steps,)
    starting = c.starting & active
    log_slice = torch.zeros_like(step) if multinomial else uniforms[..., SLICE].log()
    first = uniforms[..., FIRST_DOUBLINGS : FIRST_DOUBLINGS + 3 * KS].unflatten(-1, (KS, 3))
    if KS == 1:  # one doubling of one leaf: the single-chain kernel's first doubling
        # (Static Runtime corrupts memory running the fused start's bookkeeping for a batch
        # of chains and one doubling, torch 2.13; the traced program runs it correctly)
        tree = nuts.init_tree(c.position, noise, log_slice, metric)
        fresh = nuts.doubling(value_and_grad, tree, first[..., 0, :], step, inv, 1, K, multinomial, max_energy_error,
                              keep_done=False, start=nuts.fresh_tree_end(tree))
    else:
        # the round's leapfrog steps, one batched trajectory: a starting chain's fused start
        # (each doubling from the end its direction says), a continuing chain's next chunk
        r0 = momentum(noise, metric.momentum_scale)
        position = c.position
        fresh_start = IntegratorState(position.z, r0, position.potential_energy, position.grad)
        directions = nuts.is_forward(first)  # (C, KS)
        with_chunks = kind != STARTS and K > KS
        if with_chunks:
            continuing = active & ~c.starting
            directions = torch.where(continuing.unsqueeze(-1), c.forward.unsqueeze(-1), directions)  # straight on
            states = nuts.fused_start_states(value_and_grad, select(continuing, c.leaf, fresh_start), directions, step,
                                             inv, KS)
            states += leapfrog_states(value_and_grad, states[-1], nuts.signed_step_size(step, c.forward), inv,
                                      (1 << CHUNK_DEPTH) - len(states))
        else:
            states = nuts.fused_start_states(value_and_grad, fresh_start, directions, step, inv, KS)
        leaves = stack_states(states)
        n_start = (1 << KS) - 1
        start_leaves = leaves if len(states) == n_start else IntegratorState(
            leaves.z[..., :n_start, :], leaves.r[..., :n_start, :], leaves.potential_energy[..., :n_start],
            leaves.grad[..., :n_start, :])
        fresh = nuts.fused_start_tree(position, r0, start_leaves, log_slice, first, inv, KS, K, multinomial,
                                      max_energy_error)
    done = starting & fresh.done
    info, proposal = nuts.info(fresh), fresh.proposal
    steps = torch.where(starting, fresh.n_steps, torch.zeros_like(fresh.n_steps))
    if K == KS:  # every tree ends within the fused start
        advanced = c._replace(starting=done | ~active)
    else:
        advanced = c
        if with_chunks:
            advanced, ended, grown, chunk_steps = _next_chunk(c, leaves, uniforms, inv, K, multinomial,
                                                              max_energy_error)
            ended = continuing & ended
            done = done | ended
            info = select(ended, nuts.info(grown), info)
            proposal = select(ended, grown.proposal, proposal)
            steps = steps + torch.where(continuing, chunk_steps, torch.zeros_like(chunk_steps))
        # chains whose tree outgrew the fused start build their fourth doubling from the next round
        entering = starting & ~fresh.done
        entry_forward = uniforms[..., ENTRY_DIRECTION] < 0.5
        advanced = advanced._replace(
            starting=done | ~active,
            tree=select(starting, fresh, advanced.tree),
            forward=torch.where(entering, entry_forward, advanced.forward),
            leaf=select(entering, nuts.subtree_start(fresh, entry_forward), advanced.leaf),
            n_chunks=torch.where(entering, torch.zeros_like(advanced.n_chunks), advanced.n_chunks),
            subtree=select(entering, _no_chunks(advanced.subtree.proposal, advanced.subtree.proposal_energy),
                           advanced.subtree),
        )
    return _emitted(c, advanced, done, info, proposal, schedule) + (steps,)


def _emitted(c: NUTSChains, advanced: NUTSChains, done, info: nuts.NUTSInfo, proposal: HMCState, schedule: Schedule):
    """``(chains, draw, done)`` after a round: the chains ``advanced``, with the transitions
    that finished (``done``) moved to their ``proposal``, counted and their step sizes
    adapted; ``draw`` their rows (valid where ``done``), with the step size they used."""
    draw = draw_row(proposal.z, info, c.step_size.value, info.n_steps, info.tree_depth)
    draws, step_size = counted_and_adapted(c, done, info.acceptance_prob, schedule)
    advanced = advanced._replace(position=select(done, proposal, c.position), step_size=step_size, draws=draws)
    return advanced, draw, done
