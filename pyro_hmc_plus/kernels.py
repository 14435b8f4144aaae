"""The Pyro shell: kernels that implement ``pyro.infer.mcmc.MCMCKernel`` by holding the
functional core's state and calling it. The only place with mutable state, dicts of sites
and Pyro's conventions (unconstrained params in and out of ``sample``, ``diagnostics()``
with post-warmup divergence indices, ``logging()`` for the progress bar).
"""

from __future__ import annotations

import math
import numbers
import typing
from collections import OrderedDict

import torch
from pyro.infer.autoguide.initialization import init_to_uniform
from pyro.infer.mcmc.mcmc_kernel import MCMCKernel

from . import adaptation, chain_batch, nuts, potential, rounds
from ._warn import warn_user
from .engine import GradientEngine, is_numerical_failure, with_autograd
from .hmc import HMCInfo, HMCState, hmc_step, stat_row
from .inference_data import Adaptation, SamplingWarning, chain_diagnostics
from .integrator import IntegratorState, leapfrog
from .metric import Metric, kinetic_energy, make_metric, momentum, unit_metric


_VALIDATION_POINTS = 2  # random points (besides the initial one) each program is checked at
_FUSED_DOUBLINGS = 3  # most doublings of a NUTS transition's start fused into one program
# A gradient touching fewer tensor elements costs little beyond its operations' dispatch (the
# 285k-element logistic regression's ~25 µs more on one CPU thread): the fused start's
# leapfrog steps wasted where a tree stops early cost less than the bookkeeping it saves.
_CHEAP_GRADIENT_ELEMENTS = 100_000
# What replaces Pyro's ``kernel.mass_matrix_adapter`` (HMC.mass_matrix_adapter)
_METRIC_INSTEAD = ("full_mass= sets the metric's structure (False, True, or dense blocks of sites), adapt_mass_matrix= "
                   "whether it adapts, inverse_mass_matrix= the metric it starts from; the adapted one is "
                   "kernel.inverse_mass_matrix (mcmc.inverse_mass_matrix per chain)")


def _flatten(x, leaves: list):
    """Append the tensors of ``x`` (a tensor or nested tuples/NamedTuples of them) to
    ``leaves`` and return its structure, for :func:`_unflatten`. Hand-written because it runs
    around every program call, where torch's general pytree utilities cost ~100 µs."""
    if isinstance(x, tuple):
        return type(x), [_flatten(y, leaves) for y in x]
    leaves.append(x)
    return None


def _leaves(x) -> list:
    """The tensors of ``x`` in :func:`_flatten`'s order."""
    leaves = []
    _flatten(x, leaves)
    return leaves


def _unflatten(structure, leaves):
    """Rebuild what :func:`_flatten` took apart, from an iterator over its leaves."""
    if structure is None:
        return next(leaves)
    kind, children = structure
    values = [_unflatten(child, leaves) for child in children]
    return tuple(values) if kind is tuple else kind(*values)


def _structure_of(record_type):
    """:func:`_flatten`'s structure of any ``record_type`` (a NamedTuple whose fields are
    tensors or such records, by its type hints), known before any program has made one."""
    hints = typing.get_type_hints(record_type)
    return record_type, [
        _structure_of(hints[name]) if isinstance(hints[name], type) and issubclass(hints[name], tuple) else None
        for name in record_type._fields
    ]


_TREE = _structure_of(nuts.Tree)  # a NUTS transition's tree between its programs is a flat list of tensors


def one_step_energy_change(value_and_grad, state: HMCState, noise: torch.Tensor, step_size: float,
                           metric: Metric) -> float:
    """The energy change of one leapfrog step of ``step_size`` from ``state`` (one chain)
    with the momentum of ``noise`` under ``metric``; ``inf`` if it is not finite or the model
    fails numerically. For the step-size search (:func:`adaptation.find_reasonable_step_size`).
    The step runs op by op on ``value_and_grad`` (the engine's gradient graph): a search makes
    a few dozen steps in a whole run (~0.2 ms each on eight schools), fewer than recording a
    program for them would pay for (~30 ms)."""
    z, U, g = state
    inverse_mass = metric.inverse_mass
    r = momentum(noise, metric.momentum_scale)
    eps = torch.tensor(step_size, dtype=z.dtype, device=z.device)
    try:
        end = leapfrog(value_and_grad, IntegratorState(z, r, U, g), eps, inverse_mass, 1)
    except (RuntimeError, ValueError) as e:
        if not is_numerical_failure(e):
            raise
        return math.inf
    delta = (end.potential_energy + kinetic_energy(end.r, inverse_mass) - U - kinetic_energy(r, inverse_mass)).item()
    return delta if math.isfinite(delta) else math.inf


class _Program:
    """A compiled program over nested records of tensors. Calling it takes and returns the
    records; :meth:`flat` takes and returns their tensors in :func:`_flatten`'s order, for
    a loop that keeps its state flat between calls (taking records apart and rebuilding
    them costs more than a small compiled call)."""

    def __init__(self, compiled, out_structure: list):
        self.flat = compiled
        self._out_structure = out_structure  # set by the first trace (or eager call)

    def __call__(self, *args):
        leaves = []
        _flatten(args, leaves)
        out_leaves = self.flat(*leaves)  # first: an eager program learns its structure by running
        return _unflatten(self._out_structure[0], iter(out_leaves))


def _host_values(*scalars: torch.Tensor) -> list:
    """The per-draw statistics (0-d tensors of any dtype) as Python numbers. On an
    accelerator in one host read (each read waits for the device); on the CPU one
    ``item()`` each, ~3 µs in all against ~40 for converting and stacking them first."""
    if all(x.device.type == "cpu" for x in scalars):
        return [x.item() for x in scalars]
    return torch.stack([x.to(torch.float64) for x in scalars]).tolist()


def _step_sizes(step_size) -> typing.Tuple[float, typing.Optional[torch.Tensor]]:
    """``step_size`` as the first chain's (a float) and, where it is given one per chain (a
    1-D tensor, list or array, as ``pyro_hmc_plus.MCMC.step_size`` holds them), all of them
    as a float64 tensor ``(C,)``; for one number (a 0-d tensor too), ``None``."""
    try:
        values = torch.as_tensor(step_size, dtype=torch.float64, device="cpu")
    except (TypeError, ValueError, RuntimeError):
        values = None
    if values is None or values.dim() > 1 or values.numel() == 0 or not (torch.isfinite(values) & (values > 0)).all():
        raise ValueError(f"step_size must be a positive finite number, or one per chain (a 1-D tensor or list of "
                         f"them), got {step_size!r}")
    return float(values.reshape(-1)[0]), (values if values.dim() == 1 else None)


def _floating_point(initial_params: typing.Optional[dict]) -> typing.Optional[dict]:
    """``initial_params`` as tensors, integers (``torch.tensor(0)``, ``0``) as floating-point
    ones of the default dtype (as ``torch.tensor(0.0)``): torch's distributions take integers
    for their parameters, so users write them for starting values too."""
    if initial_params is None:
        return None
    values = {k: torch.as_tensor(v) for k, v in initial_params.items()}
    return {k: v if v.is_floating_point() else v.to(torch.get_default_dtype()) for k, v in values.items()}


def _args_key(args, kwargs):
    """What the traced programs depend on besides the model: the data and the default dtype.

    A dense tensor argument is keyed by the memory it views (address, shape, strides, dtype,
    device) and its in-place version, which its views and ``detach()`` share: Pyro's
    ``MCMC.run`` passes a fresh ``detach()`` of each tensor to every run, and a second run on
    the same data reuses the engine. Any other argument (a sparse tensor, which has no one
    address) is keyed by identity and in-place version. The engine keeps the arguments
    alive (``_args_ref``), so no other data can take their place. A tensor made under
    ``torch.inference_mode()`` keeps no version (reading it is an error), and inside that
    mode it can be written in place: its key equals no other, so each run builds afresh."""
    items = list(args) + sorted(kwargs.items(), key=lambda kv: kv[0])
    key = []
    for a in items:
        v = a[1] if isinstance(a, tuple) and len(a) == 2 and isinstance(a[0], str) else a
        version = (object() if v.is_inference() else v._version) if torch.is_tensor(v) else None
        if torch.is_tensor(v) and v.layout == torch.strided:
            key.append((v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device, version))
        else:
            key.append((id(v), version))
    return (tuple(key), torch.get_default_dtype())


