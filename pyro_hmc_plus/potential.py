"""The model boundary: a Pyro model (or a ``potential_fn``) as a function of one flat vector.

HMC moves a point ``z`` of the unconstrained space. Pyro keeps that point as a dict of
per-site tensors; the sampler's arithmetic wants one flat vector. :class:`FlatPotential`
holds the translation (the :class:`SiteLayout`: site names sorted as Pyro sorts them,
their shapes and offsets), the constraint transforms, and the potential energy
``U(z) = -log p(z | data)`` (including the log-Jacobian of the transforms, as Pyro's
``initialize_model`` defines it).

Everything here is eager and exact; making the gradient cheap is the job of
:mod:`pyro_hmc_plus.engine`, which traces :meth:`FlatPotential.value_and_grad` once.
"""

from __future__ import annotations

import inspect
import itertools
import math
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import pyro
import torch
from pyro.distributions import constraints
from pyro.distributions.torch_distribution import TorchDistributionMixin
from pyro.distributions.transforms import Transform, biject_to
from pyro.infer.autoguide.initialization import InitMessenger, init_to_uniform, init_to_value
from pyro.infer.mcmc.util import initialize_model
from pyro.poutine.util import site_is_subsample

from .tracing import broadcast_shape


PROBES = 2  # random points (besides the initial one) where the gradient and the model are checked


def element_name(name: str, index: Sequence[int]) -> str:
    """How messages name one scalar of a site: ``name[i,j]`` for the element at ``index``,
    ``name`` where there is no index."""
    return f"{name}[{','.join(map(str, index))}]" if len(index) else name


def listing(names: List[str], limit: int = 5) -> str:
    """The first ``limit`` of ``names``, and how many more, for a message."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


class SiteLayout(NamedTuple):
    """Where each latent site lives in the flat vector: ``z[..., offsets[i]:offsets[i]+sizes[i]]``."""

    names: Tuple[str, ...]
    shapes: Tuple[torch.Size, ...]
    sizes: Tuple[int, ...]

    @staticmethod
    def of(params: Dict[str, torch.Tensor], batch_ndim: int = 0) -> "SiteLayout":
        """Layout of a dict of tensors, each with ``batch_ndim`` leading batch dimensions."""
        names = tuple(sorted(params))
        shapes = tuple(torch.Size(params[k].shape[batch_ndim:]) for k in names)
        return SiteLayout(names, shapes, tuple(math.prod(s) for s in shapes))

    @property
    def dim(self) -> int:
        """D, the length of the flat vector."""
        return sum(self.sizes)

    def positions(self, names) -> List[int]:
        """Indices into the flat vector of the sites ``names``, in that order (each site's
        entries in its own flattened order)."""
        start = dict(zip(self.names, itertools.accumulate((0,) + self.sizes[:-1])))
        size = dict(zip(self.names, self.sizes))
        return [i for name in names for i in range(start[name], start[name] + size[name])]

    def coordinate_names(self, chosen: torch.Tensor) -> List[str]:
        """Names of the flat coordinates where ``chosen`` (bool, ``(D,)``) is true: ``site`` for a
        one-element site, else ``site[i,j]``, the index in the site's unconstrained shape."""
        names, start = [], 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes):
            # the indices of the site's own shape (not torch.unravel_index: its first call
            # imports sympy, ~0.5 s of a run that has no other use for it)
            indices = chosen[start:start + size].reshape(shape).nonzero().tolist()
            names += [element_name(name, () if size == 1 else index) for index in indices]
            start += size
        return names

    def pack(self, params: Dict[str, torch.Tensor], batch_shape=()) -> torch.Tensor:
        """A dict of site tensors of shape ``batch_shape + site_shape`` -> ``batch_shape + (D,)``."""
        missing = [k for k in self.names if k not in params]
        if missing:
            raise ValueError(f"missing latent sites {missing}; expected sites {list(self.names)}")
        flat = []
        for name, shape in zip(self.names, self.shapes):
            value = torch.as_tensor(params[name])
            expected = torch.Size(batch_shape) + shape
            if value.shape != expected:
                raise ValueError(
                    f"site {name!r} has shape {tuple(value.shape)}, expected {tuple(expected)}"
                )
            flat.append(value.reshape(tuple(batch_shape) + (-1,)))
        return torch.cat(flat, dim=-1)

    def unpack(self, z: torch.Tensor) -> Dict[str, torch.Tensor]:
        """``(..., D)`` -> dict of views of shape ``... + site_shape``. (Runs for every draw
        a kernel hands to Pyro: a lone site, or a vector site, is not split or reshaped.)"""
        batch = z.shape[:-1]
        pieces = z.split(self.sizes, dim=-1) if len(self.names) > 1 else (z,)
        return {
            k: p if len(s) == 1 and p.dim() == len(batch) + 1 else p.reshape(batch + s)
            for k, p, s in zip(self.names, pieces, self.shapes)
        }


class FlatPotential:
    """``U`` and its gradient over one flat unconstrained vector, exactly as Pyro defines ``U``.

    Built by :func:`from_model` or :func:`from_potential_fn`. ``initial_z`` is the starting
    point chosen by the init strategy (or given by the user), shape ``(D,)``; ``initial_zs``
    one per chain, ``(C, D)``, where several chains were asked for. ``sites_not_finite_at``,
    for a model, describes the sites whose log density is not finite at a point (a dict of
    unconstrained values; see :func:`sites_with_a_non_finite_log_density`), for messages.
    """

    def __init__(self, potential_fn, layout: SiteLayout, transforms, initial_z, source: str, initial_zs=None,
                 sites_not_finite_at: Optional[Callable[[dict], List[str]]] = None):
        self.potential_fn = potential_fn
        self.layout = layout
        self.transforms = transforms
        self.initial_z = initial_z
        self.initial_zs = initial_z.unsqueeze(0) if initial_zs is None else initial_zs
        self.source = source  # "model" or "potential_fn": where U came from, for messages
        self.sites_not_finite_at = sites_not_finite_at

    @property
    def dim(self) -> int:
        return self.layout.dim

    def probe_points(self) -> List[torch.Tensor]:
        """The initial point and ``PROBES`` random points around it, ``(D,)`` each, from a
        private generator (the user's random stream is untouched), the same every time:
        where the engine checks the traced gradient against Pyro's, and the kernels check
        the model (its gradient, its flat coordinates, its sites)."""
        z = self.initial_z
        gen = torch.Generator(device=z.device).manual_seed(0)
        return [z] + [z + torch.empty_like(z).uniform_(-2, 2, generator=gen) for _ in range(PROBES)]

    @property
    def dtype(self) -> torch.dtype:
        return self.initial_z.dtype

    @property
    def device(self) -> torch.device:
        return self.initial_z.device

    def potential(self, z: torch.Tensor) -> torch.Tensor:
        """U at one point ``z`` of shape ``(D,)``, a 0-d tensor in ``z``'s dtype: a model whose
        data are float64 while its latent values are float32 (the default dtype) has a float64
        U, which the sampler's arithmetic, in the latent values' dtype, cannot mix with."""
        U = self.potential_fn(self.layout.unpack(z))
        if not torch.is_tensor(U) or U.numel() != 1:
            raise ValueError(
                f"the potential energy must be a scalar tensor, got "
                f"{type(U).__name__} of shape {tuple(getattr(U, 'shape', ()))}"
            )
        return U.reshape(()).to(z.dtype)

    def value_and_grad(self, z: torch.Tensor):
        """``(U, dU/dz)`` at one point ``z`` of shape ``(D,)`` by eager autograd.

        This is the function the engines trace. It uses ``torch.autograd.grad`` (not
        ``torch.func``) because Pyro's enumeration code relies on old-style
        ``autograd.Function`` s that functorch refuses.
        """
        if z.is_inference():  # a Static Runtime program's output: autograd refuses it as is
            z = z.clone()
        with torch.enable_grad():
            z = z.detach().requires_grad_(True)
            U = self.potential(z)
            (g,) = torch.autograd.grad(U, z, allow_unused=True)
        if g is None:  # U does not depend on z at all
            g = torch.zeros_like(z)
        return U.detach(), g

    def batched_value_and_grad(self, z: torch.Tensor):
        """Eager ``(U, dU/dz)`` for ``z`` of shape ``(..., D)``: a loop, the safe reference."""
        flat = z.reshape(-1, z.shape[-1])
        pairs = [self.value_and_grad(zi) for zi in flat]
        U = torch.stack([p[0] for p in pairs]).reshape(z.shape[:-1])
        g = torch.stack([p[1] for p in pairs]).reshape(z.shape)
        return U, g


