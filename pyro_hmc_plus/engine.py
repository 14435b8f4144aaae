"""The gradient engine: turns the flat potential's gradient, and the sampler's functions
around it, into programs built once and reused for every step.

Engines (``engine=`` on the kernels):

``"trace"``
    Record ``(U, dU/dz)`` once into a folded graph of aten ops (refusing
    latent-dependent Python values, see :mod:`pyro_hmc_plus.tracing`), then record each of
    the sampler's functions around it (a block of leapfrog steps, a whole transition, a NUTS
    doubling) with the gradient inlined, as one ``torch.jit.trace`` program, run on the
    CPU by Static Runtime (:func:`pyro_hmc_plus._compile.static_runtime`). Ready in a
    fraction of a second. A gradient of more than :data:`MAX_INLINED_GRADIENT_OPS`
    operations (a loop of many sites whose steps the tracer could not vectorize) is not
    inlined: it is one program of its own, which the sampler's programs call as one
    operation.
``"aot"``
    The same graph compiled ahead of time to C++ by AOTInductor and kept in an on-disk
    cache (``$PYRO_HMC_PLUS_CACHE``, default ``~/.cache/pyro_hmc_plus``): the first run
    compiles (about 30 s for the first program in a process, 10-30 s for each further one,
    on a small CPU), every later run of the same model and data loads the programs in
    milliseconds; a NUTS doubling then runs ~10x faster than with ``"trace"``.
``"inductor"``
    The same graph compiled to C++ by TorchInductor in memory (:mod:`pyro_hmc_plus._compile`),
    every process anew.
``"eager"``
    Pyro's potential and ``torch.autograd.grad`` at every step: always correct, slow. The
    sampler's programs around it are recorded all the same, calling it as one operation.
``"auto"`` (default)
    ``"trace"``, but a program already in the ``"aot"`` cache is loaded from it; falls back
    to ``"eager"``.

Checks, each against its exact reference and at its own scale: the traced gradient graph
against Pyro's eager potential and autograd at the initial point and two random points;
every program against the same sampler function run step by step on that graph, at the
caller's validation inputs (the current point and fresh random points). (Checking a whole
program against Pyro's potential instead would compare energy *differences* such as
``H0 - H``, whose float32 rounding grows with ``|U|``, not with the difference.) If tracing
is refused, fails, or a check fails, the engine warns once, saying why, and uses the eager
path. Pyro's gradient itself is checked against central differences of ``U`` at two of those
points (:attr:`GradientEngine.gradient_mismatch`): a model can cut its own gradient, which
no engine can repair. Past these checks Pyro's potential does not run again where the traced
gradient agreed with it: every later ``U`` and gradient (the differences', the chains' first
states, the programs' validation inputs) is the traced one.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import Callable, Sequence

import pyro
import torch

from . import _compile, tracing
from ._warn import warn_user
from .potential import FlatPotential, gradient_mismatch

ENGINES = ("auto", "trace", "aot", "inductor", "eager")


class EngineFallbackWarning(UserWarning):
    """The requested engine could not be used for this model; a slower, safe one is used."""


# A gradient of more operations than this is not inlined into the sampler's programs (a
# NUTS doubling or chunk, an HMC transition of up to 16 leapfrog steps, a round of many
# chains): the programs call it as one operation (``_OPAQUE_GRADIENT``), ~4 µs a call more
# than inlined, and recording and checking a program no longer costs ~0.1 ms per operation
# of up to 16 gradients. Measured, called against inlined, on ragged groups with a plate
# each, 500 + 500 draws: NUTS, one chain, faster at 106 and 148 operations (1.63-1.73 vs
# 1.84-1.90 s, 1.85-1.92 vs 2.06-2.16 s), and on the AR(1) loop's 119 (2.08-2.10 vs
# 2.30-2.31 s), as fast on eight schools' 40 and the hierarchical model's 67 (0.97-1.01 vs
# 1.00-1.03 s, 1.79-1.86 vs 1.85-1.89 s); 4 vectorized NUTS chains as fast or faster at 106,
# 148 and 229 (4.37-4.40 vs 4.41-4.54 s, 4.22-4.26 vs 4.32-4.38 s, 3.84-4.11 vs 4.20-4.40 s);
# HMC with 10 steps as fast at 106, 229 and 349 (4.74-4.82 vs 4.85-4.93 s, 3.35-3.38 vs
# 3.38-3.42 s, 7.12-7.15 vs 7.00-7.21 s). (Before the gradient was one operation of the
# programs, the sampler's functions ran in Python around it, and the thresholds were 300
# operations, 500 for the rounds of many chains.)
MAX_INLINED_GRADIENT_OPS = 100
_PROGRAM_MISMATCH = "the recorded program disagrees with the same function run step by step on the traced gradient"


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float16, torch.bfloat16) else 1e-8


def _max_rel_error(actual, expected) -> float:
    """Largest ``max|a - b| / max|b|`` over matching tensors of two (nested) outputs."""
    worst = 0.0
    for a, b in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
        if not torch.is_tensor(b) or not b.is_floating_point():
            if torch.is_tensor(b) and not torch.equal(a, b):
                return float("inf")
            continue
        finite = torch.isfinite(b)
        if not torch.equal(finite, torch.isfinite(a)):
            return float("inf")
        if not finite.any():
            continue
        scale = b[finite].abs().max().clamp(min=1.0).item()
        worst = max(worst, ((a[finite] - b[finite]).abs().max() / scale).item())
    return worst


def is_numerical_failure(e: Exception) -> bool:
    """A linear-algebra failure inside the potential (e.g. Cholesky of a non-PD matrix):
    the trajectory left the region where the model is defined, which is a divergence."""
    try:
        from pyro.ops.integrator import _EXCEPTION_HANDLERS

        if any(handler(e) for handler in _EXCEPTION_HANDLERS.values()):
            return True
    except ImportError:  # pragma: no cover - older/newer Pyro without the registry
        pass
    return isinstance(e, torch.linalg.LinAlgError)


def with_autograd(fn: Callable) -> Callable:
    """``fn`` run with autograd on and its anomaly detection off, whatever mode its caller is
    in: sampling needs the potential's gradient, and a ``torch.no_grad()`` or
    ``torch.inference_mode()`` block around ``mcmc.run`` (written to save memory, as around a
    prediction) would otherwise stop it inside Pyro with autograd's "element 0 of tensors does
    not require grad". Anomaly detection (``torch.autograd.set_detect_anomaly(True)``, turned
    on to find where a NaN comes from) checks every gradient for NaNs: the trace would refuse
    that check as reading latent values, and it stops eager autograd at the first NaN
    gradient, which a sampler meets by design at the far end of a divergent trajectory and
    discards. The checks cost ~0.2 us a call (once a draw) in the usual modes, entering the
    modes ~3 us."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled() and not torch.is_anomaly_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode(False), torch.enable_grad(), torch.autograd.set_detect_anomaly(False):
            return fn(*args, **kwargs)

    return run