def _warn_of_flat_coordinates(layout: potential.SiteLayout, engine: GradientEngine) -> None:
    """A :class:`SamplingWarning` before the run, naming the coordinates the potential energy
    does not depend on (:func:`potential.flat_coordinates` at the engine's check points):
    the posterior is improper along them, and a run costs ``2**max_tree_depth`` gradients a
    draw without converging."""
    gradients = engine.check_gradients
    names = potential.flat_coordinates(layout, gradients)
    if names:
        warn_user(
            f"the potential energy does not depend on {potential.listing(names)} (unconstrained coordinates; its "
            f"gradient there is 0 at {len(gradients)} points): the posterior is flat along them, so "
            "improper, and the sampler will run every trajectory to its maximum length without converging. Give "
            "them a density (a proper prior or a likelihood term) or leave them out of the model: a site has none "
            "where it is masked out, as `pyro.sample(name, d, obs=y, obs_mask=m)`'s `name_unobserved` site "
            "at the observed entries (sample only the missing ones instead), or `d.mask(False)`",
            SamplingWarning,
        )


def _warn_of_a_singular_dense_metric(kernel: "HMC", block_mask: typing.Optional[torch.Tensor]) -> None:
    """A :class:`SamplingWarning` before the run where the mass matrix's largest dense block
    (``block_mask`` (D, D), see :meth:`HMC._mass_structure`) has at least as many dimensions
    as warmup's last slow window has draws to estimate it from: the estimate is then
    singular (Stan's regularisation, Pyro's too, keeps it invertible, with variances of
    ~1e-3 / n along the directions the draws miss), and trajectories need many more steps
    along them. No run says so afterwards, and its warning, draws at the maximum tree depth,
    points elsewhere."""
    if block_mask is None or not kernel.adapt_mass_matrix:
        return
    dim = int(block_mask.sum(-1).max())
    draws = adaptation.metric_window_draws(kernel._warmup_steps)
    if 0 < draws <= dim:
        warn_user(
            f"full_mass: the mass matrix's dense block of {dim} coordinates is estimated from the {draws} draws of "
            f"warmup's last adaptation window (warmup_steps={kernel._warmup_steps}), no more than it has dimensions, so "
            "the estimate is singular but for a small regularisation, and trajectories need many more leapfrog steps "
            "along the directions the draws miss (a 100-dimensional Gaussian with warmup_steps=300: 412 steps a NUTS "
            "draw, against 24 with 500). Use warmup_steps="
            f"{adaptation.warmup_steps_for_metric_draws(2 * dim, kernel._warmup_steps)} (its last window has at least "
            f"{2 * dim} draws, twice the dimension), a diagonal mass matrix (full_mass=False), or smaller full_mass "
            "blocks",
            SamplingWarning,
        )


def _warn_of_a_cut_gradient(engine: GradientEngine) -> None:
    """A :class:`SamplingWarning` before the run where the potential energy's gradient does
    not match its values (:attr:`GradientEngine.gradient_mismatch`): HMC follows the gradient,
    so its draws would not follow the posterior, with Pyro's kernels as with these."""
    found = engine.gradient_mismatch
    if found is not None:
        warn_user(
            f"the gradient of the potential energy does not match its values: along a random direction its "
            f"slope is {found[0]:.4g} by finite differences and {found[1]:.4g} by the gradient. Something in the "
            f"{engine.flat.source} cuts the gradient of a term the potential depends on, as `torch.tensor([...])`, "
            "`float(x)` or `x.item()` of a latent value, `.detach()`, `torch.no_grad()` or a NumPy round trip "
            "do; HMC and NUTS (Pyro's too) follow the gradient, so the draws will not follow the posterior. "
            "Build tensors from latent values with `torch.stack` or `torch.cat`, and keep them tensors",
            SamplingWarning,
        )


def _warn_of_data_left_out(model, args, kwargs, layout: potential.SiteLayout) -> None:
    """A :class:`SamplingWarning` naming the latent sites that look like data the run was
    not given (:func:`potential.data_left_out`): the usual cause of a posterior that is the
    prior (Pyro's NUTS, on a regression of 100 points without its ``y``: 134 s for 400
    draws of the prior, without a word)."""
    left_out = potential.data_left_out(model, args, kwargs, layout)
    if left_out:
        warn_user(
            f"the latent sites {'; '.join(left_out)} are sampled as unknowns: the model got no data for them, so "
            "`obs=` of a None observes nothing and the other sites follow their prior, not the data. If they are "
            "data, give them to run() (`mcmc.run(x, y)` or `mcmc.run(x, y=y)`); if they are meant to be "
            "latent, ignore this warning",
            SamplingWarning,
        )


def _check_the_models_sites(model, args, kwargs, flat: potential.FlatPotential, user_transforms) -> None:
    """Runs the model at the random probe points (:meth:`potential.FlatPotential.probe_points`,
    :func:`potential.trace_at`) and compares its sites there with the initial run's. A
    :class:`ValueError` where it samples other latent sites than there
    (:func:`potential.sites_that_come_and_go`): no HMC kernel, Pyro's included, samples such a
    model. A :class:`SamplingWarning` before the run, naming the latent sites whose support
    moves with other latent sites (:func:`potential.sites_with_moving_supports`, at the last
    point where the model evaluates): Pyro's transforms fix it at the initial values, and the
    draws do not follow the model's posterior. Others there, naming the angles of a periodic
    density (:func:`potential.sites_with_periodic_densities`), which wander over many turns,
    and the observed data that broadcast against their distributions into an outer product
    (:func:`potential.data_broadcast_against_their_distributions`)."""
    runs = [(z, potential.trace_at(model, args, kwargs, flat, z)) for z in flat.probe_points()[1:]]
    runs = [(z, trace) for z, trace in runs if trace is not None]
    for _, trace in runs:
        potential.check_the_same_sites(flat.layout, trace)
    if not runs:  # the model evaluates only at its initial values: nothing to compare
        return
    z, trace = runs[-1]
    outer = potential.data_broadcast_against_their_distributions(trace, flat.layout)
    if outer:
        warn_user(
            f"observed data and their distributions broadcast against each other: {'; '.join(outer)}. Each value "
            "is scored against every other value's parameters (an outer product), so the posterior is wrong, "
            "with Pyro's HMC and NUTS as with these kernels. Give the data the distribution's batch shape: a "
            "column of data (`y[:, None]`, `df[['y']]`) against a plate of the same length needs "
            "`y.reshape(-1)`",
            SamplingWarning,
        )
    angles = potential.sites_with_periodic_densities(trace, flat.layout, skip=user_transforms or ())
    if angles:
        warn_user(
            f"the latent sites {angles} are angles whose density repeats every turn (von Mises): torch declares "
            "their support the whole real line, so Pyro's HMC and NUTS, and these kernels, sample a posterior "
            "with a copy in every turn (improper): the draws wander over many turns (trajectories often run to "
            "the maximum tree depth), or chains settle in different turns. The draws are right modulo 2 pi only "
            "(wrapped into [-pi, pi): `torch.remainder(a + math.pi, 2 * math.pi) - math.pi`); R-hat and ESS of "
            "the raw draws mean nothing. Sample a direction instead, as Stan's unit vectors do: `v = "
            "pyro.sample('v', dist.Normal(0., 1.).expand([2]).to_event(1))` with `pyro.factor('v_radius', -50 * "
            "(v.norm(dim=-1) - 1) ** 2)` (a density of the radius alone leaves the angle uniform; one near 1 "
            "keeps NUTS away from the origin, where a concentrated angle diverges), the angle `a = "
            "pyro.deterministic('a', torch.atan2(v[..., 1], v[..., 0]))` and its density "
            "`pyro.factor('a_density', dist.VonMises(loc, kappa).log_prob(a))`",
            SamplingWarning,
        )
    names = potential.sites_with_moving_supports(trace, flat, z, skip=user_transforms or ())
    if names:
        warn_user(
            f"the supports of the latent sites {names} move with other latent sites (as `b ~ Uniform(0, a)` "
            "does): Pyro's HMC and NUTS, and these kernels, which use Pyro's potential, map a site to "
            "unconstrained space through one transform fixed at the initial values, so the draws do not "
            "follow the posterior (the site is truncated to its initial support). Sample a site with a fixed "
            "support and transform it instead: `u = pyro.sample('u', dist.Uniform(0., 1.))` and "
            "`b = pyro.deterministic('b', a * u)`",
            SamplingWarning,
        )


