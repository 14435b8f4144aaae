"""``pyro_hmc_plus.MCMC``: Pyro's ``MCMC`` with a third way to run several chains.

``chain_method="vectorized"`` (the default for this package's kernels) keeps every chain in
one batch of flat states in this process: each compiled call advances every chain by one
round (NUTS: a transition's fused start or a chunk of a deeper tree,
:mod:`pyro_hmc_plus.rounds`; HMC: 8 leapfrog steps of its trajectory,
:mod:`pyro_hmc_plus.chain_batch`), so one gradient evaluation serves all chains, no chain
waits for another's trajectory, nothing is pickled and no worker process is spawned.
``"sequential"`` and ``"parallel"`` are Pyro's (one chain after another in this process,
through Pyro's own ``_gen_samples`` but without its per-draw logging; one process per
chain, reporting in batches).

The host side of a vectorized run lives here: each chain's adaptation windows (a chain is
paused in the compiled call when it reaches the end of a window; its metric and step size are
re-estimated here, from its own draws), collecting the draws each chain emits at its own
pace, the progress bar, ``hook_fn``, and keeping the draws made so far when the run is
interrupted.
"""

from __future__ import annotations

import copy
import io
import numbers
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import types
from typing import List, NamedTuple, Optional

import pyro
import pyro.poutine as poutine
import torch
import torch.multiprocessing as mp
from pyro.infer.mcmc.api import MAX_SEED as _MAX_SEED
from pyro.infer.mcmc.api import AbstractMCMC, _gen_samples, _UnarySampler
from tqdm.auto import tqdm

from . import adaptation, chain_batch, rounds
from ._warn import warn_user
from .hmc import HMCState
from .engine import EngineFallbackWarning, is_numerical_failure, with_autograd
from .inference_data import (Adaptation, chain_diagnostics, diagnose, require_draws, require_draws_for_split_rhat,
                             summary_table, to_inference_data)
from .kernels import HMC, _flatten, _unflatten, _warn_of_a_singular_dense_metric, one_step_energy_change
from .nuts import select
from .metric import Metric, make_metric

CHAIN_METHODS = ("vectorized", "sequential", "parallel")
# NUTS rounds of chunks only (no chain starting a transition) run ~360 operations fewer than
# rounds of both kinds (0.3-0.9 ms saved a round); their program takes ~0.15-0.2 s to build.
# Until this many such rounds have come, rounds of both kinds serve them, so that runs whose
# trees are shallow do not build it (4 chains x 1,000 draws: 3-43 such rounds on the 2-D
# Gaussian, eight schools and the logistic regression; 914 on the hierarchical model).
CHUNK_ROUNDS_BEFORE_PROGRAM = 100