def from_model(
    model: Callable,
    model_args=(),
    model_kwargs=None,
    *,
    transforms=None,
    max_plate_nesting=None,
    init_strategy=None,
    initial_params=None,
    num_chains=1,
) -> FlatPotential:
    """Build the flat potential of a Pyro model with Pyro's own ``initialize_model``.

    Pyro chooses the transforms (``transforms`` overrides them site by site; a
    ``MixtureSameFamily`` site, where Pyro's kernels stop, gets its components'), enumerates
    discrete sites where it can, runs the init strategy (retrying until the potential is
    finite; once per chain) and defines ``U``; we only flatten. ``initial_zs`` holds each
    chain's starting point. A flat prior (``ImproperUniform``), where Pyro's kernels stop,
    starts as ``init_to_uniform`` starts any site, and the plates are read from a run of the
    model at the starting values where Pyro's guess (from a prior draw) fails.
    """
    user_transforms, user_init_strategy = transforms, init_strategy

    def again(**changed):
        """``from_model`` of the same model and settings but ``changed`` (a retry)."""
        settings = dict(transforms=user_transforms, max_plate_nesting=max_plate_nesting,
                        init_strategy=user_init_strategy, initial_params=initial_params, num_chains=num_chains)
        return from_model(model, model_args, model_kwargs, **{**settings, **changed})

    init_strategy = _checked_init(init_strategy or init_to_uniform, transforms or {})
    data_versions = _data_versions(model_args, model_kwargs or {})
    try:
        if transforms is not None:
            transforms = _with_default_transforms(model, model_args, model_kwargs or {}, transforms, init_strategy)
        init, potential_fn, transforms, prototype = initialize_model(
            model,
            model_args,
            model_kwargs or {},
            transforms=transforms,
            max_plate_nesting=max_plate_nesting,
            initial_params=initial_params,
            num_chains=num_chains,
            init_strategy=init_strategy,
        )
    except NotImplementedError as e:
        untransformable = _sites_without_a_bijection(model, model_args, model_kwargs or {}, init_strategy,
                                                     user_transforms)
        mixtures = _mixture_transforms(untransformable)
        if mixtures:
            return again(transforms={**(user_transforms or {}), **mixtures})
        if untransformable:
            untransformable = {name: _support_name(site) for name, site in untransformable.items()}
            remedies = [remedy.format(names=", ".join(sorted(n for n, s in untransformable.items() if s == support)))
                        for support, remedy in _REPARAMETRISATIONS.items() if support in untransformable.values()]
            raise NotImplementedError(
                f"{str(e).rstrip('.')}: the latent sites {untransformable} have supports that torch "
                "cannot map one-to-one to unconstrained space, which HMC and NUTS sample in. Give "
                "those sites a transform (`transforms={name: transform}`), or sample a "
                "parametrisation that has one" + (": " + "; ".join(remedies) if remedies else "") + "."
            ) from e
        if max_plate_nesting is None:
            # Pyro guesses the plates from a run of the model at a draw from the prior, which a
            # flat prior (``ImproperUniform``) cannot give: a run with the continuous sites at the
            # init strategy's values (and the discrete ones, which Pyro enumerates, drawn) can
            def init_or_discrete_draw(site):
                return site["fn"].sample().detach() if site["fn"].support.is_discrete else init_strategy(site)

            try:
                nesting = plate_nesting(_trace_at_init(model, model_args, model_kwargs or {}, init_or_discrete_draw))
            except Exception:  # noqa: BLE001 - Pyro's own error says more than a second failure would
                nesting = None
            if nesting is not None:
                return again(max_plate_nesting=nesting)
        raise NotImplementedError(
            f"{str(e).rstrip('.')}. HMC and NUTS need a model without subsampling "
            "(`subsample_size`), with discrete latent sites only where Pyro can enumerate them "
            "(finite support; else marginalise them out), and a starting value for every latent "
            "site (`init_strategy`)."
        ) from e
    except (AttributeError, TypeError, RuntimeError, ValueError, ZeroDivisionError) as e:
        explained = _explained(e, model, model_args, model_kwargs or {}, init_strategy)
        if explained is e:
            raise
        raise explained from e
    _check_the_data_are_kept(model, model_args, model_kwargs or {}, init_strategy, data_versions)
    if not init:
        raise ValueError(
            "the model has no continuous latent sites to sample: each of its sample sites is observed "
            "(`obs=`) or discrete and summed out. HMC and NUTS draw the sites without `obs`; check "
            "that no unknown got data by mistake (an argument meant to be None).")
    if initial_params is not None:
        _check_initial_shapes(init, transforms, prototype)
    batch = () if num_chains == 1 or initial_params is not None else (num_chains,)
    layout = SiteLayout.of(init, batch_ndim=len(batch))
    zs = layout.pack({k: v.detach() for k, v in init.items()}, batch_shape=batch).reshape(-1, layout.dim)
    return FlatPotential(
        _checking_the_sites(potential_fn, layout), layout, transforms, zs[0], source="model", initial_zs=zs,
        sites_not_finite_at=lambda unconstrained: sites_with_a_non_finite_log_density(
            model, model_args, model_kwargs or {},
            init_to_value(values={name: transforms[name].inv(u) for name, u in unconstrained.items()})),
    )


