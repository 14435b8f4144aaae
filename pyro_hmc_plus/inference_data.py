"""ArviZ export and Stan-style run diagnostics for runs of this package's kernels.

:func:`to_inference_data` turns a run -- driven by :class:`pyro_hmc_plus.MCMC` or by
:class:`pyro.infer.MCMC` -- into ArviZ data with everything a sampler records: the posterior
in constrained space (dims named after ``pyro.plate`` s where the shapes say so), every
draw's sample statistics with Stan's names, warmup, pointwise log likelihood per observed
site, observed and constant data, and the posterior predictive, prior and prediction draws
that ``pyro.infer.Predictive`` gives it. It is built with ArviZ's public ``from_dict``, so it works
with ArviZ 0.x and stays clear of its internals.

:func:`diagnose` checks a run the way Stan's ``diagnose`` does (divergences, maximum tree
depth, E-BFMI, R-hat, bulk and tail ESS) and returns a structured report; with ``warn=True``
it also emits one :class:`SamplingWarning` that names each problem and its usual remedy.

Sample statistics travel with each chain's ``kernel.diagnostics()`` (Pyro collects that
dict from every chain, also from worker processes), under ``"sample_stats"``:
``lp`` is ``-U``, the log density of the *unconstrained* parameters up to a constant, with
the log-Jacobian of the transforms included (Stan's ``lp__`` convention); ``energy`` is the
Hamiltonian ``U + K`` at the draw.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional

import numpy as np
import pyro
import torch
from pyro.infer import config_enumerate
from pyro.infer.autoguide.initialization import InitMessenger, init_to_sample, init_to_uniform, init_to_value
from pyro.poutine.util import site_is_subsample

from .potential import element_name, is_factor, listing, model_trace, plate_nesting, unwrapped_distribution
from ._warn import warn_user

ARVIZ_DIMS = ("chain", "draw")  # the dimensions ArviZ gives every draw
STAT_NAMES = ("lp", "energy", "diverging", "acceptance_rate", "step_size", "tree_depth", "n_steps",
              "reached_max_treedepth")
_STAT_DTYPES = {"diverging": bool, "reached_max_treedepth": bool, "tree_depth": np.int64, "n_steps": np.int64}


class SamplingWarning(UserWarning):
    """The run's diagnostics say its draws should not be trusted as they are; or, at a
    kernel's setup, the potential energy does not depend on some coordinates (the posterior
    is improper along them), a latent site's support moves with other latent sites (Pyro's
    transforms fix it at the initial values), a latent angle's density repeats every turn
    (its draws wander over many turns), observed data broadcast against their distribution
    into an outer product, data were left out of the run (``obs=None`` makes them latent),
    the gradient misses part of the potential (the model cuts it), or a dense mass matrix
    has no fewer dimensions than warmup has draws to estimate it from."""


class SampleStats(dict):
    """One chain's per-draw statistics, ``name -> list`` (warmup included), as they travel in
    the chain's diagnostics. A plain dict with a short ``repr``: ``print(mcmc.diagnostics())``
    shows Pyro's summary of every chain, not the thousands of numbers of every draw
    (read them with :func:`to_inference_data`, or index the dict)."""

    def __repr__(self):
        draws = len(next(iter(self.values()), ()))
        names = ", ".join(name for name in self if name != "warmup")
        return (f"<sample stats of {draws} draws ({sum(self.get('warmup', ()))} warmup): {names}; "
                "pyro_hmc_plus.to_inference_data(mcmc) exports them>")


class Adaptation(NamedTuple):
    """One chain's step size and inverse mass matrix (``(D,)`` diagonal or ``(D, D)``, over
    the flat unconstrained vector), those its last draw used (the adapted ones once its
    warmup is over), as they travel in the chain's diagnostics. A named tuple with a short
    ``repr``, as :class:`SampleStats`: printed diagnostics show no matrix of numbers."""

    step_size: float
    inverse_mass_matrix: torch.Tensor

    def __repr__(self):
        return (f"<step size {self.step_size:.3g}, inverse mass matrix {tuple(self.inverse_mass_matrix.shape)}; "
                "pyro_hmc_plus.MCMC stacks every chain's: mcmc.step_size, mcmc.inverse_mass_matrix>")


def chain_diagnostics(divergences: List[int], acceptance_rate: float, sample_stats: dict,
                      adaptation: Adaptation) -> dict:
    """A chain's ``kernel.diagnostics()``: Pyro's (the post-warmup draws that diverged, by
    index, and the acceptance rate), the chain's per-draw ``sample_stats`` and its step size
    and metric (``adaptation``)."""
    return {"divergences": divergences, "acceptance rate": acceptance_rate,
            "sample_stats": SampleStats(sample_stats), "adaptation": adaptation}


def chain_sample_stats(mcmc) -> List[dict]:
    """Each chain's per-draw statistics (dicts of lists, warmup included), in chain order.

    Read from the per-chain diagnostics that Pyro's ``MCMC`` keeps, in chain order, from what
    each chain's kernel reported (``_diagnostics``, which ``mcmc.diagnostics()`` merges; read
    directly because that method also computes ESS and R-hat of every site): this works for
    sequential, multiprocess and vectorized runs alike."""
    per_chain = [d.get("sample_stats") if d else None for d in getattr(mcmc, "_diagnostics", None) or [None]]
    if not all(per_chain):
        raise ValueError(
            "this run has no per-draw sample statistics: run pyro_hmc_plus.HMC or NUTS "
            "(pyro.infer's kernels record only divergences; use arviz.from_pyro for them)"
        )
    return per_chain


def _split_stats(stats: List[dict], num_draws: int):
    """``(warmup, post-warmup)`` dicts ``name -> (chains, draws)`` arrays; post-warmup
    draws are cut to ``num_draws`` (an interrupted run keeps as many draws per chain)."""
    num_warmup = min(sum(s["warmup"]) for s in stats)
    names = [n for n in STAT_NAMES if n in stats[0]]

    def stack(rows):
        return {n: np.asarray([r[n] for r in rows], dtype=_STAT_DTYPES.get(n, np.float64)) for n in names}

    warm = stack([{n: s[n][:num_warmup] for n in names} for s in stats])
    post = []
    for s in stats:
        first = sum(s["warmup"])
        post.append({n: s[n][first : first + num_draws] for n in names})
    return warm, stack(post)


def _starting_at(model, draw: Dict[str, torch.Tensor]):
    """``model`` with its latent sites set to ``draw`` (one posterior draw, constrained)
    wherever nothing else sets them: the runs that ArviZ's export makes for the shapes of the
    sites (here, and Pyro's ``Predictive`` before it conditions on the draws) then work for
    priors that cannot be sampled (``ImproperUniform``). Observed sites stay observed; a
    discrete site summed out by enumeration (never in the draws) takes a prior draw."""
    return _ValuesOfTheDraw(init_to_value(values=draw, fallback=_prior_draw_if_discrete))(model)


class _ValuesOfTheDraw(InitMessenger):
    """Pyro's ``InitMessenger``, but not offered to ``poutine.reparam``: a reparametrizer
    initialises the site it replaces with the init messengers it finds, then computes the new
    site from it (``theta_decentered`` from ``theta``), where the export needs the site it
    replaces computed from the new one, which is in the draw (``theta`` from
    ``theta_decentered``); so ``theta`` is left to the reparametrizer, which records it as an
    observed value."""

    def _pyro_get_init_messengers(self, msg):
        pass


def _prior_draw_if_discrete(site):
    """The init strategy's fallback for a site not in the draw: a prior draw where the site
    is discrete (Pyro's default, ``init_to_uniform``, refuses those)."""
    return init_to_sample(site) if site["fn"].has_enumerate_support else init_to_uniform(site)


def _is_latent(site) -> bool:
    """A sample site whose value the model does not observe (nor a plate's subsample)."""
    return site["type"] == "sample" and not site["is_observed"] and not site_is_subsample(site)


def _is_marginalised(site) -> bool:
    """A discrete latent site: the kernels sum it out by enumeration rather than sample it."""
    return _is_latent(site) and site["fn"].has_enumerate_support


def plate_dims(trace) -> Dict[str, List[str]]:
    """Dimension names for each sample site: a ``pyro.plate`` 's name where the plate's
    dimension and size match an axis of the site's value, ``<site>_dim_<i>`` elsewhere and
    for a plate named like one of :data:`ARVIZ_DIMS`. (A ``pyro.deterministic`` value is all
    event dimensions by default: its axes are matched from the right as batch dimensions.)"""
    dims = {}
    for name, site in trace.nodes.items():
        if site["type"] != "sample" or site_is_subsample(site):
            continue
        shape = tuple(torch.as_tensor(site["value"]).shape)
        # (a reparametrized site's Delta keeps the event dimensions of the site it replaces)
        batch_ndim = len(shape) - (0 if site["infer"].get("_deterministic") else len(site["fn"].event_shape))
        names = [f"{name}_dim_{i}" for i in range(len(shape))]
        for frame in site["cond_indep_stack"]:
            if frame.dim is None or frame.vectorized is False or frame.name in ARVIZ_DIMS:
                continue
            axis = batch_ndim + frame.dim
            if 0 <= axis < batch_ndim and shape[axis] == frame.size:
                names[axis] = frame.name
        if shape:
            dims[name] = names
    return dims


def require_draws(mcmc, what: str) -> None:
    """Stop with a clear error where ``mcmc`` (Pyro's ``MCMC`` or this package's) has no
    draws yet: Pyro's methods fail with "'NoneType' object has no attribute 'items'"."""
    if getattr(mcmc, "_samples", None) is None:
        raise RuntimeError(f"{what} reads the draws of a run, and this MCMC has not run yet: call mcmc.run(...) first")


def require_draws_for_split_rhat(samples: Dict[str, torch.Tensor], what: str) -> None:
    """Stop with a clear error where the draws, grouped by chain ``(C, N) + site shape``,
    are too few for Pyro's split R-hat (4 per chain; a run interrupted early keeps fewer):
    Pyro fails with a bare ``AssertionError``."""
    num_draws = min((v.shape[1] for v in samples.values()), default=0)
    if num_draws < 4:
        raise ValueError(
            f"{what}'s split R-hat (Pyro's) needs at least 4 draws per chain; this run kept {num_draws}: "
            "run more draws, or read mcmc.get_samples() directly"
        )


def to_inference_data(
    mcmc,
    *,
    save_warmup: bool = False,
    coords: Optional[dict] = None,
    dims: Optional[dict] = None,
    log_likelihood: bool = True,
    constant_data: Optional[dict] = None,
    deterministic: bool = True,
    posterior_predictive: Optional[dict] = None,
    prior: Optional[dict] = None,
    predictions: Optional[dict] = None,
    predictions_constant_data: Optional[dict] = None,
    pred_dims: Optional[dict] = None,
):
    """ArviZ data (``InferenceData``; a ``DataTree`` with ArviZ 1.x) for a run of :class:`~pyro_hmc_plus.HMC` / :class:`~pyro_hmc_plus.NUTS`.

    :param mcmc: a finished :class:`pyro_hmc_plus.MCMC` or :class:`pyro.infer.MCMC`.
    :param bool save_warmup: also export ``warmup_sample_stats``, and ``warmup_posterior``
        where the warmup draws were kept (:class:`pyro_hmc_plus.MCMC` keeps them, but not
        with ``chain_method="parallel"``; ``pyro.infer.MCMC`` does not).
    :param dict coords: ArviZ coordinates, ``{dim name: values}``.
    :param dict dims: ``{site: [dim names]}``; sites not given get their ``pyro.plate`` names,
        except a site named like a sample statistic (``lp``, ``energy``, ...: ArviZ gives a
        name's dims to it in every group), which gets ArviZ's default names, as does a plate
        named ``chain`` or ``draw`` (ArviZ's own dimensions). A site of one of those two
        names is an error that says to rename it (ArviZ would drop its group).
    :param bool log_likelihood: pointwise log likelihood of every observed site (for
        ``az.loo``/``az.waic``), by replaying the model vectorised over the draws with
        ``pyro.infer.Predictive`` (draw by draw where the model does not broadcast over them).
        Where the model's discrete sites are summed out by enumeration (their values are in
        no draw), an observed site's log likelihood sums out the discrete sites of its own
        plates (a mixture's assignments, one per observation), as the potential does; it is
        left out, with a warning, where a discrete site is shared by several observations (a
        change point), as are ``pyro.deterministic`` values that depend on discrete sites.
        A ``pyro.factor`` term is a likelihood term where it is pointwise (it has batch
        dimensions: a custom likelihood in a plate), and left out where it is a scalar (a
        prior term, a penalty, a Jacobian: nothing to leave one out of); factors are never
        in ``observed_data`` (their values are empty placeholders).
    :param dict constant_data: extra data to store (``{name: array}``).
    :param bool deterministic: export the ``pyro.deterministic`` sites (below).
    :param dict posterior_predictive: replicated data, ``{site: draws}`` as
        ``pyro.infer.Predictive(model, mcmc.get_samples())`` returns them: a leading
        dimension of every chain's draws, chain after chain (or ``(chains, draws)``), for
        ``az.plot_ppc``. ``Predictive`` returns an observed site's *data*, not new draws,
        unless the model is run without its observations (``y=None``) or wrapped in
        ``pyro.poutine.uncondition``; replicated data equal to the observed data at every
        draw get a warning that says so.
    :param dict prior: draws of ``Predictive(model, num_samples=N)`` (one chain of ``N``
        draws): the latent and deterministic sites go to the ``prior`` group, the observed
        ones to ``prior_predictive``.
    :param dict predictions: out-of-sample predictions, as ``posterior_predictive``, with
        their inputs in ``predictions_constant_data`` and their dims in ``pred_dims``
        (``dims`` where not given).

    ``Predictive`` pads a site's draws with dimensions of size 1 for the model's plates
    (a scalar site of a model with one plate comes back as ``(draws, 1)``); those are removed,
    so that each site has the shape it has in the posterior and the observed data.

    ``pyro.deterministic`` sites are in the posterior, their value at every draw from the same
    replay (as NumPyro's export and Stan's transformed parameters): Pyro records them as
    observed ``Delta`` sites, which would otherwise put one draw's value in ``observed_data``
    and a log likelihood of zeros beside the data's (``az.loo`` then asks which to use). So
    are the sites that ``poutine.reparam`` replaces, which Pyro records the same way. A run
    with ``save_params`` lacks the other latent sites: the log likelihood and these values
    are left out, with a warning.
    """
    require_draws(mcmc, "to_inference_data()")
    by_chain = mcmc.get_samples(group_by_chain=True)
    samples = {k: v.detach().cpu().numpy() for k, v in by_chain.items()}
    num_chains, num_draws = next(iter(samples.values())).shape[:2]
    stats = chain_sample_stats(mcmc)
    warm_stats, post_stats = _split_stats(stats, num_draws)
    model = getattr(mcmc.kernel, "model", None)
    args, kwargs = getattr(mcmc, "_args", None) or (), getattr(mcmc, "_kwargs", None) or {}
    all_dims, site_ndims, factors = {}, {}, set()
    observed, loglik, computed = {}, {}, {}
    if model is not None:
        raw_model, first_draw = model, {k: v[0, 0].detach() for k, v in by_chain.items() if v.shape[1]}
        model = _starting_at(model, first_draw)
        trace = model_trace(model, args, kwargs)
        all_dims = plate_dims(trace)
        factors = {name for name, site in trace.nodes.items() if site["type"] == "sample" and is_factor(site)}
        site_ndims = {name: site["value"].dim() for name, site in trace.nodes.items()
                      if site["type"] == "sample" and name not in factors}
        terms = [name for name, site in trace.nodes.items()
                 if site["type"] == "sample" and site["is_observed"] and not site_is_subsample(site)
                 and not _is_deterministic(site)]
        observed = {name: trace.nodes[name]["value"].detach().cpu().numpy() for name in terms if name not in factors}
        pointwise = [name for name in terms if name in observed or _log_density(trace.nodes[name]).dim() > 0]
        shapes = {name: tuple(site["value"].shape) for name, site in trace.nodes.items()
                  if deterministic and _is_deterministic(site)}
        marginalised = [name for name, site in trace.nodes.items() if _is_marginalised(site)]
        replayed, summed_out, enumerated = (pointwise if log_likelihood else []), None, None
        unsaved = [name for name, site in trace.nodes.items()
                   if _is_latent(site) and not _is_marginalised(site) and name not in by_chain]
        if unsaved and (replayed or shapes):
            # a replay would take these sites' values from their priors (Predictive's way), silently
            warn_user(
                f"the draws have no values of the latent sites {unsaved} (save_params kept {sorted(by_chain)}), "
                f"so {sorted(replayed) + sorted(shapes)} are left out of the export: the log likelihood and "
                "pyro.deterministic values are computed from every latent site (log_likelihood=False, "
                "deterministic=False export without this warning)",
                UserWarning,
            )
            replayed, shapes = [], {}
        if marginalised:
            # the draws lack the discrete sites' values (:func:`_enumeration_plan`); the model is
            # enumerated as the kernel ran it, left of the plates it was given (or has)
            nesting = max(plate_nesting(trace), getattr(mcmc.kernel, "_max_plate_nesting", None) or 0)
            enumerated = functools.partial(_enumerated_trace, raw_model, args, kwargs, trace, nesting)
            summed_out, kept = (_enumeration_plan(enumerated, first_draw, replayed, shapes)
                                if replayed or shapes else ({}, []))
            left_out = [name for name in shapes if name not in kept]
            left_out += [name for name in replayed if name not in summed_out]
            shapes, replayed = {name: shapes[name] for name in kept}, [name for name in replayed if name in summed_out]
            if left_out:
                warn_user(
                    f"the model's discrete sites {listing(marginalised)} are summed out by enumeration, not sampled, "
                    f"so {listing(left_out)} are left out of the export: a pointwise log likelihood can sum out only the "
                    "discrete sites of its own plates (a value per observation, as a mixture's assignments), "
                    "and a pyro.deterministic value must not depend on them (log_likelihood=False, "
                    "deterministic=False export without this warning)",
                    UserWarning,
                )
        if replayed or shapes:
            one_draw_shapes = {name: _log_density(trace.nodes[name]).shape for name in replayed}
            replay_at = (functools.partial(_plain_replay, model, args, kwargs, trace, one_draw_shapes, shapes)
                         if summed_out is None else
                         functools.partial(_enumerated_replay, enumerated, summed_out, one_draw_shapes, shapes))
            loglik, computed = _replay(replay_at, mcmc.get_samples(), num_chains, num_draws)
    # ArviZ gives a name's dims to it in every group: a site named like a sample statistic (a
    # ``pyro.factor("lp", ...)``) keeps ArviZ's default dimension names, the statistic its own
    all_dims = {name: names for name, names in all_dims.items() if name not in STAT_NAMES}
    all_dims.update(dims or {})
    groups = dict(posterior={**samples, **computed}, sample_stats=post_stats)
    if loglik:
        groups["log_likelihood"] = loglik
    if observed:
        groups["observed_data"] = observed
    if constant_data:
        groups["constant_data"] = {k: np.asarray(v) for k, v in constant_data.items()}
    as_run = functools.partial(_predictive_draws, num_chains=num_chains, num_draws=num_draws, site_ndims=site_ndims,
                               factors=factors)
    groups.update(_predictive_groups(as_run, observed, posterior_predictive, prior, predictions))
    if predictions_constant_data:
        groups["predictions_constant_data"] = {k: np.asarray(v) for k, v in predictions_constant_data.items()}
    if save_warmup:
        groups["warmup_sample_stats"] = warm_stats
        warmup_samples = getattr(mcmc, "warmup_samples", None)
        if warmup_samples is not None:
            groups["warmup_posterior"] = {k: v.detach().cpu().numpy() for k, v in warmup_samples.items()}
        else:
            warn_user(
                "this run does not keep warmup draws (pyro.infer.MCMC discards them): exporting warmup "
                "sample statistics only (pyro_hmc_plus.MCMC gives warmup_posterior too)",
                UserWarning,
            )
    used = {k: v for k, v in all_dims.items() if any(k in g for g in groups.values())}
    clashes = sorted({name for g in groups.values() for name in g} & set(ARVIZ_DIMS))
    if clashes:  # ArviZ drops a group with such a variable, without a word
        raise ValueError(
            f"the model's sites {clashes} are named like ArviZ's dimensions {ARVIZ_DIMS}, which ArviZ cannot "
            "export (it drops the group that holds them): rename them; the draws are in mcmc.get_samples()"
        )
    return _from_dict(groups, coords, used, used if pred_dims is None else pred_dims, save_warmup)


def _from_dict(groups: dict, coords, dims, pred_dims, save_warmup: bool):
    """ArviZ's public ``from_dict``: keyword groups in ArviZ 0.x (``InferenceData``), one dict
    of groups in ArviZ 1.x (``DataTree``)."""
    import arviz as az  # imported on use: it takes ~2 s, more than torch and Pyro together

    if int(az.__version__.split(".")[0]) >= 1:
        return az.from_dict(groups, coords=coords, dims=dims, pred_dims=pred_dims, save_warmup=save_warmup)
    return az.from_dict(**groups, coords=coords, dims=dims, pred_dims=pred_dims, save_warmup=save_warmup)


def _predictive_groups(as_run, observed: Dict[str, np.ndarray], posterior_predictive: Optional[dict],
                       prior: Optional[dict], predictions: Optional[dict]) -> dict:
    """The groups of the draws that ``pyro.infer.Predictive`` gives the export, each
    ``{site: (chains, draws, *shape)}`` (``as_run``: :func:`_predictive_draws` for this run):
    ``posterior_predictive``, ``prior`` (latent and deterministic sites) and
    ``prior_predictive`` (observed sites) from ``prior``'s one chain, and ``predictions``."""
    groups = {}
    if posterior_predictive:
        groups["posterior_predictive"] = as_run(posterior_predictive, "posterior_predictive")
        _warn_if_observed_data(groups["posterior_predictive"], observed, "posterior_predictive")
    if prior:
        drawn = as_run(prior, "prior", num_chains=1, num_draws=None)
        for group, names in (("prior", [k for k in drawn if k not in observed]),
                             ("prior_predictive", [k for k in drawn if k in observed])):
            if names:
                groups[group] = {k: drawn[k] for k in names}
        _warn_if_observed_data(groups.get("prior_predictive", {}), observed, "prior")
    if predictions:
        groups["predictions"] = as_run(predictions, "predictions")
    return groups


def _predictive_draws(values: dict, group: str, *, num_chains: int, num_draws: Optional[int],
                      site_ndims: Dict[str, int], factors: set) -> Dict[str, np.ndarray]:
    """``{site: (chains, draws, *site shape)}`` arrays of draws given as ``Predictive``
    returns them: a leading dimension of ``chains * draws`` (chain after chain, as
    ``mcmc.get_samples()`` orders them) or leading ``(chains, draws)``; ``num_draws`` None
    takes any number of draws (a prior's). The dimensions of size 1 that ``Predictive`` puts
    left of a site's value for the model's plates are removed where the model's trace gives
    the site's number of dimensions. ``pyro.factor`` sites (``factors``), whose values
    ``Predictive`` returns as empty tensors, are left out."""
    arrays = {}
    for name, value in values.items():
        if name in factors:
            continue
        x = value.detach().cpu().numpy() if torch.is_tensor(value) else np.asarray(value)
        draws = num_draws if num_draws is not None else (x.shape[0] if x.ndim else 0)
        if x.shape[:2] == (num_chains, draws):
            rest = x.shape[2:]
        elif x.ndim and x.shape[0] == num_chains * draws:
            rest = x.shape[1:]
        else:
            raise ValueError(
                f"{group}[{name!r}] has shape {tuple(x.shape)}; expected a leading dimension of the run's "
                f"{num_chains} chains x {draws} draws = {num_chains * draws} (what Predictive(model, "
                f"mcmc.get_samples()) returns) or leading ({num_chains}, {draws})"
            )
        ndim = site_ndims.get(name)
        while ndim is not None and len(rest) > ndim and rest[0] == 1:
            rest = rest[1:]
        arrays[name] = x.reshape((num_chains, draws) + rest)
    return arrays


def _warn_if_observed_data(replicated: Dict[str, np.ndarray], observed: Dict[str, np.ndarray], group: str):
    """Warns where "replicated" data are the observed data at every draw: ``Predictive``
    returns an observed site's data when the model is run with its observations, which makes
    a posterior predictive check look perfect."""
    copies = [name for name, x in replicated.items() if name in observed
              and x.shape[2:] == observed[name].shape and bool((x == observed[name]).all())]
    if copies:
        warn_user(
            f"{group} {copies} equal the observed data at every draw: pyro.infer.Predictive returns an "
            "observed site's data, not new draws, when the model is given its observations; run it "
            "without them (y=None) or pass Predictive pyro.poutine.uncondition(model)",
            UserWarning,
        )


def _shaped_for_plates(samples: Dict[str, torch.Tensor], trace,
                       nesting: Optional[int] = None) -> Dict[str, torch.Tensor]:
    """Each site's draws ``(draws, *value shape)`` with a 1 inserted after the draws for
    every plate the site is outside of, so that the draws' dimension lies left of every
    plate of the model, where ``Predictive`` 's vectorised replay puts it. ``Predictive``
    pads by the number of dimensions of a value, taking them all as batch dimensions: a
    latent vector (``to_event(1)``) would land its draws in a plate's dimension. ``nesting``:
    the plate dimensions to leave room for, the model's own by default."""
    nesting = plate_nesting(trace) if nesting is None else nesting
    shaped = {}
    for name, value in samples.items():
        site = trace.nodes.get(name)
        batch_ndim = value.dim() - 1 - (site["fn"].event_dim if site is not None else 0)
        shaped[name] = value.reshape(value.shape[:1] + (1,) * max(nesting - batch_ndim, 0) + value.shape[1:])
    return shaped


def _is_deterministic(site) -> bool:
    """A value computed from the latent sites, which Pyro records as an observed ``Delta``
    (masked out of the density): a ``pyro.deterministic`` site, or the original site of a
    reparametrized one (``poutine.reparam``: with ``LocScaleReparam``, ``theta`` is computed
    from the sampled ``theta_decentered``). It belongs with the posterior, not with the data
    or the log likelihood."""
    if site["type"] != "sample" or not site["is_observed"]:
        return False
    return bool(site["infer"].get("_deterministic")) or isinstance(unwrapped_distribution(site["fn"]), pyro.distributions.Delta)


def _replay(replay_at, samples, num_chains, num_draws):
    """The model replayed at every draw: ``({observed site: (chains, draws, *data shape)} log
    densities, {deterministic site: (chains, draws, *its shape)} values)``. ``replay_at(draws,
    num=None)`` replays it at one draw (``num`` None: the values as the sampler had them) or
    at ``num`` draws at once (``(num, ...)`` each), and returns both dicts with a leading
    dimension of draws: :func:`_plain_replay`, or :func:`_enumerated_replay` for a model
    whose discrete sites are summed out. Over all draws at once where the model broadcasts
    over a leading dimension, else draw by draw, as ``Predictive`` does by default (a
    ``PyroModule`` network's ``nn.Linear`` does not broadcast over draws).

    Whether it broadcasts is checked on two draws, against their replay one by one: a model
    that multiplies a scalar site's draws ``(draws, 1)`` into a vector site's ``(draws, 1,
    n)`` (``sigma * torch.cumsum(innovations, -1)``) computes each draw with every other
    draw's values, which raises no error where no shape is checked: it once gave a log
    likelihood of shape ``(chains, draws, draws, n)``, and took draws-squared memory."""
    num = num_chains * num_draws

    def one_by_one(draws: range):
        each = [replay_at({k: v[i] for k, v in samples.items()}) for i in draws]
        return tuple({name: torch.cat([e[part][name] for e in each]) for name in each[0][part]} for part in (0, 1))

    def vectorised(draws: range):
        return replay_at({k: v[draws.start:draws.stop] for k, v in samples.items()}, len(draws))

    try:
        probe = range(min(num, 2))
        if not _agree(vectorised(probe), one_by_one(probe)):
            raise ValueError("the vectorised replay disagrees with the replay draw by draw")
        log_p, values = vectorised(range(num))
    except Exception:  # the model does not broadcast over the draws: replay them one by one
        try:
            log_p, values = one_by_one(range(num))
        except Exception as e:
            warn_user(
                f"could not replay the model at the draws ({type(e).__name__}: {e}); the log_likelihood group "
                "and the values of pyro.deterministic sites are left out (log_likelihood=False skips the "
                "log likelihood)",
                UserWarning,
            )
            return {}, {}

    def by_chain(x):
        return x.detach().reshape((num_chains, num_draws) + x.shape[1:]).cpu().numpy()

    return {k: by_chain(v) for k, v in log_p.items()}, {k: by_chain(v) for k, v in values.items()}


def _plain_replay(model, args, kwargs, trace, one_draw_shapes, deterministic_shapes, draws, num=None):
    """``({observed site: (num, *shape)} log likelihoods, {deterministic site: (num, *its
    shape)} values)`` of ``model`` conditioned on ``draws``: one draw (``num`` None: a
    leading dimension of 1), or ``num`` draws at once through ``pyro.infer.Predictive``'s
    vectorised trace (the draws' dimension left of the model's plates)."""
    if num is None:
        replayed = model_trace(pyro.poutine.condition(model, draws), args, kwargs)
    else:
        with torch.no_grad():
            predictive = pyro.infer.Predictive(model, _shaped_for_plates(draws, trace))
            replayed = predictive.get_vectorized_trace(*args, **kwargs)
    return ({name: _log_density(replayed.nodes[name]).reshape((num or 1,) + shape)
             for name, shape in one_draw_shapes.items()},
            {name: _at_every_draw(replayed.nodes[name]["value"], shape, num or 1)
             for name, shape in deterministic_shapes.items()})


def _enumerated_trace(model, args, kwargs, trace, nesting: int, draws: Dict[str, torch.Tensor],
                      num: Optional[int] = None):
    """``model`` run once at ``draws``, its discrete sites enumerated as Pyro's MCMC
    enumerates them: every site's log density at every value of the discrete sites it
    depends on. ``draws`` is one draw (the values as the sampler had them), or with ``num``,
    that many draws ``(num, ...)`` each, run over a plate left of the model's plates and
    enumerated further left (the model must broadcast over it)."""
    free_dim = -nesting - 1  # the first dimension left of the model's plates (``nesting`` of them)
    if num is None:
        conditioned = pyro.poutine.condition(model, draws)
    else:
        draws_dim = free_dim

        def over_draws(*a, **k):
            with pyro.plate("_draws", num, dim=draws_dim):
                return model(*a, **k)

        conditioned = pyro.poutine.condition(over_draws, _shaped_for_plates(draws, trace, nesting))
        free_dim -= 1  # the draws' plate takes the first free dimension
    return model_trace(pyro.poutine.enum(config_enumerate(conditioned), first_available_dim=free_dim), args, kwargs)


def _enumeration_plan(enumerated_trace, draw: Dict[str, torch.Tensor], observed, deterministic):
    """What the export can give of a model whose discrete sites are summed out by enumeration
    (their values are in no draw), from one enumerated run at ``draw``: ``(summed_out,
    kept)``. ``summed_out`` maps each observed site whose pointwise log likelihood can be had
    to the discrete sites to sum out with it, ``log p(x_i | draw) = log sum_z p(z_i | draw)
    p(x_i | z_i, draw)``, where each such ``z`` has a value per element of ``x`` (the same
    plates: a mixture's assignments), depends on no other discrete site, and enters no other
    site's density. Where ``x`` depends on a discrete site shared by several of its elements
    (a change point, a hidden Markov chain), its elements are not independent given the draw,
    and no pointwise log likelihood is given. ``kept``: the ``deterministic`` sites whose
    values depend on no discrete site. Nothing where the model cannot be run enumerated at a
    draw (the export then says which sites it leaves out)."""
    try:
        enumerated = enumerated_trace(draw)
    except Exception:
        return {}, []
    enum_dims = {name: site["infer"]["_enumerate_dim"] for name, site in enumerated.nodes.items()
                 if site["type"] == "sample" and site["infer"].get("_enumerate_dim") is not None}

    def discrete_in(x: torch.Tensor, but=None):
        return [z for z, d in enum_dims.items() if z != but and x.dim() >= -d and x.shape[d] > 1]

    def plates(name):
        return {frame.name for frame in enumerated.nodes[name]["cond_indep_stack"] if frame.vectorized}

    deps = {name: discrete_in(_log_density(site), but=name) for name, site in enumerated.nodes.items()
            if site["type"] == "sample" and not _is_deterministic(site)}  # a deterministic Delta: no density
    users = [z for zs in deps.values() for z in zs]
    summed_out = {
        name: deps[name] for name in observed
        if all(plates(z) == plates(name) and not deps[z] and users.count(z) == 1 for z in deps[name])
    }
    return summed_out, [name for name in deterministic if not discrete_in(enumerated.nodes[name]["value"])]


def _enumerated_replay(enumerated_trace, summed_out, one_draw_shapes, deterministic_shapes, draws, num=None):
    """``({observed site: (num, *shape)} log likelihoods, {deterministic site: (num, *its
    shape)} values)`` at ``draws`` (as :func:`_enumerated_trace` takes them; one draw: ``num``
    is 1), each observed site's own discrete sites (``summed_out[site]``) summed out by
    log-sum-exp over their enumerated values."""
    enumerated = enumerated_trace(draws, num)
    log_p = {}
    for name, shape in one_draw_shapes.items():
        lp = _log_density(enumerated.nodes[name])
        for z in summed_out[name]:
            dim = enumerated.nodes[z]["infer"]["_enumerate_dim"]
            lp = torch.logsumexp(lp + _log_density(enumerated.nodes[z]), dim, keepdim=True)
        log_p[name] = lp.reshape((num or 1,) + tuple(shape))
    return log_p, {name: _at_every_draw(enumerated.nodes[name]["value"], shape, num or 1)
                   for name, shape in deterministic_shapes.items()}


def _log_density(site) -> torch.Tensor:
    return site["fn"].log_prob(site["value"]).detach()


def _agree(first, second) -> bool:
    """Whether two replays' ``(log densities, values)`` are the same within float rounding."""
    pairs = [(a[name], b[name]) for a, b in zip(first, second) for name in a]
    return all(x.shape == y.shape and torch.allclose(x, y, rtol=1e-4, atol=1e-5, equal_nan=True) for x, y in pairs)


def _at_every_draw(value: torch.Tensor, shape: tuple, num: int) -> torch.Tensor:
    """A deterministic site's values from the vectorised replay as ``(num, *shape)``; a value
    computed from the data alone has no draws' dimension: the same at every draw."""
    per_draw = torch.Size((num,) + shape)
    if value.numel() != per_draw.numel():
        return value.reshape(shape).expand(per_draw)
    return value.reshape(per_draw)


# ---------------------------------------------------------------------------- diagnostics
EBFMI_THRESHOLD = 0.3
RHAT_THRESHOLD = 1.01
ESS_PER_CHAIN = 100
# tail ESS is the smaller ESS of the indicators below the 5% and above the 95% quantile
# (Vehtari et al. 2021): ArviZ 0.x's default, which ArviZ 1.x asks for (`prob`)
TAIL_ESS_PROB = 0.05


@dataclass
class RunDiagnostics:
    """What :func:`diagnose` found. Per-chain lists are in chain order."""

    num_chains: int
    num_draws: int  # post-warmup draws per chain
    divergences: List[int]  # divergent post-warmup transitions per chain
    max_treedepth_hits: List[int]  # post-warmup draws that hit max_tree_depth, per chain (NUTS)
    ebfmi: List[float]  # energy Bayesian fraction of missing information, per chain
    max_rhat: float  # largest rank-normalised split R-hat over scalar parameters
    high_rhat: List[str]  # parameters with R-hat above RHAT_THRESHOLD
    low_ess_bulk: List[str]  # parameters with bulk ESS below ESS_PER_CHAIN per chain
    low_ess_tail: List[str]
    problems: List[str] = field(default_factory=list)  # one sentence per problem, with its remedy

    @property
    def ok(self) -> bool:
        return not self.problems


def _names_where(dataset, predicate) -> List[str]:
    names = []
    for var, values in dataset.data_vars.items():
        arr = np.asarray(values)
        if arr.ndim == 0:
            if predicate(arr):
                names.append(element_name(var, ()))
            continue
        names += [element_name(var, idx) for idx in zip(*np.nonzero(predicate(arr)))]
    return names


def diagnose(run, *, warn: bool = False) -> RunDiagnostics:
    """Stan's checks of a finished run (an MCMC object or ArviZ data from
    :func:`to_inference_data`): divergent transitions, draws at the maximum tree depth,
    E-BFMI below 0.3 in any chain, R-hat above 1.01 (rank-normalised split R-hat, ArviZ) and
    bulk or tail ESS below 100 per chain for any scalar parameter (Vehtari et al. 2021).
    With ``warn=True`` the problems are also emitted as one :class:`SamplingWarning`."""
    import arviz as az  # imported on use: it takes ~2 s, more than torch and Pyro together

    # the sampled sites only: no replay of the model (draw by draw for a model that does not
    # broadcast), and no R-hat of a deterministic site computed from the data alone (constant)
    idata = run if hasattr(run, "posterior") else to_inference_data(run, log_likelihood=False, deterministic=False)
    post, stats = idata.posterior, idata.sample_stats
    num_chains, num_draws = post.sizes["chain"], post.sizes["draw"]
    if num_draws < 4:
        report = RunDiagnostics(num_chains, num_draws, [], [], [], float("nan"), [], [], [],
                                [f"only {num_draws} draws per chain: too few to diagnose; run more draws"])
        if warn:
            warn_user(report.problems[0], SamplingWarning)
        return report
    diverging = np.asarray(stats["diverging"]).astype(bool)
    divergences = diverging.sum(1).tolist()
    hits = np.asarray(stats["reached_max_treedepth"]).sum(1).tolist() if "reached_max_treedepth" in stats else [0] * num_chains
    ebfmi = np.atleast_1d(az.bfmi(np.asarray(stats["energy"]))).tolist()  # (chain, draw) energies, any ArviZ
    problems = []
    if sum(divergences):
        share = ", ".join(f"{d / num_draws:.1%}" for d in divergences)
        problems.append(
            f"{sum(divergences)} divergent transitions after warmup (per chain: {share}): the posterior "
            "has regions the sampler cannot explore; reparametrise the model (e.g. non-centered "
            "hierarchies) or raise target_accept_prob"
        )
    if sum(hits):
        problems.append(
            f"{sum(hits)} transitions hit the maximum tree depth (per chain: {hits}): raise "
            "max_tree_depth, or reparametrise if the posterior is badly scaled"
        )
    low_bfmi = [c for c, e in enumerate(ebfmi) if e < EBFMI_THRESHOLD]
    if low_bfmi:
        problems.append(
            f"E-BFMI below {EBFMI_THRESHOLD} in chains {low_bfmi} ({', '.join(f'{ebfmi[c]:.2f}' for c in low_bfmi)}): "
            "the momentum resampling explores the energy poorly; reparametrise the model"
        )
    high_rhat, max_rhat = [], float("nan")
    with warnings.catch_warnings():  # numpy's warnings on constant draws (all rejected): reported as problems
        warnings.simplefilter("ignore")
        ess_bulk, ess_tail = az.ess(idata, method="bulk"), az.ess(idata, method="tail", prob=TAIL_ESS_PROB)
        rhat = az.rhat(idata) if num_chains > 1 else None  # R-hat compares chains (ArviZ logs a shape warning for one)
        if rhat is not None:
            max_rhat = float(np.nanmax([np.nanmax(np.asarray(v)) for v in rhat.data_vars.values()]))
    if rhat is not None:
        high_rhat = _names_where(rhat, lambda x: x > RHAT_THRESHOLD)
    floor = ESS_PER_CHAIN * num_chains
    low_bulk = _names_where(ess_bulk, lambda x: x < floor)
    low_tail = _names_where(ess_tail, lambda x: x < floor)
    if high_rhat:
        problems.append(
            f"R-hat above {RHAT_THRESHOLD} for {listing(high_rhat)} (largest {max_rhat:.4f}): the chains "
            "disagree; run longer or check for multimodality"
        )
    if low_bulk or low_tail:
        problems.append(
            f"ESS below {ESS_PER_CHAIN} per chain for {listing(sorted(set(low_bulk) | set(low_tail)))}: "
            "estimates are noisy; run more draws (or reparametrise if the chains mix slowly)"
        )
    report = RunDiagnostics(num_chains, num_draws, divergences, hits, ebfmi, max_rhat, high_rhat, low_bulk,
                            low_tail, problems)
    if warn and problems:
        warn_user("sampling problems: " + "; ".join(problems) + ".", SamplingWarning)
    return report


def summary_table(samples: Dict[str, torch.Tensor], prob: float = 0.9):
    """One row per scalar parameter: Pyro's summary columns (mean, std, median, the ``prob``
    credible interval, Pyro's ``n_eff`` and ``r_hat``) and ArviZ's rank-normalised
    diagnostics (``ess_bulk``, ``ess_tail``, ``r_hat_rank``, ``mcse_mean``), for draws grouped
    by chain ``(C, N) + site shape``. A pandas DataFrame."""
    import arviz as az  # imported on use: it takes ~2 s, more than torch and Pyro together

    import pandas as pd
    from pyro.infer.mcmc.util import summary

    require_draws_for_split_rhat(samples, "the summary")
    pyro_stats = summary(samples, prob=prob, group_by_chain=True)
    rows, index = [], []
    for name in sorted(samples):
        value = samples[name].detach().cpu().double()
        site_shape = value.shape[2:]
        flat = value.reshape(value.shape[:2] + (-1,)).numpy()
        columns = {k: v.reshape(-1).double().numpy() for k, v in pyro_stats[name].items()}
        for j in range(flat.shape[-1]):
            draws = flat[..., j]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                arviz_stats = {
                    "ess_bulk": float(az.ess(draws, method="bulk")),
                    "ess_tail": float(az.ess(draws, method="tail", prob=TAIL_ESS_PROB)),
                    "r_hat_rank": float(az.rhat(draws)) if draws.shape[0] > 1 else float("nan"),
                    "mcse_mean": float(az.mcse(draws)),
                }
            rows.append({**{k: float(v[j]) for k, v in columns.items()}, **arviz_stats})
            idx = np.unravel_index(j, site_shape) if site_shape else ()
            index.append(f"{name}[{','.join(map(str, idx))}]" if site_shape else name)
    return pd.DataFrame(rows, index=index)