class MCMC(pyro.infer.MCMC):
    """:class:`pyro.infer.MCMC` with ``chain_method``; the same constructor and methods.

    :param str chain_method: ``"vectorized"`` (default for :class:`~pyro_hmc_plus.HMC` and
        :class:`~pyro_hmc_plus.NUTS` with several chains; one chain, or a model whose gradient
        falls back to eager autograd, runs ``"sequential"``, which then says so):
        all chains in one batch, each at its own pace;
        ``"sequential"``: one chain after another (Pyro's way without processes, minus
        Pyro's per-draw JSON logging: ~90 µs less per draw);
        ``"parallel"``: one worker process per chain, as Pyro's (sequential when there are
        more chains than CPUs; Pyro's also when there are as many), each chain from its own
        ``initial_params`` (in Pyro's, every chain starts from the last chain's), its draws
        sent in batches (Pyro's workers send each on its own: ~1-2 ms a draw), keeping the
        draws at a Ctrl-C (Pyro's lost them). Other kernels only run
        ``"sequential"``/``"parallel"`` (the default for them, which runs ``"sequential"``
        where worker processes started by ``"spawn"`` could not find the model: one defined
        in a notebook or a console; ``"parallel"`` asked for is an error there).
        Vectorized chains share the per-operation overhead of a small model; a model whose
        gradient is mostly arithmetic (thousands of dimensions or data points) gains
        nothing from that (4 NUTS chains with D=2,004: as fast as sequential ones), and
        ``"parallel"`` gives each chain a core. Where the dimensions are many and the
        gradient light (a few operations per dimension), ``"sequential"`` is faster, as the
        vectorized rounds do more bookkeeping per dimension (4 NUTS chains of D=10,000
        independent normals: 9 s against 46 s; see "How it works").
    :param int leaves_per_call: leapfrog steps per chain in one compiled call of a vectorized
        run, in whole rounds of the kernel's (at least one: a NUTS round is 8 steps, an HMC
        round 8 steps (at most the kernel's ``max_unroll``), or one whole trajectory without
        step-size adaptation). More steps per call spread the host's work per call thinner
        but make a longer program to trace or compile.
    :param bool warn_on_problems: after a run of this package's kernels, check it as Stan does
        (:func:`pyro_hmc_plus.diagnose`: divergences, maximum tree depth, E-BFMI, R-hat, ESS)
        and emit one :class:`~pyro_hmc_plus.SamplingWarning` naming any problem and its remedy.
        If the checks themselves fail, that is a ``RuntimeWarning``: ``run()`` still returns.
        The first check in a process imports ArviZ (~1 s on a 2-core machine).

    After a vectorized run, :attr:`batch_utilisation` is the fraction of chain-slots in the
    batched gradient evaluations that did useful work: the leapfrog steps of the chains'
    transitions (as Stan counts them) over those computed. Slots are idle where a chain is
    finished or waits for its metric update at the end of an adaptation window, and for NUTS
    a starting chain's 8th step in a round that also builds chunks, and the steps of a fused
    start or chunk after the tree stopped (see :mod:`pyro_hmc_plus.rounds`), for HMC the steps
    of a round after the chain's trajectory ended (:mod:`pyro_hmc_plus.chain_batch`).
    :attr:`step_size` ``(C,)`` and :attr:`inverse_mass_matrix` ``(C, D)`` or ``(C, D, D)``
    are each chain's adapted values after a run of this package's kernel (over the flat
    unconstrained vector, sites in sorted order), which the kernels take as they are
    (``step_size=``, ``inverse_mass_matrix=``) to go on from them in another run of as many
    chains.
    """

    def __init__(
        self,
        kernel,
        num_samples,
        warmup_steps=None,
        initial_params=None,
        num_chains=1,
        hook_fn=None,
        mp_context=None,
        disable_progbar=False,
        disable_validation=True,
        transforms=None,
        save_params=None,
        chain_method=None,
        *,
        leaves_per_call: int = 4,
        warn_on_problems: bool = True,
    ):
        ours = isinstance(kernel, HMC)
        self._default_chain_method = chain_method is None  # not the user's choice: may change at run time
        if chain_method is None:  # one chain: the kernel's own fused transitions beat one leaf per call
            chain_method = ("vectorized" if num_chains > 1 else "sequential") if ours else "parallel"
        if chain_method not in CHAIN_METHODS:
            raise ValueError(f"chain_method must be one of {CHAIN_METHODS}, got {chain_method!r}")
        if chain_method == "vectorized" and not ours:
            raise ValueError(
                "chain_method='vectorized' needs a pyro_hmc_plus kernel (HMC or NUTS); "
                f"for {type(kernel).__name__} use 'sequential' or 'parallel'"
            )
        if not (isinstance(num_chains, numbers.Integral) and num_chains >= 1):
            raise ValueError(f"num_chains must be a positive integer, got {num_chains!r}")
        # Pyro's MCMC takes these and fails after the warmup (ZeroDivisionError), or runs no warmup
        if not (isinstance(num_samples, numbers.Integral) and num_samples >= 1):
            raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
        if warmup_steps is not None and not (isinstance(warmup_steps, numbers.Integral) and warmup_steps >= 0):
            raise ValueError(f"warmup_steps must be a non-negative integer (or None: as many as num_samples), got {warmup_steps!r}")
        num_chains, num_samples = int(num_chains), int(num_samples)  # numpy integers too
        warmup_steps = None if warmup_steps is None else int(warmup_steps)
        if leaves_per_call < 1:
            raise ValueError("leaves_per_call must be at least 1")
        if hook_fn is not None and not callable(hook_fn):  # Pyro's MCMC calls it after the first draw
            raise ValueError(f"hook_fn must be a function hook_fn(kernel, params, stage, i), got {hook_fn!r}")
        if initial_params:  # numbers and lists too, for every chain method
            initial_params = {k: torch.as_tensor(v) for k, v in initial_params.items()}
        if initial_params and num_chains > 1:  # Pyro's own check names no site (an IndexError on a number)
            unbatched = {k: tuple(v.shape) for k, v in initial_params.items() if v.dim() == 0 or len(v) != num_chains}
            if unbatched:
                raise ValueError(
                    f"initial_params {list(unbatched)} (shapes {list(unbatched.values())}) have no chain dimension "
                    f"of {num_chains}: with num_chains={num_chains}, give every site's unconstrained value a leading "
                    f"dimension of {num_chains}, one value per chain (e.g. value.expand({num_chains}, *value.shape))"
                )
        self.chain_method = chain_method
        self.leaves_per_call = int(leaves_per_call)
        self.batch_utilisation = self.step_size = self.inverse_mass_matrix = self.warmup_samples = None
        self.warn_on_problems = warn_on_problems
        # Pyro's constructor, with this package's samplers
        AbstractMCMC.__init__(self, kernel, num_chains, None)  # the draws' transforms: _set_transforms
        self._given_transforms = transforms or {}
        self.warmup_steps = num_samples if warmup_steps is None else warmup_steps
        self.num_samples = num_samples
        self.disable_validation = disable_validation
        self.disable_progbar = disable_progbar
        self._samples = None
        self._args = None
        self._kwargs = None
        if save_params is not None:  # sorted: Pyro's run reads the draws back in sorted order
            kernel.save_params = sorted(save_params)
        self._validate_kernel(initial_params)
        if initial_params and num_chains == 1:  # several chains' leading dimension is checked above
            initial_params = {k: v.unsqueeze(0) for k, v in initial_params.items()}
        self._initial_params = initial_params
        self._hook = hook_fn
        self._diagnostics = [None] * num_chains
        # Pyro keeps a CPU for the main process, which takes every draw of every worker on its
        # own; here the workers report in batches, and the main process mostly waits
        available_cpus = mp.cpu_count()
        if chain_method == "parallel" and num_chains > available_cpus:
            warn_user(f"num_chains={num_chains} is more than available_cpu={available_cpus}. "
                      "Chains will be drawn sequentially.", UserWarning)  # Pyro's own warning
        if chain_method == "parallel" and 1 < num_chains <= available_cpus:
            if mp_context is None and initial_params and next(iter(initial_params.values())).is_cuda:
                mp_context = "spawn"  # as Pyro: a forked process cannot use CUDA
            self.sampler = _ParallelSampler(
                kernel, num_samples, self.warmup_steps, num_chains, mp_context, disable_progbar,
                initial_params=initial_params, hook=hook_fn,
            )
        else:
            self.sampler = self._sequential_sampler()

    def _sequential_sampler(self) -> "_SequentialSampler":
        """The chains one after another in this process, with this ``MCMC``'s settings."""
        return _SequentialSampler(self.kernel, self.num_samples, self.warmup_steps, self.num_chains,
                                  self.disable_progbar, initial_params=self._initial_params, hook=self._hook)

    @poutine.block
    @with_autograd
    def run(self, *args, **kwargs):
        self.step_size = self.inverse_mass_matrix = None
        if isinstance(self.sampler, _ParallelSampler):
            self._run_parallel(args, kwargs)
        elif self.chain_method == "vectorized":
            self._run_vectorized(args, kwargs)
        else:
            self._run_sequential(args, kwargs)
        adapted = [d["adaptation"] for d in self._diagnostics if d and "adaptation" in d]
        if adapted and len(adapted) == self.num_chains:  # this package's kernel, every chain kept
            step_sizes, masses = zip(*adapted)
            self.step_size = torch.tensor(step_sizes, dtype=masses[0].dtype, device=masses[0].device)
            self.inverse_mass_matrix = torch.stack(masses)
        drawn = next(iter(self._samples.values())).shape[1] if self._samples else 0
        if self.warn_on_problems and isinstance(self.kernel, HMC) and drawn >= 4:
            try:
                diagnose(self, warn=True)
            except Exception as e:  # checks of a finished run must not turn it into an error
                warn_user(
                    f"the run finished, but checking its draws failed ({type(e).__name__}: {e}); the "
                    "draws are in get_samples() (pass warn_on_problems=False to skip the checks)",
                    RuntimeWarning,
                )

    def _run_sequential(self, args, kwargs):
        """Pyro's run, chain after chain, keeping what Pyro's loop discards where the kernel
        is this package's (:class:`_SequentialSampler` records each chain's draws): the warmup
        draws (:attr:`warmup_samples`, as a vectorized run keeps them) and, if the run is
        interrupted, the draws made so far."""
        self.num_chains = self.sampler.num_chains  # an interrupted run may have kept fewer
        self._diagnostics = [None] * self.num_chains
        try:
            super().run(*args, **kwargs)
        except KeyboardInterrupt:
            if not any(getattr(self.sampler, "draws", [])):  # nothing drawn, or not this package's kernel
                raise
            self._keep_interrupted(args, kwargs)
        draws = getattr(self.sampler, "draws", [])
        if draws and len(draws) == self.num_chains:
            num_warmup = min(min(len(d), self.warmup_steps) for d in draws)
            self.warmup_samples = self._constrained(self._recorded(0, num_warmup))

    def _run_parallel(self, args, kwargs):
        """Pyro's results of the chains run in worker processes (:meth:`_ParallelSampler.collect`);
        after a Ctrl-C, every chain keeps as many post-warmup draws as the one with fewest, as
        after an interrupted vectorized run."""
        self._args, self._kwargs = args, kwargs
        args = [arg.detach() if torch.is_tensor(arg) else arg for arg in args]
        sampler = self.sampler
        try:
            with pyro.validation_enabled(not self.disable_validation):
                interrupted = sampler.collect(*args, **kwargs)
        except _DefinedInteractively as e:
            if not self._default_chain_method:
                raise
            warn_user(f"{e}. The chain method was the default: the chains run one after another in this process "
                      "instead (chain_method='sequential')", UserWarning)
            self.chain_method = "sequential"
            self.sampler = self._sequential_sampler()
            self._run_sequential(self._args, self._kwargs)
            return
        if sampler.structure is None:  # interrupted before any chain was set up
            raise KeyboardInterrupt
        num_kept = min(len(d) for d in sampler.draws)
        if interrupted:
            _warn_of_an_interrupt(sampler.transitions, self.warmup_steps + self.num_samples, self.warmup_steps, num_kept)
        self._diagnostics = sampler.diagnostics
        if self.transforms is None:
            self._set_transforms(*args, **kwargs)
        self._samples = self._from_workers(sampler.draws, num_kept)
        self.warmup_samples = self._from_workers(sampler.warmup, min(len(w) for w in sampler.warmup))

    def _from_workers(self, draws: List[List[torch.Tensor]], num: int) -> dict:
        """The first ``num`` of each chain's flat draws from its worker as Pyro's ``_samples``:
        per saved site, ``(C, num) + site shape``, in constrained space."""
        structure = self.sampler.structure
        size = sum(shape.numel() for shape in structure.values())
        flat = torch.stack([torch.stack(d[:num]) if num else torch.zeros(0, size) for d in draws])
        params, start = {}, 0
        for name in sorted(structure):  # the order the workers flattened them in
            params[name] = flat[..., start : start + structure[name].numel()].reshape(flat.shape[:2] + structure[name])
            start += structure[name].numel()
        return self._constrained(params)

    def _set_transforms(self, *args, **kwargs):
        """The transforms that take the draws to constrained space: those given to this
        ``MCMC``, and the kernel's for the other sites (Pyro takes the given ones alone, or
        the kernel's where none are given: a site left out of the given ones kept its
        unconstrained draws, a positive site's negative). Where this process has not set up
        this package's kernel for a model (its chains ran in worker processes), Pyro would set
        it up, tracing and compiling the gradient to read them, and fail on a step size per
        chain: the model's flat potential gives them."""
        if isinstance(self.kernel, HMC) and self.kernel.transforms is None and self.kernel.model is not None:
            self.transforms = self.kernel._flat_potential(args, kwargs, None).transforms
        else:
            super()._set_transforms(*args, **kwargs)
        self.transforms = {**self.transforms, **self._given_transforms}

    def _recorded(self, start: int, stop: int) -> dict:
        """Draws ``start:stop`` of each chain the sequential sampler recorded, per site
        ``(C, stop - start) + site shape``."""
        empty = self.kernel._flat.initial_z.new_empty(0, self.kernel._flat.dim)
        draws = torch.stack([torch.stack(d[start:stop]) if stop > start else empty for d in self.sampler.draws])
        return self.kernel._flat.layout.unpack(draws)

    def _keep_interrupted(self, args, kwargs):
        """After a ``KeyboardInterrupt`` of sequential chains: the same post-warmup draws of
        every chain that has some (the chains that finished, and the interrupted one if it was
        past its warmup), as many as the shortest has; the chains that never started are not
        kept (``num_chains`` says how many were, until the next ``run``)."""
        draws, W = self.sampler.draws, self.warmup_steps
        interrupted = len(draws) - 1
        kept = [c for c, d in enumerate(draws) if len(d) > W] or [c for c, d in enumerate(draws) if d]
        if interrupted in kept:
            self._diagnostics[interrupted] = self.kernel.diagnostics()
        num_kept = min(max(len(draws[c]) - W, 0) for c in kept)
        warn_user(
            f"sampling interrupted in chain {interrupted} of {self.sampler.num_chains}: draws per chain "
            f"{[len(d) for d in draws]} (of {W + self.num_samples}, warmup {W}); keeping the first "
            f"{num_kept} post-warmup draws of chains {kept}",
            RuntimeWarning,
        )
        self.num_chains = len(kept)
        self._diagnostics = [self._diagnostics[c] for c in kept]
        self.sampler.draws = [draws[c] for c in kept]
        if self.transforms is None:
            self._set_transforms(*args, **kwargs)
        self._samples = self._constrained(self._recorded(W, W + num_kept))

    def _run_vectorized(self, args, kwargs):
        self._args, self._kwargs = args, kwargs
        args = [arg.detach() if torch.is_tensor(arg) else arg for arg in args]
        initial = self._initial_params
        if initial is not None and self.num_chains == 1:
            initial = {k: v[0] for k, v in initial.items()}
        validation = pyro.validation_enabled(not self.disable_validation)
        rng_state = pyro.util.get_rng_state()
        try:
            with validation:
                run = _VectorizedRun(self.kernel, self.num_chains, self.warmup_steps, self.num_samples,
                                     self.leaves_per_call, self._default_chain_method)
                rows = run.sample(args, kwargs, initial, self._hook, self.disable_progbar)
        except _EagerGradient:
            warn_user(
                f"pyro_hmc_plus: this model's gradient runs on eager autograd, so its {self.num_chains} chains run "
                "one after another (chain_method='sequential'), which is faster than vectorized chains for it "
                "(4 NUTS chains of a model with `.item()`: ~1.5x); pass chain_method='vectorized' to batch them anyway",
                EngineFallbackWarning,
            )
            pyro.util.set_rng_state(rng_state)  # the draws of chain_method='sequential' with this seed
            self.chain_method = "sequential"
            self._run_sequential(args, kwargs)  # the same (detached) data: the kernel reuses its engine
            return
        self.batch_utilisation = run.utilisation
        self._collect(rows, run)

    def _collect(self, rows: List[torch.Tensor], run: "_VectorizedRun"):
        """Pyro's results (``_samples`` in constrained space, per-chain ``_diagnostics``) and
        the kernel's ``sample_stats`` from each chain's rows of draws and statistics."""
        kernel, W = self.kernel, self.warmup_steps
        D = kernel._flat.dim
        num_kept = min(max(len(r) - W, 0) for r in rows)
        num_warmup_kept = min(min(len(r), W) for r in rows)
        for chain, r in enumerate(rows):
            stats = run.statistics(r)
            kernel._chain_stats.append(stats)
            post = r[W:]
            self._diagnostics[chain] = chain_diagnostics(
                [i for i, d in enumerate(stats["diverging"][W:]) if d],
                post[:, D + chain_batch.STAT_COLUMNS.index("accepted")].double().mean().item()
                if len(post) else float("nan"),
                stats,
                Adaptation(run.chains.step_size.value[chain].item(), run.metric.inverse_mass[chain]),
            )
        if self.transforms is None:
            self._set_transforms(*self._args, **self._kwargs)
        unpack = kernel._flat.layout.unpack
        self._samples = self._constrained(unpack(torch.stack([r[W : W + num_kept, :D] for r in rows])))
        self.warmup_samples = self._constrained(unpack(torch.stack([r[:num_warmup_kept, :D] for r in rows])))

    def _constrained(self, params: dict) -> dict:
        """Draws of the sites in unconstrained space, ``(C, N) + site shape`` each, as Pyro's
        ``_samples``: the saved sites, in constrained space."""
        save_params = getattr(self.kernel, "save_params", None) or sorted(params)
        return {
            name: self.transforms[name].inv(params[name]) if name in self.transforms else params[name]
            for name in save_params
        }

    # ------------------------------------------------------------------ draws, ArviZ and diagnostics
    def get_samples(self, num_samples=None, group_by_chain=False):
        """Pyro's :meth:`pyro.infer.MCMC.get_samples`, with a clear error before a run."""
        require_draws(self, "get_samples()")
        return super().get_samples(num_samples, group_by_chain)

    def diagnostics(self):
        """Pyro's :meth:`pyro.infer.MCMC.diagnostics`, with a clear error before a run or
        after one that kept too few draws (an interrupted one)."""
        require_draws(self, "diagnostics()")
        require_draws_for_split_rhat(self._samples, "diagnostics()")
        return super().diagnostics()

    def to_inference_data(self, **kwargs):
        """ArviZ data for this run: :func:`pyro_hmc_plus.to_inference_data`."""
        return to_inference_data(self, **kwargs)

    def summary(self, prob=0.9):
        """Pyro's summary table (mean, std, median, credible interval, Pyro's n_eff and
        r_hat) with ArviZ's rank-normalised diagnostics beside it (bulk and tail ESS,
        split R-hat, MCSE of the mean), then the number of divergences."""
        require_draws(self, "summary()")
        print(summary_table(self._samples, prob).to_string(float_format=lambda x: f"{x:.3f}"))
        if self._diagnostics and self._diagnostics[0] and "divergences" in self._diagnostics[0]:
            print(f"\nNumber of divergences: {sum(len(d['divergences']) for d in self._diagnostics)}")