class _WhatTheSitesAreGiven(pyro.poutine.messenger.Messenger):
    """Records, as the model meets each sample site, the ones given what Pyro cannot score,
    which fail further on with errors that name no site: torch's own distributions in place
    of Pyro's (``torch_distributions``, name -> class; Pyro calls the distribution to draw
    from it: "'Normal' object is not callable"), data passed as a positional argument where
    ``obs=`` was meant (``positional_data``, names; Pyro passes it to the distribution as a
    sample shape: "torch.Size() takes an iterable of 'int'"), and observed values that are
    not tensors (``non_tensor_observations``, name -> type; a NumPy array or a number: an
    ``AttributeError`` in Pyro or torch)."""

    def __init__(self):
        super().__init__()
        self.torch_distributions: Dict[str, str] = {}
        self.positional_data: List[str] = []
        self.non_tensor_observations: Dict[str, str] = {}

    def _process_message(self, msg):
        if msg["type"] != "sample":
            return
        fn = msg["fn"]
        if isinstance(fn, torch.distributions.Distribution) and not isinstance(fn, TorchDistributionMixin):
            self.torch_distributions[msg["name"]] = f"torch.distributions.{type(fn).__name__}"
        if any(torch.is_tensor(a) or hasattr(a, "__array__") for a in msg["args"]):
            self.positional_data.append(msg["name"])
        if msg["is_observed"] and not torch.is_tensor(msg["value"]):
            self.non_tensor_observations[msg["name"]] = type(msg["value"]).__name__


def _integer_observations_refused(trace) -> Dict[str, str]:
    """The observed sites of ``trace`` (name -> "Bernoulli, int64") whose values are integer
    or boolean tensors that their distribution's ``log_prob`` refuses (torch's ``Bernoulli``
    fails with "result type Float can't be cast to the desired output type Long", or of
    outcomes written ``x > 0``, "Subtraction ... with two bool tensors is not supported",
    naming no site)."""
    refused = {}
    for name, site in trace.nodes.items():
        value = site.get("value")
        if site["type"] != "sample" or not site["is_observed"] or not torch.is_tensor(value) \
                or value.is_floating_point():
            continue
        try:
            with pyro.validation_enabled(False):
                site["fn"].log_prob(value)
        except RuntimeError:
            refused[name] = f"{type(unwrapped_distribution(site['fn'])).__name__}, {str(value.dtype).replace('torch.', '')}"
    return refused


def _explained(e: Exception, model, model_args, model_kwargs, init_strategy) -> Exception:
    """The error to raise for ``e``, which Pyro's ``initialize_model`` raised on the model: one
    that names the user's sites or data that caused it and says what to write instead, where
    one run of the model finds them (torch's and Pyro's messages name neither); else ``e``.
    The run is under the init strategy, as Pyro's was; where it fails, only the sites met
    before the failure are looked at (:class:`_WhatTheSitesAreGiven`)."""
    message = str(e)
    if isinstance(e, ZeroDivisionError) and message == "size cannot be zero":  # Pyro's, for pyro.plate(name, 0)
        return _with_a_line(
            e, "A `pyro.plate` of the model has size 0: the data it runs over are empty (`len(y)` is 0: filtered "
            "away, or not loaded). Check the data given to run()."
        )
    given = _WhatTheSitesAreGiven()
    try:
        trace = _trace_at_init(given(model), model_args, model_kwargs, init_strategy)
    except Exception:  # noqa: BLE001 - the sites met before the failure are what is asked
        trace = None
    if given.torch_distributions:
        return _with_a_line(
            e, f"The sample sites {given.torch_distributions} are given torch's distributions, which Pyro's sample "
            "sites cannot draw from or score: use Pyro's, which wrap them with the same arguments "
            "(`import pyro.distributions as dist`, then `dist.Normal(loc, scale)`)."
        )
    if given.positional_data:
        return _with_a_line(
            e, f"The sample sites {given.positional_data} are given data as a positional argument "
            "(`pyro.sample(name, distribution, y)`), which Pyro passes to the distribution as a sample shape. "
            "To observe the data, write `pyro.sample(name, distribution, obs=y)`."
        )
    not_tensors = given.non_tensor_observations
    if not_tensors:
        return _with_a_line(
            e, f"The observed values of the sites {not_tensors} are not torch tensors, and Pyro's distributions "
            "score tensors only. Convert the data before the run: `torch.as_tensor(array, "
            "dtype=torch.get_default_dtype())` for a NumPy array (a pandas column: `column.to_numpy()` first), "
            "`torch.tensor(1.5)` for a number."
        )
    arrays = _array_arguments(model_args, model_kwargs)
    if arrays and "numpy" in message.lower():
        return _with_a_line(
            e, f"Some of the model's arguments are NumPy or pandas arrays ({', '.join(arrays)}): arithmetic between "
            "them and the latent values runs in NumPy, which cannot follow the gradient. Convert them before the run: "
            "`torch.as_tensor(array, dtype=torch.get_default_dtype())` (a pandas column: `column.to_numpy()` first)."
        )
    if "numpy() on Tensor that requires grad" in message:
        return _with_a_line(
            e, "The model turns a value computed from its latent sites into a NumPy array (`.numpy()`): NumPy cannot "
            "follow the gradient that HMC and NUTS need, and `.detach()`, which torch suggests, cuts it (the "
            "sampler then draws from another distribution). Write that computation with torch's functions "
            "(`torch.tanh`, `torch.special.gammaln`, ...)."
        )
    if "in-place operation" in message:
        return _with_a_line(
            e, "The model writes into a latent value in place (`x[1] = 0.0`, `x += 1`), which autograd cannot "
            "differentiate: write into a copy (`x = x.clone()` first) or build a new tensor (`torch.where`, "
            "`torch.cat`)."
        )
    point_masses = [] if trace is None else _latent_point_masses(trace)
    if point_masses:
        return ValueError(
            f"the latent sites {point_masses} are point masses (`Delta`): a point mass has no density to move "
            "through, so HMC and NUTS, Pyro's too, cannot sample it (Pyro stops with autograd's error above). "
            "To record a value computed from other sites, write `pyro.deterministic(name, value)`; for a "
            "known value, give the site `obs=value`"
        )
    unused = _latent_sites_the_density_ignores(model, model_args, model_kwargs, trace) \
        if trace is not None and ("does not require grad" in message or "not have been used in the graph" in message) \
        else []
    if unused:
        return ValueError(
            f"the model's log density does not depend on the latent sites {unused}: their own densities are "
            "constant (a flat `ImproperUniform` prior, or masked out) and no other site uses their values, so the "
            "posterior is improper along them (it does not integrate to 1), and HMC and NUTS have no gradient to "
            "follow (autograd's error above). Give them a proper prior, or leave them out of the model"
        )
    if "valid initial" in message:  # Pyro's "cannot find valid initial params"
        culprits = sites_with_a_non_finite_log_density(model, model_args, model_kwargs, init_strategy)
        return type(e)(
            f"{message.rstrip('.')}. The potential energy was not finite at any initial point "
            "the init strategy tried"
            + (f"; at one of them, these sites' log densities are not finite: {'; '.join(culprits)}"
               if culprits else "")
            + ". Check the model's data and priors, or pass finite `initial_params` (or another "
            "`init_strategy`)."
        )
    integers = {} if trace is None else _integer_observations_refused(trace)
    if integers:
        return _with_a_line(
            e, f"The observed sites {integers} have integer or boolean values, which their distributions' log "
            "densities cannot take (torch's `Bernoulli` computes one in floating point and cannot write it into an "
            "integer or boolean tensor). Convert the data to floating point: `y.float()`, or `torch.as_tensor(array, "
            "dtype=torch.get_default_dtype())` from NumPy or pandas."
        )
    other_dtype = _data_of_another_dtype(model_args, model_kwargs)
    if other_dtype and ("dtype" in message or "scalar type" in message):
        default = str(torch.get_default_dtype()).replace("torch.", "")
        return _with_a_line(
            e, f"Some of the model's data are not {default}, torch's default dtype, which its latent values have "
            f"({', '.join(other_dtype)}): NumPy's arrays are float64, and `torch.tensor(array)` keeps that. "
            f"Convert the data (`torch.as_tensor(array, dtype=torch.{default})`), or sample in float64 "
            "(`torch.set_default_dtype(torch.float64)` before the run)."
        )
    return e


