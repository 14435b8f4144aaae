"""The No-U-Turn Sampler as pure functions over flat tensors: Stan's multinomial NUTS.

A transition starts from ``(z, r)`` with fresh momentum and repeatedly doubles a trajectory
of leapfrog steps, each time in a random direction (forward or backward in time), until the
trajectory makes a U-turn, an energy error exceeds ``max_energy_error`` (a divergence), or
``max_tree_depth`` doublings were made. The draw is chosen among the trajectory's states
with probability proportional to ``exp(-H)``:

* inside a new subtree, multinomially (each leaf in proportion to its weight);
* between the old tree and a new subtree, by *biased progressive sampling*: the subtree's
  proposal replaces the tree's with probability ``min(1, w_subtree / w_tree)``, which favours
  states far from the start (Betancourt 2017, appendix A.3.2).

The U-turn criterion is Stan's generalised one, ``p_sharp(-) . rho > 0`` and
``p_sharp(+) . rho > 0`` with ``rho`` the sum of momenta and ``p_sharp = M^{-1} p``, checked on
every subtree when its two halves are merged, and -- Stan's extra checks -- across the
halves: on the first half plus the first state of the second, and on the second half plus
the last state of the first. A subtree that turns or diverges is discarded.

How this is arranged for speed: a subtree of ``2^j`` leaves is one fused program -- the
``2^j`` leapfrog steps (gradient inlined), then all of its U-turn checks at once, vectorised
over the sub-subtrees of each size, the energy errors, the multinomial choice and the merge
into the tree -- so a transition costs one program call and one host read (is it done?) per
doubling, not per leaf. The result is exactly Stan's: where Stan stops building a subtree at
its first failure, we integrate the subtree to its end and count only the steps up to the
first failure (``n_steps``, the acceptance statistic). Long subtrees are built in chunks of
``2^c`` leaves (:func:`build_subtree`) combined by :func:`merge_subtrees`, in Stan's
recursion order, so that a failure stops the work after at most one chunk. A transition's
first doublings can also run as one program (:func:`first_doublings`): their leapfrog steps,
then the bookkeeping of all of them at once, vectorised over the doublings.

``use_multinomial_sampling=False`` (Pyro's option) gives slice sampling: a leaf's weight is 1
inside the slice ``{H - H0 <= -log u}`` and 0 outside; the same code runs with log weights
``0``/``-inf``.

Every function is batch-shaped: leading dimensions are chains, and chains that are already
done (``Tree.done``) are left unchanged by :func:`extend_tree`, so lock-step batches of chains
use the same code as one chain.

References: Hoffman & Gelman, "The No-U-Turn Sampler" (2014); Betancourt, "A Conceptual
Introduction to Hamiltonian Monte Carlo" (2017); Stan's ``base_nuts.hpp``.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ._compile import static_shape
from .hmc import MAX_ENERGY_ERROR, HMCState
from .integrator import IntegratorState, leapfrog, leapfrog_states, leapfrog_trajectory, stack_states
from .metric import Metric, kinetic_energy, momentum, velocity


class Tree(NamedTuple):
    """The trajectory of one NUTS transition so far. Batch shape ``(...)``."""

    ends: IntegratorState  # z, r, grad (..., 2, D); U (..., 2). Index 0: backward end, 1: forward end
    rho: torch.Tensor  # (..., D) sum of the momenta of all states
    log_weight: torch.Tensor  # (...) log of the sum of the states' weights
    proposal: HMCState  # the draw so far
    proposal_energy: torch.Tensor  # (...) H at the draw (Stan's energy__)
    H0: torch.Tensor  # (...) H at the start
    log_slice: torch.Tensor  # (...) 0 (multinomial) or log u of the slice variable
    depth: torch.Tensor  # (...) int64: successful doublings
    n_steps: torch.Tensor  # (...) int64: leapfrog steps counted as Stan does
    sum_accept: torch.Tensor  # (...) sum of min(1, exp(H0 - H)) over those steps
    diverging: torch.Tensor  # (...) bool
    accepted: torch.Tensor  # (...) bool: the draw differs from the start
    done: torch.Tensor  # (...) bool


class Subtree(NamedTuple):
    """A new subtree, in the order it was built. Batch shape ``(...)``."""

    last: IntegratorState  # the last state built (where the next chunk starts)
    p_first: torch.Tensor  # (..., D) momentum of the first state built
    p_last: torch.Tensor  # (..., D) momentum of the last state built
    rho: torch.Tensor  # (..., D)
    log_weight: torch.Tensor  # (...)
    proposal: HMCState
    proposal_energy: torch.Tensor  # (...)
    n_steps: torch.Tensor  # (...) int64
    sum_accept: torch.Tensor  # (...)
    diverging: torch.Tensor  # (...) bool
    valid: torch.Tensor  # (...) bool: neither turned nor diverged (its proposal may be used)


class NUTSInfo(NamedTuple):
    """Per-transition statistics, batch shape ``(...)``."""

    potential_energy: torch.Tensor  # U at the draw (lp = -U)
    energy: torch.Tensor  # H at the draw
    acceptance_prob: torch.Tensor  # mean of min(1, exp(H0 - H)) over the leapfrog steps (Stan)
    diverging: torch.Tensor  # bool
    accepted: torch.Tensor  # bool
    tree_depth: torch.Tensor  # int64
    n_steps: torch.Tensor  # int64


def _joins_without_u_turn(v_a0, v_a1, p_a1, rho_a, v_b0, v_b1, p_b0, rho_b):
    """Stan's no-U-turn criterion on the join of two adjacent pieces of trajectory, ``a``
    then ``b`` in build order (index 0: the first state built, 1: the last; ``v = M^{-1} p``,
    ``rho`` a piece's sum of momenta): both ends still move apart along ``rho``, checked on
    the whole (``rho_a + rho_b``) and, Stan's extra checks, across the join (``rho_a + p_b0``
    and ``rho_b + p_a1``). Vector arguments are ``(..., D)``; the three checks run as one
    batched dot product (the traced program's cost is per operation, not per flop)."""
    whole, across_a, across_b = rho_a + rho_b, rho_a + p_b0, rho_b + p_a1
    rho = torch.stack([whole, whole, across_a, across_a, across_b, across_b], -2)  # (..., 6, D)
    v_ends = torch.stack([v_a0, v_b1, v_a0, v_b0, v_a1, v_b1], -2)  # each check's two ends
    return ((v_ends * rho).sum(-1) > 0).all(-1)


def select(mask: torch.Tensor, a, b, _masks=None):
    """``a`` where ``mask`` else ``b``, field by field through nested records; ``mask`` has
    the batch shape. In a traced program every operation has its own overhead, so: a field
    that is the same tensor in both is not selected, and the mask is broadcast once per
    field rank, by ``unsqueeze`` (a ``reshape`` would also record reading its shape)."""
    masks = {mask.dim(): mask} if _masks is None else _masks
    if isinstance(a, tuple):
        fields = (select(mask, x, y, masks) for x, y in zip(a, b))
        return tuple(fields) if type(a) is tuple else type(a)(*fields)
    if a is b:
        return a
    m = masks.get(a.dim())
    if m is None:
        m = mask
        for _ in range(a.dim() - mask.dim()):
            m = m.unsqueeze(-1)
        masks[a.dim()] = m
    return torch.where(m, a, b)


def init_tree(state: HMCState, noise: torch.Tensor, log_slice: torch.Tensor, metric: Metric) -> Tree:
    """The one-state tree at the start of a transition, momentum ``r = scale (x) noise``."""
    z, U, g = state
    r = momentum(noise, metric.momentum_scale)
    H0 = U + kinetic_energy(r, metric.inverse_mass)

    def zero(dtype=None):
        return torch.zeros_like(U, dtype=dtype)  # a new tensor for each field

    ends = IntegratorState(
        torch.stack([z, z], -2), torch.stack([r, r], -2), torch.stack([U, U], -1), torch.stack([g, g], -2)
    )
    return Tree(
        ends, r, zero(), state, H0, H0, log_slice, zero(torch.int64), zero(torch.int64),
        zero(), zero(torch.bool), zero(torch.bool), zero(torch.bool),
    )


def fresh_tree_end(tree: Tree) -> IntegratorState:
    """Either end of a one-state tree from :func:`init_tree`, which is its state with the new
    momentum: what :func:`subtree_start` returns for it, without selecting between ends."""
    return IntegratorState(tree.proposal.z, tree.rho, tree.proposal.potential_energy, tree.proposal.grad)


def is_forward(rands: torch.Tensor) -> torch.Tensor:
    """The doubling's direction from its uniforms ``rands (..., 3)``."""
    return rands[..., 0] < 0.5


def subtree_start(tree: Tree, forward: torch.Tensor) -> IntegratorState:
    """The end of ``tree`` a subtree in direction ``forward`` grows from."""
    fwd = forward.unsqueeze(-1)
    return IntegratorState(
        torch.where(fwd, tree.ends.z[..., 1, :], tree.ends.z[..., 0, :]),
        torch.where(fwd, tree.ends.r[..., 1, :], tree.ends.r[..., 0, :]),
        torch.where(forward, tree.ends.potential_energy[..., 1], tree.ends.potential_energy[..., 0]),
        torch.where(fwd, tree.ends.grad[..., 1, :], tree.ends.grad[..., 0, :]),
    )


def signed_step_size(step_size: torch.Tensor, forward: torch.Tensor) -> torch.Tensor:
    """Negative steps integrate backward in time (the momentum keeps its sign, as in Stan)."""
    return torch.where(forward, step_size, -step_size)


def _subtree_blocks(sizes, device, dtype):
    """U-turn blocks of consecutive subtrees of ``sizes`` leaves (powers of two) in one leaf
    axis of ``n = sum(sizes)`` leaves: every block of 2, 4, ... leaves aligned inside each
    subtree, as the six dot products of :func:`_joins_without_u_turn` for it. Dot product
    ``v_i . (C_b - C_a)``, with ``C_k`` the sum of the first ``k`` momenta, is the difference
    of entries ``(i, b)`` and ``(i, a)`` of the ``(n, n + 1)`` matrix ``W = v C^T``
    (:func:`_turned_at`). Returns the flat indices into ``W`` of the ``b`` and the ``a``
    entries ``(6 num_blocks,)``, and the ``(num_blocks, n)`` 0/1 matrix mapping each block
    to its last leaf."""
    n = sum(sizes)
    plus, minus, last = [], [], []
    offset = 0
    for num_leaves in sizes:
        size = 2
        while size <= num_leaves:
            for a0 in range(offset, offset + num_leaves, size):
                b0, b1 = a0 + size // 2, a0 + size - 1  # first and last leaf of the second half
                a1 = b0 - 1
                # (leaf, C_b, C_a): both ends along the whole (a0 .. b1), across the join
                # (a0 .. b0) and (a1 .. b1), as in _joins_without_u_turn
                for i, b, a in ((a0, b1 + 1, a0), (b1, b1 + 1, a0), (a0, b0 + 1, a0), (b0, b0 + 1, a0),
                                (a1, b1 + 1, a1), (b1, b1 + 1, a1)):
                    plus.append(i * (n + 1) + b)
                    minus.append(i * (n + 1) + a)
                last.append(b1)
            size *= 2
        offset += num_leaves
    ends_at = [[float(leaf == end) for leaf in range(n)] for end in last]
    return (torch.tensor(plus, dtype=torch.int64, device=device), torch.tensor(minus, dtype=torch.int64, device=device),
            torch.tensor(ends_at, dtype=dtype, device=device).reshape(len(last), n))


def _cumulative_momenta(r):
    """``(..., L + 1, D)``: the sums of the first 0, 1, ..., L momenta of ``r (..., L, D)``
    (a sum over leaves ``a..b`` is a difference of two rows, and stays finite where a later
    leaf's momentum is not)."""
    return torch.cat([torch.zeros_like(r[..., :1, :]), r.cumsum(-2)], -2)  # (pad costs ~3x more in a program)


def _turned_at(r, v, blocks):
    """``(..., L)``: how many of ``blocks`` (:func:`_subtree_blocks`) that end at each leaf
    turn, from the leaves' momenta ``r`` and velocities ``v`` ``(..., L, D)``, all blocks at
    once. A failure is charged to the block's last leaf, where Stan's recursion checks it.

    Every check is a dot product of a leaf's velocity with a sum of consecutive momenta, so
    all of them are differences of entries of one ``(L, L + 1)`` matrix of velocities times
    cumulative momenta, made by one matrix product: the work on ``D``-vectors is that
    product, not a copy of the leaves per block (a 16-leaf chunk has 15 blocks). A leaf
    whose momentum is not finite touches no check of the blocks before it."""
    plus, minus, ends_at = blocks
    dots = (v @ r.mT).cumsum(-1)  # (..., L, L): v_i . (r_0 + ... + r_k)
    W = torch.cat([torch.zeros_like(dots[..., :1]), dots], -1).flatten(-2)  # entry (i, k): v_i . C_k
    checks = W.index_select(-1, plus) - W.index_select(-1, minus)  # (..., 6 num_blocks)
    ok = (checks.unflatten(-1, (-1, 6)) > 0).all(-1)  # (..., num_blocks); NaN turns
    return (~ok).to(r.dtype) @ ends_at


def _log_sum_exp(log_w: torch.Tensor, num_leaves: int) -> torch.Tensor:
    """``logsumexp`` over the last dimension, of size ``num_leaves`` (a subtree's leaves, two
    or more), with torch's values. torch's ``logsumexp`` is one op of a program that runs
    its ~9 steps each into a fresh tensor (~8 µs on Static Runtime); here for two leaves
    it is one ``logaddexp`` (~1 µs), and for more torch's own steps as the program's ops,
    each into a planned buffer (~5 µs): the maximum, made 0 where infinite, is subtracted
    before the exponentials and added after the log. (``num_leaves`` is passed, not read
    from the shape, which a recording would follow as a tensor.)"""
    if num_leaves == 2:
        return torch.logaddexp(log_w[..., 0], log_w[..., 1])
    top = log_w.amax(-1, keepdim=True)
    top = top.nan_to_num(0.0, 0.0, 0.0)  # +-inf -> 0 as torch's (weights are never NaN: leaf_weights)
    return (log_w - top).exp().sum(-1).log() + top.squeeze(-1)


def leaf_weights(H, H0, log_slice, multinomial: bool, max_energy_error: float):
    """``(delta, log_w, divergent)`` of leaves with Hamiltonians ``H``: the energy change
    ``H0 - H`` (NaN counts as -inf), the leaf's log weight in the draw (``delta``, or with
    slice sampling 0 inside the slice and -inf outside), and whether it diverged (its
    sliced energy error, Pyro's, above ``max_energy_error``). Elementwise; ``H0`` and
    ``log_slice`` broadcast against ``H``."""
    delta = H0 - H
    delta = torch.where(torch.isnan(delta), torch.full_like(delta, -float("inf")), delta)
    excess = log_slice - delta
    divergent = excess > max_energy_error
    if multinomial:
        return delta, delta, divergent
    return delta, torch.where(excess <= 0, torch.zeros_like(delta), torch.full_like(delta, -float("inf"))), divergent


def _one_leaf_subtree(value_and_grad, start, H0, log_slice, step_size, inverse_mass, multinomial, max_energy_error):
    """:func:`build_subtree` of one leaf (every transition's first doubling), without the
    leaf axis and the draw among leaves: the leaf is the proposal, and it is counted
    whether or not it diverged. The same values in ~50 fewer operations (eight schools: 183 -> 133)."""
    leaf = leapfrog(value_and_grad, start, step_size, inverse_mass, 1)
    H = leaf.potential_energy + kinetic_energy(leaf.r, inverse_mass)
    delta, log_w, divergent = leaf_weights(H, H0, log_slice, multinomial, max_energy_error)
    return Subtree(
        last=leaf,
        p_first=leaf.r,
        p_last=leaf.r,
        rho=leaf.r,
        log_weight=log_w,
        proposal=HMCState(leaf.z, leaf.potential_energy, leaf.grad),
        proposal_energy=H,
        n_steps=torch.ones_like(divergent, dtype=torch.int64),
        sum_accept=torch.exp(delta.clamp(max=0.0)),
        diverging=divergent,
        valid=~divergent,
    )


def build_subtree(
    value_and_grad: Callable,
    start: IntegratorState,
    H0: torch.Tensor,
    log_slice: torch.Tensor,
    step_size: torch.Tensor,
    inverse_mass: torch.Tensor,
    u: torch.Tensor,
    num_leaves: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
) -> Subtree:
    """The subtree of ``num_leaves`` (a power of two) leapfrog steps of signed ``step_size``
    from ``start``, with all its U-turn checks, and a multinomial draw among its leaves
    (from the uniform ``u``). Shapes: batch ``(...)`` for ``H0, log_slice, step_size, u``."""
    if num_leaves == 1:
        return _one_leaf_subtree(value_and_grad, start, H0, log_slice, step_size, inverse_mass, multinomial,
                                 max_energy_error)
    leaves = leapfrog_trajectory(value_and_grad, start, step_size, inverse_mass, num_leaves)
    return subtree_of(leaves, H0, log_slice, inverse_mass, u, num_leaves, multinomial, max_energy_error)


def subtree_of(
    leaves: IntegratorState,
    H0: torch.Tensor,
    log_slice: torch.Tensor,
    inverse_mass: torch.Tensor,
    u: torch.Tensor,
    num_leaves: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
) -> Subtree:
    """:func:`build_subtree`'s bookkeeping on its ``num_leaves`` (two or more) leapfrog
    states ``leaves`` (stacked, :func:`~pyro_hmc_plus.integrator.stack_states`), for a caller
    that computes them itself."""
    shape, L = static_shape(leaves.z), num_leaves
    batch, D = shape[:-2], shape[-1]
    inv = _for_stack(inverse_mass, leaves.r)
    r = leaves.r
    v = velocity(r, inv)
    H = leaves.potential_energy + kinetic_energy(r, inv)
    delta, log_w, divergent = leaf_weights(H, H0.unsqueeze(-1), log_slice.unsqueeze(-1), multinomial, max_energy_error)
    # U-turn checks of every complete sub-subtree (2, 4, ..., L leaves), all at once
    fail = divergent | (_turned_at(r, v, _subtree_blocks([L], r.device, r.dtype)) > 0)
    failures_before = fail.cumsum(-1) - fail.to(torch.int64)
    counted = failures_before == 0  # Stan stops at the first failure, that step included
    accept = torch.exp(delta.clamp(max=0.0))
    log_weight = _log_sum_exp(log_w, L)
    cdf = torch.exp(log_w - log_weight.unsqueeze(-1)).cumsum(-1)
    idx = (cdf < u.unsqueeze(-1)).sum(-1).clamp(max=L - 1)
    packed = torch.cat([leaves.z, leaves.grad, leaves.potential_energy.unsqueeze(-1), H.unsqueeze(-1)], -1)
    chosen = packed.gather(-2, idx.reshape(batch + (1, 1)).expand(batch + (1, 2 * D + 2))).squeeze(-2)
    z, g, U, H_chosen = chosen.split([D, D, 1, 1], -1)
    proposal = HMCState(z, U.squeeze(-1), g)
    return Subtree(
        last=IntegratorState(leaves.z[..., -1, :], r[..., -1, :], leaves.potential_energy[..., -1], leaves.grad[..., -1, :]),
        p_first=r[..., 0, :],
        p_last=r[..., -1, :],
        rho=r.sum(-2),
        log_weight=log_weight,
        proposal=proposal,
        proposal_energy=H_chosen.squeeze(-1),
        n_steps=counted.sum(-1),
        sum_accept=(accept * counted).sum(-1),
        diverging=(divergent & counted).any(-1),
        valid=~fail.any(-1),
    )


def _for_stack(inverse_mass: torch.Tensor, stack: torch.Tensor) -> torch.Tensor:
    """The inverse mass matrix (diagonal ``(..., D)`` or dense ``(..., D, D)``, one per
    chain) broadcast against a stack of momenta ``(..., k, D)``."""
    return inverse_mass.unsqueeze(-3 if inverse_mass.dim() >= stack.dim() else -2)


def _velocities(momenta: torch.Tensor, inverse_mass: torch.Tensor) -> torch.Tensor:
    """``M^{-1} p`` for a stack of momenta ``(..., k, D)`` under one metric per chain."""
    return velocity(momenta, _for_stack(inverse_mass, momenta))


def merge_subtrees(first: Subtree, second: Subtree, u: torch.Tensor, inverse_mass: torch.Tensor) -> Subtree:
    """Stan's merge of the two halves of a subtree (``second`` built after ``first``): the
    proposal is taken from ``second`` with probability ``w_second / (w_first + w_second)``.
    If ``first`` is already invalid, ``second`` was never built as far as Stan is concerned:
    the result is ``first``'s counts, invalid."""
    log_weight = torch.logaddexp(first.log_weight, second.log_weight)
    take = u < torch.exp(second.log_weight - log_weight)
    p = torch.stack([first.p_first, first.p_last, second.p_first, second.p_last], -2)
    v_a0, v_a1, v_b0, v_b1 = _velocities(p, inverse_mass).unbind(-2)
    ok = _joins_without_u_turn(v_a0, v_a1, first.p_last, first.rho, v_b0, v_b1, second.p_first, second.rho)
    counted = first.valid
    zero = torch.zeros_like(second.sum_accept)
    return Subtree(
        last=second.last,
        p_first=first.p_first,
        p_last=second.p_last,
        rho=first.rho + second.rho,
        log_weight=log_weight,
        proposal=select(take, second.proposal, first.proposal),
        proposal_energy=torch.where(take, second.proposal_energy, first.proposal_energy),
        n_steps=first.n_steps + torch.where(counted, second.n_steps, torch.zeros_like(second.n_steps)),
        sum_accept=first.sum_accept + torch.where(counted, second.sum_accept, zero),
        diverging=first.diverging | (counted & second.diverging),
        valid=first.valid & second.valid & ok,
    )


def extend_tree(
    tree: Tree,
    subtree: Subtree,
    forward: torch.Tensor,
    u: torch.Tensor,
    inverse_mass: torch.Tensor,
    max_tree_depth: int,
    keep_done: bool = True,
) -> Tree:
    """Merge a new subtree, built from the end ``forward`` of ``tree``, into it: biased
    progressive sampling of the proposal (uniform ``u``), Stan's U-turn checks across the
    join, and the stopping rule. With ``keep_done``, chains whose tree was already done are
    returned unchanged (lock-step batches); a single chain that stops calling once done can
    skip that."""
    valid = subtree.valid
    take = valid & (u < torch.exp(subtree.log_weight - tree.log_weight))
    fwd = forward.unsqueeze(-1)
    backward_end, forward_end = tree.ends.r.unbind(-2)
    near = torch.where(fwd, forward_end, backward_end)
    far = torch.where(fwd, backward_end, forward_end)
    p = torch.stack([far, near, subtree.p_first, subtree.p_last], -2)
    v_a0, v_a1, v_b0, v_b1 = _velocities(p, inverse_mass).unbind(-2)
    ok = _joins_without_u_turn(v_a0, v_a1, near, tree.rho, v_b0, v_b1, subtree.p_first, subtree.rho)
    is_near = torch.stack([~forward, forward], -1)  # (..., 2)
    ends = IntegratorState(
        torch.where(is_near.unsqueeze(-1), subtree.last.z.unsqueeze(-2), tree.ends.z),
        torch.where(is_near.unsqueeze(-1), subtree.last.r.unsqueeze(-2), tree.ends.r),
        torch.where(is_near, subtree.last.potential_energy.unsqueeze(-1), tree.ends.potential_energy),
        torch.where(is_near.unsqueeze(-1), subtree.last.grad.unsqueeze(-2), tree.ends.grad),
    )
    depth = tree.depth + valid.to(torch.int64)
    turning = valid & ~ok
    extended = Tree(
        ends=ends,
        rho=tree.rho + subtree.rho,
        log_weight=torch.where(valid, torch.logaddexp(tree.log_weight, subtree.log_weight), tree.log_weight),
        proposal=select(take, subtree.proposal, tree.proposal),
        proposal_energy=torch.where(take, subtree.proposal_energy, tree.proposal_energy),
        H0=tree.H0,
        log_slice=tree.log_slice,
        depth=depth,
        n_steps=tree.n_steps + subtree.n_steps,
        sum_accept=tree.sum_accept + subtree.sum_accept,
        diverging=subtree.diverging,
        accepted=tree.accepted | take,
        done=~valid | turning | (depth >= max_tree_depth),
    )
    return select(tree.done, tree, extended) if keep_done else extended


def doubling(
    value_and_grad: Callable,
    tree: Tree,
    rands: torch.Tensor,
    step_size: torch.Tensor,
    inverse_mass: torch.Tensor,
    num_leaves: int,
    max_tree_depth: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
    keep_done: bool = True,
    start: IntegratorState = None,
) -> Tree:
    """One doubling of ``num_leaves`` new states as a single subtree, with the uniforms
    ``rands (..., 3)``: direction, multinomial draw inside the subtree, and progressive
    sampling of the tree (``keep_done``: see :func:`extend_tree`). ``start``: the end the
    subtree grows from, where the caller knows it (:func:`fresh_tree_end`)."""
    forward = is_forward(rands)
    subtree = build_subtree(
        value_and_grad, subtree_start(tree, forward) if start is None else start, tree.H0, tree.log_slice,
        signed_step_size(step_size, forward), inverse_mass, rands[..., 1], num_leaves,
        multinomial, max_energy_error,
    )
    return extend_tree(tree, subtree, forward, rands[..., 2], inverse_mass, max_tree_depth, keep_done)


class _FirstDoublings(NamedTuple):
    """Constants of :func:`first_doublings` for ``K`` doublings (``n = 2**K - 1`` leaves; leaf
    ``i`` is the ``i``-th built, doubling ``j``'s are the segment ``2**j - 1 .. 2**(j+1) - 2``;
    the *pool* of states is the start, index 0, then leaf ``i`` at ``1 + i``)."""

    sizes: torch.Tensor  # (K,) 2**j: doubling j's leaves, the pool index of its first leaf, and its
    #                      bit in a pattern of directions (sum_j forward_j 2**j)
    joins: torch.Tensor  # (2**K, 4K) pool indices per pattern: for each doubling the tree end it grows
    #                      from, the other end, its subtree's first leaf and last leaf
    ends: torch.Tensor  # (2**K * K, 2) pool indices of the tree's (backward, forward) ends
    #                     after doubling j, row pattern * K + j
    first_of_leaf: torch.Tensor  # (n,) the first leaf of each leaf's segment
    in_segment: torch.Tensor  # (K, n) bool
    segment_matrix: torch.Tensor  # (K, n) the same, 0/1 in the floating dtype
    segment_log_mask: torch.Tensor  # (K, n) 0 inside the segment, -inf outside
    last_in_segment: torch.Tensor  # (K,) 2**j - 1: largest index inside segment j
    segment_ends: torch.Tensor  # (2, K) rows of _cumulative_momenta bounding each segment
    doubling_number: torch.Tensor  # (K,) j + 1
    is_last: torch.Tensor  # (K,) bool: j == K - 1
    blocks: tuple  # the U-turn blocks inside every segment (:func:`_subtree_blocks`)


def _first_doublings_constants(K: int, device, dtype) -> _FirstDoublings:
    n = (1 << K) - 1
    sizes = [1 << j for j in range(K)]
    joins, ends = [], []
    for pattern in range(1 << K):
        backward_end = forward_end = 0
        near, far, pattern_ends = [], [], []
        for j in range(K):
            forward = (pattern >> j) & 1
            near.append(forward_end if forward else backward_end)
            far.append(backward_end if forward else forward_end)
            if forward:
                forward_end = 2 * sizes[j] - 1  # pool index of the doubling's last leaf
            else:
                backward_end = 2 * sizes[j] - 1
            pattern_ends.append([backward_end, forward_end])
        joins.append(near + far + sizes + [2 * size - 1 for size in sizes])
        ends.append(pattern_ends)
    in_segment = [[size - 1 <= i <= 2 * size - 2 for i in range(n)] for size in sizes]

    def t(x, dtype=torch.int64):
        return torch.tensor(x, dtype=dtype, device=device)
    return _FirstDoublings(
        sizes=t(sizes), joins=t(joins), ends=t(ends).reshape(-1, 2),
        first_of_leaf=t([size - 1 for size in sizes for _ in range(size)]),
        in_segment=t(in_segment, torch.bool), segment_matrix=t(in_segment, dtype),
        segment_log_mask=t([[0.0 if x else -float("inf") for x in row] for row in in_segment], dtype),
        last_in_segment=t([size - 1 for size in sizes]),
        segment_ends=t([[size - 1 for size in sizes], [2 * size - 1 for size in sizes]]),
        doubling_number=t(list(range(1, K + 1))), is_last=t([j == K - 1 for j in range(K)], torch.bool),
        blocks=_subtree_blocks(sizes, device, dtype),
    )


def first_doublings(
    value_and_grad: Callable,
    state: HMCState,
    noise: torch.Tensor,
    log_slice: torch.Tensor,
    uniforms: torch.Tensor,
    step_size: torch.Tensor,
    metric: Metric,
    num_doublings: int,
    max_tree_depth: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
) -> Tree:
    """A transition's first ``K = num_doublings`` doublings (``2**K - 1`` leapfrog steps) in
    one go, with the uniforms ``uniforms (..., K, 3)`` of :func:`doubling`: the same tree as
    :func:`init_tree` followed by ``K`` calls of :func:`doubling` (with ``keep_done``: those
    after the tree is done change nothing), up to floating-point rounding.

    Why: in a traced program the bookkeeping of a doubling (U-turn checks, merge, draw,
    ~200 operations) costs more than a cheap model's gradients, and it is the same for every
    doubling. Here the ``2**K - 1`` leapfrog steps run first, in build order (each doubling
    from the end its direction says), and then every doubling's bookkeeping runs at once,
    vectorised over the doublings: the U-turn checks inside each new subtree and across each
    join, the draw inside each subtree, the biased progressive sampling and the stopping rule
    (the first doubling whose subtree turns or diverges, or whose join turns, is the last).
    The price: the steps after the tree is done are wasted, so this pays where trees usually
    reach depth ``K``. Shapes: batch ``(...)`` for ``log_slice``, ``step_size``."""
    r0 = momentum(noise, metric.momentum_scale)
    start = IntegratorState(state.z, r0, state.potential_energy, state.grad)
    states = fused_start_states(value_and_grad, start, is_forward(uniforms), step_size, metric.inverse_mass,
                                num_doublings)
    return fused_start_tree(state, r0, stack_states(states), log_slice, uniforms, metric.inverse_mass, num_doublings,
                            max_tree_depth, multinomial, max_energy_error)


def fused_start_states(value_and_grad: Callable, start: IntegratorState, forward: torch.Tensor, step_size: torch.Tensor,
                       inverse_mass: torch.Tensor, num_doublings: int) -> list:
    """The ``2**K - 1`` leapfrog states of a transition's first ``K = num_doublings``
    doublings from ``start``, in build order: doubling ``j`` grows from the last leaf of the
    latest doubling in its direction ``forward[..., j]`` (or from the start), with the
    step's sign of its direction. Where every direction is the same, one straight
    trajectory."""
    states, lasts = [], []
    for j in range(num_doublings):
        begin = start
        for i, last in enumerate(lasts):
            begin = select(forward[..., j] == forward[..., i], last, begin)
        signed = signed_step_size(step_size, forward[..., j])
        states += leapfrog_states(value_and_grad, begin, signed, inverse_mass, 1 << j)
        lasts.append(states[-1])
    return states


def fused_start_tree(
    state: HMCState,
    r0: torch.Tensor,
    leaves: IntegratorState,
    log_slice: torch.Tensor,
    uniforms: torch.Tensor,
    inverse_mass: torch.Tensor,
    num_doublings: int,
    max_tree_depth: int,
    multinomial: bool = True,
    max_energy_error: float = MAX_ENERGY_ERROR,
) -> Tree:
    """:func:`first_doublings`'s bookkeeping on its leaves (:func:`fused_start_states`,
    stacked) from ``state`` with momentum ``r0``, for a caller that computes them itself."""
    K = num_doublings
    z0, U0, g0 = state
    c = _first_doublings_constants(K, z0.device, z0.dtype)
    H0 = U0 + kinetic_energy(r0, inverse_mass)
    forward = is_forward(uniforms)  # (..., K)
    inv = _for_stack(inverse_mass, leaves.r)
    r, v = leaves.r, velocity(leaves.r, inv)
    H = leaves.potential_energy + 0.5 * (r * v).sum(-1)
    delta, log_w, divergent = leaf_weights(H, H0.unsqueeze(-1), log_slice.unsqueeze(-1), multinomial, max_energy_error)
    # the pool of states, rows z | r | v | grad | (U, H): the start, then the leaves
    D = static_shape(z0)[-1]
    pool = torch.cat([
        torch.cat([z0, r0, velocity(r0, inverse_mass), g0, U0.unsqueeze(-1), H0.unsqueeze(-1)], -1).unsqueeze(-2),
        torch.cat([leaves.z, r, v, leaves.grad, leaves.potential_energy.unsqueeze(-1), H.unsqueeze(-1)], -1),
    ], -2)  # (..., n + 1, 4D + 2)
    # each doubling's subtree: its U-turn checks, what Stan counts (up to its first failure)
    cumulative = _cumulative_momenta(r)
    fail = divergent | (_turned_at(r, v, c.blocks) > 0)
    fail_i = fail.to(torch.int64)
    fails_before = fail_i.cumsum(-1) - fail_i
    counted = (fails_before == fails_before.index_select(-1, c.first_of_leaf)).to(H.dtype)
    per_leaf = torch.stack([counted, torch.exp(delta.clamp(max=0.0)) * counted, divergent.to(H.dtype) * counted,
                            fail.to(H.dtype)], -2)
    seg_steps, seg_accept, seg_diverging, seg_fails = (per_leaf @ c.segment_matrix.mT).unbind(-2)  # (..., K)
    valid = seg_fails == 0
    # ... its log weight and its multinomial draw (uniform uniforms[..., j, 1])
    masked = log_w.unsqueeze(-2) + c.segment_log_mask  # (..., K, n)
    peak = masked.amax(-1, keepdim=True)
    peak = peak.clamp(min=torch.finfo(peak.dtype).min)  # a segment of zero weights: -inf, not nan
    weights = torch.exp(masked - peak)
    total = weights.sum(-1, keepdim=True)
    seg_log_weight = (total.log() + peak).squeeze(-1)  # (..., K)
    below = ((weights / total).cumsum(-1) < uniforms[..., 1].unsqueeze(-1)) & c.in_segment
    drawn = torch.minimum(below.sum(-1), c.last_in_segment) + c.sizes  # pool index (..., K)
    # the tree's log weight after 0, 1, ..., K doublings (the start weighs 1), and the biased
    # progressive sampling of each doubling (uniform uniforms[..., j, 2])
    tree_log_weights = [torch.zeros_like(U0)]
    for lw in seg_log_weight.unbind(-1):
        tree_log_weights.append(torch.logaddexp(tree_log_weights[-1], lw))
    tree_log_weight = torch.stack(tree_log_weights, -1)  # (..., K + 1)
    take = valid & (uniforms[..., 2] < torch.exp(seg_log_weight - tree_log_weight[..., :K]))
    # the U-turn checks across each join: the tree before doubling j, its new subtree
    pattern = (forward.to(torch.int64) * c.sizes).sum(-1)
    joins = c.joins[pattern.unsqueeze(-1)].squeeze(-2)  # (..., 4K) (a 0-d index would be read on the host)
    rv = pool[..., D:3 * D].gather(-2, joins.unsqueeze(-1).expand(static_shape(joins) + (2 * D,)))
    p_near, p_far, p_first, p_last = rv[..., :D].split(K, -2)
    v_near, v_far, v_first, v_last = rv[..., D:].split(K, -2)
    seg_rho = cumulative.index_select(-2, c.segment_ends[1]) - cumulative.index_select(-2, c.segment_ends[0])
    rho_before = r0.unsqueeze(-2) + seg_rho.cumsum(-2) - seg_rho
    ok = _joins_without_u_turn(v_far, v_near, p_near, rho_before, v_first, v_last, p_first, seg_rho)
    # the stopping rule: doublings after the first that ends the tree are not made
    depth_after = c.doubling_number - (~valid).to(torch.int64)
    done = ~valid | ~ok | (depth_after >= max_tree_depth)
    done_i = done.to(torch.int64)
    made = (done_i.cumsum(-1) - done_i) == 0  # (..., K)
    made_f, taken = made.to(H.dtype), made & take
    depth = (made & valid).sum(-1)
    chosen = torch.where(taken, drawn, torch.zeros_like(drawn)).amax(-1)  # the latest subtree taken, or the start
    ends = c.ends[(pattern * K + made.sum(-1) - 1).unsqueeze(-1)].squeeze(-2)  # (..., 2)
    rows = torch.cat([chosen.unsqueeze(-1), ends], -1)  # the draw, the backward end, the forward end
    picked = pool.gather(-2, rows.unsqueeze(-1).expand(static_shape(rows) + (4 * D + 2,)))
    z, r_picked, _, grad, U, H_picked = picked.split([D, D, D, D, 1, 1], -1)
    return Tree(
        ends=IntegratorState(z[..., 1:, :], r_picked[..., 1:, :], U[..., 1:, 0], grad[..., 1:, :]),
        rho=r0 + torch.where(made.unsqueeze(-1), seg_rho, torch.zeros_like(seg_rho)).sum(-2),
        log_weight=tree_log_weight.gather(-1, depth.unsqueeze(-1)).squeeze(-1),
        proposal=HMCState(z[..., 0, :], U[..., 0, 0], grad[..., 0, :]),
        proposal_energy=H_picked[..., 0, 0],
        H0=H0,
        log_slice=log_slice,
        depth=depth,
        n_steps=(seg_steps * made_f).sum(-1).round().to(torch.int64),
        sum_accept=(seg_accept * made_f).sum(-1),
        diverging=((seg_diverging > 0) & made & (done | c.is_last)).any(-1),
        accepted=taken.any(-1),
        done=done.any(-1),
    )


def acceptance_statistic(sum_accept, n_steps):
    """Stan's acceptance statistic of a transition: the mean of ``min(1, exp(H0 - H))`` over
    its ``n_steps`` counted leapfrog steps (0 if none). Tensors, or the Python numbers a
    kernel read from them (cheaper than computing it on the device first)."""
    return sum_accept / (n_steps.clamp(min=1) if torch.is_tensor(n_steps) else max(n_steps, 1))


def info(tree: Tree) -> NUTSInfo:
    """The statistics of a finished transition."""
    return NUTSInfo(
        potential_energy=tree.proposal.potential_energy,
        energy=tree.proposal_energy,
        acceptance_prob=acceptance_statistic(tree.sum_accept, tree.n_steps),
        diverging=tree.diverging,
        accepted=tree.accepted,
        tree_depth=tree.depth,
        n_steps=tree.n_steps,
    )