def _warn_of_an_interrupt(transitions: List[int], total: int, warmup: int, num_kept: int) -> None:
    """The warning of a run of chains interrupted together (vectorized, or in worker
    processes): each chain's ``transitions`` so far, and the post-warmup draws every chain keeps."""
    warn_user(
        f"sampling interrupted: draws per chain {list(transitions)} (of {total}, warmup {warmup}); keeping the "
        f"first {num_kept} post-warmup draws of every chain",
        RuntimeWarning,
    )


def _setup_bar(total: int, disable: bool, chain: Optional[int] = None) -> tqdm:
    """The run's progress bar (``chain``'s, one line each, for chains in worker processes),
    shown from the start as "Setup": tracing and checking the model and building the
    sampler's programs come before the first draw (a second, or ~15 s for a model of a
    thousand sample sites in a Python loop). Reset at the first draws, so that its rate and
    time left are the sampling's."""
    if chain is None:
        return tqdm(total=total, disable=disable, dynamic_ncols=True, desc="Setup")
    return tqdm(total=total, disable=disable, dynamic_ncols=True, desc=f"Setup [{chain}]", position=chain)


class _SequentialSampler(_UnarySampler):
    """Pyro's one-chain-after-another sampler (the same kernel calls, hooks and yields, by
    Pyro's own ``_gen_samples``) without its per-draw logging: Pyro sends every draw's
    ``kernel.logging()`` through ``json.dumps`` and a ``logging`` handler to reach the progress
    bar, ~90 µs a draw, more than a whole fused HMC transition of a small model. Here the bar
    counts draws and shows ``kernel.logging()`` at most twice a second, and at the chain's end."""

    def run(self, *args, **kwargs):
        # each started chain's draws, warmup first, as flat unconstrained vectors, where the
        # kernel is this package's: the warmup draws (which Pyro's loop discards) and, if the
        # run is interrupted, the draws made so far (which Pyro's accumulator loses)
        ours = isinstance(self.kernel, HMC)
        self.draws = []
        try:
            for chain in range(self.num_chains):
                if ours:
                    self.draws.append([])
                    self.kernel._chain_of_run = (chain, self.num_chains)
                yield from self._run_chain(chain, *args, **kwargs)
        finally:
            if ours:
                self.kernel._chain_of_run = None  # a chain run on its own later is not this run's

    def _run_chain(self, chain: int, *args, **kwargs):
        """One chain by Pyro's ``_gen_samples``, with its progress bar and the draws' record."""
        if self.initial_params is not None:
            self.kernel.initial_params = {k: v[chain] for k, v in self.initial_params.items()}
        bar = _setup_bar(self.warmup_steps + self.num_samples, self.disable_progbar)
        shown = {"stage": None, "at": 0.0}

        def hook(kernel, params, stage, i):
            if self.draws:
                self.draws[-1].append(kernel._state.z)  # the flat vector ``params`` unpacks (never written)
            if not self.disable_progbar:
                now = time.monotonic()
                if stage != shown["stage"]:
                    if shown["stage"] is None:
                        bar.reset()  # rate and time left from the first draw on, not the setup
                    shown["stage"] = stage
                    bar.set_description(stage, refresh=False)
                bar.update(1)
                if now - shown["at"] > 0.5 or bar.n == bar.total:  # and the chain's last values
                    shown["at"] = now
                    bar.set_postfix(kernel.logging(), refresh=False)
            if self.hook is not None:
                self.hook(kernel, params, stage, i)

        try:
            for sample in _gen_samples(self.kernel, self.warmup_steps, self.num_samples, hook,
                                       chain if self.num_chains > 1 else None, *args, **kwargs):
                yield sample, chain
        finally:
            if not self.disable_progbar and 0 < bar.n < bar.total:  # stopped: its values then
                bar.set_postfix(self.kernel.logging(), refresh=False)  # (a finished chain's kernel is reset)
            bar.close()
        self.kernel.cleanup()