def _named_arguments(model_args, model_kwargs) -> List[Tuple[str, object]]:
    """The model's arguments with the names the errors give them: ``"argument 0"`` for a
    positional one, its keyword for the others."""
    return [(f"argument {i}", a) for i, a in enumerate(model_args)] + list(model_kwargs.items())


def _array_arguments(model_args, model_kwargs) -> List[str]:
    """The model's arguments that are arrays but not tensors (NumPy's, pandas'), as
    ``"argument 0 (ndarray)"`` or ``"x (Series)"``."""
    return [f"{name} ({type(a).__name__})" for name, a in _named_arguments(model_args, model_kwargs)
            if not torch.is_tensor(a) and hasattr(a, "__array__") and getattr(a, "ndim", 0) >= 1]


def _with_a_line(e: Exception, explanation: str) -> Exception:
    """``e`` as an error of its own type with a line that says which of the user's sites or
    data caused it and what to write instead (torch's and Pyro's messages name neither)."""
    return type(e)(f"{str(e).rstrip()}\n{explanation}")


def _data_of_another_dtype(model_args, model_kwargs) -> List[str]:
    """The model's floating-point tensor arguments whose dtype is not torch's default (which
    Pyro gives the latent values), as ``"argument 0 is float64"`` or ``"x is float64"``."""
    return [f"{name} is {str(a.dtype).replace('torch.', '')}" for name, a in _named_arguments(model_args, model_kwargs)
            if torch.is_tensor(a) and a.is_floating_point() and a.dtype != torch.get_default_dtype()]


def _data_versions(model_args, model_kwargs) -> Dict[str, Tuple[torch.Tensor, int]]:
    """The model's tensor arguments by name, each with its in-place version counter now."""
    return {name: (a, a._version) for name, a in _named_arguments(model_args, model_kwargs)
            if torch.is_tensor(a) and not a.is_inference()}


def _check_the_data_are_kept(model, model_args, model_kwargs, init_strategy, versions) -> None:
    """A :class:`ValueError` where the model changes its data in place at every run
    (``y -= y.mean()`` where ``y = y - y.mean()`` was meant): Pyro's kernels run the model at
    every leapfrog step, so the data drift through the run, and the draws follow no
    posterior (Pyro says nothing; these kernels' check of the traced gradient sees a
    mismatch and falls back, with a warning that does not say why). ``versions`` are
    :func:`_data_versions` from before the setup's first run of the model; where some moved,
    one more run tells a change from an in-place write that leaves the values as they were
    (``y.clamp_(0.0, 1.0)``), which samples correctly."""
    written = {name: a for name, (a, version) in versions.items() if a._version != version}
    if not written:
        return
    before = {name: a.clone() for name, a in written.items()}
    with torch.random.fork_rng(devices=[]):
        try:
            _trace_at_init(model, model_args, model_kwargs, init_strategy)
        except Exception:  # noqa: BLE001 - a model that fails on its drifted data: the comparison says why
            pass
    drifting = [name for name, a in written.items()
                if not torch.equal(torch.nan_to_num(a, 0.0), torch.nan_to_num(before[name], 0.0))]
    if drifting:
        raise ValueError(
            f"the model changes its data ({', '.join(drifting)}) in place at every run (as `y -= y.mean()` "
            "does): Pyro's HMC and NUTS, and these kernels, run the model at every step, so the data drift "
            "through the run and the draws follow no posterior. The setup's runs have changed them already: "
            "make them again, and compute new tensors in the model (`y = y - y.mean()`)"
        )


def _checked_init(init_strategy: Callable, transforms: Dict[str, Transform]) -> Callable:
    """``init_strategy`` whose values are checked as it gives them: finite and inside their
    sites' supports. A value outside (``init_to_value(values={"sigma": torch.tensor(-1.0)})``,
    or a NaN) otherwise fails later as whatever the model's next line makes of it ("normal
    expects all elements of std >= 0.0"), without the site's name.

    Where Pyro's strategies cannot start a site (see :func:`_uniform_start`), it starts as
    ``init_to_uniform`` would: uniformly in (-2, 2) of its unconstrained space."""

    def checked(site):
        try:
            value = init_strategy(site)
        except NotImplementedError:
            value = _uniform_start(site, transforms.get(site["name"]))
            if value is None:
                raise
        if not isinstance(value, torch.Tensor):
            return value  # Pyro's own checks say what is wrong with it
        try:
            inside = site["fn"].support.check(value)
        except NotImplementedError:  # a dependent support, which biject_to will refuse with its own error
            return value
        if value.is_floating_point():
            finite = torch.isfinite(value)
            for _ in range(site["fn"].support.event_dim):
                finite = finite.all(-1)
            inside = inside & finite
        if not bool(inside.all()):
            shown = value.detach().reshape(-1).tolist()
            infinite = value.is_floating_point() and bool(torch.isinf(value).any())
            raise ValueError(
                f"init_strategy gave the latent site {site['name']!r} initial values outside its support or not "
                f"finite ({site['fn'].support} of {type(site['fn']).__name__}): {shown[:6]}"
                f"{' ...' if len(shown) > 6 else ''}. "
                + ("`init_to_mean` gives a prior's mean, which is infinite for some heavy-tailed priors (a "
                   "HalfCauchy scale): use `init_to_median` or `init_to_uniform` for them. " if infinite else "")
                + "Initial values are constrained values (a scale is positive, a probability in (0, 1)): "
                "give finite ones inside the support, or leave the site to the fallback (init_to_uniform)"
            )
        return value

    return checked


