"""The Euclidean metric: kinetic energy, velocity and momentum draws for a mass matrix M.

HMC's kinetic energy is ``K(r) = r^T M^{-1} r / 2``. We store the *inverse* mass matrix
(the posterior covariance estimate that adaptation produces) either as a diagonal, shape
``(..., D)``, or dense, shape ``(..., D, D)``; which one is read off the shapes (dense when
``inverse_mass`` has one more dimension than ``r``), so traced programs never branch on
values. Leading dimensions are chains. Block-diagonal mass matrices (Pyro's
``full_mass=[("a", "b"), ...]``) are dense matrices whose off-block entries are zero.

``momentum_scale`` turns standard normal noise into momentum ``r ~ N(0, M)``: ``1/sqrt(diag)``
for a diagonal metric, a factor ``S`` with ``S S^T = M`` for a dense one. It is computed once
per metric (:func:`make_metric`), not per draw.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Metric(NamedTuple):
    inverse_mass: torch.Tensor  # (..., D) diagonal or (..., D, D) dense; units of z**2
    momentum_scale: torch.Tensor  # (..., D) or (..., D, D): r = scale (x) noise ~ N(0, M)


def is_dense(inverse_mass: torch.Tensor, r: torch.Tensor) -> bool:
    return inverse_mass.dim() > r.dim()


def make_metric(inverse_mass: torch.Tensor, dense: bool) -> Metric:
    """A :class:`Metric` from an inverse mass matrix (diagonal ``(..., D)`` or dense ``(..., D, D)``)."""
    if not dense:
        return Metric(inverse_mass, inverse_mass.rsqrt())
    # inverse_mass = L L^T  =>  M = L^{-T} L^{-1}, and S = L^{-T} satisfies S S^T = M.
    L = torch.linalg.cholesky(inverse_mass)
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand(L.shape)
    L_inv = torch.linalg.solve_triangular(L, eye, upper=False)
    return Metric(inverse_mass, L_inv.mT.contiguous())


def unit_metric(dim: int, dense: bool, batch_shape=(), dtype=None, device=None) -> Metric:
    """The identity metric, M = I."""
    if dense:
        eye = torch.eye(dim, dtype=dtype, device=device)
        return Metric(eye.expand(*batch_shape, dim, dim).clone(), eye.expand(*batch_shape, dim, dim).clone())
    ones = torch.ones(*batch_shape, dim, dtype=dtype, device=device)
    return Metric(ones, ones.clone())


def velocity(r: torch.Tensor, inverse_mass: torch.Tensor) -> torch.Tensor:
    """dz/dt = M^{-1} r, shape of ``r``."""
    if is_dense(inverse_mass, r):
        return (inverse_mass @ r.unsqueeze(-1)).squeeze(-1)
    return inverse_mass * r


def kinetic_energy(r: torch.Tensor, inverse_mass: torch.Tensor) -> torch.Tensor:
    """K(r) = r^T M^{-1} r / 2, shape ``r.shape[:-1]``."""
    return 0.5 * (r * velocity(r, inverse_mass)).sum(-1)


def momentum(noise: torch.Tensor, momentum_scale: torch.Tensor) -> torch.Tensor:
    """r ~ N(0, M) from standard normal ``noise`` of shape ``(..., D)``."""
    if momentum_scale.dim() > noise.dim():
        return (momentum_scale @ noise.unsqueeze(-1)).squeeze(-1)
    return momentum_scale * noise
