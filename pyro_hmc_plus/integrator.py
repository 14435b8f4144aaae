"""The leapfrog (velocity Verlet) integrator over flat tensors.

One step of size ``eps`` maps ``(z, r)`` to (in a trajectory, the last half kick of a step and
the first of the next are one kick of ``eps``)::

    r <- r - eps/2 * grad U(z)
    z <- z + eps * M^{-1} r
    r <- r - eps/2 * grad U(z)

It is volume-preserving and reversible, which is what makes the Metropolis correction of
HMC (and NUTS) exact. ``num_steps`` steps are unrolled in Python: traced, they become one
graph with the gradient inlined, which is where the package's speed comes from (one call
per block of steps instead of a Pyro trace plus ``backward()`` per step).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ._compile import static_shape
from .metric import is_dense, velocity


class IntegratorState(NamedTuple):
    z: torch.Tensor  # (..., D) position, unconstrained
    r: torch.Tensor  # (..., D) momentum
    potential_energy: torch.Tensor  # (...) U(z)
    grad: torch.Tensor  # (..., D) dU/dz at z


def leapfrog(
    value_and_grad: Callable,
    state: IntegratorState,
    step_size: torch.Tensor,
    inverse_mass: torch.Tensor,
    num_steps: int,
) -> IntegratorState:
    """``num_steps`` leapfrog steps; ``step_size`` has the batch shape ``z.shape[:-1]``.

    ``value_and_grad(z) -> (U, dU/dz)`` must accept the batch shape of ``z``. A negative
    ``step_size`` integrates backwards in time (NUTS uses this).
    """
    for state in _steps(value_and_grad, state, step_size, inverse_mass, num_steps, every_state=False):
        pass
    return state


def leapfrog_trajectory(
    value_and_grad: Callable,
    state: IntegratorState,
    step_size: torch.Tensor,
    inverse_mass: torch.Tensor,
    num_steps: int,
) -> IntegratorState:
    """Every state of ``num_steps`` leapfrog steps (not the start), stacked on a new axis:
    ``z, r, grad`` of shape ``(..., num_steps, D)`` and the energies ``(..., num_steps)``.
    NUTS builds its trees from these leaves."""
    return stack_states(leapfrog_states(value_and_grad, state, step_size, inverse_mass, num_steps))


def leapfrog_states(
    value_and_grad: Callable,
    state: IntegratorState,
    step_size: torch.Tensor,
    inverse_mass: torch.Tensor,
    num_steps: int,
) -> list:
    """Every state of ``num_steps`` leapfrog steps (not the start), as a list: for a caller
    that joins several pieces of trajectory and stacks them once (:func:`stack_states`)."""
    return list(_steps(value_and_grad, state, step_size, inverse_mass, num_steps))


def stack_states(states: list) -> IntegratorState:
    """States stacked on a new axis: ``z, r, grad`` ``(..., len(states), D)``, energies ``(..., len(states))``."""
    return IntegratorState(
        torch.stack([s.z for s in states], -2),
        torch.stack([s.r for s in states], -2),
        torch.stack([s.potential_energy for s in states], -1),
        torch.stack([s.grad for s in states], -2),
    )


def state_at(states: list, index: torch.Tensor) -> IntegratorState:
    """State ``index[b]`` of ``states`` (a list of states of batch shape ``(B,)``) for each
    ``b``: where each of a batch of trajectories is, from one batched run of steps. One
    gather of the states packed side by side (a ``where`` per state and field would cost
    ``4 * len(states)`` operations in a traced program)."""
    D = static_shape(states[0].z)[-1]
    packed = torch.stack([torch.cat([s.z, s.r, s.grad, s.potential_energy.unsqueeze(-1)], -1) for s in states])
    rows = index.unsqueeze(0).unsqueeze(-1).expand((1,) + static_shape(index) + (3 * D + 1,))
    picked = packed.gather(0, rows).squeeze(0)
    z, r, g, U = picked.split([D, D, D, 1], -1)
    return IntegratorState(z, r, U.squeeze(-1), g)


def _steps(value_and_grad, state, step_size, inverse_mass, num_steps, every_state=True):
    """Yield the state after each of ``num_steps`` leapfrog steps, or (``every_state=False``)
    only the last one, in which case the closing half kick of each step and the opening half
    kick of the next are one kick of ``eps``."""
    z, r, U, g = state
    eps = step_size.unsqueeze(-1)
    half = 0.5 * eps
    # few tensor operations per step besides the gradient (each op of a traced program
    # costs the same few microseconds of dispatch, whatever its size): fused multiply-adds,
    # and with a diagonal metric the drift's eps * M^{-1} computed once per trajectory
    dense = is_dense(inverse_mass, r)
    drift = eps if dense else eps * inverse_mass
    r = torch.addcmul(r, half, g, value=-1.0)
    for i in range(num_steps):
        z = torch.addcmul(z, drift, velocity(r, inverse_mass) if dense else r)
        U, g = value_and_grad(z)
        last = i == num_steps - 1
        if every_state or last:
            r = torch.addcmul(r, half, g, value=-1.0)
            yield IntegratorState(z, r, U, g)
            if not last:
                r = torch.addcmul(r, half, g, value=-1.0)
        else:
            r = torch.addcmul(r, eps, g, value=-1.0)