def _uniform_start(site, to_unconstrained: Optional[Transform] = None) -> Optional[torch.Tensor]:
    """``init_to_uniform``'s start, uniform in (-2, 2) of the site's unconstrained space, for
    the sites where Pyro's strategies fail (``NotImplementedError``): a support torch has no
    transform for but ``to_unconstrained`` maps (a ``MixtureSameFamily``'s, given its
    components' transform), or a prior that cannot be sampled (``ImproperUniform``, the flat
    prior of a Stan model, which NumPyro starts this way): shaped by the distribution, not
    by a draw. ``None`` where the site has no transform either."""
    fn = site["fn"]
    try:
        to_unconstrained = to_unconstrained or biject_to(fn.support).inv
    except NotImplementedError:
        return None
    try:
        unconstrained = to_unconstrained(fn.sample().detach())
    except NotImplementedError:
        unconstrained = torch.empty(to_unconstrained.forward_shape(fn.shape()))
    value = to_unconstrained.inv(torch.rand_like(unconstrained) * 4.0 - 2.0)
    value._pyro_custom_init = False  # as Pyro's strategies mark theirs, for poutine.reparam
    return value


def model_trace(model, args, kwargs):
    """One run of ``model`` recorded as a Pyro trace, hidden from any handler outside (an
    enclosing ``MCMC.run``) and without gradients."""
    with pyro.poutine.block(), torch.no_grad():
        return pyro.poutine.trace(model).get_trace(*args, **kwargs)


def _with_default_transforms(model, model_args, model_kwargs, transforms, init_strategy) -> dict:
    """``transforms`` (the user's, to unconstrained space) completed with Pyro's default,
    ``biject_to(support).inv``, for every continuous latent site they leave out: Pyro's
    ``initialize_model`` takes a given dict as the whole set and fails with a bare
    ``KeyError`` on the first site it lacks, where the kernels' ``transforms`` argument
    overrides the defaults. One run of the model (under the init strategy) finds its sites;
    a name that is not one of them is refused."""
    latent = _continuous_latent_sites(model, model_args, model_kwargs, init_strategy)
    unknown = sorted(set(transforms) - set(latent))
    if unknown:
        raise ValueError(
            f"transforms are given for {unknown}, which are not continuous latent sites of the model "
            f"(those are {sorted(latent)})"
        )
    return {
        **{name: biject_to(site["fn"].support).inv for name, site in latent.items() if name not in transforms},
        **transforms,
    }


# What to sample instead of a support without a bijection, by the support's name (as
# :func:`_support_name` gives it); ``{names}`` are those sites' names.
_REPARAMETRISATIONS = {
    "PositiveDefinite": "for a covariance matrix ({names}), a Cholesky factor of the correlations "
                        "(`LKJCholesky`) scaled by standard deviations, as Stan advises over `Wishart`",
    "Sphere": "for a `ProjectedNormal` direction ({names}), the vector it normalises, as Pyro advises: "
              "`poutine.reparam(model, config={{name: ProjectedNormalReparam()}})`",
}


def _sites_without_a_bijection(model, model_args, model_kwargs, init_strategy, transforms) -> Dict[str, dict]:
    """The continuous latent sites (name -> site) without a given transform whose support
    ``biject_to`` refuses (``Wishart``'s positive-definite matrices): Pyro's error names the
    constraint but not the site. The init strategy's values, or a prior draw where it asks
    torch for a transform to such a support (``init_to_uniform``). Empty where one run of
    the model fails: the caller keeps Pyro's error."""

    def init_or_prior_draw(site):
        try:
            return init_strategy(site)
        except NotImplementedError:
            return site["fn"].sample().detach()

    try:
        latent = _continuous_latent_sites(model, model_args, model_kwargs, init_or_prior_draw)
    except Exception:  # noqa: BLE001 - Pyro's own error says more than a second failure would
        return {}
    untransformable = {}
    for name, site in latent.items():
        if name in (transforms or {}):
            continue
        try:
            biject_to(site["fn"].support)
        except NotImplementedError:
            untransformable[name] = site
    return untransformable


def _support_name(site) -> str:
    """The name of a site's support's constraint, ``"PositiveDefinite"`` for ``Wishart``."""
    return type(site["fn"].support).__name__.lstrip("_")


def _mixture_transforms(sites: Dict[str, dict]) -> Dict[str, Transform]:
    """Transforms to unconstrained space for the ``MixtureSameFamily`` sites among ``sites``
    whose components share one support (torch's ``biject_to`` has none for a mixture's
    support, Pyro's kernels stop there): its components', where it maps a value of the
    mixture to a value of its shape (not where components differ in their bounds)."""
    transforms = {}
    for name, site in sites.items():
        support = site["fn"].support
        if not isinstance(support, constraints.MixtureSameFamilyConstraint):
            continue
        try:
            to_unconstrained = biject_to(support.base_constraint).inv
            fits = to_unconstrained(site["value"]).shape == site["value"].shape
        except NotImplementedError:
            continue
        if fits:
            transforms[name] = to_unconstrained
    return transforms


def _continuous_latent_sites(model, model_args, model_kwargs, init_strategy) -> dict:
    """The continuous latent sites (name -> site) of one run of ``model`` under the init
    strategy."""
    return _continuous_latent_sites_of(_trace_at_init(model, model_args, model_kwargs, init_strategy))


def _continuous_latent_sites_of(trace) -> dict:
    """The continuous latent sites (name -> site) of a trace: its unobserved sample sites
    but subsample sites and discrete sites (Pyro enumerates them)."""
    return {
        name: site for name, site in trace.iter_stochastic_nodes()
        if not site_is_subsample(site) and not site["fn"].has_enumerate_support
    }


def _latent_sites_the_density_ignores(model, model_args, model_kwargs, trace_at_init) -> List[str]:
    """The continuous latent sites on whose values the model's log density does not depend
    at their values in ``trace_at_init`` (autograd finds no path from them to it): a flat
    ``ImproperUniform`` prior on the real line that no other site uses, whose log density is
    a constant 0. Empty where the model fails at those values."""
    values = {name: site["value"].detach().requires_grad_()
              for name, site in _continuous_latent_sites_of(trace_at_init).items()}
    try:
        with pyro.poutine.block(), torch.enable_grad():
            trace = pyro.poutine.trace(pyro.poutine.condition(model, values)).get_trace(*model_args, **model_kwargs)
            log_density = trace.log_prob_sum()
            if not log_density.requires_grad:
                return sorted(values)
            grads = torch.autograd.grad(log_density, list(values.values()), allow_unused=True)
    except Exception:  # noqa: BLE001 - Pyro's own error says more than a second failure would
        return []
    return [name for name, g in zip(values, grads) if g is None]


def _latent_point_masses(trace) -> List[str]:
    """The latent sites of ``trace`` whose distribution is a ``Delta`` (a value written as a
    sample site without ``obs``, where ``pyro.deterministic`` was meant): Pyro's kernels stop
    on them with an autograd error that names none."""
    return [name for name, site in _continuous_latent_sites_of(trace).items()
            if isinstance(unwrapped_distribution(site["fn"]), pyro.distributions.Delta)]