class _ParallelSampler:
    """One worker process per chain (Pyro's ``chain_method="parallel"``), each with its own
    copy of the kernel and its own seed, reporting to this process in batches.

    Pyro's sampler has four faults this one mends. Its workers share one kernel object, which
    each sets to its chain's ``initial_params`` and which is copied into the processes only
    when they all start: every chain started from the last chain's initial values. It seeds
    chain ``c`` with ``torch.initial_seed() + c``, the same in every run of the process: a
    second run, to go on from the first, repeated the first's random numbers. It sends every
    draw on its own, through shared memory and a file descriptor, and every draw's
    ``kernel.logging()`` for the progress bars, and waits for this process to take each: ~1-2
    ms a draw, more than a whole NUTS transition of this package's kernels (two chains of
    eight schools on two cores took 2.3x as long as the same chains one after another). And
    its loop keeps only chains of full length: a Ctrl-C lost every draw. Here the workers
    send their draws by value, in batches, and this process keeps what they sent.

    A copy of this package's kernel also knows its chain, to take the chain's step size and
    metric where they are given one per chain."""

    def __init__(self, kernel, num_samples, warmup_steps, num_chains, mp_context, disable_progbar,
                 initial_params=None, hook=None):
        self.kernel, self.num_samples, self.warmup_steps, self.num_chains = kernel, num_samples, warmup_steps, num_chains
        self.ctx = mp.get_context(mp_context) if mp_context else mp
        self.disable_progbar, self.initial_params, self.hook = disable_progbar, initial_params, hook

    def collect(self, *args, **kwargs) -> bool:
        """Run every chain in its worker process (:func:`_run_worker`) and collect what they
        send. Sets :attr:`structure` (each saved site's shape, a worker's first message), and
        per chain :attr:`warmup` and :attr:`draws` (lists of flat vectors, the saved sites in
        sorted order), :attr:`diagnostics` (the kernel's) and :attr:`transitions` (made,
        warmup included). Returns whether the run was interrupted.

        At the first Ctrl-C (or ``KeyboardInterrupt`` raised by ``hook_fn`` in a worker, as it
        stops a run in this process) the workers end their chains after the transition they
        are in and send what they have, and this returns it; a second one abandons them
        (``KeyboardInterrupt``). A worker that ends without its results (killed for lack of
        memory) is an error, where Pyro's loop waited for ever."""
        C, total = self.num_chains, self.warmup_steps + self.num_samples
        start_method = self.ctx.get_start_method()
        if _starts_by_pickling(start_method):
            interactive = _defined_interactively((self.kernel, self.hook, self.initial_params, args, kwargs))
            if interactive:
                raise _DefinedInteractively(interactive, start_method)
        self.structure, self.warmup, self.draws = None, [[] for _ in range(C)], [[] for _ in range(C)]
        self.diagnostics, self.transitions = [None] * C, [0] * C
        results, stop = self.ctx.Queue(), self.ctx.Event()
        seeds = torch.randint(0, _MAX_SEED, (C,)).tolist()
        workers = []
        for chain in range(C):
            kernel = copy.copy(self.kernel)
            if isinstance(kernel, HMC):
                kernel._chain_of_run = (chain, C)
            if self.initial_params is not None:
                kernel.initial_params = {k: v[chain] for k, v in self.initial_params.items()}
            # daemonic: a worker left behind by an error here ends with this process
            workers.append(self.ctx.Process(
                name=f"chain {chain}", target=_run_worker, daemon=True,
                args=(_WorkerSettings(chain, kernel, self.warmup_steps, self.num_samples, self.hook, seeds[chain],
                                      torch.get_default_dtype(), torch.get_default_device()), results, stop, *args),
                kwargs=kwargs))
        bars = [_setup_bar(total, self.disable_progbar, chain) for chain in range(C)]
        running, interrupts = set(range(C)), []

        def on_interrupt(signum, frame):
            # a flag, not a KeyboardInterrupt in the middle of reading a message
            if interrupts:  # the second: abandon the workers
                raise KeyboardInterrupt
            interrupts.append(signum)

        handler = _set_sigint(signal.SIG_IGN)  # inherited by the workers: this process stops them
        try:
            for worker in workers:
                _start(worker, start_method)
            _set_sigint(on_interrupt)
            heard = set()  # the chains whose worker has sent something
            while running:
                if interrupts:
                    stop.set()
                try:
                    chain, payload = results.get(timeout=0.5)
                except queue.Empty:
                    if any(w.is_alive() for w in workers) or not results.empty():
                        continue
                    raise _died_error(sorted(running), [workers[c].exitcode for c in sorted(running)],
                                      silent=not heard & running, start_method=start_method) from None
                heard.add(chain)
                message = pickle.loads(payload)
                if isinstance(message, KeyboardInterrupt):  # from a worker's hook_fn: as a Ctrl-C here
                    interrupts.append(None)
                    continue
                if isinstance(message, BaseException):  # the worker has printed its traceback
                    raise message
                if isinstance(message, dict):  # the saved sites' shapes, once the chain is set up
                    self.structure = message
                    continue
                self.transitions[chain] = message.transitions
                self.warmup[chain] += list(message.warmup)
                self.draws[chain] += list(message.draws)
                bar = bars[chain]
                if bar.n == 0:
                    bar.reset()  # rate and time left from the first draws on, not the setup
                bar.set_description(f"{message.stage} [{chain}]", refresh=False)
                bar.set_postfix(message.logging, refresh=False)
                bar.update(message.transitions - bar.n)
                if message.diagnostics is not None:  # the chain's end
                    self.diagnostics[chain] = message.diagnostics
                    running.discard(chain)
        finally:
            _set_sigint(handler)
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
            for bar in bars:
                bar.close()
        return bool(interrupts)