class HMC(MCMCKernel):
    """Hamiltonian Monte Carlo with a fixed trajectory length, on a compiled gradient.

    A drop-in replacement for :class:`pyro.infer.HMC`: every argument has Pyro's meaning.

    :param model: a Pyro model (or give ``potential_fn``).
    :param potential_fn: ``U(params)`` over a dict of unconstrained tensors; needs
        ``initial_params`` (given to :class:`pyro.infer.MCMC`) and optionally ``transforms``.
    :param float step_size: initial leapfrog step size (with ``adapt_step_size``, where the search
        for a reasonable one starts at setup). Or one per chain, a 1-D tensor or list of ``C``
        numbers, for a run of ``C`` chains in :class:`pyro_hmc_plus.MCMC`, with any ``chain_method``
        (as its ``step_size`` holds them after a run, and as Stan takes one per chain): to go on from
        another run's adapted values with a trajectory length shared by the chains, so
        ``HMC`` takes ``trajectory_length`` rather than ``num_steps`` with them.
    :param float trajectory_length: default ``step_size * num_steps``, else ``2 * pi``. The number of
        steps is ``max(1, int(trajectory_length / step_size))``, so it follows the adapted step size.
        Where the adapted mass matrix fits a near-Gaussian posterior, ``2 * pi`` is about one
        whole turn of it, in Pyro's HMC as here: each trajectory ends near its start and the
        draws barely move (a 1-D normal: 7 steps of 0.84, 6.08 rad, a variance of 0.005 for
        0.1). NUTS chooses the length itself; with HMC, a shorter one (``pi / 2``) avoids it.
    :param int num_steps: leapfrog steps per transition: sets ``trajectory_length`` to
        ``step_size * num_steps`` where that is not given (as in Pyro, a given
        ``trajectory_length`` overrides it).
    :param bool adapt_step_size: search a reasonable step size at setup (also without warmup, as
        Pyro does), then dual averaging to ``target_accept_prob`` during warmup.
    :param bool adapt_mass_matrix: estimate the inverse mass matrix in Stan's warmup windows.
    :param full_mass: ``False`` (diagonal), ``True`` (dense), or a list of tuples of site names
        whose joint blocks are dense (the rest diagonal).
    :param dict transforms: per-site transforms to unconstrained space (``potential_fn`` only,
        or to override the model's defaults). For a model, the kernel's ``transforms``
        attribute holds every site's once the kernel is set up, ``None`` before.
    :param int max_plate_nesting: as in Pyro, for models with enumerated discrete sites.
    :param jit_compile: accepted for compatibility. This package always builds the
        gradient once (see ``engine``); ``jit_compile=False`` does not switch it off.
    :param jit_options: accepted for compatibility; ignored.
    :param ignore_jit_warnings: accepted for compatibility; ignored.
    :param float target_accept_prob: target of step-size adaptation (default 0.8).
    :param init_strategy: Pyro init strategy (default ``init_to_uniform``).
    :param float min_stepsize: lower bound of the adapted step size (during warmup, and the
        average it ends with).
    :param float max_stepsize: upper bound of the adapted step size.
    :param str engine: ``"auto"``, ``"trace"``, ``"aot"``, ``"inductor"`` or ``"eager"`` (see
        :mod:`pyro_hmc_plus.engine`).
    :param int max_unroll: most leapfrog steps fused into one compiled call; longer
        trajectories run as several calls.
    :param inverse_mass_matrix: the metric the chains start from, in place of the identity (as
        Stan's ``inv_metric`` and NumPyro's argument): another run's, to start where its warmup
        ended or to sample with it fixed (``adapt_mass_matrix=False``). Either
        :attr:`inverse_mass_matrix`'s format (a dict from tuples of site names to blocks), or a
        tensor over the flat vector, ``(D,)`` or ``(D, D)`` as ``full_mass`` makes it, or one
        per chain, ``(C, D)`` or ``(C, D, D)``, as ``pyro_hmc_plus.MCMC.inverse_mass_matrix``
        holds them after a run of ``C`` chains (any ``chain_method``), for another such run
        (a chain run on its own takes ``(1, D)``, as after a run of one chain).
    """

    # Sample statistics recorded for every draw (warmup too), with Stan/ArviZ names.
    stat_names = ("lp", "energy", "acceptance_rate", "diverging", "step_size", "n_steps")

    def __init__(
        self,
        model=None,
        potential_fn=None,
        step_size=1,
        trajectory_length=None,
        num_steps=None,
        adapt_step_size=True,
        adapt_mass_matrix=True,
        full_mass=False,
        transforms=None,
        max_plate_nesting=None,
        jit_compile=False,
        jit_options=None,
        ignore_jit_warnings=False,
        target_accept_prob=0.8,
        init_strategy=init_to_uniform,
        *,
        min_stepsize: float = 1e-10,
        max_stepsize: float = 1e10,
        engine: str = "auto",
        max_unroll: int = 16,
        inverse_mass_matrix=None,
    ):
        if (model is None) == (potential_fn is None):
            raise ValueError("give exactly one of `model` or `potential_fn`")
        step_size, step_sizes = _step_sizes(step_size)
        if step_sizes is not None and num_steps is not None and trajectory_length is None:
            raise ValueError(
                "with a step size per chain, give trajectory_length (shared by the chains, as after adaptation; "
                "each chain then takes trajectory_length / its step size steps) instead of num_steps"
            )
        if num_steps is not None and not (isinstance(num_steps, numbers.Integral) and num_steps >= 1):
            raise ValueError(f"num_steps must be a positive integer, got {num_steps!r}")
        if trajectory_length is not None and not trajectory_length > 0:
            raise ValueError(f"trajectory_length must be positive, got {trajectory_length!r}")
        if not 0 < target_accept_prob < 1:
            raise ValueError(f"target_accept_prob must be in (0, 1), got {target_accept_prob!r}")
        if not 0 < min_stepsize < max_stepsize:
            raise ValueError(f"need 0 < min_stepsize < max_stepsize, got {min_stepsize!r} and {max_stepsize!r}")
        if not (full_mass in (True, False) or isinstance(full_mass, list)):
            raise ValueError(f"full_mass must be True, False or a list of tuples of site names, got {full_mass!r}")
        if max_plate_nesting is not None and not (isinstance(max_plate_nesting, numbers.Integral)
                                                  and max_plate_nesting >= 0):
            raise ValueError(f"max_plate_nesting must be a non-negative integer (or None: found by running "
                             f"the model), got {max_plate_nesting!r}")
        if not callable(init_strategy):
            raise ValueError(f"init_strategy must be a function of a sample site, such as "
                             f"pyro.infer.autoguide.init_to_median, got {init_strategy!r}")
        if max_unroll < 1:
            raise ValueError(f"max_unroll must be at least 1, got {max_unroll!r}")
        GradientEngine.check_name(engine)
        self.model = model
        self._user_potential_fn = potential_fn
        # a model's transforms are known once it is set up: the user's, with Pyro's for the other
        # sites (until then None, so that Pyro's MCMC, whose chains ran in worker processes,
        # sets the kernel up to read them rather than taking the user's as all of them)
        self.transforms = transforms if model is None else None
        self._user_transforms = transforms
        self._max_plate_nesting = max_plate_nesting
        self._init_strategy = init_strategy
        self._init_step_size = float(step_size)
        self._init_step_sizes = step_sizes  # one per chain (float64, (C,)), or None
        if trajectory_length is None:  # as Pyro: a given trajectory_length overrides num_steps
            trajectory_length = 2 * math.pi if num_steps is None else step_size * num_steps
        self.trajectory_length = float(trajectory_length)
        self.adapt_step_size = adapt_step_size
        self.adapt_mass_matrix = adapt_mass_matrix
        self.full_mass = full_mass
        self.target_accept_prob = target_accept_prob
        self.min_stepsize = min_stepsize
        self.max_stepsize = max_stepsize
        self.engine = engine
        self.max_unroll = int(max_unroll)
        self._given_inverse_mass = inverse_mass_matrix
        # (chain, number of chains) while pyro_hmc_plus.MCMC runs this kernel (or, in a worker
        # process, this copy of it) as one chain of a run, as Pyro sets `initial_params` per
        # chain: picks the chain's step size and metric where they are given one per chain
        self._chain_of_run = None
        self._initial_params = None
        self._save_params = None
        self._engines = {}  # args key -> GradientEngine, reused by sequential chains
        self._engine = None
        self._flat = None
        self._chain_stats = []  # one dict of lists per chain run by this kernel object
        self._programs = {}  # built programs, kept for the next chain while the engine is the same
        self._reset()

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        state = self.__dict__.copy()
        for k in ("_engines", "_engine", "_flat", "_programs"):
            state[k] = {} if k in ("_engines", "_programs") else None
        return state

    # ------------------------------------------------------------------ Pyro protocol
    @property
    def initial_params(self):
        return self._initial_params

    @initial_params.setter
    def initial_params(self, params):
        self._initial_params = params

    @property
    def save_params(self):
        """The sites whose draws ``MCMC`` keeps, sorted by name, as ``MCMC(save_params=...)``
        sets them; unset (an ``AttributeError``, as Pyro's kernels), every latent site. Pyro's
        ``MCMC`` reads it with ``getattr(kernel, "save_params", every site)``, flattens each
        draw in its order, and reads the draws back in sorted order: given in another order,
        one site's draws came back as another's."""
        if self._save_params is None:
            raise AttributeError("save_params is not set: MCMC keeps every latent site's draws")
        return self._save_params

    @save_params.setter
    def save_params(self, names):
        self._save_params = None if names is None else sorted(names)

    @property
    def potential_fn(self):
        """``U(params)`` over a dict of unconstrained tensors, as Pyro's attribute: the one
        given, or for a model the one Pyro's ``initialize_model`` built for the last chain set
        up (``None`` before that, as in Pyro), which users call to score draws."""
        if self._user_potential_fn is not None or self._flat is None:
            return self._user_potential_fn
        return self._flat.potential_fn

    @property
    def step_size(self) -> float:
        return self._step_size

    @property
    def num_steps(self) -> int:
        return max(1, int(self.trajectory_length / self._step_size))

    @property
    def inverse_mass_matrix(self) -> "OrderedDict[tuple, torch.Tensor]":
        """The current inverse mass matrix in Pyro's format: each dense block of ``full_mass``
        (a tuple of site names; all sites, sorted, for ``full_mass=True``) to its ``(n, n)``
        matrix, then the other sites (sorted, as one tuple) to their ``(n,)`` diagonal;
        entries follow the tuple's sites, each site flattened."""
        metric = getattr(self, "_metric", None)
        if metric is None:
            raise AttributeError(
                "inverse_mass_matrix: this kernel has not run a chain yet (after a vectorized run of "
                "pyro_hmc_plus.MCMC, each chain's is mcmc.inverse_mass_matrix)"
            )
        inv = metric.inverse_mass
        return OrderedDict(
            (names, inv[idx][:, idx] if dense else (inv.diagonal() if inv.dim() == 2 else inv)[idx])
            for names, idx, dense in self._mass_blocks()
        )

    @property
    def mass_matrix_adapter(self):
        """Pyro's kernels keep their metric in a ``mass_matrix_adapter`` object, which code
        written for them reads or replaces (Pyro's epidemiology models put an
        ``ArrowheadMassMatrix`` there). These kernels adapt the metric inside their compiled
        programs: there is no such object, and one assigned here would be ignored, so both
        are errors that say what to use instead."""
        raise AttributeError(f"{type(self).__name__} of pyro_hmc_plus has no mass_matrix_adapter: {_METRIC_INSTEAD}")

    @mass_matrix_adapter.setter
    def mass_matrix_adapter(self, adapter):
        raise AttributeError(
            f"{type(self).__name__} of pyro_hmc_plus cannot use a mass matrix adapter ({type(adapter).__name__}): "
            f"it adapts a diagonal or dense-block metric inside its compiled programs, where {_METRIC_INSTEAD}. For "
            "another metric structure, use Pyro's kernel"
        )

    def _mass_blocks(self) -> list:
        """The blocks of :attr:`inverse_mass_matrix`, in its order: ``(site names, their
        positions in the flat vector, dense?)`` for each dense block of ``full_mass``, then
        the other sites as one diagonal block."""
        layout, device = self._flat.layout, self._flat.device
        dense_blocks = self._dense_blocks()
        in_blocks = {name for block in dense_blocks for name in block}
        diagonal_sites = tuple(name for name in layout.names if name not in in_blocks)
        blocks = [(block, True) for block in dense_blocks] + ([(diagonal_sites, False)] if diagonal_sites else [])
        return [(names, torch.tensor(layout.positions(names), device=device), dense) for names, dense in blocks]

    def _starting_metric(self, block_mask, batch_shape=()) -> Metric:
        """The metric the chains start from, ``batch_shape`` of them: the identity, or the
        ``inverse_mass_matrix`` given to the constructor, checked against this model's flat
        vector and the ``full_mass`` structure (``block_mask``, ``None`` for a diagonal metric)."""
        flat, dense = self._flat, block_mask is not None
        given = self._given_inverse_mass
        if given is None:
            return unit_metric(flat.dim, dense, batch_shape, dtype=flat.dtype, device=flat.device)
        inv = self._flat_inverse_mass(given, dense) if isinstance(given, dict) else torch.as_tensor(given)
        inv = inv.to(dtype=flat.dtype, device=flat.device)
        event = (flat.dim, flat.dim) if dense else (flat.dim,)
        if inv.shape not in (event, tuple(batch_shape) + event):
            raise ValueError(
                f"inverse_mass_matrix has shape {tuple(inv.shape)}: over the flat vector of the sites "
                f"{list(flat.layout.names)} ({flat.dim} entries, full_mass={self.full_mass!r}) it is {event}"
                + (f", or {tuple(batch_shape) + event} with one per chain" if batch_shape else "")
            )
        if dense and ((inv * (1 - block_mask)) != 0).any():
            raise ValueError("inverse_mass_matrix has entries outside the dense blocks of full_mass, where they are 0")
        inv = inv.expand(*batch_shape, *event).clone()
        not_positive = ValueError("inverse_mass_matrix must be finite and positive definite (a diagonal: positive)")
        if not (torch.isfinite(inv).all() and (inv.diagonal(dim1=-2, dim2=-1) if dense else inv).gt(0).all()
                and (not dense or torch.allclose(inv, inv.mT))):
            raise not_positive
        try:
            return make_metric(inv, dense)  # a dense one's Cholesky factor: the definiteness check
        except torch.linalg.LinAlgError as e:
            raise not_positive from e

    def _step_sizes_of_run(self, num_chains: int) -> torch.Tensor:
        """Each chain's starting step size in a run of ``num_chains``, float64 ``(C,)`` (as
        Python's floats: rounded once to the model's dtype): the one given, or one per chain."""
        given = self._init_step_sizes
        if given is None:
            return torch.full((num_chains,), self._init_step_size, dtype=torch.float64)
        if len(given) != num_chains:
            raise ValueError(f"step_size holds {len(given)} values, one per chain, but the run has num_chains={num_chains}")
        return given

    def _flat_inverse_mass(self, given: dict, dense: bool) -> torch.Tensor:
        """The given inverse mass matrix in :attr:`inverse_mass_matrix`'s format as one tensor
        over the flat vector, ``(D, D)`` if ``dense`` else ``(D,)``."""
        blocks = self._mass_blocks()
        if set(given) != {names for names, _, _ in blocks}:
            raise ValueError(
                f"inverse_mass_matrix has the blocks {list(given)}; with full_mass={self.full_mass!r} this model's "
                f"are {[names for names, _, _ in blocks]} (the keys of kernel.inverse_mass_matrix)"
            )
        D = self._flat.dim
        inv = torch.eye(D, dtype=self._flat.dtype) if dense else torch.ones(D, dtype=self._flat.dtype)
        for names, idx, block_dense in blocks:
            value = torch.as_tensor(given[names], dtype=self._flat.dtype).cpu()
            shape = (len(idx), len(idx)) if block_dense else (len(idx),)
            if value.shape != shape:
                raise ValueError(f"inverse_mass_matrix[{names!r}] has shape {tuple(value.shape)}, expected {shape}")
            idx = idx.cpu()
            if block_dense:
                inv[idx.unsqueeze(-1), idx] = value
            elif dense:
                inv[idx, idx] = value
            else:
                inv[idx] = value
        return inv

    @property
    def engine_name(self) -> str:
        """The engine actually in use (after any fallback)."""
        return self._engine.name

    def _reset(self):
        self._t = 0
        self._accept_cnt = 0
        self._mean_accept_prob = 0.0
        self._divergences = []
        self._state = None
        self._warmup_steps = 0
        self._step_size = self._init_step_size

    @with_autograd
    def setup(self, warmup_steps, *args, **kwargs):
        if self._init_step_sizes is not None and len(self._init_step_sizes) > 1 and self._chain_of_run is None:
            raise ValueError(
                f"step_size holds {len(self._init_step_sizes)} values, one per chain: they are for a run of "
                f"pyro_hmc_plus.MCMC with num_chains={len(self._init_step_sizes)}; a chain run on its own "
                "(pyro.infer.MCMC) takes one number"
            )
        initial = self._initial_params
        self._reset()
        self._warmup_steps = warmup_steps
        z0, U0, g0 = (x[0] for x in self._build_potential(args, kwargs, initial))
        if self.model is not None:  # Pyro's model path returns the init point as `initial_params`
            self._initial_params = self._flat.layout.unpack(z0)
        self._state = HMCState(z0, U0, g0)
        self._configure_adaptation()
        if self._engine.name == "aot":
            with torch.random.fork_rng(devices=[]):  # building programs must not shift the user's stream
                self._build_programs()
        self._chain_stats.append({name: [] for name in self.stat_names + ("warmup",)})

    def _build_potential(self, args, kwargs, initial, num_chains: int = 1) -> HMCState:
        """Build ``self._flat`` and ``self._engine`` for the model (with these arguments) or the
        ``potential_fn``, reusing the engine while the data are the same, and return every
        chain's checked starting state (the engine's potential and gradient there), shapes
        ``(num_chains, D)``, ``(num_chains,)``, ``(num_chains, D)``. ``initial``
        (unconstrained values) has a leading chain dimension when ``num_chains > 1``."""
        batch = (num_chains,) if num_chains > 1 else ()
        initial = _floating_point(initial)
        first = None if initial is None else {k: v[(0,) * len(batch)] for k, v in initial.items()}
        flat = self._flat_potential(args, kwargs, first, num_chains)
        unknown = sorted(set(self._save_params or ()) - set(flat.layout.names))
        if unknown:  # Pyro: a KeyError naming the site, after the first transition
            raise ValueError(f"save_params names {unknown}, which are not latent sites of this model; its latent "
                             f"sites (whose draws MCMC can keep) are {sorted(flat.layout.names)}")
        self.transforms = flat.transforms
        key = _args_key(args, kwargs)
        reused = self._engines.get(key)
        if reused is None or reused.flat.layout != flat.layout or not reused.agrees_with(flat):
            if self.model is not None:
                _warn_of_data_left_out(self.model, args, kwargs, flat.layout)
                _check_the_models_sites(self.model, args, kwargs, flat, self._user_transforms)
            engine = GradientEngine(flat, self.engine)
            _warn_of_flat_coordinates(flat.layout, engine)
            _warn_of_a_cut_gradient(engine)
            engine._args_ref = (args, kwargs)  # keep what the key names alive
            self._engines = {key: engine}
            self._programs = {}  # programs of another model or data
        self._engine = self._engines[key]
        self._flat = flat
        zs = flat.initial_zs if initial is None else flat.layout.pack(initial, batch).reshape(num_chains, flat.dim)
        U, g = zip(*(potential.check_initial_point(flat, z, self._engine.value_and_grad) for z in zs))
        return HMCState(zs, torch.stack(U), torch.stack(g))

    def _flat_potential(self, args, kwargs, initial, num_chains: int = 1) -> potential.FlatPotential:
        """The flat potential of the model (with these arguments) or of the ``potential_fn``,
        without a gradient engine; ``initial``: one chain's unconstrained values, or ``None``."""
        if self.model is None:
            return potential.from_potential_fn(self._user_potential_fn, initial, self._user_transforms)
        return potential.from_model(
            self.model,
            args,
            kwargs,
            transforms=self._user_transforms,
            max_plate_nesting=self._max_plate_nesting,
            init_strategy=self._init_strategy,
            initial_params=self._checked_initial_params(initial),
            num_chains=num_chains,
        )

    def _checked_initial_params(self, initial):
        if initial is None:
            return None
        bad = [k for k, v in initial.items() if not torch.isfinite(v).all()]
        if bad:
            raise ValueError(f"initial values of sites {bad} are not finite")
        return initial

    def cleanup(self):
        step_size = self._step_size
        self._reset()
        self._step_size = step_size  # as Pyro: `kernel.step_size` is the adapted one after a run
        self._initial_params = None  # as Pyro: the next chain draws its own initial point

    def logging(self):
        return OrderedDict(
            [
                ("step size", "{:.2e}".format(self._step_size)),
                ("acc. prob", "{:.3f}".format(self._mean_accept_prob)),
            ]
        )

    def diagnostics(self):
        """Pyro's per-chain diagnostics, plus this chain's per-draw ``sample_stats`` (see
        :attr:`sample_stats`) and the step size and inverse mass matrix its last draw used
        (the adapted ones once its warmup is over): Pyro's ``MCMC`` collects this dict from
        every chain, worker processes included, which is how
        :func:`pyro_hmc_plus.to_inference_data` and :class:`pyro_hmc_plus.MCMC` find them."""
        n = self._t - self._warmup_steps
        return chain_diagnostics(list(self._divergences), self._accept_cnt / n if n > 0 else float("nan"),
                                 self._chain_stats[-1] if self._chain_stats else {},
                                 Adaptation(self._step_size, self._metric.inverse_mass))

    @property
    def sample_stats(self):
        """Per-draw statistics of every chain this kernel ran, warmup included.

        A list (one entry per chain) of dicts ``name -> list``, with Stan's names: ``lp``
        (log density up to a constant, ``-U``, in unconstrained space, Jacobian included),
        ``energy`` (Hamiltonian), ``acceptance_rate``, ``diverging``, ``step_size``,
        ``n_steps`` (leapfrog steps), and ``warmup`` (True for warmup draws).
        """
        return self._chain_stats

    # ------------------------------------------------------------------ adaptation
    def _dense_blocks(self) -> list:
        """The dense blocks of ``full_mass``: tuples of site names (all sites for ``True``,
        none for ``False``)."""
        if self.full_mass is False:
            return []
        return [self._flat.layout.names] if self.full_mass is True else list(self.full_mass)

    def _mass_structure(self):
        """``None`` for a diagonal metric, else a (D, D) 0/1 mask of the dense blocks
        (sites outside every block of ``full_mass`` keep a diagonal metric)."""
        layout = self._flat.layout
        if self.full_mass is False:
            return None
        blocks = self._dense_blocks()
        block_of = {}
        for b, block in enumerate(blocks):
            if not (isinstance(block, tuple) and block and all(n in layout.names for n in block)):
                raise ValueError(
                    f"full_mass entries must be non-empty tuples of latent site names "
                    f"{list(layout.names)}, got {block!r}"
                )
            for name in block:
                if name in block_of:
                    raise ValueError(f"site {name!r} appears in two full_mass blocks")
                block_of[name] = b
        group, next_id = [], len(blocks)
        for name, size in zip(layout.names, layout.sizes):
            if name in block_of:
                group += [block_of[name]] * size
            else:
                group += range(next_id, next_id + size)
                next_id += size
        group = torch.tensor(group, device=self._flat.device)
        return (group.unsqueeze(0) == group.unsqueeze(1)).to(self._flat.dtype)

    def _configure_adaptation(self):
        flat = self._flat
        self._block_mask = self._mass_structure()
        _warn_of_a_singular_dense_metric(self, self._block_mask)
        dense = self._block_mask is not None
        chain, num_chains = self._chain_of_run or (0, 1)  # a chain run on its own: a run of one
        self._metric = Metric(*(x[chain] for x in self._starting_metric(self._block_mask, (num_chains,))))
        self._schedule = (
            adaptation.adaptation_schedule(self._warmup_steps)
            if (self.adapt_step_size or self.adapt_mass_matrix)
            else []
        )
        self._metric_windows = adaptation.metric_windows(self._schedule) if self.adapt_mass_matrix else []
        self._window = 0
        self._welford = adaptation.welford_init(flat.initial_z, dense) if self.adapt_mass_matrix else None
        self._set_step_size(self._step_sizes_of_run(num_chains)[chain])
        if self.adapt_step_size:  # as Pyro: searched at setup even without warmup, which adapts nothing
            self._reset_step_size_adaptation()

    def _set_step_size(self, value: float):
        self._step_size = float(value)
        self._step_size_tensor = torch.tensor(self._step_size, dtype=self._flat.dtype, device=self._flat.device)

    def _set_adapted_step_size(self, log_step_size: float):
        """Dual averaging's step size, within ``[min_stepsize, max_stepsize]``."""
        self._set_step_size(min(max(math.exp(log_step_size), self.min_stepsize), self.max_stepsize))

    def _reset_step_size_adaptation(self):
        self._set_step_size(
            adaptation.find_reasonable_step_size(
                self._one_step_energy_change, self._step_size, self.min_stepsize, self.max_stepsize
            )
        )
        self._dual_avg = adaptation.dual_averaging_init(math.log(self._step_size))

    def _one_step_energy_change(self, step_size: float) -> float:
        return one_step_energy_change(self._engine.value_and_grad, self._state, self._noise(), step_size, self._metric)

    def _adapt(self, i: int, accept_prob: float):
        """Warmup iteration ``i`` (0-based) finished with acceptance statistic ``accept_prob``."""
        if self._window >= len(self._schedule):
            return
        window = self._schedule[self._window]
        last = len(self._schedule) - 1
        slow = window in self._metric_windows
        if self.adapt_step_size:
            self._dual_avg = adaptation.dual_averaging_update(
                self._dual_avg, accept_prob, self.target_accept_prob
            )
            self._set_adapted_step_size(self._dual_avg.log_step_size)
        if slow:
            self._welford = adaptation.welford_update(self._welford, self._state.z)
        if i != window.end:
            return
        if self._window == last:
            if self.adapt_step_size:  # the average, as Stan, within the bounds as every step before
                self._set_adapted_step_size(self._dual_avg.log_step_size_avg)
        elif slow:
            cov = adaptation.welford_covariance(self._welford)
            if self._block_mask is not None:
                cov = cov * self._block_mask
            self._metric = make_metric(cov, dense=self._block_mask is not None)
            self._welford = adaptation.welford_init(self._state.z, self._block_mask is not None)
            if self.adapt_step_size:
                self._reset_step_size_adaptation()
        self._window += 1

    # ------------------------------------------------------------------ the transition
    def _noise(self):
        flat = self._flat
        return torch.randn(flat.dim, dtype=flat.dtype, device=flat.device)

    def _leapfrog_program(self, num_steps: int):
        """The compiled ``num_steps``-step leapfrog block, built (and validated) on first use."""

        def block(value_and_grad, z, r, U, g, step_size, inverse_mass):
            state = IntegratorState(z, r, U, g)
            return tuple(leapfrog(value_and_grad, state, step_size, inverse_mass, num_steps))

        return self._program(("leapfrog", num_steps), block, self._validation_inputs)

    def _transition_program(self, num_steps: int):
        """The whole transition (momentum, ``num_steps`` leapfrog steps, Metropolis test) as
        one compiled call: used when the number of steps is fixed (no step-size adaptation
        under way) and at most ``max_unroll``."""

        def transition(value_and_grad, z, U, g, noise, log_u, step_size, inverse_mass, momentum_scale):
            def integrate(start, eps, inv_mass):
                return leapfrog(value_and_grad, start, eps, inv_mass, num_steps)

            state, info = hmc_step(
                integrate, HMCState(z, U, g), noise, log_u, step_size, Metric(inverse_mass, momentum_scale)
            )
            return tuple(state) + (stat_row(info),)

        def validation():
            log_u = torch.tensor(-1.0, dtype=self._flat.dtype, device=self._flat.device)
            return [
                (z, U, g, r, log_u, eps, inv_mass, self._metric.momentum_scale)
                for z, r, U, g, eps, inv_mass in self._validation_inputs()
            ]

        return self._program(("transition", num_steps), transition, validation)

    def _program(self, key, fn, make_validation_inputs):
        """The cached program ``key`` computing ``fn(value_and_grad, *args)``, where the
        arguments and the result are (nested tuples of) tensors such as the core's state
        records. On first use it is traced and checked at the argument tuples that
        ``make_validation_inputs()`` returns (the first also serves as the tracing example)."""
        program = self._programs.get(key)
        if program is None:
            before = self._engine.name
            inputs = make_validation_inputs()
            in_structure = _flatten(inputs[0], [])
            out_structure = []

            def flat_fn(value_and_grad, *leaves):
                out_leaves = []
                out_structure[:] = [_flatten(fn(value_and_grad, *_unflatten(in_structure, iter(leaves))), out_leaves)]
                return tuple(out_leaves)

            flat_inputs = []
            for args in inputs:
                flat_inputs.append([])
                _flatten(args, flat_inputs[-1])
            cache_key = (type(self).__name__, key, self._program_settings())
            compiled = self._engine.program(flat_fn, flat_inputs[0], flat_inputs, cache_key=cache_key)
            program = _Program(compiled, out_structure)
            if self._engine.name != before:  # fell back: earlier programs are for the old engine
                self._programs = {}
            self._programs[key] = program
        return program

    def _build_programs(self):
        """Build every program a run may need now (used with the ``"aot"`` engine, so that
        no compilation happens mid-run and a later process finds them all in the cache).
        HMC's programs depend on the adapted number of steps, so they are built on use."""

    def _program_settings(self) -> tuple:
        """The kernel settings that programs depend on beyond their key and input shapes
        (part of their on-disk cache key)."""
        return ()

    def _block_inputs(self, z=None, generator=None):
        """A program's example inputs at ``z`` (default: the current point): its potential
        and gradient from the engine's own gradient, which was checked against Pyro's
        (computing them with Pyro's potential cost one run of the model and a backward each,
        ~0.6 s for a loop of 1,000 sample sites, three per set of validation inputs)."""
        z = self._state.z if z is None else z
        U, g = self._engine.value_and_grad(z)
        r = torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device)
        eps = torch.tensor(1e-2, dtype=z.dtype, device=z.device)
        return (z.clone(), r, U, g, eps, self._metric.inverse_mass.clone())

    def _validation_inputs(self):
        """The current point and fresh random points near it, drawn from a private generator
        so validation never shifts the user's random stream. Where the model fails
        numerically at a random point (a Cholesky beyond its support), the current point
        again: that failure, raised while a program is being built inside a trajectory, was
        taken for the trajectory's divergence, at every transition that needed the program."""
        gen = torch.Generator(device=self._state.z.device).manual_seed(0)
        z = self._state.z
        inputs = [self._block_inputs(z, gen)]
        for _ in range(_VALIDATION_POINTS):
            point = z + torch.empty(z.shape, dtype=z.dtype, device=z.device).uniform_(-2, 2, generator=gen)
            try:
                inputs.append(self._block_inputs(point, gen))
            except (RuntimeError, ValueError) as e:
                if not is_numerical_failure(e):
                    raise
                inputs.append(self._block_inputs(z, gen))
        return inputs

    # ------------------------------------------------------------------ many chains at once
    # (pyro_hmc_plus.MCMC's vectorized runs: every chain advances one round per call, for HMC
    # 8 leapfrog steps or a whole fixed-length transition, for NUTS see rounds.nuts_round)
    def _chains_init(self, state: HMCState, metric: Metric, step_size: chain_batch.StepSize):
        return chain_batch.hmc_init(state, metric, step_size)

    def _chains_advance(self, value_and_grad, chains, noise, uniforms, metric, schedule, kind: int):
        """One round for every chain: ``(chains, draw, done, steps)``. ``kind`` is NUTS's
        kind of round (:data:`pyro_hmc_plus.rounds.ROUND_KINDS`); HMC has one kind."""
        return chain_batch.hmc_round(value_and_grad, chains, noise, uniforms, metric, schedule,
                                     self.trajectory_length, self._steps_per_round(), self._fixed_num_steps())

    def _fixed_num_steps(self):
        """Every chain's number of leapfrog steps where the step size is not adapted and the
        same for all chains (then all trajectories have that length), else ``None``."""
        return None if self.adapt_step_size or self._init_step_sizes is not None else self.num_steps

    def _chains_next_kind(self, chains, schedule) -> torch.Tensor:
        """The kind of the next round, ``()`` int64: NUTS's choice
        (:func:`pyro_hmc_plus.rounds.next_round_kind`); HMC has one kind (0)."""
        return torch.zeros((), dtype=torch.int64, device=chains.draws.device)

    def _steps_per_round(self, kind: int = rounds.MIXED) -> int:
        """Leapfrog steps per chain in one round of :meth:`_chains_advance` (HMC: a whole
        trajectory where all have the same length of at most ``max_unroll`` steps, else
        :data:`chain_batch.ROUND_STEPS`, at most ``max_unroll``)."""
        fixed = self._fixed_num_steps()
        if fixed is not None and fixed <= self.max_unroll:
            return fixed
        return min(chain_batch.ROUND_STEPS, self.max_unroll)

    _chains_uniforms = chain_batch.NUM_UNIFORMS  # per chain and round

    def _chains_settings(self) -> tuple:
        """What the batched program depends on besides its inputs' shapes."""
        return (self.trajectory_length, self._steps_per_round(), self._fixed_num_steps())

    def _integrate(self, start: IntegratorState, step_size, inverse_mass, num_steps=None) -> IntegratorState:
        """``num_steps`` leapfrog steps as a few fused blocks of at most ``max_unroll`` steps.

        A numerical failure inside the model (e.g. a failed Cholesky) ends the trajectory
        with ``U = nan``, which the transition turns into a rejected, divergent proposal.
        """
        remaining = self.num_steps if num_steps is None else num_steps
        state = start
        try:
            while remaining:
                k = min(remaining, self.max_unroll)
                k = 1 << (k.bit_length() - 1)  # blocks of powers of two: few distinct programs
                state = IntegratorState(*self._leapfrog_program(k)(*state, step_size, inverse_mass))
                remaining -= k
        except (RuntimeError, ValueError) as e:
            if not is_numerical_failure(e):
                raise
            nan = torch.full_like(start.potential_energy, float("nan"))
            return IntegratorState(start.z, start.r, nan, start.grad)
        return state

    def _failed_transition(self):
        """The outcome of a transition whose trajectory failed numerically: rejected, divergent."""
        z, U, g = self._state
        inf = torch.full_like(U, float("inf"))
        false, true = torch.zeros_like(U, dtype=torch.bool), torch.ones_like(U, dtype=torch.bool)
        return (z, U, g, stat_row(HMCInfo(U, inf, torch.zeros_like(U), true, false)))

    def _transition(self, warmup: bool):
        """One transition from ``self._state``: returns the new state, its statistics (a
        dict over ``self.stat_names`` except ``step_size``), and whether it moved."""
        flat = self._flat
        n_steps = self.num_steps
        log_u = torch.rand((), dtype=flat.dtype, device=flat.device).log()
        noise = self._noise()
        step_size_fixed = not (warmup and self.adapt_step_size)
        if step_size_fixed and n_steps <= self.max_unroll:
            try:
                out = self._transition_program(n_steps).flat(  # flat in, flat out: (z, U, g, row)
                    *self._state, noise, log_u, self._step_size_tensor, *self._metric
                )
            except (RuntimeError, ValueError) as e:
                if not is_numerical_failure(e):
                    raise
                out = self._failed_transition()
            state, row = HMCState(*out[:3]), out[3]
        else:
            state, info = hmc_step(
                self._integrate, self._state, noise, log_u, self._step_size_tensor, self._metric
            )
            row = stat_row(info)
        lp, energy, accept_prob, diverging, accepted = row.tolist()
        stats = dict(lp=lp, energy=energy, acceptance_rate=accept_prob, diverging=bool(diverging), n_steps=n_steps)
        return state, stats, bool(accepted)

    @with_autograd
    def sample(self, params):
        if self._state is None:
            raise RuntimeError("call setup() before sample()")
        warmup = self._t < self._warmup_steps
        step_size = self._step_size
        self._state, stats, accepted = self._transition(warmup)
        stats.update(step_size=step_size, warmup=warmup)
        record = self._chain_stats[-1]
        for name in record:
            record[name].append(stats[name])
        accept_prob = stats["acceptance_rate"]
        if warmup:
            self._adapt(self._t, accept_prob)
            n = self._t + 1
        else:
            n = self._t - self._warmup_steps + 1
            self._accept_cnt += int(accepted)
            if stats["diverging"]:
                self._divergences.append(self._t - self._warmup_steps)
        self._mean_accept_prob += (accept_prob - self._mean_accept_prob) / n
        self._t += 1
        # a copy: the program's output is an inference tensor (see _compile.static_runtime),
        # which a hook_fn or Pyro's worker processes could not update in place or share
        return self._flat.layout.unpack(self._state.z.clone())