def _trace_at_init(model, model_args, model_kwargs, init_strategy):
    """One run of ``model`` with its latent sites at the init strategy's values (for
    ``None``, ``init_to_uniform``: the default of Pyro's HMC and NUTS)."""
    return model_trace(InitMessenger(init_strategy or init_to_uniform)(model), model_args, model_kwargs)


def plate_nesting(trace) -> int:
    """How many plate dimensions the model's sites have at most (its ``max_plate_nesting``)."""
    return max((-frame.dim for site in trace.nodes.values() if site["type"] == "sample"
                for frame in site["cond_indep_stack"] if frame.vectorized and frame.dim is not None), default=0)


def _check_initial_shapes(initial_params, transforms, prototype_trace) -> None:
    """Raise a clear error unless every latent site (each has a transform) has a given
    initial value and each has the shape of its site in unconstrained space (Pyro itself
    does not check: a missing site failed later with a bare ``KeyError``)."""
    unknown = sorted(name for name in initial_params if name not in transforms)
    if unknown:  # a misspelt site's value, where the check below would only miss the right one
        raise ValueError(
            f"initial_params has values for {unknown}, which are not continuous latent sites of the model "
            f"(those are {sorted(transforms)})"
        )
    missing = sorted(set(transforms) - set(initial_params))
    if missing:
        raise ValueError(
            f"initial_params has no value for {missing}: give an unconstrained value for every latent "
            f"site of the model ({sorted(transforms)})"
        )
    for name, value in initial_params.items():
        prototype = prototype_trace.nodes[name]["value"]
        expected = transforms[name](prototype).shape  # every name has one (checked above)
        if torch.as_tensor(value).shape != expected:
            raise ValueError(
                f"initial value of site {name!r} has shape {tuple(torch.as_tensor(value).shape)}, "
                f"expected {tuple(expected)} (unconstrained)"
            )


def from_potential_fn(potential_fn: Callable, initial_params, transforms=None) -> FlatPotential:
    """Build the flat potential of a user ``potential_fn`` over a dict of unconstrained tensors.

    ``initial_params`` (one value per site, unconstrained) fixes the layout and the start.
    """
    if not initial_params:
        raise ValueError(
            "with `potential_fn`, pass `initial_params`: a dict of unconstrained tensors, one "
            "per site (to pyro.infer.MCMC or to the kernel), so the sampler knows the sites "
            "and where to start"
        )
    params = {k: torch.as_tensor(v).detach() for k, v in initial_params.items()}
    layout = SiteLayout.of(params)
    z0 = layout.pack(params)
    flat = FlatPotential(potential_fn, layout, transforms or {}, z0, source="potential_fn")
    try:
        check_initial_point(flat, z0)
    except RuntimeError as e:  # autograd's words, which name neither the params nor the remedy
        if not any(words in str(e) for words in ("in-place operation", "modified inplace")):  # one site, several
            raise
        raise _with_a_line(
            e, f"The potential_fn writes into one of its params ({', '.join(layout.names)}) in place (`q -= 1.0`, "
            "`q[0] = 0.0`): they are what autograd differentiates the potential with respect to. Compute a new "
            "tensor (`q = q - 1.0`) or write into a copy (`q = q.clone()` first)."
        ) from e
    return flat


def flat_coordinates(layout: SiteLayout, gradients: Sequence[torch.Tensor]) -> List[str]:
    """Names (:meth:`SiteLayout.coordinate_names`) of the unconstrained coordinates that ``U``
    does not depend on: its gradient in them is exactly 0 in every one of ``gradients``
    (each ``(D,)``, at different points; two at least, or nothing is named). The posterior is
    flat along such a coordinate, so improper: a trajectory moving along it never turns
    back, every NUTS tree runs to ``max_tree_depth``, and the coordinate's draws drift
    without bound. Pyro gives a site no density where it is masked out: the
    ``name_unobserved`` site of ``pyro.sample(name, ..., obs_mask=mask)`` at the observed
    entries, ``.mask(False)``, ``ImproperUniform`` with no likelihood term."""
    if len(gradients) < 2:
        return []
    return layout.coordinate_names((torch.stack(list(gradients)) == 0).all(0))


def gradient_mismatch(potential: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, g: torch.Tensor):
    """``(slope, gradient_slope)`` where the potential energy's slope at ``z`` along a random
    direction (central differences of ``U``) and the gradient ``g``'s grossly disagree, else
    ``None``: something in the model cuts the gradient of a term that ``U`` depends on, as
    ``torch.tensor([...])``, ``float(x)`` or ``x.item()`` of a latent value, ``.detach()``,
    ``torch.no_grad()`` or a NumPy round trip do, and autograd, Pyro's included, misses it.

    Two step sizes, ``1e-2`` and ``1e-3`` along a unit direction: the differences must agree
    with each other (ten times closer than to the gradient's slope, which they must miss by a
    quarter): rounding of ``U`` (float32) or a kink between the points makes them disagree,
    and nothing is said. Four evaluations of ``potential`` (``U`` of a flat point ``(D,)``:
    :meth:`FlatPotential.potential`, or a traced graph's); ``None`` where the model fails
    there."""
    gen = torch.Generator(device=z.device).manual_seed(0)
    direction = torch.randn(z.shape, generator=gen, dtype=z.dtype, device=z.device)
    direction = direction / direction.norm()

    def slope(h: float) -> float:
        return (float(potential(z + h * direction)) - float(potential(z - h * direction))) / (2 * h)

    try:
        with torch.no_grad(), pyro.validation_enabled(False):
            wide, narrow = slope(1e-2), slope(1e-3)
    except Exception:  # the model fails at one of the points: nothing to compare
        return None
    gradient_slope = float(g @ direction)
    miss = abs(narrow - gradient_slope)
    if not math.isfinite(wide + narrow + gradient_slope):
        return None
    if miss > 0.25 * max(abs(narrow), abs(gradient_slope)) and miss > 10 * abs(wide - narrow):
        return narrow, gradient_slope
    return None


def trace_at(model, model_args, model_kwargs, flat: FlatPotential, z: torch.Tensor):
    """One run of ``model`` with every latent site of ``flat`` at the unconstrained point
    ``z (D,)`` (conditioned on those values), the user's random stream untouched: a site left
    to sample (discrete, or one that the initial run did not have) draws from the prior.
    ``None`` where the model fails at that point. A :class:`ValueError` where the model
    changes a latent value in place (``s += 1``, ``s[0] = 1.0``): Pyro scores each site
    after the model has run, so its potential (and these kernels') scores the changed value,
    another model than the one written, without a word."""
    try:
        values = {name: flat.transforms[name].inv(u) for name, u in flat.layout.unpack(z).items()}
    except Exception:  # noqa: BLE001 - no values there: nothing to compare
        return None
    versions = {name: value._version for name, value in values.items()}
    try:
        with torch.random.fork_rng(devices=[]):
            trace = model_trace(pyro.poutine.condition(model, data=values), model_args, model_kwargs)
    except Exception:  # noqa: BLE001 - the model fails there: nothing to compare
        trace = None
    changed = [name for name, value in values.items() if value._version != versions[name]]
    if changed:
        raise ValueError(
            f"the model changes the values of the latent sites {changed} in place (as `s += 1` or `s[0] = 1.0` "
            "do): Pyro scores each site after the model has run, so its potential (Pyro's HMC and NUTS, and "
            "these kernels) scores the changed values, another model than the one written. Compute a new "
            "tensor instead (`s = s + 1`; `s = s.clone()` before writing into it)"
        )
    return trace


