"""Warnings located at the user's line of code.

A warning's location is what Python prints above its message and what ``module=`` filters
match. The package's warnings arise at varying depths below the user's call (a kernel's
setup runs under ``pyro.infer.MCMC``, under this package's ``MCMC``, sequential or
vectorized, behind Pyro's ``poutine`` wrappers), so no fixed ``stacklevel`` finds the
user's line: :func:`warn_user` walks out of this package, Pyro and torch to it.
"""

import os
import sys
import warnings

import pyro
import torch

_LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(path)) + os.sep for path in (__file__, pyro.__file__, torch.__file__)
)


def warn_user(message: str, category: type) -> None:
    """``warnings.warn(message, category)`` at the innermost frame outside this package,
    Pyro and torch (the user's ``mcmc.run(...)``, ``to_inference_data(...)``)."""
    level, frame = 2, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_LIBRARY_DIRS):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