class NUTS(HMC):
    """The No-U-Turn Sampler (Stan's multinomial variant) on a compiled gradient.

    A drop-in replacement for :class:`pyro.infer.NUTS`: every argument has Pyro's meaning.
    The algorithm is in :mod:`pyro_hmc_plus.nuts`; each doubling of the trajectory is one
    compiled call (leapfrog steps, U-turn checks and the multinomial draw fused) and one
    host read of "done?", and the first three doublings are one call together (where a
    gradient is cheap, or where the previous transition's tree was that deep).

    :param bool use_multinomial_sampling: multinomial sampling of the draw among the
        trajectory's states (Stan's NUTS, default); ``False`` uses slice sampling as the
        original NUTS does.
    :param int max_tree_depth: most doublings per transition (at most ``2**max_tree_depth - 1``
        leapfrog steps).
    :param int max_unroll: most leapfrog steps in one compiled call (rounded down to a power
        of two): doublings that add fewer states are one call each; longer subtrees are built
        in chunks of this many steps. Vectorized chains (:class:`pyro_hmc_plus.MCMC`) run
        rounds of 8 steps whatever this is (:mod:`pyro_hmc_plus.rounds`).

    The other arguments are those of :class:`HMC` (without ``trajectory_length`` and
    ``num_steps``, which NUTS chooses itself). Per-draw statistics (``sample_stats``)
    add ``tree_depth`` and ``reached_max_treedepth`` to HMC's.
    """

    stat_names = HMC.stat_names + ("tree_depth", "reached_max_treedepth")

    def __init__(
        self,
        model=None,
        potential_fn=None,
        step_size=1,
        adapt_step_size=True,
        adapt_mass_matrix=True,
        full_mass=False,
        use_multinomial_sampling=True,
        transforms=None,
        max_plate_nesting=None,
        jit_compile=False,
        jit_options=None,
        ignore_jit_warnings=False,
        target_accept_prob=0.8,
        max_tree_depth=10,
        init_strategy=init_to_uniform,
        *,
        min_stepsize: float = 1e-10,
        max_stepsize: float = 1e10,
        engine: str = "auto",
        max_unroll: int = 16,
        inverse_mass_matrix=None,
    ):
        if not (isinstance(max_tree_depth, numbers.Integral) and max_tree_depth >= 1):
            raise ValueError(f"max_tree_depth must be a positive integer, got {max_tree_depth!r}")
        super().__init__(
            model,
            potential_fn,
            step_size,
            adapt_step_size=adapt_step_size,
            adapt_mass_matrix=adapt_mass_matrix,
            full_mass=full_mass,
            transforms=transforms,
            max_plate_nesting=max_plate_nesting,
            jit_compile=jit_compile,
            jit_options=jit_options,
            ignore_jit_warnings=ignore_jit_warnings,
            target_accept_prob=target_accept_prob,
            init_strategy=init_strategy,
            min_stepsize=min_stepsize,
            max_stepsize=max_stepsize,
            engine=engine,
            max_unroll=max_unroll,
            inverse_mass_matrix=inverse_mass_matrix,
        )
        self.use_multinomial_sampling = bool(use_multinomial_sampling)
        self.max_tree_depth = int(max_tree_depth)
        self._chunk_depth = self.max_unroll.bit_length() - 1  # chunks of 2**_chunk_depth leaves
        # a transition's first doublings run as one program (nuts.first_doublings): at most
        # three (7 leapfrog steps, wasted where the tree stops earlier), within max_unroll
        self._fused_doublings = min(_FUSED_DOUBLINGS, self.max_tree_depth, (self.max_unroll + 1).bit_length() - 1)

    def _reset(self):
        super()._reset()
        self._last_tree_depth = None  # of the chain's previous transition

    # ------------------------------------------------------------------ programs
    def _program_settings(self) -> tuple:
        return (self.max_tree_depth, self.use_multinomial_sampling)

    def _build_programs(self):
        self._first_doubling_program()
        if self._fused_doublings > 1:
            self._first_doublings_program()
        for depth in range(1, min(self._chunk_depth, self.max_tree_depth)):
            self._doubling_program(depth)
        if self.max_tree_depth > self._chunk_depth:  # the chunk, and the merge/extend programs
            _, _, _, rands, eps, metric, tree = self._tree_validation_inputs()[0]
            self._chunked_doubling(tree, self._chunk_depth + 1, rands, eps, metric.inverse_mass)

    def _tree_validation_inputs(self):
        """Validation arguments for the tree programs: a fresh one-state tree at each
        validation point, with fixed uniforms."""
        out = []
        for z, r, U, g, eps, inv_mass in self._validation_inputs():
            state = HMCState(z, U, g)
            log_slice = torch.zeros_like(U)
            rands = torch.tensor([0.7, 0.3, 0.4], dtype=z.dtype, device=z.device)
            metric = Metric(inv_mass, self._metric.momentum_scale)
            out.append((state, r, log_slice, rands, eps, metric, nuts.init_tree(state, r, log_slice, metric)))
        return out

    def _first_doubling_program(self):
        """A transition's start (momentum, one-state tree) and its first doubling (1 leaf)."""

        def first(value_and_grad, state, noise, log_slice, rands, step_size, metric):
            tree = nuts.init_tree(state, noise, log_slice, metric)
            return nuts.doubling(
                value_and_grad, tree, rands, step_size, metric.inverse_mass, 1,
                self.max_tree_depth, self.use_multinomial_sampling, keep_done=False, start=nuts.fresh_tree_end(tree),
            )

        return self._program(
            ("nuts_first",), first, lambda: [args[:6] for args in self._tree_validation_inputs()]
        )

    def _first_doublings_program(self):
        """A transition's start and its first ``_fused_doublings`` doublings in one call."""
        num = self._fused_doublings

        def first_doublings(value_and_grad, state, noise, log_slice, uniforms, step_size, metric):
            return nuts.first_doublings(
                value_and_grad, state, noise, log_slice, uniforms, step_size, metric, num,
                self.max_tree_depth, self.use_multinomial_sampling,
            )

        def validation():
            out = []
            for state, r, log_slice, rands, eps, metric, _ in self._tree_validation_inputs():
                # both directions: forward (< 0.5) and backward doublings
                uniforms = torch.tensor([[0.7, 0.3, 0.4], [0.2, 0.6, 0.5], [0.4, 0.8, 0.1]][:num], dtype=rands.dtype,
                                        device=rands.device)
                out.append((state, r, log_slice, uniforms, eps, metric))
            return out

        return self._program(("nuts_first_doublings", num), first_doublings, validation)

    def _doubling_program(self, depth: int):
        """The doubling of a tree of ``2**depth`` states, fewer than ``max_unroll``: one
        subtree of as many leaves, merged into the tree, in one call."""

        def double(value_and_grad, tree, rands, step_size, inverse_mass):
            return nuts.doubling(
                value_and_grad, tree, rands, step_size, inverse_mass, 1 << depth,
                self.max_tree_depth, self.use_multinomial_sampling, keep_done=False,
            )

        return self._program(
            ("nuts_doubling", depth),
            double,
            lambda: [(tree, rands, eps, metric.inverse_mass) for _, _, _, rands, eps, metric, tree in self._tree_validation_inputs()],
        )

    def _chunk_program(self):
        """A subtree chunk of ``2**_chunk_depth`` leaves from a given start."""
        num_leaves = 1 << self._chunk_depth

        def chunk(value_and_grad, start, H0, log_slice, step_size, inverse_mass, u):
            return nuts.build_subtree(
                value_and_grad, start, H0, log_slice, step_size, inverse_mass, u, num_leaves,
                self.use_multinomial_sampling,
            )

        def validation():
            return [
                (nuts.subtree_start(tree, nuts.is_forward(rands)), tree.H0, log_slice, eps, metric.inverse_mass, rands[1])
                for _, _, log_slice, rands, eps, metric, tree in self._tree_validation_inputs()
            ]

        return self._program(("nuts_chunk", num_leaves), chunk, validation)

    def _tensor_program(self, key, fn, *args):
        """``fn(*args)`` for tensor code that does not involve the model (merging trees),
        run as a compiled program built on first use, with these arguments as its example."""
        return self._program(key, lambda _value_and_grad, *xs: fn(*xs), lambda: [args])(*args)

    def _chunked_doubling(self, tree, depth, rands, step_size, inverse_mass):
        """A doubling of at least ``2**_chunk_depth`` new states: chunks of that many, merged
        in Stan's recursion order, stopping after the first chunk or merge that turns or
        diverges."""

        def start_of(tree, rands, step_size):
            forward = nuts.is_forward(rands)
            return nuts.subtree_start(tree, forward), nuts.signed_step_size(step_size, forward)

        def extend(tree, subtree, rands, inverse_mass):
            return nuts.extend_tree(
                tree, subtree, nuts.is_forward(rands), rands[2], inverse_mass, self.max_tree_depth, keep_done=False
            )

        start, signed = self._tensor_program(("nuts_start",), start_of, tree, rands, step_size)
        chunk = self._chunk_program()
        uniforms = iter(torch.rand(2 << (depth - self._chunk_depth), dtype=rands.dtype, device=rands.device))

        def merge(first, second):
            return self._tensor_program(("nuts_merge",), nuts.merge_subtrees, first, second, next(uniforms), inverse_mass)

        pending = []  # valid subtrees of decreasing size, waiting for their right halves
        for i in range(1 << (depth - self._chunk_depth)):
            subtree = chunk(start, tree.H0, tree.log_slice, signed, inverse_mass, next(uniforms))
            k = i + 1
            while k % 2 == 0:  # complete halves: merge as Stan's recursion does
                subtree = merge(pending.pop(), subtree)
                k //= 2
            if not subtree.valid.item():
                break
            pending.append(subtree)
            start = subtree.last
        else:
            subtree = pending.pop()
        while pending:  # stopped early: the invalid subtree takes its valid left neighbours' counts
            subtree = merge(pending.pop(), subtree)
        return self._tensor_program(("nuts_extend",), extend, tree, subtree, rands, inverse_mass)

    # ------------------------------------------------------------------ many chains at once
    def _chains_init(self, state: HMCState, metric: Metric, step_size: chain_batch.StepSize):
        return rounds.nuts_init(state, metric, step_size, self.max_tree_depth)

    def _chains_advance(self, value_and_grad, chains, noise, uniforms, metric, schedule, kind: int):
        return rounds.nuts_round(
            value_and_grad, chains, noise, uniforms, metric, schedule, self.max_tree_depth, self.use_multinomial_sampling,
            kind=kind,
        )

    def _chains_next_kind(self, chains, schedule):
        return rounds.next_round_kind(chains, schedule)

    def _chains_settings(self) -> tuple:
        return self._program_settings()

    def _steps_per_round(self, kind: int = rounds.MIXED) -> int:
        return rounds.steps_per_round(self.max_tree_depth, kind)

    _chains_uniforms = rounds.NUM_UNIFORMS

    # ------------------------------------------------------------------ the transition
    def _fused_start_pays(self) -> bool:
        """Whether this transition's first doublings run as one program: always where a
        gradient is cheap (the steps it wastes when the tree stops early cost less than the
        per-doubling bookkeeping it saves: cold runs of eight schools were ~20% faster than
        when choosing by the previous tree, of the 2-D Gaussian, half of whose trees stop at
        depth 1 or 2, ~10%), else where the previous transition's tree reached that depth, so
        that a costly model with shallow trees does not pay for steps it would not take."""
        elements = self._engine.gradient_elements
        cheap = elements is not None and elements <= _CHEAP_GRADIENT_ELEMENTS
        return cheap or self._last_tree_depth is None or self._last_tree_depth >= self._fused_doublings

    def _transition(self, warmup: bool):
        flat = self._flat
        noise = self._noise()
        log_slice = torch.zeros((), dtype=flat.dtype, device=flat.device)
        if not self.use_multinomial_sampling:
            log_slice = torch.rand((), dtype=flat.dtype, device=flat.device).log()
        step_size, inverse_mass = self._step_size_tensor, self._metric.inverse_mass
        # Between doublings the tree stays the programs' flat list of tensors (`_flatten`'s
        # order, `Tree.done` last): taking the records apart and rebuilding them around
        # every call costs ~7 µs a doubling.
        leaves = None
        # uniforms of every possible doubling: direction, draw inside the subtree, draw of the tree
        uniforms = torch.rand(self.max_tree_depth, 3, dtype=flat.dtype, device=flat.device)
        fused = self._fused_doublings if self._fused_start_pays() else 0
        start = self._first_doublings_program() if fused > 1 else self._first_doubling_program()
        if fused > 1:
            try:
                leaves = start.flat(
                    *_leaves((self._state, noise, log_slice, uniforms[:fused], step_size, self._metric))
                )
            except (RuntimeError, ValueError) as e:
                if not is_numerical_failure(e):
                    raise
                # the model failed numerically in one of these doublings: the same transition
                # (the same uniforms) doubling by doubling below finds which, a divergence
        for depth in range(fused if leaves is not None else 0, self.max_tree_depth):
            if leaves is not None and leaves[-1].item():  # Tree.done
                break
            rands = uniforms[depth]
            try:
                if depth == 0:
                    leaves = self._first_doubling_program().flat(
                        *_leaves((self._state, noise, log_slice, rands, step_size, self._metric))
                    )
                elif depth < self._chunk_depth:
                    leaves = self._doubling_program(depth).flat(*leaves, rands, step_size, inverse_mass)
                else:
                    tree = _unflatten(_TREE, iter(leaves))
                    leaves = _leaves(self._chunked_doubling(tree, depth, rands, step_size, inverse_mass))
            except (RuntimeError, ValueError) as e:
                if not is_numerical_failure(e):
                    raise
                # the model failed numerically inside the new subtree: a divergence
                if leaves is None:
                    tree = nuts.init_tree(self._state, noise, log_slice, self._metric)
                else:
                    tree = _unflatten(_TREE, iter(leaves))
                one = torch.ones_like(tree.n_steps)
                leaves = _leaves(tree._replace(n_steps=tree.n_steps + one, diverging=one.bool(), done=one.bool()))
        tree = _unflatten(_TREE, iter(leaves))
        # read the tree's fields as they are: no eager op on the device for the statistics
        U, energy, sum_accept, n_steps, diverging, accepted, tree_depth = _host_values(
            tree.proposal.potential_energy, tree.proposal_energy, tree.sum_accept, tree.n_steps,
            tree.diverging, tree.accepted, tree.depth,
        )
        self._last_tree_depth = int(tree_depth)
        stats = dict(
            lp=-U, energy=energy, acceptance_rate=nuts.acceptance_statistic(sum_accept, n_steps),
            diverging=bool(diverging),
            n_steps=int(n_steps), tree_depth=int(tree_depth),
            reached_max_treedepth=int(tree_depth) >= self.max_tree_depth,
        )
        return tree.proposal, stats, bool(accepted)