def sites_that_come_and_go(layout: SiteLayout, trace) -> Tuple[List[str], List[str]]:
    """``(absent, new)`` in a run of the model at another point than the initial one
    (:func:`trace_at`): the latent sites of ``layout`` that it does not sample, and the
    continuous latent sites that it samples and ``layout`` lacks. Both are empty unless a
    Python ``if`` or loop on a latent value decides which sites the model has (``if a > 0:
    pyro.sample("b", ...)``): HMC and NUTS move a fixed set of sites, so at the points where
    the sites differ from the initial run's, Pyro's potential (and these kernels') scores
    another model, a site it lacks is flat and drifts without bound, and a new one is drawn
    from its prior at every evaluation."""
    absent = [name for name in layout.names if name not in trace.nodes]
    new = [name for name in _continuous_latent_sites_of(trace) if name not in layout.names]
    return absent, new


def check_the_same_sites(layout: SiteLayout, trace) -> None:
    """A :class:`ValueError` where ``trace``, a run of the model at another point than the
    initial one, samples other latent sites than ``layout`` (:func:`sites_that_come_and_go`):
    HMC and NUTS, Pyro's too, cannot sample such a model. The message says what to write
    instead."""
    absent, new = sites_that_come_and_go(layout, trace)
    if absent or new:
        change = " and ".join(f"{verb} {listing(names)}" for verb, names in
                              (("does not sample", absent), ("also samples", new)) if names)
        raise ValueError(
            f"the model's latent sites change with their values: at its initial values it samples "
            f"{listing(list(layout.names))}; at other values it {change} (a Python `if` or loop on a "
            "latent value decides which sites exist). HMC and NUTS, Pyro's too, move one fixed set of sites, "
            "so they cannot sample this model: sample every site at every point and let the value decide "
            "how it is used (`torch.where`), or make the choice a discrete site that Pyro sums out "
            "(`infer={'enumerate': 'parallel'}`)"
        )


def _checking_the_sites(potential_fn: Callable, layout: SiteLayout) -> Callable:
    """Pyro's potential of a model, which checks at every evaluation that the model sampled
    the sites of ``layout`` (:func:`check_the_same_sites`). The kernels check a few points
    before a run; this catches a model whose sites change only where the run goes. Where
    they do, Pyro's potential would score a prior draw of a new site, or leave a site that
    the model no longer has to drift, without a word. A traced potential records it once (its
    check runs no tensor operation); the eager path, where a Python ``if`` on a latent value
    sends such a model, pays a Pyro trace per evaluation (~1-2% of a gradient there)."""

    def potential_of_the_same_sites(params):
        with pyro.poutine.trace() as run:
            U = potential_fn(params)
        check_the_same_sites(layout, run.trace)
        return U

    return potential_of_the_same_sites


def data_left_out(model, model_args, model_kwargs, layout: SiteLayout) -> List[str]:
    """The latent sites of ``layout`` that look like data the run did not get: each named
    like one of the model's arguments that is ``None`` in this run (given so, or left at its
    default), or named ``obs`` (as Pyro's tutorials name the likelihood) while one is,
    described as ``"'obs' (100 values; y is None)"``. ``obs=None`` makes a site latent, so a
    forgotten ``y=y`` samples the data as unknowns and the other sites from their prior,
    with Pyro's kernels as with these, without a word. A model in Pyro's handlers has the
    model's signature (``__wrapped__``), a ``PyroModule`` its ``forward``'s; empty where there
    is none to read."""
    try:
        signature = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)
        bound = signature.bind_partial(*model_args, **model_kwargs)
    except (TypeError, ValueError):
        return []
    bound.apply_defaults()
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    missing = [name for name, value in bound.arguments.items()
               if value is None and bound.signature.parameters[name].kind not in variadic]
    found = []
    for name, size in zip(layout.names, layout.sizes):
        if name in missing:
            found.append(f"{name!r} ({size:,} values; {name} is None)")
        elif name == "obs" and missing:
            verb = "is" if len(missing) == 1 else "are"
            found.append(f"{name!r} ({size:,} values; {' and '.join(missing)} {verb} None)")
    return found


def data_broadcast_against_their_distributions(trace, layout: SiteLayout) -> List[str]:
    """The observed sites of ``trace`` (a run of the model, :func:`trace_at`; not the latent
    sites of ``layout``, which it conditions) whose log density scores each data value more
    than once, each described as ``"'y': data (50, 1) against batch shape (50,) give 2,500
    log densities for 50 values"``: where data and distribution both grow when broadcast
    against each other (a column of data against a plate), or where several data values
    are repeated along a dimension that no plate of the site declares (the distribution's
    parameters a column, ``w * x[:, None]``, which a plate then expands). The log density
    then scores every value against every other value's parameters (an outer product), and
    the posterior is wrong, without an error from torch or Pyro. Data broadcast against a
    smaller distribution (a scalar ``Normal(mu, s)`` over a vector), one value observed for
    a whole batch, and data repeated along a plate are not found."""
    found = []
    for name, site in trace.nodes.items():
        if (site["type"] != "sample" or not site["is_observed"] or name in layout.names or site_is_subsample(site)
                or is_factor(site)):
            continue
        fn, value = site["fn"], site["value"]
        if not torch.is_tensor(value):
            continue
        data_shape, batch_shape = value.shape[:value.dim() - fn.event_dim], torch.Size(fn.batch_shape)
        scored = broadcast_shape(data_shape, batch_shape)
        if scored is None:  # shapes that do not broadcast: torch's own error says so, at the first log density
            continue
        padded = (1,) * (len(scored) - len(data_shape)) + tuple(data_shape)
        repeated_along = {d for d in range(-len(scored), 0) if scored[d] > padded[d]}  # negative dims
        plate_dims = {frame.dim for frame in site["cond_indep_stack"]}
        if scored.numel() > max(data_shape.numel(), batch_shape.numel()) or (
                data_shape.numel() > 1 and repeated_along - plate_dims):
            found.append(f"{name!r}: data {tuple(data_shape)} against batch shape {tuple(batch_shape)} give "
                         f"{scored.numel():,} log densities for {data_shape.numel():,} values")
    return found


