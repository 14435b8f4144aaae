"""pyro-hmc-plus: fast Hamiltonian Monte Carlo for Pyro.

Swap ``from pyro.infer import NUTS`` (or ``HMC``) for ``from pyro_hmc_plus import NUTS``: the kernels take
the same arguments and run inside ``pyro.infer.MCMC``, but build the gradient of the
model's potential energy once (traced and compiled) instead of re-running the model under
Pyro's tracing and autograd at every leapfrog step.
"""

from .engine import ENGINES, EngineFallbackWarning, GradientEngine
from .kernels import HMC, NUTS
from .inference_data import RunDiagnostics, SamplingWarning, diagnose, to_inference_data
from .mcmc import MCMC
from .potential import FlatPotential, SiteLayout, from_model, from_potential_fn
from .tracing import UntraceableModel

__all__ = [
    "HMC",
    "MCMC",
    "NUTS",
    "ENGINES",
    "EngineFallbackWarning",
    "FlatPotential",
    "GradientEngine",
    "SiteLayout",
    "RunDiagnostics",
    "SamplingWarning",
    "UntraceableModel",
    "diagnose",
    "from_model",
    "from_potential_fn",
    "to_inference_data",
]
__version__ = "0.1.0"