# The gradient of a program that does not inline it (the model's potential runs on eager
# autograd, or its graph is too large to inline) is one operation of the recorded program:
# ``pyro_hmc_plus::value_and_grad(z, engine)`` calls back into Python, into
# ``GradientEngine._gradient_behind_programs`` of the engine registered under that number.
# The sampler's bookkeeping around it (hundreds of small operations a NUTS doubling) then runs
# on Static Runtime instead of op by op in Python.
_ENGINES_BY_KEY = weakref.WeakValueDictionary()
_ENGINE_KEYS = itertools.count()
_OPAQUE_GRADIENT = torch.library.Library("pyro_hmc_plus", "DEF")
_OPAQUE_GRADIENT.define("value_and_grad(Tensor z, int engine) -> (Tensor, Tensor)")


def _opaque_value_and_grad(z: torch.Tensor, engine: int):
    return _ENGINES_BY_KEY[engine]._gradient_behind_programs(z)


_OPAQUE_GRADIENT.impl("value_and_grad", _opaque_value_and_grad, "CompositeExplicitAutograd")


class GradientEngine:
    """Builds the sampler's programs for one flat potential.

    ``program(fn, example_inputs, validation_inputs)`` returns a callable equivalent to
    ``lambda *xs: fn(self.value_and_grad, *xs)``, where ``fn`` is a pure function of tensors
    from the functional core that calls ``value_and_grad(z)`` for ``z`` of shape ``(..., D)``.
    """

    @staticmethod
    def check_name(engine: str) -> None:
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")

    def __init__(self, flat: FlatPotential, engine: str = "auto"):
        self.check_name(engine)
        self.flat = flat
        self.requested = engine
        self.name = engine if engine in ("eager", "inductor", "aot") else "trace"
        self.use_aot_cache = engine in ("auto", "aot")
        self.cached_programs = 0  # programs loaded from the on-disk cache
        self.rejected_compiled_programs = 0  # compiled programs that failed validation
        self._gradient_key = None
        self.fallback_reason = None
        self._said_not_compiled = False
        self._said_no_torchscript = False
        self._graph = None
        self._batched_graphs = {}  # batch size -> graph (or None: not vmappable)
        self._gradient_programs = {}  # shape of z -> traced program of value_and_grad
        self._gradient_functions = {}  # shape of z -> TorchScript function of value_and_grad
        self._check_point_values = None  # see _at_check_points
        self._key = next(_ENGINE_KEYS)  # see _around_opaque_gradient
        _ENGINES_BY_KEY[self._key] = self
        if self.name != "eager":
            try:
                with pyro.validation_enabled(False):
                    self._graph = tracing.trace(flat.value_and_grad, (flat.initial_z.clone(),))
            except tracing.UntraceableModel as e:
                self._fall_back(f"{e}", e.eager_is_correct)
        if self._graph is not None:
            problem = self._check(self._graph, self._at_check_points(),
                                  "the traced potential disagrees with Pyro's eager potential")
            if problem is not None:
                self._fall_back(problem)

    def agrees_with(self, flat: FlatPotential) -> bool:
        """Whether this engine's traced gradient still equals ``flat``'s (Pyro's potential of the
        same model and arguments, built again) at ``flat``'s initial point. The trace bakes in
        every tensor the model reads as a constant, the arguments as well as data the model
        finds elsewhere (a global, a closure); the kernels reuse an engine while the arguments
        are the same (tensors: the same memory, unchanged), so this catches the rest: a global replaced or written
        between runs. One traced and one eager gradient: cheap beside a run."""
        if self._graph is None:  # the eager path runs the model itself: nothing baked in
            return True
        with pyro.validation_enabled(False):
            return self._check(self._graph, self._reference_cases(flat.value_and_grad, [(flat.initial_z,)]), "") is None

    def _at_check_points(self):
        """``[((z,), (U, dU/dz))]``: Pyro's eager potential and gradient at each of the check
        points where the model evaluates, computed once (one eager gradient of a model with
        a 500-step loop takes ~0.3 s)."""
        if self._check_point_values is None:
            points = [(z,) for z in self.flat.probe_points()]
            self._check_point_values = list(self._reference_cases(self.eager_value_and_grad, points))
        return self._check_point_values

    @functools.cached_property
    def gradient_mismatch(self):
        """:func:`pyro_hmc_plus.potential.gradient_mismatch` of Pyro's eager gradient at the
        last check point where the model evaluates (a random one, unless the model fails at
        both), confirmed at one more: ``(slope, gradient_slope)`` at the last point where the
        model cuts its own gradient, else ``None`` (also where the model fails at every check
        point). A cut shows at any point; at one point alone, float32 can flatten ``U``'s
        values where its gradient is right: a term that saturates there (an
        ``OrderedLogistic`` whose top class has a probability below float32's resolution
        at every observation) is constant in ``U`` within the differences' steps. The other
        points are looked at only where the last one disagrees (four evaluations of ``U``
        each). ``U`` is the traced graph's where there is one: the same function as Pyro's
        potential, checked at these points, without a run of the model (~0.3 s each for a
        loop of 1,000 sample sites)."""
        points = self._at_check_points()[::-1]
        if not points:
            return None
        potential = self.flat.potential if self._graph is None else (lambda z: self._graph(z)[0])
        (z,), (_, g) = points[0]
        found = gradient_mismatch(potential, z, g)
        if found is None or len(points) == 1:
            return found
        confirmed = any(gradient_mismatch(potential, z, g) is not None for (z,), (_, g) in points[1:])
        return found if confirmed else None

    @property
    def check_points(self):
        """The points, ``(D,)`` each, where the traced gradient is checked (the initial point
        and two random points near it) and the model evaluates: the kernels check the model
        itself there too."""
        return [z for (z,), _ in self._at_check_points()]

    @property
    def check_gradients(self):
        """Pyro's eager gradient, ``(D,)``, at each of the points where the traced one is
        checked (the initial point and two random points near it) where the model
        evaluates: the kernels look there for coordinates that U does not depend on."""
        return [g for _, (_, g) in self._at_check_points()]

    # ------------------------------------------------------------------ gradient
    def value_and_grad(self, z: torch.Tensor):
        """``(U, dU/dz)`` for ``z`` of shape ``(D,)`` or ``(..., D)``: the traced graph when
        there is one (this is what gets inlined into programs), else eager autograd."""
        if self._graph is None:
            return self.eager_value_and_grad(z)
        if z.dim() == 1:
            return self._graph(z)
        flat = z.dim() == 2  # (chains, D): no reshapes (each is an operation in a program)
        flat_z = z if flat else z.reshape(-1, z.shape[-1])
        # the batch size as a number: in a recording a size is a tensor (a new key at every call)
        batched = self._batched_graph(_compile.static_shape(flat_z)[0])
        if batched is not None:
            U, g = batched(flat_z)
        else:
            pairs = [self._graph(zi) for zi in flat_z.unbind(0)]
            U, g = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        return (U, g) if flat else (U.reshape(z.shape[:-1]), g.reshape(z.shape))

    @property
    def gradient_elements(self):
        """How many tensor elements one gradient touches (:func:`tracing.elements_touched`),
        a measure of its arithmetic; ``None`` on the eager path, where Pyro's potential and
        autograd cost far more than any program's operations."""
        return None if self._graph is None else self._graph.meta.get("elements_touched")

    def _batched_graph(self, n: int):
        """The gradient graph for ``n`` points at once, ``(n, D) -> ((n,), (n, D))``: traced once
        per ``n`` from ``vmap`` of the single-point graph (also in the middle of recording a
        program, be it a TorchScript recording or a compiler's fake-tensor trace),
        functionalized first: its in-place ops (the ``scatter_`` in the gradients of simplex
        and ``LKJCholesky`` sites) have no batching rules, their out-of-place forms do; and
        the ops that ``vmap`` would still run through Python decompositions written out
        (:func:`tracing.for_vmap`: their first call imports ``torch._dynamo``, ~1.1 s).
        ``None`` if vmap fails, in which case the points go through the single-point graph
        one by one. Recorded at copies of the initial point (where the model is known to
        evaluate), whatever the engine, so every engine inlines the same graph."""
        if n not in self._batched_graphs:
            try:
                with _compile.outside_traces():
                    example = self.flat.initial_z.expand(n, -1).clone()
                    batched = torch.func.vmap(torch.func.functionalize(tracing.for_vmap(self._graph, example[0])))
                    graph = tracing.trace(batched, (example,), check_escapes=False)
            except (tracing.UntraceableModel, NotImplementedError):
                graph = None
            self._batched_graphs[n] = graph
        return self._batched_graphs[n]

    @with_autograd  # also inside a program: Static Runtime runs its programs in inference mode
    def eager_value_and_grad(self, z: torch.Tensor):
        with pyro.validation_enabled(False):
            if z.dim() == 1:
                return self.flat.value_and_grad(z)
            return self.flat.batched_value_and_grad(z)

    # ------------------------------------------------------------------ programs
    def program(
        self,
        fn: Callable,
        example_inputs: Sequence[torch.Tensor],
        validation_inputs: Sequence[Sequence[torch.Tensor]] = (),
        cache_key: tuple = None,
    ) -> Callable:
        """A compiled (or eager) program computing ``fn(value_and_grad, *inputs)``.

        The gradient graph is inlined into the program wherever ``fn`` calls
        ``value_and_grad``, unless it has more than :data:`MAX_INLINED_GRADIENT_OPS`
        operations: then the program calls one traced program of the gradient as one
        operation (:meth:`_around_opaque_gradient`).

        ``cache_key`` (hashable, its ``repr`` stable across processes) names ``fn`` among
        the sampler's functions, with every setting it depends on; with it, a program found
        in the on-disk AOT cache is loaded without tracing ``fn`` again. The cache entry is
        also keyed by the gradient graph (so by the model and data), the inputs' shapes and
        dtypes, and the source of this package.
        """

        reference = self._reference(fn)
        # distinct copies (a tracer would merge two inputs that are the same tensor object),
        # contiguous (what compiled programs are called with: _compile._on_contiguous_inputs)
        examples = tuple(x.clone(memory_format=torch.contiguous_format) for x in example_inputs)
        if self.name == "eager":
            return self._around_opaque_gradient(fn, examples)
        key = self._aot_key(cache_key, examples) if self.use_aot_cache and cache_key is not None else None
        cached = self._load_cached(key) if key is not None else None
        if cached is not None:
            if self._check(cached, self._reference_cases(reference, validation_inputs), _PROGRAM_MISMATCH) is None:
                return cached
            self.rejected_compiled_programs += 1
        if self.name in ("aot", "inductor"):
            compiled = self._compiled_program(fn, examples, key, reference, validation_inputs, skip_aot=cached is not None)
            if compiled is not None:
                return compiled
        if self.gradient_ops > MAX_INLINED_GRADIENT_OPS:
            return self._around_opaque_gradient(fn, examples)
        return self._traced_program(fn, examples, validation_inputs)

    @property
    def gradient_ops(self):
        """How many operations one gradient runs (the graph's calls); ``None`` on the eager path."""
        if self._graph is None:
            return None
        return tracing.operations(self._graph.graph)

    def _value_and_grad_program(self, z: torch.Tensor):
        """``value_and_grad(z)`` run as a traced program, one per shape of ``z``, recorded at
        (and checked at) the gradient's check points (:meth:`FlatPotential.probe_points`), where the
        model is known to evaluate."""
        shape = tuple(z.shape)
        program = self._gradient_programs.get(shape)
        if program is None:
            points = [(point.expand(shape).clone(),) for point in self.flat.probe_points()]
            program = self._traced_program(lambda value_and_grad, x: value_and_grad(x), points[0], points)
            self._gradient_programs[shape] = program
        return program(z)

    def _gradient_behind_programs(self, z: torch.Tensor):
        """``value_and_grad(z)`` where programs do not inline it: eager autograd, or the
        traced gradient as one program of its own."""
        return self.eager_value_and_grad(z) if self._graph is None else self._value_and_grad_program(z)

    def _around_opaque_gradient(self, fn, examples):
        """``fn`` recorded around ``value_and_grad`` as one opaque operation (see
        ``_OPAQUE_GRADIENT``) and run by Static Runtime: the gradient costs what it costs on
        its own (eager autograd, or a large graph's program), and the sampler's bookkeeping
        around it ~1 µs an operation instead of a Python call each (a NUTS transition of a
        small model on eager autograd: ~0.3 ms less).

        Checked at ``examples`` only: the bookkeeping is the functional core, recorded and
        checked with inlined gradients everywhere else, and every check here costs the
        program's gradients twice. ``fn`` runs in Python around the gradient instead where
        Static Runtime is missing (not on the CPU): the TorchScript interpreter would turn a
        ``KeyboardInterrupt`` inside the model into a ``RuntimeError``, and the run would lose
        its draws."""
        in_python = lambda *xs: fn(self._gradient_behind_programs, *xs)  # noqa: E731
        key = self._key
        opaque = lambda z: torch.ops.pyro_hmc_plus.value_and_grad(z, key)  # noqa: E731
        try:
            expected = in_python(*examples)  # first: builds the large graph's program outside the recording
            traced = tracing.to_torchscript(lambda *xs: fn(opaque, *xs), examples)
        except (tracing.UntraceableModel, tracing.TorchScriptDisabled):
            return in_python
        except (RuntimeError, ValueError) as e:
            if not is_numerical_failure(e):
                raise
            return in_python  # the model fails at the example: nothing to record the program at
        program = _compile.static_runtime(traced, examples)
        if program is None or self._check(program, [(examples, expected)], _PROGRAM_MISMATCH) is not None:
            return in_python
        return program

    def _gradient_function(self, z: torch.Tensor):
        """``value_and_grad(z)`` for a program being recorded: a TorchScript function, one per
        shape of ``z``, recorded once at the initial point, which the program's recording
        calls as one node (:func:`tracing.to_torchscript` inlines it). Running the gradient
        graph op by op under the recorder costs ~25 µs an operation at every call, and a
        sampler's programs call it dozens of times: half of their recording time (an ordinal
        regression's gradient of 119 operations: 0.85 -> 0.41 s)."""
        shape = tuple(_compile.static_shape(z))
        function = self._gradient_functions.get(shape)
        if function is None:
            with _compile.outside_traces():
                function = tracing.to_torchscript(self.value_and_grad, (self.flat.initial_z.expand(shape).clone(),))
            self._gradient_functions[shape] = function
        return function(z)

    def _traced_program(self, fn, examples, validation_inputs):
        """``fn`` recorded by ``torch.jit.trace`` (inlining the gradient graph wherever ``fn``
        calls ``value_and_grad``), run by Static Runtime, else by TorchScript, whichever first
        agrees with :meth:`_reference` at ``validation_inputs``. If none does (or the model
        cannot be traced), the engine falls back to eager autograd, and ``fn`` is recorded
        around it as every later program is (:meth:`_around_opaque_gradient`)."""
        candidates = [examples] + [tuple(x.clone() for x in xs) for xs in validation_inputs[1:]]
        try:
            traced = self._first_that_runs(
                lambda inputs: tracing.to_torchscript(lambda *xs: fn(self._gradient_function, *xs), inputs), candidates
            )
        except tracing.UntraceableModel as e:
            self._fall_back(f"{e}")
            return self._around_opaque_gradient(fn, examples)
        except tracing.TorchScriptDisabled as e:
            return self._without_torchscript(fn, e)
        if traced is None:  # the model fails numerically at every example: run it eagerly
            warn_user(
                "pyro_hmc_plus: the model failed numerically (e.g. a Cholesky factorisation) at every point "
                "where a sampler program was to be recorded; that program runs on eager autograd "
                "(correct, several times slower)",
                EngineFallbackWarning,
            )
            return lambda *xs: fn(self.eager_value_and_grad, *xs)
        problem = None
        for program in (_compile.static_runtime(traced, examples), traced):  # the faster executor first
            if program is not None:
                problem = self._check(program, self._reference_cases(self._reference(fn), validation_inputs),
                                      _PROGRAM_MISMATCH)
                if problem is None:
                    return program
        self._fall_back(problem)
        return self._around_opaque_gradient(fn, examples)

    def _without_torchscript(self, fn, reason: Exception):
        """``fn`` run in Python on the traced gradient graph (:meth:`_reference`), where torch
        records no TorchScript: correct, and still free of Pyro's and autograd's per-gradient
        work, but each of the program's operations costs a Python call. Said once."""
        if not self._said_no_torchscript:
            self._said_no_torchscript = True
            warn_user(
                f"pyro_hmc_plus: {reason}, so the sampler's programs run in Python around the traced gradient "
                "graph (correct, slower than with TorchScript); unset PYTORCH_JIT for the fast path",
                EngineFallbackWarning,
            )
        return self._reference(fn)

    def _reference(self, fn):
        """What a program must agree with: ``fn`` run op by op on the gradient graph."""
        return lambda *xs: fn(self.value_and_grad, *xs)

    def _compiled_program(self, fn, examples, key, reference, validation_inputs, skip_aot: bool):
        """``fn`` traced into an FX graph and compiled to C++ (``"aot"``: into the on-disk
        cache, unless ``skip_aot`` because the cached one was just rejected; ``"inductor"``: in
        memory), if that works and passes validation; else ``None`` (use the traced program).

        C++ compilation reorders floating-point sums; where the sampler's energies cancel
        (large U, float32) that can exceed the tolerance although the graph is right. The
        traced program runs Pyro's operations in Pyro's order: it is used instead."""
        if self.name == "aot" and (skip_aot or key is None):
            return None  # nothing to compile into: skip the (seconds-long) fake-tensor trace
        try:
            # the gradient graph was checked for latent escapes when it was traced; the
            # core's functions around it are branch-free tensor code
            gm = tracing.trace(lambda *xs: fn(self.value_and_grad, *xs), examples, check_escapes=False, fake=True)
        except tracing.UntraceableModel as e:
            self._not_compiled(e)
            return None  # the traced program (which does not need make_fx) may still work
        if self.name == "aot":
            compiled = self._compile_into_cache(gm, examples, key)
        else:
            candidates = [examples] + list(validation_inputs[1:])
            compiled = self._first_that_runs(lambda inputs: self._inductor(gm, inputs), candidates)
        if compiled is None:
            return None
        if self._check(compiled, self._reference_cases(reference, validation_inputs), _PROGRAM_MISMATCH) is None:
            return compiled
        self.rejected_compiled_programs += 1
        return None

    @staticmethod
    def _reference_cases(reference_fn, validation_inputs):
        """``(inputs, reference_fn(*inputs))`` for each of ``validation_inputs`` where the
        reference evaluates: where the model itself fails there is nothing to compare."""
        for inputs in validation_inputs:
            try:
                expected = reference_fn(*inputs)
            except RuntimeError:
                continue
            yield inputs, expected

    def _check(self, actual_fn, cases, mismatch: str):
        """``None`` if ``actual_fn(*inputs)`` agrees with ``expected`` for every ``(inputs,
        expected)`` of ``cases`` (:meth:`_reference_cases`), else what is wrong
        (``mismatch`` says what disagrees with what)."""
        for inputs, expected in cases:
            try:
                actual = actual_fn(*inputs)
            except RuntimeError as e:
                return f"the traced or compiled program failed where the reference did not: {e}"
            err = _max_rel_error(actual, expected)
            if not err <= _tolerance(self.flat.dtype):
                return f"{mismatch} (relative error {err:.2e}) at a validation point"
        return None

    def _aot_key(self, cache_key, examples) -> str:
        if self._gradient_key is None:
            self._gradient_key = _compile.graph_key(self._graph, (self.flat.initial_z,))
        return _compile.digest(repr(cache_key), self._gradient_key, _compile.source_digest(),
                               *(f"{x.dtype}{tuple(x.shape)}{x.device.type}" for x in examples))

    def _load_cached(self, key):
        try:
            compiled = _compile.aot_load(key)
        except Exception:  # an unreadable cache entry: compile (or trace) again
            return None
        if compiled is not None:
            self.cached_programs += 1
        return compiled

    def _compile_into_cache(self, gm, examples, key):
        try:
            return _compile.aot_compile(gm, examples, key)
        except Exception as e:  # AOTInductor has many failure types; the trace still works
            self._compiler_failed("AOTInductor", e)
            return None

    @staticmethod
    def _first_that_runs(build, candidates):
        """``build(inputs)`` for the first of ``candidates`` (argument tuples) at which it
        succeeds: tracing runs the program once, and it may fail numerically at one example
        (e.g. a Cholesky beyond its support) but not at another. The traced gradient does not
        raise there (its error checks are not recorded: it gives NaN, a divergence); the
        function around it, or a compiler's run, may. The result does not depend on which
        example was used (the program has no control flow). ``None`` if it fails numerically
        at every candidate."""
        for inputs in candidates:
            try:
                return build(inputs)
            except (RuntimeError, ValueError) as e:
                if isinstance(e, tracing.UntraceableModel) or not is_numerical_failure(e):
                    raise
        return None

    def _inductor(self, gm, example_inputs):
        try:
            return _compile.inductor(gm, example_inputs)
        except Exception as e:  # inductor has many failure types; the traced program still works
            if is_numerical_failure(e):
                raise
            self._compiler_failed("TorchInductor", e)
            return None

    def _not_compiled(self, error: Exception):
        """The compilers' fake-tensor trace failed on a program, which then runs traced:
        say so once (the user asked for compiled programs; such a failure once went unseen
        for a whole feature)."""
        if not self._said_not_compiled:
            self._said_not_compiled = True
            warn_user(
                f"engine={self.name!r}: a sampler program could not be traced for the C++ compiler "
                f"({error}); it runs as a traced program instead (correct, slower)",
                EngineFallbackWarning,
            )

    def _compiler_failed(self, compiler: str, error: Exception):
        """A C++ compiler failed on a program: warn, and trace from now on."""
        warn_user(
            f"{compiler} could not compile the program ({type(error).__name__}: {error}); "
            "using the traced graph instead",
            EngineFallbackWarning,
        )
        self.name = "trace"

    def _fall_back(self, reason: str, eager_is_correct: bool = True):
        self._graph = None  # first: a graph that disagrees with Pyro's potential judges nothing
        if self.name != "eager":
            if eager_is_correct and self.gradient_mismatch is not None:
                advice = ("Falling back to eager autograd, which runs the potential as it is, but whose gradient "
                          "misses part of it (see the SamplingWarning that follows).")
            elif eager_is_correct:
                advice = ("Falling back to eager autograd (correct but slow). To silence this, pass "
                          "engine='eager'; to get the fast path, make the potential branch-free in the "
                          "latent variables (e.g. torch.where instead of `if`, no .item()).")
            else:
                advice = ("Falling back to eager autograd, which runs the potential as it is: the draws "
                          "follow the posterior only if those random numbers leave its value unchanged.")
            warn_user(
                f"pyro_hmc_plus: cannot use the {self.name!r} engine for this {self.flat.source}: {reason}. {advice}",
                EngineFallbackWarning,
            )
        self.name = "eager"
        self.fallback_reason = reason