def sites_with_moving_supports(trace, flat: FlatPotential, z: torch.Tensor, skip=()) -> List[str]:
    """The latent sites whose support moves with the other latent sites (``b ~ Uniform(0,
    a)``, ``Pareto(scale=a, ...)``), except those in ``skip``, found in ``trace``, a run of
    the model at the unconstrained point ``z`` ``(D,)`` (one away from the initial values;
    :func:`trace_at`).

    Pyro's ``initialize_model`` maps each latent site to unconstrained space through one
    transform, ``biject_to`` of the site's support in one run of the model. For such a site
    that fixes the support at that run's values, so Pyro's HMC and NUTS, and these kernels,
    which use the same potential, sample another distribution than the model's (the site
    truncated to that support). Found by comparing each site's transform in ``trace`` with
    the fixed one. Nothing is found where a support has no ``biject_to`` there."""
    moved = []
    try:
        for name, u in flat.layout.unpack(z).items():
            if name in skip or name not in trace.nodes:
                continue
            site = trace.nodes[name]
            if not torch.allclose(biject_to(site["fn"].support)(u), site["value"], rtol=1e-6, atol=0.0,
                                  equal_nan=True):
                moved.append(name)
    except Exception:  # noqa: BLE001 - a support without a bijection: nothing to compare
        return []
    return moved


# Distributions of angles whose density repeats every 2 pi over a support that torch declares
# the whole real line (so ``biject_to`` leaves them unconstrained).
PERIODIC_DISTRIBUTIONS = (pyro.distributions.VonMises, pyro.distributions.SineBivariateVonMises,
                          pyro.distributions.SineSkewed)


def sites_with_periodic_densities(trace, layout: SiteLayout, skip=()) -> List[str]:
    """The latent sites of ``layout``, except those in ``skip``, whose distribution in
    ``trace`` (a run of the model, :func:`trace_at`) is one of :data:`PERIODIC_DISTRIBUTIONS`.
    Along such a site the posterior is improper (it repeats every turn), so Pyro's HMC and
    NUTS, and these kernels, draw an angle that wanders over many turns, right only modulo
    2 pi."""
    return [name for name in layout.names if name not in skip and name in trace.nodes
            and isinstance(unwrapped_distribution(trace.nodes[name]["fn"]), PERIODIC_DISTRIBUTIONS)]


def is_factor(site) -> bool:
    """A ``pyro.factor`` site: an observed ``Unit`` whose value is an empty placeholder and
    whose log density is the factor."""
    return isinstance(unwrapped_distribution(site["fn"]), pyro.distributions.Unit)


def unwrapped_distribution(fn):
    """A site's distribution without the masks (a plate's, ``obs_mask``), ``expand`` s and
    ``to_event`` s around it."""
    wrappers = (pyro.distributions.MaskedDistribution, pyro.distributions.Independent,
                pyro.distributions.ExpandedDistribution)
    while isinstance(fn, wrappers):
        fn = fn.base_dist
    return fn


def sites_with_a_non_finite_log_density(model, model_args, model_kwargs, init_strategy=None) -> List[str]:
    """Why the potential is not finite, site by site, at one point of the init strategy: each
    site whose log density has a non-finite element, described with the likely cause (NaN
    in its values, values outside its support; else, where the log density is NaN, a
    parameter that is not finite or not valid there, such as a NaN covariate upstream, and
    where it is infinite, a point mass or a parameter at the edge of its range), as
    ``"'x' (observed): 1 of 30 values are NaN, first at index (3,)"``. Pyro's "cannot find
    valid initial params" names none. Empty where the model fails at that point."""
    try:
        with pyro.validation_enabled(False):
            trace = _trace_at_init(model, model_args, model_kwargs, init_strategy)
            log_densities = {
                name: site["fn"].log_prob(site["value"]) for name, site in trace.nodes.items()
                if site["type"] == "sample" and not site_is_subsample(site)
            }
    except Exception:  # noqa: BLE001 - the caller keeps Pyro's error
        return []
    described, hinted = [], False
    for name, log_density in log_densities.items():
        finite = torch.isfinite(log_density)
        if finite.all():
            continue
        site = trace.nodes[name]
        kind = "observed" if site["is_observed"] else "latent"
        value = torch.as_tensor(site["value"])
        try:
            inside = site["fn"].support.check(value)
        except NotImplementedError:  # a dependent support
            inside = torch.ones_like(finite)
        nan = value.isnan() if value.is_floating_point() else torch.zeros_like(value, dtype=torch.bool)
        if nan.any():
            bad, why = nan, "are NaN"
        elif not inside.all():
            bad, why = ~inside, f"are outside the support of {type(site['fn']).__name__} ({site['fn'].support})"
        elif log_density.isnan().any():
            bad, why = log_density.isnan(), ("have a NaN log density: a parameter of the distribution is not finite "
                                               "or not valid there (NaN upstream, as in a covariate)")
        else:
            bad, why = ~finite, ("have a log density of -inf or inf: the distribution has no density there (a point "
                                 "mass such as `Delta`) or a parameter is at the edge of its range (a scale of 0)")
        first = tuple(int(i) for i in bad.nonzero()[0]) if bad.dim() else ()
        where = f", first at index {first}" if bad.dim() else ""
        missing = "" if hinted or not (nan.any() and site["is_observed"]) else (  # said once, at the first
            " (if NaN marks missing values, observe the others: keep = ~data.isnan(), then data[keep] and the "
            "same rows of any covariates)")
        hinted = hinted or bool(missing)
        described.append(f"'{name}' ({kind}): {int(bad.sum())} of {bad.numel()} values {why}{where}{missing}")
    return described


def _non_finite_sites(layout: SiteLayout, x: torch.Tensor) -> List[str]:
    """The sites with a non-finite entry in the flat vector ``x`` ``(D,)``."""
    return [name for name, v in layout.unpack(x).items() if not torch.isfinite(v).all()]


def check_initial_point(flat: FlatPotential, z: torch.Tensor, value_and_grad: Optional[Callable] = None
                        ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Raise a clear error unless ``z`` (shape ``(D,)``) is finite with a finite U and
    gradient; return them, ``U`` (0-d) and ``grad`` ``(D,)`` (the chain's first state).
    ``value_and_grad`` computes them (default: Pyro's potential, ``flat.value_and_grad``;
    the kernels pass their engine's gradient, checked against Pyro's)."""
    if z.shape != (flat.dim,):
        raise ValueError(f"initial point has shape {tuple(z.shape)}, expected ({flat.dim},)")
    if not torch.isfinite(z).all():
        raise ValueError(f"initial values of sites {_non_finite_sites(flat.layout, z)} are not finite")
    with pyro.validation_enabled(False):
        U, g = (value_and_grad or flat.value_and_grad)(z)
    if not torch.isfinite(U):
        culprits = flat.sites_not_finite_at(flat.layout.unpack(z)) if flat.sites_not_finite_at else []
        raise ValueError(
            f"the potential energy at the initial point is {U.item()}"
            + (f"; these sites' log densities are not finite there: {'; '.join(culprits)}" if culprits else "")
            + ". Check the data, or give initial values inside the support (unconstrained "
            "values where the log density is finite)."
        )
    if not torch.isfinite(g).all():
        raise ValueError(
            f"the gradient of the potential energy at the initial point is not finite for sites "
            f"{_non_finite_sites(flat.layout, g)} (e.g. "
            "sqrt or abs at 0); start where it is finite: other initial values, or another init_strategy"
        )
    return U, g