def _set_sigint(handler):
    """Set the SIGINT handler (Ctrl-C) and return the one it replaces, in the main thread.
    Python runs signal handlers in its main thread only, and refuses to set them in another
    (a ``ValueError``; Pyro's worker processes fail so from a web app's or a GUI's worker
    thread): there, where no Ctrl-C reaches the run, this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, handler)


def _starts_by_pickling(start_method: str) -> bool:
    """Whether a worker started by ``start_method`` gets what it runs by pickling (the kernel,
    the model, ``hook_fn``, the run's arguments) and finds their functions by importing their
    modules, the main script among them: ``"spawn"`` and ``"forkserver"``; ``"fork"`` copies
    this process instead."""
    return start_method != "fork"


def _start(worker, start_method: str):
    """Start a worker process, with a clear error where what it runs does not pickle and the
    start method pickles it (:func:`_starts_by_pickling`; ``"spawn"`` is the default on macOS
    and Windows)."""
    try:
        worker.start()
    except (AttributeError, TypeError, pickle.PicklingError) as e:
        if not _starts_by_pickling(start_method):
            raise
        raise ValueError(
            f"chain_method='parallel' with the {start_method!r} start method sends the kernel, its model and the "
            f"run's arguments to each worker process by pickling, and they do not pickle ({type(e).__name__}: {e}): "
            "define the model at the top level of a module (not inside a function, nor as a lambda), or run the "
            "chains in this process with chain_method='vectorized', which pickles nothing"
        ) from e


class _DefinedInteractively(ValueError):
    """Chains to run in worker processes that would not find what they run: functions or
    classes defined in an interactive session (a notebook, a console, ``python -c``).

    A worker started by ``"spawn"`` or ``"forkserver"`` (the default on macOS and Windows, and
    on Linux from Python 3.14) unpickles the kernel, the model, ``hook_fn`` and the run's
    arguments, finding each function and class by importing its module; the session's
    ``__main__`` is not a module it can import (Pyro's workers die there with
    ``AttributeError: Can't get attribute 'model' on <module '__main__'>`` on their stderr,
    which a notebook does not show, and Pyro's run waits for them for ever)."""

    def __init__(self, names: List[str], start_method: str):
        super().__init__(
            f"chain_method='parallel' runs each chain in a worker process started by {start_method!r}, which finds "
            f"the model's functions and classes by importing their module, and {names} are defined in this "
            "interactive session (a notebook, a console), which it cannot import: define them in a module (a .py "
            "file) and import them from there, or run the chains in this process with chain_method='sequential' "
            "(or 'vectorized', with this package's kernels)"
        )


def _defined_interactively(payload) -> List[str]:
    """The names of the functions and classes of an interactive ``__main__`` (one with neither
    a file nor a module name, which ``multiprocessing`` would import again in a worker) that
    pickling ``payload`` refers to. Tensors are not pickled (their data refers to nothing);
    what does not pickle at all is left to :func:`_start` to report."""
    main = sys.modules.get("__main__")
    if getattr(main, "__file__", None) is not None or getattr(getattr(main, "__spec__", None), "name", None):
        return []
    found = []

    class Finder(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor):
                return tuple, ()
            if isinstance(obj, (types.FunctionType, type)) and obj.__module__ == "__main__":
                found.append(obj.__qualname__)
            return NotImplemented

    try:
        Finder(io.BytesIO(), pickle.HIGHEST_PROTOCOL).dump(payload)
    except Exception:
        pass
    return sorted(set(found))


def _died_error(chains: List[int], exit_codes: List[int], silent: bool, start_method: str) -> RuntimeError:
    """The error of a run whose worker processes of ``chains`` ended without their results.
    ``silent``: none of them sent anything, so (where they were not killed) they failed while
    starting, before this package's code ran in them."""
    ended = f"the worker processes of chains {chains} ended without their chains' results (exit codes {exit_codes}"
    if silent and _starts_by_pickling(start_method) and all(code is not None and code > 0 for code in exit_codes):
        return RuntimeError(
            f"{ended}): they failed while starting, each with its traceback on stderr (from a notebook: in the "
            f"terminal that runs it). A worker started by {start_method!r} runs the main script again as a module, "
            "and finds there only what the script defines outside `if __name__ == '__main__':` (a model defined "
            "under it is not found), and a script that starts the run outside that guard starts it again in every "
            "worker. Define the model at the top level of the script and start the run under the guard, or run the "
            "chains in this process with chain_method='sequential' (or 'vectorized', with this package's kernels)"
        )
    return RuntimeError(
        f"{ended}; -9: killed, e.g. for lack of memory): run fewer chains at once, or chain_method='vectorized'"
    )


class _WorkerSettings(NamedTuple):
    """What a worker process runs: its chain (numbered), the kernel (a copy of its own), the
    run's length, the user's hook, the chain's seed, and this process's default dtype and
    device."""

    chain: int
    kernel: object
    warmup_steps: int
    num_samples: int
    hook: object
    seed: int
    dtype: torch.dtype
    device: torch.device


class _ChainReport(NamedTuple):
    """A worker's batch of news: its chain's transitions so far (warmup included), the
    warmup draws and the draws after the warmup made since the last report (``(num, size)``
    each, flat, the saved sites in sorted order), the stage and the kernel's ``logging()``
    for the progress bar, and at the chain's end (or stop) the kernel's ``diagnostics()``."""

    transitions: int
    warmup: torch.Tensor
    draws: torch.Tensor
    stage: str
    logging: dict
    diagnostics: Optional[dict]


class _StopChain(BaseException):
    """Raised in a worker by its hook once the main process asks the chains to stop: not an
    ``Exception``, so that nothing on the way takes it for the chain's failure."""


REPORTS_PER_SECOND = 4  # a worker's reports while its chain runs: the progress bar's rate


def _run_worker(settings: _WorkerSettings, results, stop, *args, **kwargs):
    """A worker process's chain by Pyro's ``_gen_samples`` (the kernel's setup and
    transitions, the user's hook after each, the stages ``"Warmup"`` and ``"Sample"`` as in
    Pyro's workers), on one thread, until it ends or ``stop`` (an event) is set. Every message
    to ``results`` is ``(chain, pickled bytes)``: pickled by value, not through shared memory
    and file descriptors as a queue sends tensors, which the main process could not read once
    this process has ended. The draws go in batches (:class:`_ChainReport`), a few a second.

    One thread: a process forked from one whose torch had run on several threads hangs at
    its first multi-threaded operation (the threads are not copied into it; here the second
    run of an ``MCMC`` of a 2-D ``MultivariateNormal``, with Pyro's kernels and ours). One
    chain per process on a core each needs no more."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    torch.set_default_dtype(settings.dtype)
    torch.set_default_device(settings.device)
    pyro.set_rng_seed(settings.seed)
    kernel = settings.kernel
    state = {"transitions": 0, "warmup": [], "draws": [], "stage": "Setup", "sent_at": time.monotonic()}

    def send(message):
        results.put((settings.chain, pickle.dumps(message)))

    def report(diagnostics=None):
        batch = [torch.stack(state[k]) if state[k] else torch.empty(0) for k in ("warmup", "draws")]
        send(_ChainReport(state["transitions"], *batch, state["stage"], kernel.logging(), diagnostics))
        state.update(warmup=[], draws=[], sent_at=time.monotonic())

    def hook(kernel, params, stage, i):
        if stop.is_set():
            raise _StopChain()
        state["transitions"] += 1
        state["stage"] = stage
        if stage == "Warmup":  # flattened as Pyro's _gen_samples flattens a draw after the warmup
            save_params = getattr(kernel, "save_params", sorted(params))
            state["warmup"].append(torch.cat([params[name].reshape(-1) for name in save_params]))
        if settings.hook is not None:
            settings.hook(kernel, params, stage, i)
        if time.monotonic() - state["sent_at"] > 1 / REPORTS_PER_SECOND:
            report()  # (a draw after the warmup goes with the next: it is yielded after this)

    try:
        samples = _gen_samples(kernel, settings.warmup_steps, settings.num_samples, hook, None, *args, **kwargs)
        send(next(samples))  # the saved sites' shapes
        for sample in samples:
            if isinstance(sample, dict):  # the kernel's diagnostics, at the end
                report(sample)
            else:
                state["draws"].append(sample)
    except _StopChain:
        report(kernel.diagnostics())
    except KeyboardInterrupt:  # raised by the user's hook (Ctrl-C is ignored here): the run stops, as in one process
        send(KeyboardInterrupt())
        report(kernel.diagnostics())
    except Exception as e:
        print(f"chain {settings.chain} failed in its worker process:", file=sys.stderr)
        traceback.print_exc()
        try:
            send(e)
        except Exception:  # it does not pickle
            send(RuntimeError(f"chain {settings.chain} failed in its worker process: {type(e).__name__}: {e}"))


class _EagerGradient(Exception):
    """Raised by a vectorized run's setup when the model's gradient runs on eager autograd
    and the chain method was the default: the caller runs the chains sequentially instead."""


class _VectorizedRun:
    """One vectorized run: the chains' batched state, their adaptation, and their draws.
    ``sequential_if_eager``: where the model's gradient runs on eager autograd, stop at setup
    with :class:`_EagerGradient` instead of batching chains that would be evaluated one by one."""

    def __init__(self, kernel: HMC, num_chains: int, warmup_steps: int, num_samples: int, leaves_per_call: int,
                 sequential_if_eager: bool = False):
        self.kernel = kernel
        self.sequential_if_eager = sequential_if_eager
        self.C = num_chains
        self.W = warmup_steps
        self.total = warmup_steps + num_samples
        self.T = leaves_per_call
        self.utilisation = None

    # ------------------------------------------------------------------ setup
    def _setup(self, args, kwargs, initial):
        k = self.kernel
        k._reset()
        k._warmup_steps = self.W
        self.T = max(1, self.T // k._steps_per_round())  # rounds per call
        state = k._build_potential(args, kwargs, initial, self.C)
        if k._engine.name == "eager" and self.C > 1:
            if self.sequential_if_eager:
                raise _EagerGradient()
            warn_user(
                "pyro_hmc_plus: this model's gradient runs on eager autograd, so vectorized chains evaluate it "
                "chain after chain at every step of a round, steps of chains whose trajectories have ended "
                "included: chain_method='sequential' runs them faster (4 NUTS chains of a model with `.item()`: "
                "~1.5x)",
                EngineFallbackWarning,
            )
        flat = k._flat
        self.layout, self.D = flat.layout, flat.dim
        k._state = HMCState(*(x[0] for x in state))  # the kernel's single-chain view (validation points)
        self.block_mask = k._mass_structure()
        _warn_of_a_singular_dense_metric(k, self.block_mask)
        self.dense = self.block_mask is not None
        self.metric = k._starting_metric(self.block_mask, batch_shape=(self.C,))
        adapting = (k.adapt_step_size or k.adapt_mass_matrix) and self.W > 0
        self.windows = adaptation.adaptation_schedule(self.W) if adapting else []
        self.metric_updates = adaptation.metric_windows(self.windows) if k.adapt_mass_matrix else []
        given = k._step_sizes_of_run(self.C)
        if k.adapt_step_size:  # as the kernel: searched even without warmup, from each chain's given one
            given = torch.tensor([self._reasonable_step_size(state, c, float(given[c])) for c in range(self.C)],
                                 dtype=torch.float64)
        step = given.to(dtype=flat.dtype, device=flat.device)
        self.chains = k._chains_init(state, self.metric, chain_batch.StepSize.start(step))
        like = torch.ones_like(step)
        self.schedule = chain_batch.Schedule(
            pause_at=torch.tensor([self._next_pause(0)] * self.C, device=flat.device),
            adapt_until=torch.full((self.C,), self.W if k.adapt_step_size else 0, device=flat.device),
            target_accept=like * k.target_accept_prob,
            min_step_size=like * k.min_stepsize,
            max_step_size=like * k.max_stepsize,
        )

    def _next_pause(self, draws: int) -> int:
        """The draw count at which a chain with ``draws`` draws next waits for the host."""
        return min([w.end + 1 for w in self.metric_updates if w.end + 1 > draws] + [self.total])

    def _reasonable_step_size(self, state: HMCState, c: int, step_size: float) -> float:
        """Pyro's initial step-size heuristic for chain ``c`` under its current metric."""
        k = self.kernel
        z, U, g = state.z[c], state.potential_energy[c], state.grad[c]
        inv, scale = self.metric.inverse_mass[c], self.metric.momentum_scale[c]

        def energy_change(eps: float) -> float:
            return one_step_energy_change(k._engine.value_and_grad, HMCState(z, U, g), torch.randn_like(z), eps,
                                          Metric(inv, scale))

        return adaptation.find_reasonable_step_size(energy_change, step_size, k.min_stepsize, k.max_stepsize)

    # ------------------------------------------------------------------ the compiled call
    def _advance_program(self, kind: int):
        """The compiled call of ``T`` rounds, the first of kind ``kind`` (NUTS's
        :data:`pyro_hmc_plus.rounds.ROUND_KINDS`: the previous call said which serves every
        chain), the others of both kinds. Returns the chains, the rounds' draws, done flags and
        steps, and the kind of round that serves every chain next."""
        k, T = self.kernel, self.T

        def advance(value_and_grad, chains, noise, uniforms, metric, schedule):
            draws, dones, steps = [], [], []
            for t in range(T):
                chains, draw, done, used = k._chains_advance(value_and_grad, chains, noise[t], uniforms[t], metric,
                                                             schedule, kind if t == 0 else rounds.MIXED)
                draws.append(draw)
                dones.append(done)
                steps.append(used)
            return (chains, torch.stack(draws), torch.stack(dones), torch.stack(steps),
                    k._chains_next_kind(chains, schedule))

        def validation():
            """The chains' states, two random points near them, and last the states again with
            steps a thousandth as long: a program is recorded at the first of these where every
            chain's model evaluates along its trajectory, and a Gaussian process's Cholesky
            fails somewhere along 4 chains' full-length trajectories more often than not."""
            gen = torch.Generator(device=self.metric.inverse_mass.device).manual_seed(0)
            here, step = self.chains.position, self.chains.step_size
            starts = ([(here, step)] + [(self._near(here, gen), step) for _ in range(2)]
                      + [(here, step._replace(value=step.value * 1e-3))])
            out = []
            for state, step_size in starts:
                chains = k._chains_init(state, self.metric, step_size)
                z = state.z
                noise = torch.randn((T,) + z.shape, generator=gen, dtype=z.dtype, device=z.device)
                uniforms = torch.rand((T, self.C, k._chains_uniforms), generator=gen, dtype=z.dtype, device=z.device)
                out.append((chains, noise, uniforms, self.metric, self.schedule))
            return out

        self._eager_advance[kind] = lambda *xs: advance(self._safe_value_and_grad, *xs)
        return k._program(("chains", self.C, T, kind) + k._chains_settings(), advance, validation)

    def _near(self, here: HMCState, generator: torch.Generator) -> HMCState:
        """A random point within +-2 of each chain's state (``here``), with its energy and
        gradient; the chain's own state where its model fails at that point."""
        z = here.z + torch.empty_like(here.z).uniform_(-2, 2, generator=generator)
        U, g = self._safe_value_and_grad(z)
        ok = torch.isfinite(U)
        return HMCState(torch.where(ok[:, None], z, here.z), torch.where(ok, U, here.potential_energy),
                        torch.where(ok[:, None], g, here.grad))

    def _slots(self, kind: int) -> int:
        """Leapfrog steps per chain of one call of :meth:`_advance_program` ``(kind)``."""
        k = self.kernel
        return k._steps_per_round(kind) + (self.T - 1) * k._steps_per_round(rounds.MIXED)

    def _safe_value_and_grad(self, z: torch.Tensor):
        """``(U, dU/dz)`` chain by chain, from the engine's gradient (the traced one, checked
        against Pyro's, else Pyro's), with ``U = nan`` (a divergence) where the model fails
        numerically: used to redo a call in which one chain's model raised, and at the random
        points of a program's validation inputs."""
        out = []
        for zc in z:
            try:
                out.append(self.kernel._engine.value_and_grad(zc))
            except (RuntimeError, ValueError) as e:
                if not is_numerical_failure(e):
                    raise
                out.append((torch.full_like(zc[0], float("nan")), torch.zeros_like(zc)))
        return torch.stack([u for u, _ in out]), torch.stack([g for _, g in out])

    # ------------------------------------------------------------------ adaptation windows
    def _update_metric(self, c: int, window, rows: torch.Tensor):
        """Chain ``c`` finished the slow window ``window``: its inverse mass matrix becomes the
        regularised covariance of its draws there, and its step size is searched afresh."""
        k = self.kernel
        x = rows[window.start : window.end + 1, : self.D]
        mean = x.mean(0)
        dev = x - mean
        m2 = dev.T @ dev if self.dense else (dev * dev).sum(0)
        cov = adaptation.welford_covariance(adaptation.WelfordState(len(x), mean, m2))
        if self.block_mask is not None:
            cov = cov * self.block_mask
        new = make_metric(cov, self.dense)
        for field, value in zip(self.metric, new):
            field[c] = value
        if k.adapt_step_size:
            eps = self._reasonable_step_size(self.chains.position, c, self.chains.step_size.value[c].item())
            step = self.chains.step_size
            this_chain = torch.arange(self.C, device=step.value.device) == c
            fresh = chain_batch.StepSize.start(torch.full_like(step.value, eps))
            self.chains = self.chains._replace(step_size=select(this_chain, fresh, step))

    # ------------------------------------------------------------------ the run
    def sample(self, args, kwargs, initial, hook, disable_progbar) -> List[torch.Tensor]:
        """Run every chain to its ``warmup_steps + num_samples`` draws (or until interrupted);
        returns each chain's rows ``(draws, D + NUM_STATS)`` (:data:`chain_batch.STAT_COLUMNS`).

        Between calls the chains' state stays the program's flat list of tensors, and each
        call's draws stay in its ``(T, C, D + NUM_STATS)`` block until a chain's rows are
        needed (:class:`_Rows`): per call the host reads only how many draws each chain made.
        A compiled call for a few chains takes ~0.2 ms, as long as rebuilding the records
        and splitting the draws row by row took."""
        bar = _setup_bar(self.C * self.total, disable_progbar)
        try:
            self._setup(args, kwargs, initial)
        except BaseException:
            bar.close()
            raise
        C, T = self.C, self.T
        self._eager_advance = {}
        programs = {}
        kind = rounds.STARTS  # every chain is about to start a transition
        chunk_rounds = 0
        z = self.chains.position.z
        structure, leaves, fixed = self._flat_inputs()
        n = len(leaves)
        rows = _Rows(C, self.W, z.new_zeros(0, self.D + chain_batch.NUM_STATS))
        counts = [0] * C
        pause_at = self.schedule.pause_at.tolist()
        slots, useful = 0, torch.zeros((), dtype=torch.int64)  # steps that did work, summed without host reads
        last_postfix, first_round = 0.0, True
        try:
            while min(counts) < self.total:
                noise = torch.randn((T, C, self.D), dtype=z.dtype, device=z.device)
                uniforms = torch.rand((T, C, self.kernel._chains_uniforms), dtype=z.dtype, device=z.device)
                if kind not in programs:
                    programs[kind] = self._advance_program(kind)
                try:
                    out = programs[kind].flat(*leaves, noise, uniforms, *fixed)
                except (RuntimeError, ValueError) as e:
                    if not is_numerical_failure(e):
                        raise
                    chains = _unflatten(structure, iter(leaves))
                    out = []
                    _flatten(self._eager_advance[kind](chains, noise, uniforms, self.metric, self.schedule), out)
                leaves, (draws, done, steps, next_kind) = out[:n], out[n:]
                emitted = done.sum(0).tolist()
                if hook is not None:
                    self._call_hook(hook, draws, done, counts)
                rows.add(draws, done)
                slots, useful = slots + C * self._slots(kind), useful + steps.sum()
                kind = int(next_kind)
                if kind == rounds.CHUNKS and rounds.CHUNKS not in programs:
                    chunk_rounds += 1  # served by a round of both kinds until its own program pays
                    if chunk_rounds < CHUNK_ROUNDS_BEFORE_PROGRAM:
                        kind = rounds.MIXED
                for c in range(C):
                    counts[c] += emitted[c]
                paused = [c for c in range(C) if counts[c] == pause_at[c] and counts[c] < self.total]
                if paused:  # end of an adaptation window: new metric and step size
                    self.chains = _unflatten(structure, iter(leaves))
                    for c in paused:
                        window = next(w for w in self.metric_updates if w.end + 1 == counts[c])
                        self._update_metric(c, window, rows.of_chain(c))
                        pause_at[c] = self._next_pause(counts[c])
                    self.schedule = self.schedule._replace(pause_at=torch.tensor(pause_at, device=z.device))
                    if kind == rounds.CHUNKS:  # the resumed chains start transitions
                        kind = rounds.MIXED
                    _, leaves, fixed = self._flat_inputs()
                if first_round:  # over, with the building of its program
                    bar.reset()  # rate and time left from here on, not the setup
                    first_round = False
                bar.update(sum(emitted))
                now = time.monotonic()
                if now - last_postfix > 0.5 and not disable_progbar:
                    last_postfix = now
                    self.chains = _unflatten(structure, iter(leaves))
                    self._describe(bar, counts, rows.divergences())
        except KeyboardInterrupt:
            _warn_of_an_interrupt(counts, self.total, self.W, min(max(n - self.W, 0) for n in counts))
        finally:
            self.chains = _unflatten(structure, iter(leaves))
            if not disable_progbar:
                self._describe(bar, counts, rows.divergences())
            bar.close()
            self.utilisation = int(useful) / slots if slots else float("nan")
        return [rows.of_chain(c) for c in range(C)]

    def _flat_inputs(self):
        """``(structure, chain leaves, metric and schedule leaves)``: the program's inputs
        besides the random numbers, as the flat lists its ``flat`` call takes."""
        leaves, fixed = [], []
        structure = _flatten(self.chains, leaves)
        _flatten((self.metric, self.schedule), fixed)
        return structure, leaves, fixed

    def _call_hook(self, hook, draws, done, counts):
        """``hook_fn(kernel, params, stage, i)`` for each draw of a call, in the order made
        (``counts``: each chain's draws before the call)."""
        k, C, D = self.kernel, self.C, self.D
        made = list(counts)
        for row, c in zip(draws[done], done.nonzero()[:, 1].tolist()):
            i = made[c]
            stage = "Warmup" if i < self.W else "Sample"
            hook(k, self.layout.unpack(row[:D]), f"{stage} [{c}]" if C > 1 else stage, i if i < self.W else i - self.W)
            made[c] += 1

    def _describe(self, bar, counts, divergences: int) -> None:
        """The progress bar's phase (until every chain is past warmup), post-warmup
        divergences so far and the range of the chains' step sizes."""
        steps = self.chains.step_size.value
        bar.set_description("Warmup" if min(counts) < self.W else "Sample", refresh=False)
        bar.set_postfix_str(f"divergences={divergences}, step size={steps.min().item():.2e}..{steps.max().item():.2e}")

    def statistics(self, rows: torch.Tensor) -> dict:
        """One chain's per-draw statistics, with the kernel's (Stan's) names, as lists."""
        k, D = self.kernel, self.D
        cols = {name: rows[:, D + i] for i, name in enumerate(chain_batch.STAT_COLUMNS)}
        stats = {
            "lp": (-cols["potential_energy"]).tolist(),
            "energy": cols["energy"].tolist(),
            "acceptance_rate": cols["acceptance_rate"].tolist(),
            "diverging": [bool(x) for x in cols["diverging"].tolist()],
            "step_size": cols["step_size"].tolist(),
            "n_steps": [int(x) for x in cols["n_steps"].tolist()],
        }
        if "tree_depth" in k.stat_names:
            depth = [int(x) for x in cols["tree_depth"].tolist()]
            stats["tree_depth"] = depth
            stats["reached_max_treedepth"] = [d >= k.max_tree_depth for d in depth]
        stats["warmup"] = [i < self.W for i in range(len(rows))]
        return {name: stats[name] for name in k.stat_names + ("warmup",)}


class _Rows:
    """Each chain's rows of draws and statistics ``(D + NUM_STATS)``, from the calls'
    ``draws (T, C, D + NUM_STATS)`` and ``done (T, C)``, split by chain only when asked
    (and every :attr:`FLUSH_EVERY` calls, since a block holds every slot of a call, not
    only its draws). Rows keep the order in which each chain made them."""

    FLUSH_EVERY = 64

    def __init__(self, num_chains: int, warmup_steps: int, no_rows: torch.Tensor):
        self.W = warmup_steps
        self.no_rows = no_rows  # ``(0, D + NUM_STATS)``: a chain's rows before its first draw
        self.diverging_column = no_rows.shape[1] - chain_batch.NUM_STATS + chain_batch.STAT_COLUMNS.index("diverging")
        self.chunks = [[] for _ in range(num_chains)]
        self.made = [0] * num_chains  # rows in each chain's chunks
        self.post_warmup_divergences = 0
        self.pending = []

    def add(self, draws: torch.Tensor, done: torch.Tensor) -> None:
        self.pending.append((draws, done))
        if len(self.pending) >= self.FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        draws = torch.cat([d for d, _ in self.pending])
        done = torch.cat([m for _, m in self.pending])
        emitted = draws[done]  # call by call, step by step, chain by chain
        by_chain = torch.sort(done.nonzero()[:, 1], stable=True).indices
        for c, chunk in enumerate(emitted[by_chain].split(done.sum(0).tolist())):
            if len(chunk):
                self.post_warmup_divergences += int(chunk[max(self.W - self.made[c], 0) :, self.diverging_column].sum())
                self.chunks[c].append(chunk)
                self.made[c] += len(chunk)
        self.pending = []

    def divergences(self) -> int:
        """Divergent post-warmup draws so far, all chains."""
        self._flush()
        return self.post_warmup_divergences

    def of_chain(self, c: int) -> torch.Tensor:
        """Chain ``c``'s rows so far, ``(draws, D + NUM_STATS)``."""
        self._flush()
        if len(self.chunks[c]) != 1:
            self.chunks[c] = [torch.cat(self.chunks[c]) if self.chunks[c] else self.no_rows]
        return self.chunks[c][0]

