"""Tracing a function of flat tensors into a pure FX graph, safely.

:func:`trace` records every aten operation a function performs on example inputs (the
backward of ``torch.autograd.grad`` included); the resulting FX graph can be re-run (or
compiled) at new inputs without Python or Pyro in the way. The
danger is a trace that silently freezes a value which depends on the inputs: a Python
``if`` on a latent, ``.item()``, ``.tolist()``. Pyro's own ``jit_compile=True`` bakes such
values in without a word. We refuse them instead: the recorder marks the inputs and every
tensor computed from them, and raises :class:`UntraceableModel` when a marked tensor is
turned into a Python value, in the model's Python code (:class:`LatentTaint`) or inside a
torch operation, or decides how many elements a result has (``x[x > 0]``). Branches on
data alone (not derived from the inputs) are allowed and traced as constants.

After tracing, :func:`fold_constants` evaluates once everything that depends only on
constants (a Cholesky of a fixed precision matrix, masks, ``eye``), which can halve the
cost of small models, and removes aliasing no-ops.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import heapq
import math
import operator
import sys
import warnings
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only
from torch.utils._python_dispatch import TorchDispatchMode


class UntraceableModel(RuntimeError):
    """The function cannot be traced into a graph that is valid at other inputs.
    ``eager_is_correct=False`` where the function itself is at fault (it draws random
    numbers), so that eager autograd is no remedy either."""

    def __init__(self, message: str, eager_is_correct: bool = True):
        super().__init__(message)
        self.eager_is_correct = eager_is_correct


_ESCAPES = {
    "__bool__": "a Python `if`/`while` (or `bool()`) on",
    "item": "`.item()` of",
    "tolist": "`.tolist()` of",
    "numpy": "`.numpy()` of",
    "__float__": "`float()` of",
    "__int__": "`int()` of",
    "__index__": "indexing or `range` with",
    "__array__": "a NumPy conversion of",
}


# Why a potential that draws random numbers cannot be traced, and what to do.
_RANDOM_POTENTIAL = ("so its value changes from call to call, and HMC needs the same value at the same point: "
                     "generate data outside the model, and put modules with dropout in eval mode")


class LatentTaint(TorchFunctionMode):
    """Refuses to let a tensor computed from the traced inputs, or from a random draw, become
    a Python value in the model's Python code (an ``if``, ``.item()``, ``.numpy()``), naming
    the call. Which tensors are so computed, the recorder underneath follows through the aten
    ops (:meth:`_AtenRecorder.computed_from_inputs`, :meth:`_AtenRecorder.random_draw_behind`).
    A random draw that stays a tensor is refused only where it reaches the traced function's
    outputs (:func:`_erase_unused_random_draws`)."""

    def __init__(self, recorder: "_AtenRecorder"):
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _ESCAPES:
            tensors = tree_flatten((args, kwargs))[0]
            if self._recorder.computed_from_inputs(tensors):
                raise UntraceableModel(
                    f"the potential uses {_ESCAPES[name]} a value computed from the latent "
                    "variables, so one trace cannot stand for every point"
                )
            draw = self._recorder.random_draw_behind(tensors)
            if draw is not None:  # a branch or a number that the next call may draw otherwise
                raise UntraceableModel(f"the potential uses {_ESCAPES[name]} random numbers it draws ({draw}), "
                                       + _RANDOM_POTENTIAL, eager_is_correct=False)
        if name == "__setitem__" and len(args) == 3 and _is_masked_write(*args) \
                and self._recorder.computed_from_inputs([args[1]]):
            # x[mask] = v with a mask of x's shape, computed from the latents: torch reads a
            # 0-dim mask with item() and counts a larger one's elements; as `where`, the same
            # values with no number (Pyro's safe_normalize, under ProjectedNormalReparam)
            target, mask, value = args
            return target.copy_(torch.where(mask, torch.as_tensor(value, dtype=target.dtype), target))
        return func(*args, **kwargs)


def _is_masked_write(target, index, value) -> bool:
    """Whether ``target[index] = value`` writes a number (or a 0-d tensor) where ``index``, a
    boolean tensor of ``target``'s shape, is true."""
    return (torch.is_tensor(target) and torch.is_tensor(index) and index.dtype == torch.bool
            and index.shape == target.shape
            and (isinstance(value, (int, float)) or (torch.is_tensor(value) and value.dim() == 0)))


class _AtenRecorder(TorchDispatchMode):
    """Writes every aten operation run under it, on real tensors, into an FX graph: the
    operations ``make_fx`` would record (the backward of ``torch.autograd.grad`` included),
    without ``make_fx``'s machinery, whose first use imports ``torch._dynamo`` (~1.5 s of
    every fresh process, a third of a short NUTS run). Tensors are known by identity (all
    kept alive while recording); one that no recorded operation produced and that is not
    an input (the model's data, parameters) becomes a constant of the graph. Each node's
    ``meta["val"]`` is the tensor it computed, for the simplification passes.

    One op is recorded with an operand made explicit: ``vmap`` calls
    ``log_sigmoid_backward`` (the stick-breaking transform's gradient, under every simplex
    site) with the incoming gradient unbatched, and its CPU kernel then resizes its output
    to the batch with a C++ warning, thousands of lines on every many-chain run. The
    gradient is expanded to the input's shape first: the same values, no warning.

    With ``check_escapes``, it follows which tensors are computed from the inputs, for
    :class:`LatentTaint` above it, and itself refuses what happens inside one torch operation,
    which that mode cannot see (:meth:`_refuse_escapes`)."""

    def __init__(self, graph: torch.fx.Graph, root: torch.nn.Module, check_escapes: bool = False):
        super().__init__()
        self.graph, self.root = graph, root
        # ids of the inputs and of every tensor computed from them, when escapes are checked
        self._from_inputs = set() if check_escapes else None
        # id of every tensor computed from a random draw -> the draw's op, when escapes are checked
        self._drawn = {} if check_escapes else None
        self._node_of = {}  # id(tensor) -> node
        self._alive = []  # the tensors of _node_of, so that their ids are not reused
        self._constants = 0
        self._unwritten_constants = {}  # storage address -> constant node, until first written

    @classmethod
    def _should_skip_dynamo(cls):
        # torch wraps a mode's __torch_dispatch__ in a lazy ``torch._dynamo.disable``, whose
        # first call imports dynamo; this mode is never compiled, so opt out (the hook
        # torch's own docstring names for it; without it, only the import time comes back)
        return False

    def mark_input(self, tensor: torch.Tensor, node: torch.fx.Node):
        self.bind(tensor, node)
        if self._from_inputs is not None:
            self._from_inputs.add(id(tensor))

    def computed_from_inputs(self, tensors) -> bool:
        return any(torch.is_tensor(t) and id(t) in self._from_inputs for t in tensors)

    def random_draw_behind(self, tensors) -> Optional[str]:
        """The name of a random op that one of ``tensors`` was computed from, else ``None``."""
        return next((self._drawn[id(t)] for t in tensors if torch.is_tensor(t) and id(t) in self._drawn), None)

    def _refuse_escapes(self, func, args):
        """For an op with an argument computed from the inputs. Inside one torch operation,
        such a value may become a Python number (``x[i]`` with a 0-dim tensor ``i``,
        ``torch.arange(n)`` with a tensor ``n``: torch's C++ reads it with ``item()``, which
        the trace freezes), or decide the shape of the result (``x[x > 0]``, ``nonzero``,
        ``unique``), whose size later code may read as a number (``.numel()``, ``.shape``, a
        ``view``) that the trace freezes too: a silently wrong potential at every other point
        (``z[z.argmax()]`` sampled a fixed element's posterior)."""
        if torch.Tag.data_dependent_output in func.tags:
            raise UntraceableModel(
                f"the potential turns a value computed from the latent variables into a Python number inside "
                f"`{func.overloadpacket.__name__}` (e.g. indexing with a 0-dim tensor `x[i]`, or `torch.arange(n)` "
                "with a tensor `n`), so one trace cannot stand for every point"
            )
        if torch.Tag.dynamic_output_shape in func.tags and self.computed_from_inputs(_shape_deciding_arguments(func, args)):
            raise UntraceableModel(
                f"the potential selects elements by a condition on the latent variables (`{func.overloadpacket.__name__}`: "
                "`x[x > 0]`, `nonzero`, `unique`, ...), so the number of elements changes from point to point and one "
                "trace cannot stand for every point; `torch.where` over all elements keeps the shape fixed "
                "(`torch.where(x > 0, f(x), 0.).sum()`)"
            )

    def bind(self, tensor: torch.Tensor, node: torch.fx.Node):
        self._node_of[id(tensor)] = node
        self._alive.append(tensor)
        node.meta["val"] = tensor

    def node_for(self, tensor: torch.Tensor) -> torch.fx.Node:
        node = self._node_of.get(id(tensor))
        if node is None:
            name = f"_tensor_constant{self._constants}"
            self._constants += 1
            # detached: a Pyro param (which requires grad) is a constant of the potential, as in
            # Pyro's MCMC, and a program cannot hold a constant that requires grad
            value = tensor.detach()
            setattr(self.root, name, value)
            node = self.graph.get_attr(name)
            self.bind(tensor, node)
            node.meta["val"] = value
            self._unwritten_constants[value.untyped_storage().data_ptr()] = node
        return node

    def _keep_constant_values(self, written):
        """Before an in-place op writes into a constant (``c = torch.tensor([1., 2.]);
        c[0] += x``), give the graph a copy of the constant's value: it is what the model
        starts from at every run, and the tensor itself is about to change."""
        for tensor in written:
            node = self._unwritten_constants.pop(tensor.untyped_storage().data_ptr(), None)
            if node is not None:
                value = getattr(self.root, node.target).clone()
                setattr(self.root, node.target, value)
                node.meta["val"] = value

    def _keep_metadata(self, tensor: torch.Tensor):
        """Before an op changes ``tensor``'s shape or strides in place (``squeeze_``, ``t_``:
        torch's ``x @ A`` of a vector squeezes its product so), the node that computed it
        keeps a view with the metadata it had: the passes read a node's shape from its value,
        and took the squeeze after the product for a no-op (``x @ A @ x`` then failed in
        ``dot`` with a matrix, and the potential ran on eager autograd)."""
        node = self._node_of.get(id(tensor))
        if node is not None:
            node.meta["val"] = tensor.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors_of((args, kwargs)) if self._from_inputs is not None else []  # followed with the escapes
        from_inputs = self._from_inputs is not None and self.computed_from_inputs(inputs)
        if from_inputs:
            self._refuse_escapes(func, args)
        if func is aten.log_sigmoid_backward.default:
            shape = broadcast_shape(args[0].shape, args[1].shape)
            if args[0].shape != shape:
                args = (self.__torch_dispatch__(aten.expand.default, types, (args[0], list(shape))),) + args[1:]
        node_args, node_kwargs = _map_tensors(self.node_for, (args, kwargs))
        self._keep_constant_values([t for t in _written_arguments(func, args, kwargs) if torch.is_tensor(t)])
        if torch.Tag.inplace_view in func.tags:
            self._keep_metadata(args[0])
        out = func(*args, **kwargs)
        # Not followed: the outcome of torch.distributions' validation of values computed from
        # the latent variables (``if not torch._is_all_true(valid): raise ValueError``), which
        # a distribution expanded while Pyro's validation was on keeps whatever the context
        # says later (a PyroSample prior ``Normal(0, 1).expand([n]).to_event(1)``): checked at
        # the trace point (a check that fails there raises as in Pyro), its branch not in the
        # trace. Where it would fail later, the log-density is in practice NaN or infinite (a
        # log of a negative scale or probability...): a divergence, as the eager potential's
        # error would be.
        if from_inputs and func is not aten._is_all_true.default:
            self._from_inputs.update(id(t) for t in _tensors_of(out))
        if self._drawn is not None:
            draw = func.overloadpacket.__name__ if _draws_random_numbers(func) else self.random_draw_behind(inputs)
            if draw is not None:
                self._drawn.update((id(t), draw) for t in _tensors_of(out))
        node = self.graph.call_function(func, tuple(node_args), dict(node_kwargs))
        if isinstance(out, torch.Tensor):
            self.bind(out, node)  # an in-place op rebinds its tensor: later readers follow it
        elif isinstance(out, (tuple, list)):
            node.meta["val"] = out
            for i, piece in enumerate(out):
                if isinstance(piece, torch.Tensor):
                    self.bind(piece, self.graph.call_function(operator.getitem, (node, i)))
        return out


def _tensors_of(obj, found: Optional[list] = None) -> list:
    """The tensors in an aten op's arguments or result: tensors, and lists, tuples and dicts
    of them, which is all that aten schemas take and return. (``torch.utils._pytree``'s walk
    of any container cost the recorder ~25 us an operation, a third of its time.)"""
    found = [] if found is None else found
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif type(obj) in (list, tuple):
        for item in obj:
            _tensors_of(item, found)
    elif type(obj) is dict:
        for item in obj.values():
            _tensors_of(item, found)
    return found


def _map_tensors(fn, obj):
    """``obj`` (an aten op's arguments: see :func:`_tensors_of`) with each tensor ``t``
    replaced by ``fn(t)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if type(obj) in (list, tuple):
        return type(obj)([_map_tensors(fn, item) for item in obj])
    if type(obj) is dict:
        return {key: _map_tensors(fn, item) for key, item in obj.items()}
    return obj


def _draws_random_numbers(func) -> bool:
    """Whether an aten op draws random numbers. torch tags its samplers (``randn``,
    ``bernoulli``, ``normal_``, dropout) ``nondeterministic_seeded``, and also its attention
    and RNN kernels, which draw only for their dropout and are deterministic without it
    (those are left to the check of the traced gradient against Pyro's)."""
    return torch.Tag.nondeterministic_seeded in func.tags and not any(
        kind in func.overloadpacket.__name__ for kind in ("attention", "rnn", "lstm", "gru"))


def _shape_deciding_arguments(func, args) -> list:
    """The arguments whose values decide the shape of the result of an op tagged
    ``dynamic_output_shape``: a boolean index's mask (integer indices give their own shape),
    ``masked_select``'s mask, and otherwise the first argument (``nonzero``, the ``unique``
    family, ``bincount``, ``one_hot``, ``repeat_interleave``'s repeats)."""
    if func is aten.index.Tensor:
        return [i for i in args[1] if i is not None and i.dtype in (torch.bool, torch.uint8)]
    if func.overloadpacket is aten.masked_select:
        return [args[1]]
    return [args[0]]


def _record(fn, example_inputs, check_escapes: bool = False,
            module_class=torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``fn(*example_inputs)`` run once under :class:`_AtenRecorder`: a graph of its aten ops,
    in a ``module_class`` (:func:`trace` takes a :class:`_GraphInProgress`)."""
    graph, root = torch.fx.Graph(), torch.nn.Module()
    recorder = _AtenRecorder(graph, root, check_escapes)
    for i, x in enumerate(example_inputs):
        recorder.mark_input(x, graph.placeholder(f"arg{i}_1"))
    with recorder, LatentTaint(recorder) if check_escapes else contextlib.nullcontext():
        out = fn(*example_inputs)
    output = graph.output(tree_map_only(torch.Tensor, recorder.node_for, out))
    _erase_unused_random_draws(graph, output)
    return module_class(root, graph)


def _erase_unused_random_draws(graph: torch.fx.Graph, output: torch.fx.Node) -> None:
    """Erase the random draws whose values reach no output, with the operations on them
    alone: a posterior predictive draw inside the model (``pyro.deterministic("y_rep",
    dist.Normal(mu, s).sample())``, which Pyro scores 0 whatever it is) leaves the
    potential one function of the latent values. An :class:`UntraceableModel` where a draw
    reaches an output (data drawn in the model, dropout in training mode): the function's
    value changes from call to call, and HMC needs the same value at the same point."""
    draws = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
             and _draws_random_numbers(n.target)]
    if not draws:
        return
    reaching = _reachable([output], lambda node: node.all_input_nodes)
    for node in draws:
        if node in reaching:
            raise UntraceableModel(f"the potential draws random numbers ({node.target.overloadpacket.__name__}), "
                                   + _RANDOM_POTENTIAL, eager_is_correct=False)
    downstream = _reachable(draws, lambda node: node.users) | set(draws)
    for node in reversed(list(graph.nodes)):  # users first
        if node in downstream:
            graph.erase_node(node)


def _reachable(starts, neighbours) -> set:
    """The nodes reached from ``starts`` by following ``neighbours`` (a node's inputs, or its
    users), ``starts`` themselves not included unless reached again."""
    reached, stack = set(), list(starts)
    while stack:
        for node in neighbours(stack.pop()):
            if node not in reached:
                reached.add(node)
                stack.append(node)
    return reached


class _GraphInProgress(torch.fx.GraphModule):
    """A graph module while :func:`trace`'s passes rewrite its graph: no Python code is
    generated for each new graph (``recompile`` does nothing). For a graph of tens of
    thousands of operations (a model of a thousand sites in a Python loop) generating it
    takes ~0.5 s, and it happened a dozen times a trace, at every copy and every round of the
    vectorizer, for code that was never run; the finished graph becomes a plain
    ``GraphModule`` once."""

    def recompile(self):
        return None


def _shared_fake_mode():
    """One fake-tensor mode for the shape metadata of every node of a ``make_fx`` trace
    (instead of one per node). Private API: on any problem, a no-op."""
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        return tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True)))
    except Exception:  # pragma: no cover - torch internals moved
        import contextlib

        return contextlib.nullcontext()


# Where vectorizing a traced graph first divides its operations by this factor or more (a
# long Python loop became a few vectorized ops), neither the graph folded without it nor
# vectorizing again after the folds did better on any graph the test suite traces (the
# largest such ratio where one did: 4.95, 723 -> 146 against 103 operations), and for a
# loop of 1,000 sites the two would take ~5.5 s of a ~19 s setup (21,054 -> 89 operations).
VECTORIZED_LOOP_REDUCTION = 8


def trace(fn, example_inputs, check_escapes: bool = True, fake: bool = False) -> torch.fx.GraphModule:
    """Trace ``fn(*example_inputs)`` (all tensors) into a folded FX graph of aten ops.

    By default ``fn`` runs once on the example inputs while :class:`_AtenRecorder` writes
    down its operations. Raises :class:`UntraceableModel` if ``fn`` lets a value derived from
    its inputs escape into Python, or fails. ``check_escapes=False`` skips the escape check
    for functions known to be pure tensor code, such as the sampler's own functions around an
    already checked gradient. ``fake=True`` traces
    with ``make_fx`` on fake tensors instead, without the escape check (for the compilers,
    which need its metadata, on functions around the checked gradient), so no value is
    computed and a model that fails numerically at the example inputs (a Cholesky beyond its
    support) still traces.
    """

    if fake and check_escapes:
        raise ValueError("a fake-tensor trace cannot check for escapes: pass check_escapes=False")
    try:
        if fake:
            with _shared_fake_mode():
                gm = make_fx(fn, tracing_mode="fake", _error_on_data_dependent_ops=False)(*example_inputs)
            gm = _GraphInProgress(gm, gm.graph)
        else:
            gm = _record(fn, example_inputs, check_escapes, _GraphInProgress)
    except UntraceableModel as e:
        while isinstance(e.__cause__, UntraceableModel):  # Pyro re-raises an error from inside a
            e = e.__cause__  # model with its trace's shapes appended: the first one says why
        raise e
    except Exception as e:  # tracing failures come in many types; all mean "not traceable"
        raise UntraceableModel(f"tracing failed: {type(e).__name__}: {e}") from e
    try:
        return _simplified(gm, fake)
    except Exception as e:  # a failure of the passes below: the eager path is still correct
        raise UntraceableModel(
            f"simplifying the traced graph failed ({type(e).__name__}: {e}); this is a bug of "
            "pyro_hmc_plus, please report it with the model"
        ) from e


def _simplified(gm: _GraphInProgress, fake: bool) -> torch.fx.GraphModule:
    """:func:`trace`'s recorded graph, folded and simplified by the passes below."""
    for graph_pass in (
        fold_constants,
        writes_out_of_place,  # (after the aliases fold_constants drops: a write into a `detach` is a write into a view)
        simplify,
        fold_decided_comparisons,
        fold_constants,  # what the decided masks, now constants, fed
        fold_constant_solves,
        shrink_broadcasts,
        cheaper_log_softmax,
        simplify,  # the reshapes around the products fold_constant_solves made; log(exp(x)) unbroadcast
        cheaper_indexing,
        merge_duplicate_ops,
    ):
        graph_pass(gm, recompile=False)
    # Rewrites that may or may not pay are judged on the finished graph, since the passes
    # after them may fold less than they would have without them: whichever has the fewest
    # operations of the graph, vectorized before the last folds or not, and where that paid
    # (a loop), vectorized after them too (the folds can make more of the steps alike: the
    # 50-step volatility recursion 1,231 -> 891 operations, ~10% faster, for ~0.5 s more
    # tracing); then with numbers taken out of sums and products or not.
    def finished(candidate, rewrites=()):
        for graph_pass in rewrites + (fold_linear_chains, fold_constants, merge_duplicate_ops):
            graph_pass(candidate, recompile=False)
        return candidate

    def copied(candidate):
        return _GraphInProgress(candidate, copy.deepcopy(candidate.graph))

    def fewest(*candidates):
        return min(candidates, key=lambda c: cost(c.graph))  # the first of equals

    unfinished_cost = cost(gm.graph)
    vectorized_first = finished(copied(gm), (vectorize_alike_ops,))
    if cost(vectorized_first.graph) * VECTORIZED_LOOP_REDUCTION <= unfinished_cost:
        gm = vectorized_first  # a long loop, made a few vectorized ops
    else:
        gm = finished(gm)
        if cost(vectorized_first.graph) < cost(gm.graph):  # a loop: worth a second try
            gm = fewest(vectorized_first, finished(copied(gm), (vectorize_alike_ops,)))
    if _has_scalars_to_take_out(gm.graph):  # (copying and finishing a 1,800-op graph takes ~0.3 s)
        gm = fewest(gm, finished(copied(gm), (pull_scalars_out_of_sums, gather_scalar_factors)))
    lay_out_matrices_for_products(gm, recompile=False)
    copy_written_constants(gm, recompile=False)
    gm.graph.lint()
    gm = torch.fx.GraphModule(gm, gm.graph)
    gm.meta["elements_touched"] = elements_touched(gm)
    if not fake:  # the recorded values: no longer needed, and as large as the model's data
        for node in gm.graph.nodes:
            if node.op != "get_attr":
                node.meta.pop("val", None)
    return gm


def _out_of_place(node) -> Optional[torch._ops.OpOverload]:
    """The out-of-place form of an in-place aten op that writes only its first argument
    (``exp_.default`` -> ``exp.default``), or ``None``."""
    written = _written_inputs(node)
    if not written or written != {node.args[0]} or not node.target.overloadpacket.__name__.endswith("_"):
        return None
    packet = getattr(torch.ops.aten, node.target.overloadpacket.__name__[:-1], None)
    return getattr(packet, node.target._overloadname, None) if packet is not None else None


def _out_of_place_if_own(node, order: dict, value_of) -> Optional[torch._ops.OpOverload]:
    """The out-of-place form of ``node`` (:func:`_out_of_place`) where writing it out of place
    gives the same values: the tensor it writes is its own (made by an op of the graph, not a
    view), everything else that reads that tensor comes before the write and is not a view of
    it, and the out-of-place result has the same dtype and shape (``value_of(n)``: a value of
    ``n``, whose dtype and shape are what count). Else ``None``."""
    out_of_place = _out_of_place(node)
    written = node.args[0] if out_of_place is not None else None
    if written is None or written.op != "call_function" or _returns_view(written) or not all(
        user is node or (order[user] < order[node] and not _returns_view(user)) for user in written.users
    ):
        return None
    if any(value_of(n) is None for n in node.all_input_nodes + [node]):
        return None
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value_of)
    result = out_of_place(*args, **kwargs)
    return out_of_place if (result.dtype, result.shape) == (value_of(node).dtype, value_of(node).shape) else None


def _slice_bounds(node) -> Optional[Tuple[int, Optional[int], Optional[int], int]]:
    """``(dim, start, end, step)`` of a ``slice`` with a bound counted from the end of its
    dimension (``x[a::k]``, its end recorded as ``sys.maxsize``; ``x[..., 1:-1]``), else ``None``."""
    if node.target is not torch.ops.aten.slice.Tensor or node.kwargs:
        return None
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
    if (start is not None and start < 0) or (end is not None and (end < 0 or end == sys.maxsize)):
        return dim, start, end, step
    return None


def _strided_as_slices(node, values) -> Optional[Tuple[list, list]]:
    """``as_strided(x, size, stride, offset)`` as ``(shape, slices)``: ``x`` viewed as
    ``shape``, sliced by each ``(dim, start, stop, step)`` in turn and viewed as ``size``, where
    ``x`` (its value in ``values``) is contiguous from the start of its storage and the
    dimensions of more than one element (a dimension of one has no stride that matters) are
    a strided run of ``x.view(-1)`` (``[n], [k]``: a matrix's diagonal; ``[1, n], [*, k]``), a
    contiguous block of it, or a block of it in the shape its strides lay out (``[200, 2],
    [4, 1]``: columns 1-2 of a ``(200, 4)`` matrix, where autograd writes the gradient of
    ``p[..., 1:-1] = v``).
    ``None`` for other ``as_strided`` calls."""
    x, size, stride, offset = (list(node.args) + [node.kwargs.get("storage_offset")])[:4]
    x = values[x]
    offset = x.storage_offset() if offset is None else offset
    dims = [(n, k) for n, k in zip(size, stride) if n != 1]
    if not x.is_contiguous() or x.storage_offset() != 0 or any(n == 0 for n, _ in dims):
        return None
    contiguous = [math.prod(n for n, _ in dims[i + 1:]) for i in range(len(dims))]
    if len(dims) == 1 and dims[0][1] > 0:
        (n, k), = dims
        start, stop, step = offset, offset + (n - 1) * k + 1, k
    elif [k for _, k in dims] == contiguous:
        start, stop, step = offset, offset + math.prod(size), 1
    else:
        return _block_of(x, dims, offset)
    return ([-1], [(0, start, stop, step)]) if stop <= x.numel() else None


def _block_of(x: torch.Tensor, dims, offset: int) -> Optional[Tuple[list, list]]:
    """The ``as_strided`` dimensions ``dims`` (``(size, stride)`` pairs of more than one
    element) at ``offset`` as slices of the contiguous ``x`` viewed as the shape those strides
    are a contiguous layout of: decreasing strides, each a multiple of the next (``[2, 2],
    [3, 1]`` in ``(6,)``: a block of ``x.view(2, 3)``), the block inside it; else ``None``."""
    strides = [k for _, k in dims]
    if min(strides) < 1 or any(a <= b or a % b for a, b in zip(strides, strides[1:])) or x.numel() % strides[0]:
        return None
    shape = [x.numel() // strides[0]] + [a // b for a, b in zip(strides, strides[1:])] + [strides[-1]]
    layout = strides + [1]
    index = [(offset // k) % n for n, k in zip(shape, layout)]  # offset's element of x.view(shape)
    if sum(i * k for i, k in zip(index, layout)) != offset or any(i + n > m for i, (n, _), m in zip(index, dims, shape)):
        return None
    stops = [i + n for i, (n, _) in zip(index, dims)] + [index[-1] + 1]
    return shape, [(d, index[d], stops[d], 1) for d in range(len(shape)) if (index[d], stops[d]) != (0, shape[d])]


def for_vmap(gm: torch.fx.GraphModule, example: torch.Tensor) -> torch.fx.GraphModule:
    """``gm``, or a copy of it with ops that ``vmap`` of its ``functionalize``-d form would run
    through their Python decompositions, or fail on, written in ops it batches directly.
    The first call of such a decomposition imports ``torch._dynamo``: ~1.1 s, a sixth of a
    4-chain logistic regression's run. The same values; ``example`` is an input of ``gm``.

    - ``binary_cross_entropy_with_logits(x, y)`` (Pyro's ``Bernoulli(logits=x)``: every
      logistic regression) as ``(1 - y) * x - log_sigmoid(x)``;
    - in-place ops (``exp_``, ``clamp_``, ``bitwise_and_`` in the gradients of Pyro's simplex
      and correlation transforms), which ``vmap`` of a ``functionalize``-d function still
      decomposes, as their out-of-place forms, where nothing reads the tensor they write
      after the write (a tensor of its own, whose other uses come before and are not
      views of it) and the out-of-place result has the same dtype and shape (checked on
      ``example``'s values);
    - a slice's bounds counted from the end of its dimension, as counted from its start
      (from ``example``'s values): written into in place, a slice to the end
      (``K.view(-1)[::n + 1] += jitter``, the diagonal of a covariance matrix in Pyro's
      Gaussian processes) has ``sys.maxsize`` as its end, which overflows in the
      functionalized batched op ("invalid size, possible overflow?"), and a negative end
      (``p[..., 1:-1] = v`` in Pyro's ``OrderedLogistic``) fails there ("upper bound and
      lower bound inconsistent with step sign");
    - ``as_strided`` views that are slices of a contiguous tensor (that write's gradient:
      autograd reads and writes the diagonal through ``as_strided``; the gradient of
      ``p[..., 1:-1] = v``, as in Pyro's ``OrderedLogistic``, a block of columns), as ``view``
      and ``slice``: written into, ``functionalize`` makes ``as_strided_scatter`` of them,
      which ``vmap`` refuses, where it makes a ``slice_scatter`` of a slice;
    - ``fill_`` with a tensor (``B[:, -1] = 0.0``), whose out-of-place ``fill`` ``vmap`` runs
      point by point, as a ``copy_`` of the value expanded to the written tensor's shape;
    - ``special_log_ndtr`` (censored Gaussian likelihoods), which ``vmap`` runs point by
      point, as torch's formula for it in ``erfcx``, ``erfc`` and ``where``;
    - ``copy_`` (into a fresh buffer, or through such a slice), which ``functionalize``
      makes an out-of-place ``copy`` that ``vmap`` runs chain by chain (and says so on
      stderr, "no batching rule for aten::copy"): the graph is functionalized here, and each
      ``copy`` of a value of the same shape and dtype is that value."""
    aten = torch.ops.aten
    bce = aten.binary_cross_entropy_with_logits.default
    if not any(n.target in (bce, aten.as_strided.default, aten.copy_.default, aten.fill_.Tensor, aten.special_log_ndtr.default)
               or _out_of_place(n) is not None
               or _slice_bounds(n) is not None for n in gm.graph.nodes):
        return gm
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    interpreter = torch.fx.Interpreter(gm, garbage_collect_values=False)
    interpreter.run(example)
    values = interpreter.env
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}

    def new_op(replaced, target, *args, **kwargs):  # in the graph's order where ``replaced`` is
        new = graph.call_function(target, args, kwargs)
        order[new] = order[replaced]
        return new

    for node in list(graph.nodes):
        bounds = _slice_bounds(node)
        if bounds is not None:
            dim, start, end, step = bounds
            node.args = (node.args[0], dim, *slice(start, end, step).indices(values[node.args[0]].shape[dim]))
            continue
        if node.target is aten.as_strided.default:
            as_slices = _strided_as_slices(node, values)
            if as_slices is None:
                continue
            x, size = node.args[:2]
            shape, slices = as_slices
            with graph.inserting_before(node):
                piece = new_op(node, aten.view.default, x, shape)
                values[piece] = values[x].view(shape)
                for dim, start, stop, step in slices:
                    piece = new_op(node, aten.slice.Tensor, piece, dim, start, stop, step)
                    values[piece] = aten.slice.Tensor(values[piece.args[0]], dim, start, stop, step)
                replacement = new_op(node, aten.view.default, piece, list(size))
        elif node.target is aten.special_log_ndtr.default:
            # torch's own formula (calc_log_ndtr), in ops that have batching rules
            x, = node.args
            with graph.inserting_before(node):
                t = new_op(node, aten.mul.Tensor, x, math.sqrt(0.5))
                lower = new_op(node, aten.sub.Tensor, new_op(node, aten.log.default, new_op(
                    node, aten.mul.Tensor, new_op(node, aten.special_erfcx.default, new_op(node, aten.neg.default, t)), 0.5)),
                    new_op(node, aten.mul.Tensor, t, t))
                upper = new_op(node, aten.log1p.default, new_op(
                    node, aten.mul.Tensor, new_op(node, aten.special_erfc.default, t), -0.5))
                replacement = new_op(node, aten.where.self, new_op(node, aten.lt.Scalar, x, -1.0), lower, upper)
        elif node.target is aten.fill_.Tensor:
            x, value = node.args
            if values[value].dtype != values[x].dtype:
                continue
            with graph.inserting_before(node):
                filled = new_op(node, aten.expand.default, value, list(values[x].shape))
                replacement = new_op(node, aten.copy_.default, x, filled)
        elif node.target is bce:
            schema = bce._schema
            args = {a.name: a.default_value for a in schema.arguments}
            args.update(zip((a.name for a in schema.arguments), node.args))
            args.update(node.kwargs)
            if args["weight"] is not None or args["pos_weight"] is not None or args["reduction"] != 0:
                continue  # Pyro's is elementwise and unweighted; others keep the op
            x, y = args["self"], args["target"]
            with graph.inserting_before(node):
                replacement = new_op(node, aten.sub.Tensor, new_op(node, aten.mul.Tensor, new_op(node, aten.rsub.Scalar, y, 1), x),
                                     new_op(node, aten.log_sigmoid.default, x))
        else:
            out_of_place = _out_of_place_if_own(node, order, values.get)
            if out_of_place is None:
                continue  # something may read the tensor after the write, or through a view of it
            with graph.inserting_before(node):
                replacement = new_op(node, out_of_place, *node.args, **node.kwargs)
        values[replacement] = values.pop(node)  # for the ops after it that read it
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    if any(n.target is aten.copy_.default for n in graph.nodes):
        gm = _functional_without_copies(gm, example)
    return gm


def _functional_without_copies(gm: torch.fx.GraphModule, example: torch.Tensor) -> torch.fx.GraphModule:
    """``gm`` functionalized (writes as out-of-place ops and scatters; recorded by
    :func:`_record`, not ``make_fx``, whose first use imports ``torch._dynamo``), with every
    out-of-place ``copy(dst, src)`` of ``src`` 's shape and dtype replaced by a contiguous
    clone of ``src``: the same values, in a layout that every ``view`` after it accepts. (Only
    the ``as_strided`` ops read a layout (:func:`_reads_layouts`); where the graph still has
    one, only copies into contiguous tensors are replaced.)"""
    functional = _record(torch.func.functionalize(gm), (example,))
    graph = functional.graph
    layout_read = _reads_layouts(graph)
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.copy.default:
            continue
        src, out = node.args[1], node.meta.get("val")
        if isinstance(src, torch.fx.Node) and out is not None and "val" in src.meta and (
                not layout_read or out.is_contiguous()) and (
                (src.meta["val"].shape, src.meta["val"].dtype) == (out.shape, out.dtype)):
            with graph.inserting_before(node):
                clone = graph.call_function(torch.ops.aten.clone.default, (src,),
                                            {"memory_format": torch.contiguous_format})
            clone.meta["val"] = src.meta["val"].clone(memory_format=torch.contiguous_format)  # for a copy of it
            node.replace_all_uses_with(clone)
            graph.erase_node(node)
    graph.eliminate_dead_code()
    functional.recompile()
    return functional


def elements_touched(gm: torch.fx.GraphModule) -> int:
    """Roughly how many tensor elements the graph's operations read or write, each counted
    at its largest operand or result (a matrix product at its matrix): a measure of its
    arithmetic, where its number of operations measures its fixed cost in a program. Reads
    the ``meta["val"]`` of the recorded graph; nodes without one count as nothing."""
    total = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        operands = [node] + [arg for arg in node.all_input_nodes]
        sizes = [n.meta["val"].numel() for n in operands if isinstance(n.meta.get("val"), torch.Tensor)]
        total += max(sizes, default=0)
    return total


class TorchScriptDisabled(RuntimeError):
    """torch records no TorchScript in this process (``PYTORCH_JIT=0``, a debugging switch
    under which ``torch.jit.trace`` hands back the function it was given)."""


def to_torchscript(fn, example_inputs) -> torch.jit.ScriptFunction:
    """``fn`` (a function of tensors returning a tuple of tensors) run once at
    ``example_inputs`` under ``torch.jit.trace``: a TorchScript program of every aten op it
    performed (those of the TorchScript functions it called included), for the sampler's
    functions around the already traced gradient graph.

    Recording real execution costs about as much as running ``fn`` once (``make_fx`` costs
    ~1 ms per op here, seconds for a NUTS subtree). The price is that the recorder follows
    Python values silently; so every warning by which it says it had to freeze one (a tensor
    turned into a Python number, iterated, or its ``len``) is an error here, raised as
    :class:`UntraceableModel`. Constants made with ``torch.tensor`` from Python numbers are
    fine. :class:`TorchScriptDisabled` where torch records nothing.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", "torch.tensor results are registered as constants",
                                torch.jit.TracerWarning)
        try:
            traced = torch.jit.trace(fn, tuple(example_inputs), check_trace=False, strict=False)
        except Exception as e:
            cause = e
            while cause is not None and not isinstance(cause, torch.jit.TracerWarning):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise UntraceableModel(f"the program cannot be recorded as one trace: {cause}") from e
    if not isinstance(traced, torch.jit.ScriptFunction):
        raise TorchScriptDisabled("torch records no TorchScript in this process (PYTORCH_JIT=0)")
    inline = getattr(torch._C, "_jit_pass_inline", None)
    if inline is not None:  # calls of TorchScript functions (a gradient recorded once), as their operations
        inline(traced.graph)
    return _tidied(traced)


# elementwise ops of (tensor, number): the number is better a 0-d tensor of the tensor's dtype
_ARITHMETIC = {"aten::add", "aten::sub", "aten::mul", "aten::div", "aten::rsub"}
_COMPARISONS = {"aten::lt", "aten::le", "aten::gt", "aten::ge", "aten::eq", "aten::ne"}
_DTYPES = {"Float": torch.float32, "Double": torch.float64, "Long": torch.int64, "Int": torch.int32}


def _operand_constant(value, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The constant operand ``value`` (a Python number, or a 0-d tensor as the recorder keeps
    numbers in arithmetic) as a 0-d tensor of ``dtype``, where the op computes in ``dtype``
    anyway: a number meets a tensor of its own category (int with int, any with float), so
    type promotion keeps the tensor's dtype and converts the number to it."""
    node = value.node()
    if node.kind() != "prim::Constant":
        return None
    kind = value.type().kind()
    if kind == "TensorType":
        tensor = node.t("value")
        if tensor.dim() != 0 or tensor.dtype == torch.bool or tensor.dtype == dtype:
            return None
        number, is_float = tensor.item(), tensor.is_floating_point()
    elif kind in ("IntType", "FloatType"):
        number, is_float = value.toIValue(), kind == "FloatType"
    else:
        return None
    if is_float and not dtype.is_floating_point:
        return None  # an int tensor and a float: the result is a float
    return torch.tensor(number, dtype=dtype)


def _scalars_as_tensors(graph) -> int:
    """Rewrite, in a TorchScript graph, the elementwise ops that take a number -- ``x * 0.5``,
    ``n + 1``, ``u < 0.5``, recorded with the number as a Python scalar or a 0-d tensor of
    another dtype -- to take a 0-d tensor constant of their tensor's dtype, and ``x ** 2`` to
    ``x * x``; returns how many. The values are the same: the op converted the number to
    the tensor's dtype anyway, and ``pow`` squares by multiplying. Why: an op meeting a
    number wraps it into a fresh tensor at every call, or takes its mixed-dtype path, ~1
    µs more per op on Static Runtime, and our programs have dozens (a NUTS doubling, the
    gradient's normalising constants)."""
    count = 0
    for node in list(graph.nodes()):
        kind = node.kind()
        if kind not in _ARITHMETIC and kind not in _COMPARISONS and kind != "aten::pow":
            continue
        inputs = list(node.inputs())
        if len(inputs) < 2 or node.outputsSize() != 1:
            continue
        own, out = inputs[0].type(), node.output().type()
        if own.kind() != "TensorType" or out.kind() != "TensorType":
            continue
        dtype = _DTYPES.get(own.scalarType())
        if dtype is None or (kind not in _COMPARISONS and out.scalarType() != own.scalarType()):
            continue
        if kind == "aten::pow":
            exponent = inputs[1]
            if not (dtype.is_floating_point and exponent.node().kind() == "prim::Constant"
                    and exponent.type().kind() in ("IntType", "FloatType") and exponent.toIValue() == 2):
                continue
            new_inputs = [inputs[0], inputs[0]]
            kind = "aten::mul"
        else:
            if kind in _COMPARISONS and inputs[1].type().kind() == "TensorType":
                continue  # a 0-d tensor of a wider dtype may make the comparison in that dtype
            constant = _operand_constant(inputs[1], dtype)
            if constant is None:
                continue
            with graph.insert_point_guard(node):
                new_inputs = [inputs[0], graph.insertConstant(constant)] + inputs[2:]
        _replace_node(graph, node, kind, new_inputs)
        count += 1
    return count


# logical ops on tensors, as the bitwise ops they call
_AS_BITWISE = {"aten::__and__": "aten::bitwise_and", "aten::__or__": "aten::bitwise_or"}
_AS_SUBTRACTION = ("aten::add", "aten::rsub")


def _ops_with_out_variants(graph) -> int:
    """Rewrite, in a TorchScript graph, ops that Static Runtime (torch 2.13) runs through the
    interpreter's generic op, into a fresh tensor at every call, as ops with the same values
    that it runs into its planned buffers (out variants), ~0.1-0.4 µs less each; returns
    how many:

    - ``add(a, b, alpha)`` of numbers (not booleans, which ``sub`` refuses) as ``sub(a, b,
      -alpha)``: torch computes a subtraction as the addition with the negated ``alpha``, in
      the same kernel (an eight-schools NUTS chunk of 16 leapfrog steps has 177 sums: 0.43
      -> 0.36 ms a call); ``rsub(a, b, alpha)`` (``1 - x``) as the ``sub(b, a, alpha)`` it
      calls;
    - ``a & b``, ``a | b`` of tensors as ``bitwise_and``, ``bitwise_or``, which they call
      (a NUTS round of 4 chains has ~50, the U-turn and stopping rules' masks)."""
    count = 0
    for node in list(graph.nodes()):
        kind = node.kind()
        if kind not in _AS_BITWISE and kind not in _AS_SUBTRACTION or node.outputsSize() != 1 \
                or node.output().type().kind() != "TensorType":
            continue
        inputs = list(node.inputs())
        if kind in _AS_BITWISE and all(x.type().kind() == "TensorType" for x in inputs):
            _replace_node(graph, node, _AS_BITWISE[kind], inputs)
            count += 1
        elif kind in _AS_SUBTRACTION and len(inputs) == 3 and node.output().type().scalarType() not in (None, "Bool"):
            a, b, alpha = inputs
            if (b.type().kind() != "TensorType" or alpha.node().kind() != "prim::Constant"
                    or alpha.type().kind() not in ("IntType", "FloatType")):
                continue
            if kind == "aten::rsub":  # b - alpha * a, which torch computes as sub(b, a, alpha)
                _replace_node(graph, node, "aten::sub", [b, a, alpha])
            else:
                with graph.insert_point_guard(node):
                    negated = graph.insertConstant(-alpha.toIValue())
                _replace_node(graph, node, "aten::sub", [a, b, negated])
            count += 1
    return count


def _without_idle_conversions(graph) -> int:
    """Drop, from a TorchScript graph, the conversions ``x.to(dtype)`` (or ``x.to(device,
    dtype)``, ``x.to(other)``) that return ``x`` itself: to its own dtype on its own device,
    not copying, no memory format asked; returns how many. Their readers read ``x``. Why:
    sampler code converts values whatever their dtype (``n.to(torch.int64)`` of a count
    that may be one already), and each conversion costs ~0.5-1 µs on Static Runtime (a
    NUTS round of 4 chains had ~15). A conversion the program returns stays."""
    returned = set()
    for value in graph.outputs():
        returned.add(value.unique())
        if value.node().kind() == "prim::TupleConstruct":
            returned.update(x.unique() for x in value.node().inputs())
    count = 0
    for node in list(graph.nodes()):
        if node.kind() != "aten::to" or node.outputsSize() != 1 or node.inputsSize() not in (5, 6):
            continue
        inputs = list(node.inputs())
        x, out = inputs[0].type(), node.output().type()
        copy, memory_format = inputs[-2], inputs[-1]
        if (node.output().unique() in returned or x.kind() != "TensorType" or out.kind() != "TensorType"
                or x.scalarType() is None or x.scalarType() != out.scalarType() or x.device() is None
                or x.device() != out.device() or copy.node().kind() != "prim::Constant" or copy.toIValue() is not False
                or not memory_format.node().mustBeNone()):
            continue
        node.output().replaceAllUsesWith(inputs[0])
        node.destroy()
        count += 1
    return count


def _replace_node(graph, node, kind: str, inputs: list) -> None:
    """Put a ``kind`` op of ``inputs`` in ``node``'s place (one output, of ``node``'s type)."""
    replacement = graph.create(kind, inputs)
    replacement.insertBefore(node)
    replacement.output().setType(node.output().type())
    node.output().replaceAllUsesWith(replacement.output())
    node.destroy()


def _tidied(traced: torch.jit.ScriptFunction) -> torch.jit.ScriptFunction:
    """``traced`` with :func:`_without_inner_tuples`, :func:`_without_idle_conversions`,
    :func:`_scalars_as_tensors` and :func:`_ops_with_out_variants` applied to a copy of its
    graph; ``traced`` itself where there is nothing to rewrite or torch lacks the (private)
    graph API."""
    try:
        graph = traced.graph.copy()
        rewrites = [_without_inner_tuples(graph), _without_idle_conversions(graph),
                    _scalars_as_tensors(graph),  # (before: it makes `n + 1` an add of two tensors)
                    _ops_with_out_variants(graph)]
        if not any(rewrites):
            return traced
        return torch._C._create_function_from_graph(traced.name, graph)
    except (AttributeError, RuntimeError, TypeError):
        return traced


def _without_inner_tuples(graph: torch._C.Graph) -> bool:
    """Take apart the tuples inside a recorded program, then drop what nothing reads; the
    program's inputs and what it returns (a tensor, or a tuple of tensors) stay as they were.
    Returns whether the graph changed.

    Why: each inlined gradient call hands ``(U, grad)`` to its caller as a tuple, which
    keeps ``U``'s operations alive whether or not the caller reads ``U``. A fused HMC
    transition reads only its last step's ``U``: the other steps' energies were ~20% of
    the hierarchical model's 10-step transition (809 -> 662 operations, 584 -> 463 µs a
    call on Static Runtime, the same results). Graphs with other inputs or outputs (lists,
    nested tuples) are left alone."""
    outputs = list(graph.outputs())
    if len(outputs) != 1:
        return False
    kind = outputs[0].type().kind()
    if kind == "TupleType":
        if any(element.kind() != "TensorType" for element in outputs[0].type().elements()):
            return False
    elif kind != "TensorType":
        return False
    if any(value.type().kind() != "TensorType" for value in graph.inputs()):
        return False
    if not any(node.kind() in ("prim::TupleUnpack", "prim::TupleIndex") for node in graph.nodes()):
        return False  # no tuple read inside (a gradient function's own graph)
    torch._C._jit_pass_lower_all_tuples(graph)
    if kind == "TupleType":
        graph.makeMultiOutputIntoTuple()
    torch._C._jit_pass_dce(graph)
    return True


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
aten = torch.ops.aten
# ops whose value depends only on the (static) shape of their tensor input
_SHAPE_ONLY = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
               aten.new_zeros.default, aten.new_ones.default, aten.new_full.default}
# the fill of each (``full_like`` and ``new_full`` take theirs as an argument)
_SHAPE_ONLY_FILL = {aten.zeros_like.default: 0, aten.ones_like.default: 1, aten.new_zeros.default: 0,
                    aten.new_ones.default: 1, aten.full_like.default: lambda args: args[1],
                    aten.new_full.default: lambda args: args[2]}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default}
_PERMUTES = {aten.permute.default, aten.t.default, aten.transpose.int}
_LAYOUT_READS = {aten.as_strided.default, aten.as_strided_scatter.default}  # their results depend on strides
_IDENTITY_SCALAR = {aten.add.Tensor: 0, aten.sub.Tensor: 0, aten.mul.Tensor: 1, aten.div.Tensor: 1,
                    aten.pow.Tensor_Scalar: 1, aten.mul.Scalar: 1}


def _reads_layouts(graph: torch.fx.Graph) -> bool:
    """Whether an op of ``graph`` reads memory layouts (strides), which every other op's
    values are independent of: then no pass may change a tensor's layout."""
    return any(n.target in _LAYOUT_READS for n in graph.nodes)


def _constant_node(gm: torch.fx.GraphModule, prefix: str, value: torch.Tensor) -> torch.fx.Node:
    """A ``get_attr`` node (at the graph's insertion point) for ``value``, kept as a buffer of
    ``gm`` under the first free name ``{prefix}{i}``: the passes run more than once on a
    graph, and a name used again would overwrite a constant still in use. The search for a
    free name starts after the last one given (kept in ``gm.meta``), so that naming a
    graph's thousands of constants is not quadratic (a model of 400 sample sites: ~4 s of
    ``hasattr``). Its ``meta["val"]`` is the value, for the passes after."""
    next_index = gm.meta.setdefault("next_constant_index", {})
    i = next_index.get(prefix, 0)
    while hasattr(gm, f"{prefix}{i}"):
        i += 1
    next_index[prefix] = i + 1
    gm.register_buffer(f"{prefix}{i}", value)
    node = gm.graph.get_attr(f"{prefix}{i}")
    node.meta["val"] = getattr(gm, f"{prefix}{i}")
    return node


def _graph_pass(rewrite):
    """A pass over an FX graph module: ``rewrite(gm)`` changes its graph in place; then,
    unless ``recompile=False``, the graph is checked (``lint``) and the module's Python code
    is generated anew, which a call of the module needs. :func:`trace` runs its passes in a
    row and checks and generates the code once: on a gradient of thousands of operations
    each generation takes ~0.25 s, and each check of a 40,000-node graph ~0.05 s."""

    @functools.wraps(rewrite)
    def run(gm: torch.fx.GraphModule, recompile: bool = True) -> torch.fx.GraphModule:
        rewrite(gm)
        if recompile:
            gm.graph.lint()
            gm.recompile()
        return gm

    return run


@_graph_pass
def writes_out_of_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """In-place ops that write a tensor of their own (:func:`_out_of_place_if_own`) as their
    out-of-place forms: the same values, and a tensor that nothing writes, which the other
    passes may fold or replace. (The gradient of ``cumprod``, in Pyro's simplex and
    correlation transforms, builds its masks by ``scatter_``, ``logical_and_`` and
    ``bitwise_and_`` into fresh tensors: written in place, none of them is a constant for
    :func:`fold_constants`, whatever the masks' inputs.)"""
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        out_of_place = _out_of_place_if_own(node, order, _val) if node.op == "call_function" else None
        if out_of_place is None:
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(out_of_place, node.args, node.kwargs)
        replacement.meta = dict(node.meta)
        order[replacement] = order[node]
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)


@_graph_pass
def fold_constants(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Evaluate, once, every node whose inputs are all constants; drop aliasing no-ops.

    Random ops (tagged ``nondeterministic_seeded``) are never folded, so a model that draws
    inside its potential keeps drawing. Nor is a tensor that an in-place op writes, nor any
    view of it (``probs = zeros(n, 3); probs[:, 0] = f(z)``, as in ``OrderedLogistic``): its
    value at the op that made it is not the value later readers see. Error checks on
    constants that passed at trace time (``_linalg_check_errors``) are removed; checks on
    inputs stay. A folded constant is laid out contiguously (a transposed design matrix, as
    autograd's ``X.t()``: its matrix-vector product ~1.5x faster), unless the graph reads
    layouts (:func:`_reads_layouts`).
    """
    graph = gm.graph
    written = _written_storage(graph.nodes)
    layout_read = _reads_layouts(graph)
    const = {}
    for node in list(graph.nodes):
        if node.op == "get_attr":
            const[node] = getattr(gm, node.target)
            continue
        if node.op != "call_function":
            continue
        if node.target in _ALIASES:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        if node in written:  # so no in-place op is folded either: it writes into one of these
            continue
        inputs = node.all_input_nodes
        target = node.target
        if target in _SHAPE_ONLY and "val" in node.meta:
            val = node.meta["val"]
            fill = _SHAPE_ONLY_FILL[target]
            fill = fill(node.args) if callable(fill) else fill
            const[node] = torch.full(val.shape, fill, dtype=val.dtype, device=val.device)
            continue
        if not all(n in const for n in inputs):
            kept = _unmasked(node, const, written)
            if kept is not None:
                node.replace_all_uses_with(kept)
                graph.erase_node(node)
            continue
        if isinstance(target, torch._ops.OpOverload) and (
            torch.Tag.nondeterministic_seeded in target.tags
        ):
            continue
        args = torch.fx.node.map_arg(node.args, lambda n: const[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: const[n])
        const[node] = target(*args, **kwargs)
    for node in list(graph.nodes):
        if node not in const or node.op == "get_attr":
            continue
        value = const[node]
        users = [u for u in node.users if u not in const]
        if value is None and not node.users:
            graph.erase_node(node)  # a check on constants that passed when traced
            continue
        if not users or not torch.is_tensor(value):
            continue  # only feeds other constants (or is a tuple consumed by getitem)
        if not layout_read and not value.is_contiguous():
            value = value.contiguous()  # a transposed matrix: its products run in its row order
        elif value._is_view() and value.untyped_storage().nbytes() > value.numel() * value.element_size():
            value = value.clone()  # not the storage it views (which is larger: a slice of it)
        with graph.inserting_before(node):
            attr = _constant_node(gm, "_folded_", value.detach())
        for user in users:
            user.replace_input_with(node, attr)
    _eliminate_dead_code(graph)


def _unmasked(node, const: dict, written: set) -> Optional[torch.fx.Node]:
    """What ``node`` equals where its mask is a constant (``const``) that masks the same way
    everywhere: ``where(mask, a, b)`` is ``a`` where the mask is all true, ``b`` where all
    false; ``masked_fill(x, mask, v)`` (or ``masked_fill_``) is ``x`` where the mask is all
    false. ``None`` where the mask decides nothing, where the result would broadcast or
    convert the kept input, or where an in-place op writes either (``written``:
    :func:`_written_storage`), which must then stay tensors of their own."""
    if node.target is aten.where.self:
        mask, when_true, when_false = node.args
    elif node.target in _MASKED_FILLS:
        when_false, mask = node.args[:2]
        when_true = None
    else:
        return None
    mask = const.get(mask) if isinstance(mask, torch.fx.Node) else None
    if not (torch.is_tensor(mask) and mask.dtype == torch.bool and mask.numel()):
        return None
    kept = when_true if bool(mask.all()) else when_false if not bool(mask.any()) else None
    if not (isinstance(kept, torch.fx.Node) and torch.is_tensor(_val(kept)) and torch.is_tensor(_val(node))):
        return None
    if (_val(kept).shape, _val(kept).dtype) != (_val(node).shape, _val(node).dtype):
        return None
    if node.target is not aten.masked_fill_.Scalar and (kept in written or node in written):
        return None  # (an in-place fill of nothing is its input, written or not)
    return kept


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _is_value_identity(node) -> bool:
    """Whether ``node`` returns its first input's values unchanged (same shape and order)."""
    src, out = _val(node.args[0]) if node.args else None, _val(node)
    if not (torch.is_tensor(src) and torch.is_tensor(out)):
        return False
    if src.shape != out.shape or src.dtype != out.dtype:
        return False
    if node.target in _RESHAPES:
        return True
    if node.target in _PERMUTES:
        return _keeps_element_order(node)
    if node.target is aten.cat.default:
        return len(node.args[0]) == 1
    if node.target is aten.sum.default:
        return len(node.args) == 1 and src.dim() == 0  # the sum of a 0-d tensor
    if node.target in _IDENTITY_SCALAR and len(node.args) == 2:
        other = node.args[1]
        return isinstance(other, (int, float)) and other == _IDENTITY_SCALAR[node.target]
    return False


def _is_log_of_exp(node, written: set) -> bool:
    """``log(exp(x))``: the log of a positive site's constrained value, which is ``exp`` of
    the unconstrained one (every ``Normal(loc, sigma)`` whose ``sigma`` is a ``HalfNormal``,
    ``HalfCauchy``, ``LogNormal``, ... site takes ``log(sigma)``). The result is ``x`` itself
    (more exact, too: ``exp`` overflows and underflows where ``x`` does not). Not where ``x``
    or ``exp(x)`` is in ``written`` (:func:`_written_storage`): ``x`` would be read later, maybe
    after a write. (``exp(x)`` is looked up there, not searched through its users: a model of a
    thousand observation sites takes the log of one scale a thousand times.)"""
    src = node.args[0] if node.target is aten.log.default and len(node.args) == 1 else None
    return (isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target is aten.exp.default
            and not _written_through(node) and src not in written
            and isinstance(src.args[0], torch.fx.Node) and src.args[0] not in written
            and torch.is_tensor(_val(src.args[0])) and torch.is_tensor(_val(node))
            and _val(src.args[0]).dtype == _val(node).dtype and _val(src.args[0]).shape == _val(node).shape)


def _keeps_element_order(node) -> bool:
    """Whether the permutation ``node`` moves only dimensions of size 1, so that its result
    holds its input's elements in the same order: a reshape."""
    src = _val(node.args[0])
    moved = [d for d in _permutation(node) if src.shape[d] != 1]
    return moved == sorted(moved)


def _permutation(node) -> Optional[List[int]]:
    """The dimensions of ``node``'s input that ``node`` (a permute, ``t`` or ``transpose``)
    puts in each place of its result, or ``None`` where its input's rank is not known."""
    src = _val(node.args[0])
    if not torch.is_tensor(src):
        return None
    rank = src.dim()
    if node.target is aten.permute.default:
        return [d % max(rank, 1) for d in node.args[1]]
    order = list(range(rank))
    if rank >= 2:
        a, b = (0, 1) if node.target is aten.t.default else (d % rank for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
    return order


def _is_permutation_of_permutation(node) -> bool:
    src = node.args[0]
    return (isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in _PERMUTES
            and _permutation(node) is not None and _permutation(src) is not None)


def _transposed_reads(node, written) -> Optional[list]:
    """Where ``node``, a matrix product, is read only through 2-D transposes, directly or
    after elementwise ops of it alone (``t(exp(X @ W))``; numbers and one-element tensors
    besides), one of which has a reader other than a permutation (a transpose back cancels
    it: ``(x @ w.t()).t().t()``): those elementwise ops and transposes, each after the one
    it reads (each reads one of them); else ``None``."""
    if node.target is not aten.mm.default or node in written or not all(torch.is_tensor(_val(x)) for x in node.args):
        return None
    reads, pending, useful = [], [node], False
    while pending:
        for user in pending.pop().users:
            if user.target in _PERMUTES and _permutation(user) == [1, 0] and not _written_through(user):
                useful = useful or any(r.target not in _PERMUTES for r in user.users)
            elif not (_is_pointwise(user) and user not in written and _elementwise_of_one(user)):
                return None
            else:
                pending.append(user)
            reads.append(user)
    return reads if useful else None


def _elementwise_of_one(node) -> bool:
    """Whether ``node`` (elementwise) reads one tensor of its own shape, and otherwise
    numbers and one-element tensors only, so that it commutes with a transpose."""
    out = _val(node)
    inputs = [a for a in list(node.args) + list(node.kwargs.values()) if isinstance(a, torch.fx.Node)]
    full = [a for a in inputs if torch.is_tensor(_val(a)) and _val(a).numel() > 1]
    return (
        torch.is_tensor(out) and len(full) == 1 and _val(full[0]).shape == out.shape
        and all(a in full or (torch.is_tensor(_val(a)) and _val(a).numel() == 1) for a in inputs)
        and not any(isinstance(a, (list, tuple)) for a in node.args)
    )


def _is_masked_fill(node) -> bool:
    if node.target not in (aten.index_put_.default, aten.index_put.default) or len(node.args) < 3:
        return False
    if len(node.args) > 3 and node.args[3]:  # accumulate=True is an add, not a fill
        return False
    x, indices, value = node.args[:3]
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1):
        return False
    mask, xv, vv = _val(indices[0]), _val(x), _val(value)
    return (
        torch.is_tensor(mask) and mask.dtype == torch.bool and torch.is_tensor(xv)
        and mask.shape == xv.shape and torch.is_tensor(vv) and vv.dim() == 0
    )


@_graph_pass
def simplify(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove ops that do not change values (reshapes to the same shape, permutations of
    unit dimensions, ``x + 0``, ``x * 1``, ``x ** 1``, one-element ``cat``) and collapse chains of
    reshapes. Each op removed saves a few microseconds per call in the interpreted engines."""
    graph = gm.graph
    written = _written_storage(graph.nodes)  # a copy of one, read before a write, is not the same value
    order = {n: i for i, n in enumerate(graph.nodes)}
    layout_read = _reads_layouts(graph)  # then no product may be computed transposed
    for node in graph.nodes:
        if node.op == "get_attr" and "val" not in node.meta:
            node.meta["val"] = getattr(gm, node.target)  # constants: their value is their meta
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _is_masked_fill(node):
            # x[mask] = v with a full-shape mask: a `where`, which vmap and compilers accept
            x, (mask,), value = node.args[:3]
            with graph.inserting_before(node):
                where = graph.call_function(aten.where.self, (mask, value, x))
            where.meta = dict(node.meta)
            later = [u for u in x.users if u is not node and order.get(u, -1) > order[node]]
            node.replace_all_uses_with(where)
            for user in later:
                user.replace_input_with(x, where)
            graph.erase_node(node)
            continue
        if node.target is aten.cat.default and len(node.args[0]) == 1 and _val(node) is not None:
            if (_val(node.args[0][0]) is not None and _val(node.args[0][0]).shape == _val(node).shape
                    and not _written_through(node) and node.args[0][0] not in written):
                node.replace_all_uses_with(node.args[0][0])
                graph.erase_node(node)
            continue
        if node.target is aten.split_with_sizes.default and len(node.args[1]) == 1:
            # one piece: the whole tensor (a site that is the entire latent vector)
            for user in list(node.users):
                if user.target is operator.getitem and user.args[1] == 0:
                    user.replace_all_uses_with(node.args[0])
                    graph.erase_node(user)
            if not node.users:
                graph.erase_node(node)
            continue
        # (nor a copy of an input that is written in place later: its readers would see the write)
        if (_is_value_identity(node) and not _written_through(node)
                and (_returns_view(node) or node.args[0] not in written)):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        if _is_log_of_exp(node, written):
            node.replace_all_uses_with(node.args[0].args[0])
            graph.erase_node(node)
            continue
        if node.target in _PERMUTES and torch.is_tensor(_val(node)) and torch.is_tensor(_val(node.args[0])) \
                and _keeps_element_order(node):
            # a permutation of unit dimensions is a reshape (collapsed into the one below)
            node.target, node.args, node.kwargs = aten.reshape.default, (node.args[0], list(_val(node).shape)), {}
        reads = None if layout_read else _transposed_reads(node, written)
        if reads:
            # t(a @ b) -> t(b) @ t(a), and t(f(a @ b)) -> f(t(b) @ t(a)) for elementwise f:
            # vmap's matrix-vector products over a batch of points (`X @ w` for every chain
            # is `t(X @ t(W))`), the product written in the order the batch is read (the
            # logistic regression's for 4 chains: 32 -> 10 µs, and the elementwise ops on
            # its (4, 5,000) result ~3x faster); the passes after this one cancel or fold
            # the transposes of its operands
            a, b = node.args
            with graph.inserting_before(node):
                ta, tb = (graph.call_function(aten.permute.default, (x, [1, 0])) for x in (a, b))
                product = graph.call_function(aten.mm.default, (tb, ta))
            ta.meta["val"], tb.meta["val"] = _val(a).t(), _val(b).t()
            product.meta["val"] = _val(node).t().contiguous()
            transposed = {node: product}
            for read in reads:
                source = next(x for x in read.all_input_nodes if x in transposed)
                if read.target in _PERMUTES:
                    read.replace_all_uses_with(transposed[source])  # read by nothing now: dead code
                    continue
                with graph.inserting_before(read):
                    args, kwargs = torch.fx.node.map_arg((read.args, read.kwargs), lambda x: transposed.get(x, x))
                    transposed[read] = graph.call_function(read.target, args, kwargs)
                transposed[read].meta["val"] = _val(read).t().contiguous()
            continue
        if node.target in _PERMUTES and _is_permutation_of_permutation(node):
            # permute(permute(x)) -> one permute of x, or x itself where they cancel (the
            # gradient of `x @ W.T` transposes W's gradient back)
            inner, source = _permutation(node.args[0]), node.args[0].args[0]
            composed = [inner[d] for d in _permutation(node)]
            if composed == sorted(composed):
                if not _written_through(node):
                    node.replace_all_uses_with(source)
                    graph.erase_node(node)
                continue
            node.target, node.args, node.kwargs = aten.permute.default, (source, composed), {}
        # view(view(x)) -> view(x): a reshape of a reshape only needs the final shape
        if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            src = node.args[0]
            if (isinstance(src, torch.fx.Node) and src.op == "call_function"
                    and src.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)):
                node.args = (src.args[0],) + tuple(node.args[1:])
                node.target = aten.reshape.default
                if _is_value_identity(node) and not _written_through(node):  # e.g. a column and back
                    node.replace_all_uses_with(node.args[0])
                    graph.erase_node(node)
    _eliminate_dead_code(graph)


_ADDS = {aten.add.Tensor, aten.add.Scalar}
_SUBS = {aten.sub.Tensor, aten.sub.Scalar}
_MULS = {aten.mul.Tensor, aten.mul.Scalar}
_DIVS = {aten.div.Tensor, aten.div.Scalar}
_ONE = torch.ones((), dtype=torch.float64)


class _Linear(NamedTuple):
    """A node's value as ``sum(coefficients[t] * t) + constant`` over non-constant nodes
    ``t``; coefficients and constant are float64 tensors broadcasting to the node's shape
    without changing it. ``ops`` counts the nodes this form stands for."""

    coefficients: Dict[torch.fx.Node, torch.Tensor]
    constant: torch.Tensor
    ops: int


def _linear_form(gm: torch.fx.GraphModule, node) -> Optional[_Linear]:
    """The :class:`_Linear` form of ``node`` in its inputs, if it is ``x + y``, ``x - y``
    (either operand possibly a constant, ``alpha`` allowed), ``x * c``, ``x / c``, ``-x``,
    ``addcmul(c1, x, c2)`` or the sum of a 0-d tensor, with every non-constant operand of
    the node's own shape and dtype (no broadcasting, no type promotion); else ``None``."""
    if node.op != "call_function" or set(node.kwargs) - {"alpha"}:
        return None
    out, target = _val(node), node.target
    if not (torch.is_tensor(out) and out.is_floating_point()):
        return None

    def constant(arg):
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            return torch.tensor(float(arg), dtype=torch.float64)
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            value = getattr(gm, arg.target)
            if torch.is_tensor(value) and value.dtype == out.dtype and value.dim() <= out.dim():
                return value.detach().to(torch.float64)
        return None

    def term(arg):
        v = _val(arg)
        ok = isinstance(arg, torch.fx.Node) and torch.is_tensor(v) and v.shape == out.shape and v.dtype == out.dtype
        return arg if ok else None

    alpha = node.kwargs.get("alpha", 1)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        return None
    args = node.args
    if target is aten.neg.default and len(args) == 1:
        pairs, c = [(args[0], -_ONE)], 0 * _ONE
    elif target is aten.sum.default and len(args) == 1 and out.dim() == 0:
        pairs, c = [(args[0], _ONE)], 0 * _ONE
    elif target in _ADDS | _SUBS and len(args) == 2:
        sign = -1.0 if target in _SUBS else 1.0
        (lhs, rhs), weights = args, (_ONE, sign * alpha * _ONE)
        pairs, c = [], 0 * _ONE
        for arg, w in zip((lhs, rhs), weights):
            k = constant(arg)
            if k is not None:
                c = c + w * k
            else:
                pairs.append((arg, w))
        if not pairs:
            return None
    elif target is aten.addcmul.default and len(args) == 3 and not node.kwargs:  # what this pass writes
        k_self, k_factor = constant(args[0]), constant(args[2])
        if k_self is None or k_factor is None:
            return None
        pairs, c = [(args[1], k_factor)], k_self
    elif target in _MULS | _DIVS and len(args) == 2 and not node.kwargs:
        lhs, rhs = args
        k_lhs, k_rhs = constant(lhs), constant(rhs)
        if k_rhs is not None and k_lhs is None:
            pairs, c = [(lhs, 1 / k_rhs if target in _DIVS else k_rhs)], 0 * _ONE
        elif k_lhs is not None and k_rhs is None and target in _MULS:
            pairs, c = [(rhs, k_lhs)], 0 * _ONE
        else:
            return None
    else:
        return None
    coefficients = {}
    for arg, w in pairs:
        t = term(arg)
        if t is None or t.op == "get_attr":
            return None
        coefficients[t] = coefficients.get(t, 0 * _ONE) + w
    every = list(coefficients.values()) + [c]
    if not all(torch.isfinite(x).all() for x in every):
        return None
    return _Linear(coefficients, c, 1)


def _merged(outer: _Linear, inner_of):
    """``outer`` with every term that has a form in ``inner_of`` (and no other use) replaced
    by that form, where the result keeps scalar coefficients whenever it has several terms;
    and the terms so replaced.

    In time proportional to the smaller side: a sum of n log densities added one by one (a
    model with a sample site per row, in a Python loop) is n merges into a growing form,
    which copying would make quadratic. The inner form is used here only (its node has no
    other use), so its dictionary is taken over where it is the larger. A form of several
    terms has scalar coefficients (this function allows no other), so whether the result's
    are scalars is known from the inner form's size, or its one coefficient."""
    coefficients, constant, ops, replaced = dict(outer.coefficients), outer.constant, outer.ops, []
    for t, c in outer.coefficients.items():
        inner = inner_of(t)
        if inner is None:
            continue
        terms = inner.coefficients
        others = len(coefficients) - 1  # coefficients' terms besides t: scalars, if several
        one_term = len(terms) <= 1 and (others == 0 or (others == 1 and len(terms) == 1 and any(
            u is not t and u in terms for u in coefficients)))
        scalar = c.numel() == 1 and (len(terms) > 1 or all(cu.numel() == 1 for cu in terms.values()))
        if not (one_term or scalar):
            continue
        del coefficients[t]
        if c.numel() == 1 and c.item() == 1 and len(terms) > len(coefficients):
            base, addend = terms, coefficients
        else:
            base, addend = coefficients, {u: c * cu for u, cu in terms.items()}
        for u, cu in addend.items():
            base[u] = base[u] + cu if u in base else cu
        coefficients, constant, ops = base, constant + c * inner.constant, ops + inner.ops
        replaced.append(t)
    return _Linear(coefficients, constant, ops), replaced


@_graph_pass
def fold_linear_chains(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite each tree of elementwise linear ops whose intermediate results have no other
    use -- ``(x - c1) / c2 * c3 + c4``, ``-(a + c + b - d)``, ... -- as the fewest ops that
    compute the same combination: ``x * a``, ``x + b``, ``addcmul(b, x, a)``, and for several
    terms a chain of ``add(acc, t, alpha=k)``; the constants are composed once, in float64.

    Distributions' log densities are full of such trees (standardising, normalising
    constants, the sum of the sites' log densities and Jacobians, the sign of the
    potential, the factors of their gradients); in the traced engines every op costs the
    same few microseconds of dispatch whatever its size, so each op removed is a few
    microseconds off every gradient. The result agrees with the original to float rounding
    (the constants round once instead of at every step; sums are reassociated).
    """
    graph = gm.graph
    forms, absorbed = {}, set()

    def inner_of(t):
        return forms.get(t) if len(t.users) == 1 else None

    written = _written_storage(graph.nodes)
    for node in graph.nodes:
        # a tensor written in place: the composed ops would read it later, maybe after the write
        form = None if written.intersection(node.all_input_nodes) else _linear_form(gm, node)
        if form is None:
            continue
        forms[node], replaced = _merged(form, inner_of)
        absorbed.update(replaced)

    def constant(value: torch.Tensor, dtype, scalar_ok: bool):
        if scalar_ok and value.numel() == 1:
            return value.item()
        return _constant_node(gm, "_linear_", value.to(dtype).reshape(value.shape))

    def scaled(x, a, b, dtype):
        """``a * x + b`` in at most one op."""
        if bool((b == 0).all()):
            return x if bool((a == 1).all()) else graph.call_function(aten.mul.Tensor, (x, constant(a, dtype, True)))
        if bool((a == 1).all()):
            return graph.call_function(aten.add.Tensor, (x, constant(b, dtype, True)))
        return graph.call_function(aten.addcmul.default, (constant(b, dtype, False), x, constant(a, dtype, False)))

    replacement = {}  # rewritten node -> what computes it now
    for node, form in forms.items():
        if node in absorbed:
            continue
        terms = [(replacement.get(t, t), c) for t, c in form.coefficients.items()]
        if not terms:
            continue
        # the first term is the scale the others' coefficients are written against (as
        # ``alpha = c / scale``): one with coefficient 1 if any (no scaling op), never one of 0
        ones = [i for i, (_, c) in enumerate(terms) if bool((c == 1).all())]
        nonzero = [i for i, (_, c) in enumerate(terms) if bool((c != 0).all())]
        if len(terms) > 1 and not nonzero:
            continue
        if ones or nonzero:
            terms.insert(0, terms.pop((ones or nonzero)[0]))
        scale = terms[0][1]
        needed = (len(terms) - 1) + int(not bool((scale == 1).all()) or not bool((form.constant == 0).all()))
        if needed >= form.ops:
            continue
        dtype = _val(node).dtype
        with graph.inserting_before(node):
            acc = terms[0][0]
            for t, c in terms[1:]:
                ratio = (c / scale).item()
                kwargs = {} if ratio == 1 else {"alpha": ratio}
                acc = graph.call_function(aten.add.Tensor, (acc, t), kwargs)
                acc.meta["val"] = _val(node)
            new = scaled(acc, scale, form.constant, dtype)
        if new is terms[0][0] and _written_through(node):
            continue  # written in place: must stay a tensor of its own, not one of its terms
        if new is not terms[0][0]:  # a new node (else the combination is one of its terms)
            new.meta["val"] = _val(node)
        node.replace_all_uses_with(new)
        replacement[node] = new
    _eliminate_dead_code(graph)


def _scalar_operand(arg, like: torch.Tensor) -> bool:
    """Whether ``arg`` is a number, or a node of one element and ``like``'s dtype that does
    not broadcast ``like`` to another shape: an operand that a sum of ``like``'s elements can
    take out of the sum."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return True
    v = _val(arg)
    return torch.is_tensor(v) and v.numel() == 1 and v.dtype == like.dtype and v.dim() <= like.dim()


def _whole(arg, like: torch.Tensor) -> bool:
    """Whether ``arg`` is a node of ``like``'s shape and dtype."""
    v = _val(arg)
    return torch.is_tensor(v) and v.shape == like.shape and v.dtype == like.dtype


def _scaling(node):
    """For ``y = x * s``, ``x / s`` or ``-x``, with ``x`` of ``y``'s shape and dtype and ``s``
    a number or one element: ``(x, s, power)`` (``power`` -1 for a division; ``-x`` is
    ``(x, -1, 1)``); else ``None``."""
    out = _val(node)
    if node.op != "call_function" or node.kwargs or not (torch.is_tensor(out) and out.is_floating_point()):
        return None
    args = node.args
    if node.target is aten.neg.default and _whole(args[0], out):
        return args[0], -1, 1
    if node.target in _MULS and len(args) == 2:
        for x, k in (args, args[::-1]):
            if _whole(x, out) and _scalar_operand(k, out):
                return x, k, 1
    if node.target in _DIVS and len(args) == 2 and _whole(args[0], out) and _scalar_operand(args[1], out):
        return args[0], args[1], -1
    return None


def _new_op(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A call of ``target`` at the graph's insertion point, its ``meta["val"]`` computed from
    its operands' (for the passes after)."""
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = target(*torch.fx.node.map_arg(args, _val), **kwargs)
    return node


def _sum_taken_apart(node):
    """For ``y``, the input of a full sum, written as ``y = f(x, s)`` with ``x`` of ``y``'s
    shape and ``s`` one element (``-x``, ``x * s``, ``x / s``, ``x + a s``, ``x - a s``,
    ``s - a x``, ``addcmul(s, x, t)``) or a constant of ``y``'s shape (``x + a c``, ``c - a
    x``): ``(x, rebuild)``, where ``rebuild(graph, sum_of_x)`` adds the ops computing
    ``sum(y)`` from ``sum(x)`` (``n`` elements: ``x + s`` sums to ``sum(x) + n s``, ``x + c`` to
    ``sum(x) + sum(c)``, which :func:`fold_constants` computes once). ``None`` for anything
    else."""
    scaled = _scaling(node)
    if scaled is not None:
        x, k, power = scaled
        return x, lambda g, total: _new_op(g, aten.mul.Tensor if power == 1 else aten.div.Tensor, total, k)
    out = _val(node)
    if node.op != "call_function" or not (torch.is_tensor(out) and out.is_floating_point()):
        return None
    n, args, target = out.numel(), node.args, node.target
    alpha = node.kwargs.get("alpha", 1)
    if set(node.kwargs) - {"alpha", "value"} or isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        return None
    if target in _ADDS | _SUBS and len(args) == 2:
        sign = -1 if target in _SUBS else 1
        x, k = args
        if _whole(x, out) and _scalar_operand(k, out):  # x + sign alpha k
            return x, lambda g, total: _new_op(g, aten.add.Tensor, total, k, alpha=sign * alpha * n)
        # a constant of y's shape, summed once by fold_constants; only where y has no other
        # use, which would keep y and add the constant's sum to its ops
        constant = _whole(k, out) and k.op == "get_attr" and len(node.users) == 1
        if _whole(x, out) and constant:
            return x, lambda g, total: _new_op(g, aten.add.Tensor, total, _new_op(g, aten.sum.default, k),
                                               alpha=sign * alpha)
        k, x = args
        constant = _whole(k, out) and k.op == "get_attr" and len(node.users) == 1
        if _whole(x, out) and (_scalar_operand(k, out) or constant):  # k + sign alpha x
            return x, lambda g, total: _new_op(
                g, aten.add.Tensor, _new_op(g, aten.mul.Tensor, total, sign * alpha),
                _new_op(g, aten.sum.default, k) if constant else k, alpha=1 if constant else n)
    if target is aten.addcmul.default and len(args) == 3:  # k + value a b
        k, a, b = args
        value = node.kwargs.get("value", 1)
        if _scalar_operand(k, out) and not isinstance(k, (int, float)):
            for x, factor in ((a, b), (b, a)):
                if _whole(x, out) and _scalar_operand(factor, out) and not isinstance(factor, (int, float)):
                    return x, lambda g, total, f=factor: _new_op(
                        g, aten.add.Tensor, _new_op(g, aten.mul.Tensor, _new_op(g, aten.mul.Tensor, total, f), value),
                        k, alpha=n)
    return None


def _has_scalars_to_take_out(graph: torch.fx.Graph) -> bool:
    """Whether :func:`pull_scalars_out_of_sums` or :func:`gather_scalar_factors` would find
    something to rewrite: a full sum of a ``y = f(x, s)``, or two scalings in a row."""
    for node in graph.nodes:
        if node.target is aten.sum.default and len(node.args) == 1 and isinstance(node.args[0], torch.fx.Node):
            if _sum_taken_apart(node.args[0]) is not None:
                return True
        scaled = _scaling(node)
        if scaled is not None and len(scaled[0].users) == 1 and _scaling(scaled[0]) is not None:
            return True
    return False


@_graph_pass
def pull_scalars_out_of_sums(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Take one-element operands out of full sums: ``sum(x * s) = sum(x) * s``, ``sum(x + s)
    = sum(x) + n s``, ``sum(-x) = -sum(x)``, ..., as deep as they go.

    A plate's log density is summed over its elements after elementwise ops with the
    model's scalars: ``Normal(loc, sigma)`` over 960 observations computes ``-(r ** 2) / (2
    sigma ** 2) - log(sigma) - 0.919`` on 960 elements before its sum, and the gradient in
    ``sigma`` sums ``r ** 2 / sigma ** 3``-like chains of its own. Pulled out, both sums are
    ``sum(r ** 2)`` (one op once merged), the rest are ops on numbers that
    :func:`fold_linear_chains` folds into the potential's other terms, and the 960-element
    intermediates are no longer computed. The values agree to float rounding (sums are
    reassociated). The result can have *more* operations (a pulled-out intermediate that
    other ops still need is computed anyway), so :func:`trace` keeps it only where it has
    fewer once folded and merged. An op reading a tensor that is written in place is not
    taken apart (its operands would be read later, where the sum is)."""
    graph = gm.graph
    written = _written_storage(graph.nodes)
    for node in list(graph.nodes):
        if node.target is not aten.sum.default or len(node.args) != 1 or node.kwargs or _written_through(node):
            continue
        inner, wrap = node.args[0], []
        while isinstance(inner, torch.fx.Node):
            taken = _sum_taken_apart(inner)
            # the new ops read their operands where the sum is: not a tensor written in between
            if taken is None or written.intersection(inner.all_input_nodes):
                break
            inner, rebuild = taken
            wrap.append(rebuild)
        if not wrap:
            continue
        with graph.inserting_before(node):
            total = _new_op(graph, aten.sum.default, inner)
            for rebuild in reversed(wrap):
                total = rebuild(graph, total)
        node.replace_all_uses_with(total)
        graph.erase_node(node)
    _eliminate_dead_code(graph)


@_graph_pass
def gather_scalar_factors(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Scale a tensor once by the product of its one-element factors: ``-(x * 2) * s / t``
    becomes ``x * (s / t) * -2``, where the intermediate results have no other use. The
    gradient of a plate's log density is full of such chains (``Normal``'s gradient in its
    ``loc`` is ``-(r * 2) * (-1 / (2 * sigma ** 2))`` over the plate), and so is the
    arithmetic on the model's scalars. The factors are multiplied together among
    themselves (one element each), and the numbers come last, where :func:`fold_linear_chains`
    folds them into the sum or difference that uses the result (or into ``x`` itself if it
    is a constant). The values agree to float rounding. It can add an operation (``x / t *
    2`` stays two), so :func:`trace` keeps the result only where it has fewer."""
    graph = gm.graph
    written = _written_storage(graph.nodes)
    for node in reversed(list(graph.nodes)):  # the outermost op of a chain first
        if not node.users or _written_through(node):  # dead: the inside of a chain gathered already
            continue
        up, down, numbers, x, chain = [], [], 1.0, node, 0
        while True:
            scaled = _scaling(x)
            if scaled is None or (x is not node and (len(x.users) != 1 or _written_through(x))):
                break
            if written.intersection(x.all_input_nodes):
                break  # the product reads its operands where the chain ends: not a tensor written in between
            x, k, power = scaled
            chain += 1
            if isinstance(k, (int, float)):
                numbers = numbers * k if power == 1 else numbers / k
            else:
                (up if power == 1 else down).append(k)
        constant_x = x.op == "get_attr" and _val(x).numel() == 1
        # ops: products of factors (one fewer than there are), their ratio, the scaling, the number
        gathered = len(up) + len(down) + (numbers != 1.0 and not constant_x)
        if chain < 2 or not (up or down) or gathered > chain:
            continue  # one op; factors that are all numbers (fold_linear_chains' work); or more ops

        def product(factors):
            return functools.reduce(lambda a, b: _new_op(graph, aten.mul.Tensor, a, b), factors) if factors else None

        with graph.inserting_before(node):
            if constant_x and numbers != 1.0:
                x, numbers = _constant_node(gm, "_folded_", _val(x) * numbers), 1.0
            if numbers != 1.0 and up and _val(x).numel() > 1:  # on a factor, not on x's elements
                up, numbers = up[:-1] + [_new_op(graph, aten.mul.Tensor, up[-1], numbers)], 1.0
            up, down = product(up), product(down)
            if up is not None and down is not None:
                up, down = _new_op(graph, aten.div.Tensor, up, down), None
            new = _new_op(graph, aten.mul.Tensor, x, up) if up is not None else _new_op(graph, aten.div.Tensor, x, down)
            if numbers != 1.0:
                new = _new_op(graph, aten.mul.Tensor, new, numbers)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    _eliminate_dead_code(graph)


def _is_pointwise(node) -> bool:
    """A functional elementwise op (torch's ``pointwise`` tag): its value at an element depends
    only on its inputs' values at that element, after broadcasting."""
    target = node.target
    return (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)
            and torch.Tag.pointwise in target.tags and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)


@_graph_pass
def shrink_broadcasts(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Compute elementwise ops on values before they are broadcast, not after (and a
    ``log_softmax`` along a dimension the broadcast leaves alone: :func:`_is_row_wise_of_rows`).

    A plate broadcasts a model's scalars to the plate's shape: ``Normal(loc, sigma)`` over
    960 observations takes ``log(sigma)``, ``sigma ** 2``, ... of ``sigma`` expanded to 960
    elements, and its gradient divides by that again; the folded constants of the gradient
    are often tensors of the plate's shape holding one value. An elementwise op whose
    inputs are such broadcasts (``expand``, or a constant whose elements are all equal) is
    computed on the unbroadcast inputs: in place when another input still gives the result
    its shape (broadcasting does the expanding), else followed by an ``expand`` that the
    ops after it shrink in turn. The values are the same, element for element; in the
    hierarchical benchmark model's gradient six 960-element operations become scalar ones,
    and a 960-element constant a number (~3 µs of ~65 a gradient). An op
    whose result type would change (type promotion treats 0-d tensors differently) is left
    as it is, and so is a result that an in-place op writes (a write into an ``expand``
    would hit one element many times): only its operands are unbroadcast. (Written
    results are few: torch's ``clamp`` gradient ``logical_and_``s two masks; when any write
    in the graph kept every result full, a ``Binomial(n, probs=p)`` over a plate computed
    its ``log(p)``, ``log1p(-p)`` and their gradients on every observation.)"""
    graph = gm.graph
    uniform = {}  # constant node -> its one value as a 0-d constant node (or None)

    def unbroadcast(arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        if arg.op == "call_function" and arg.target is aten.expand.default and torch.is_tensor(_val(arg.args[0])):
            return arg.args[0]
        if arg.op == "get_attr":
            if arg not in uniform:
                value = getattr(gm, arg.target)
                one = torch.is_tensor(value) and value.numel() > 1 and bool((value == value.reshape(-1)[0]).all())
                if one:
                    with graph.inserting_after(arg):
                        uniform[arg] = _constant_node(gm, "_uniform_", value.reshape(-1)[0].clone())
                else:
                    uniform[arg] = None
            return uniform[arg] or arg
        return arg

    for node in list(graph.nodes):
        out = _val(node)
        if not (torch.is_tensor(out) and (_is_pointwise(node) or _is_row_wise_of_rows(node))):
            continue
        args = tuple(unbroadcast(a) for a in node.args)
        if all(a is b for a, b in zip(args, node.args)):
            continue
        try:
            val = node.target(*torch.fx.node.map_arg(args, _val), **torch.fx.node.map_arg(node.kwargs, _val))
        except Exception:
            continue
        if not torch.is_tensor(val) or val.dtype != out.dtype:
            continue
        if val.shape == out.shape:
            node.args = args
            continue
        if _written_through(node):
            continue
        with graph.inserting_before(node):
            small = graph.call_function(node.target, args, dict(node.kwargs))
            small.meta["val"] = val
            broadcast = graph.call_function(aten.expand.default, (small, list(out.shape)))
            broadcast.meta["val"] = out
        node.replace_all_uses_with(broadcast)
        graph.erase_node(node)
    _eliminate_dead_code(graph)


_ROW_WISE = {aten._log_softmax.default, aten._softmax.default}


def _is_row_wise_of_rows(node) -> bool:
    """Whether ``node`` normalises its input along one dimension (``log_softmax``), counted
    from the end, along which the input, if an ``expand``, is not broadcast: then it is the
    same computed before the broadcast (a mixture's weights, broadcast by a plate, are
    normalised once, not once per observation: 5,000 x 3, ~200 µs -> ~2)."""
    return node.target in _ROW_WISE and not node.kwargs and _broadcast_source(node.args[0], node.args[1]) is not None


def _broadcast_source(x, dim) -> Optional[torch.fx.Node]:
    """The value that ``x``, an ``expand``, broadcasts, where it broadcasts it along other
    dimensions than ``dim`` (counted from the end) only; else ``None``."""
    source = x.args[0] if isinstance(x, torch.fx.Node) and x.target is aten.expand.default else None
    small, full = _val(source), _val(x)
    if (isinstance(dim, int) and dim < 0 and torch.is_tensor(small) and torch.is_tensor(full)
            and small.dim() >= -dim and small.shape[dim] == full.shape[dim]):
        return source
    return None


@_graph_pass
def cheaper_log_softmax(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``log_softmax`` and its gradient computed only where they change values, and as
    formulas of faster ops where torch's kernels are slow (:func:`_log_softmax_rewritten`).
    Runs after :func:`shrink_broadcasts`, whose ``expand`` after a ``log_softmax`` computed
    before a plate's broadcast tells its gradient which weights to take."""
    graph = gm.graph
    normalised = {}  # logits that stood for their own log_softmax -> its dimension
    for node in list(graph.nodes):
        replacement = _log_softmax_rewritten(graph, node, normalised)
        if replacement is not None:
            node.replace_all_uses_with(replacement)
            graph.erase_node(node)
    _eliminate_dead_code(graph)


# Rows shorter than this many elements, and at least this many rows: where torch's CPU
# kernels of log_softmax and its gradient are slower than formulas (_along_short_rows).
_SHORT_ROW, _MANY_ROWS = 8, 512


def _along_short_rows(x, dim) -> bool:
    """Whether ``log_softmax`` of ``x`` along ``dim`` runs slowly in torch's CPU kernel:
    ``dim`` is the last of a floating-point tensor of at least :data:`_MANY_ROWS` rows of 2
    to 7 elements. The kernels vectorise along that dimension, and a row shorter than a
    vector (8 floats with AVX2, 16 with AVX-512) goes through a scalar loop: for 5,000 x 3 in
    float32, ~180 µs against ~75 for ``x - logsumexp(x)`` and ~90 against ~40 for the
    gradient's formula; with AVX2, rows of 8 or more are faster in the kernels. (A softmax
    regression written with ``log_softmax``; ``MixtureSameFamily``'s normalisation of
    ``Categorical`` logits goes away altogether: :func:`_log_softmax_rewritten`.)"""
    v = _val(x)
    return (torch.is_tensor(v) and v.is_floating_point() and v.dim() >= 1 and isinstance(dim, int)
            and dim % v.dim() == v.dim() - 1 and 2 <= v.shape[-1] < _SHORT_ROW
            and v.numel() // v.shape[-1] >= _MANY_ROWS)


def _log_softmax_rewritten(graph: torch.fx.Graph, node, normalised: dict) -> Optional[torch.fx.Node]:
    """What replaces ``node``, a ``log_softmax`` or its gradient, where torch computes it
    needlessly or slowly; ``None`` where nothing does.

    - ``log_softmax`` of logits normalised along that dimension already, ``x = a -
      logsumexp(a)`` (``Categorical(logits=a)`` stores its logits so, and
      ``MixtureSameFamily`` normalises them again): ``x`` itself, the same values to
      rounding. Its gradient ``g - p * g.sum()`` (``p = exp(x)``, the probabilities) then
      becomes ``g``: the two differ by a multiple of ``p`` in every row, which the gradient
      of ``x``'s own normalisation, ``h - p * h.sum()``, takes to zero, so the gradient of
      ``a`` is the same. ``normalised`` keeps the logits that stood in for a ``log_softmax``,
      so that its gradient is recognised. (Not where an in-place op writes the result, which
      would then write the logits or ``g``.)
    - where torch's kernels are slow, formulas of faster ops
      (:func:`_log_softmax_backward_as_formula`, :func:`_log_softmax_as_formula`)."""
    if node.target is aten._log_softmax.default and not node.kwargs and not node.args[2]:
        x, dim = node.args[:2]
        if _is_normalised(x, dim) and _val(x).dtype == _val(node).dtype and not _written_through(node):
            normalised[x] = dim % _val(x).dim()
            return x
    if node.target is aten._log_softmax_backward_data.default and not node.kwargs:
        g, output, dim, dtype = node.args
        if (output in normalised and isinstance(dim, int) and dim % _val(output).dim() == normalised[output]
                and torch.is_tensor(_val(g)) and _val(g).dtype == dtype == _val(node).dtype
                and _val(g).shape == _val(node).shape and not _written_through(node)):
            return g
    formula = _log_softmax_backward_as_formula(graph, node)
    return formula if formula is not None else _log_softmax_as_formula(graph, node)


def _is_normalised(x, dim) -> bool:
    """Whether ``x`` is ``a - logsumexp(a, dim, keepdim=True)``: logits normalised along
    ``dim``, whose ``log_softmax`` along it is ``x`` itself."""
    if not (isinstance(x, torch.fx.Node) and x.target is aten.sub.Tensor and not x.kwargs and isinstance(dim, int)):
        return False
    a, normaliser = x.args
    if not (isinstance(normaliser, torch.fx.Node) and normaliser.target is aten.logsumexp.default
            and normaliser.args[0] is a and len(normaliser.args) == 3 and normaliser.args[2] is True):
        return False
    v, dims = _val(x), normaliser.args[1]
    return (torch.is_tensor(v) and v.dim() >= 1 and len(dims) == 1
            and dims[0] % v.dim() == dim % v.dim() and _val(a).shape == v.shape)


def _log_softmax_as_formula(graph: torch.fx.Graph, node) -> Optional[torch.fx.Node]:
    """``log_softmax`` ``node`` along short rows (:func:`_along_short_rows`) as
    ``x - logsumexp(x, dim)``, the same values to rounding; ``None`` elsewhere, and where
    its input is a broadcast, normalised before broadcasting instead
    (:func:`_is_row_wise_of_rows`)."""
    if node.target is not aten._log_softmax.default or node.kwargs or node.args[2] or _is_row_wise_of_rows(node):
        return None
    x, dim = node.args[:2]
    if not _along_short_rows(x, dim) or _val(x).dtype != _val(node).dtype:
        return None
    with graph.inserting_before(node):
        normaliser = graph.call_function(aten.logsumexp.default, (x, [dim], True))
        result = graph.call_function(aten.sub.Tensor, (x, normaliser))
    normaliser.meta["val"] = torch.logsumexp(_val(x), dim, keepdim=True)
    result.meta["val"] = _val(x) - normaliser.meta["val"]
    return result


def _log_softmax_backward_as_formula(graph: torch.fx.Graph, node) -> Optional[torch.fx.Node]:
    """``log_softmax``'s gradient ``node`` as ``g - exp(o) * g.sum(dim)`` where torch's
    kernel is slow: at an output ``o`` that a plate broadcast (as :func:`_is_row_wise_of_rows`
    leaves it), with ``exp`` of the unbroadcast output (5,000 x 3: ~90 µs -> ~40), and along
    short rows (:func:`_along_short_rows`). ``None`` elsewhere."""
    if node.target is not aten._log_softmax_backward_data.default or node.kwargs:
        return None
    g, output, dim, dtype = node.args
    source = _broadcast_source(output, dim)
    if source is None and _along_short_rows(output, dim):
        source = output
    if source is None or not torch.is_tensor(_val(g)) or _val(g).dtype != dtype or _val(node).dtype != dtype:
        return None
    with graph.inserting_before(node):
        summed = graph.call_function(aten.sum.dim_IntList, (g, [dim], True))
        weights = graph.call_function(aten.exp.default, (source,))
        scaled = graph.call_function(aten.mul.Tensor, (weights, summed))
        result = graph.call_function(aten.sub.Tensor, (g, scaled))
    summed.meta["val"] = _val(g).sum(dim, keepdim=True)
    weights.meta["val"] = _val(source).exp()
    scaled.meta["val"] = weights.meta["val"] * summed.meta["val"]
    result.meta["val"] = _val(g) - scaled.meta["val"]
    return result


def _row_index(gm: torch.fx.GraphModule, indices) -> Optional[torch.fx.Node]:
    """The constant index of ``x[index]`` if it picks rows: one 1-D integer tensor of
    non-negative entries (``index_select`` refuses negative ones; ``x[index]`` counts them
    from the end)."""
    if not (isinstance(indices, (list, tuple)) and len(indices) == 1):
        return None
    index = _constant(gm, indices[0])
    if index is None or index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        return None
    return indices[0] if bool((index >= 0).all()) else None


@_graph_pass
def cheaper_indexing(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Gathering rows by a constant index, ``x[group]`` (how a hierarchical model gives each
    observation its group's parameter), becomes ``index_select``, and its gradient, an
    accumulating ``index_put`` into zeros, becomes ``index_add``: the same values (sums
    taken in the same order) from kernels made for exactly this case, 2x faster each on
    the CPU (the hierarchical benchmark model: ~11 -> ~5 µs and ~6 -> ~3 µs a gradient)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.index.Tensor and len(node.args) == 2 and not node.kwargs:
            index = _row_index(gm, node.args[1])
            if index is not None:
                node.target, node.args = aten.index_select.default, (node.args[0], 0, index)
        elif node.target is aten.index_put.default and len(node.args) == 4 and node.args[3] is True:
            x, indices, values = node.args[:3]
            index = _row_index(gm, indices)
            xv, vv = _val(x), _val(values)
            if (index is not None and torch.is_tensor(xv) and torch.is_tensor(vv) and vv.dtype == xv.dtype
                    and vv.shape == _constant(gm, index).shape + xv.shape[1:]):
                node.target, node.args = aten.index_add.default, (x, 0, index, values)


_FOLDED_SOLVE_ERROR = 1e-5  # largest cond(A) * eps of the dtype for which a solve becomes a product


def _constant(gm, node):
    if isinstance(node, torch.fx.Node) and node.op == "get_attr":
        value = getattr(gm, node.target)
        return value if torch.is_tensor(value) else None
    return None


def _product(gm, matrix: torch.Tensor, x, like, order):
    """A node computing ``matrix @ x`` (``matrix`` a constant) by the cheapest call: ``mv``
    where ``x`` is a vector viewed as a ``(1, ..., D, 1)`` column and ``matrix`` has no batch
    (a distribution's Mahalanobis form of one point), reshaped back; ``bmm`` where both are
    3-D with the same batch size; else ``matmul``. Its result is laid out as ``like`` (the
    solve's result), whose dimensions from the largest stride to the smallest are ``order``
    (:func:`_dense_order`)."""
    graph = gm.graph

    def constant(value):
        return _constant_node(gm, "_matrix_", value.to(like.dtype).contiguous())

    def call(target, args, val, **kwargs):
        node = graph.call_function(target, args, kwargs)
        node.meta["val"] = val
        return node

    xv = _val(x)
    source = x.args[0] if x.op == "call_function" and x.target in _RESHAPES else None
    column = (
        torch.is_tensor(xv) and torch.is_tensor(_val(source)) and _val(source).dim() == 1
        and xv.shape[-1] == 1 and xv.numel() == _val(source).numel() and math.prod(matrix.shape[:-2]) == 1
    )
    if column:
        vector = call(aten.mv.default, (constant(matrix.reshape(matrix.shape[-2:])), source), like.reshape(-1))
        return call(aten.reshape.default, (vector, list(like.shape)), like)
    bmm = matrix.dim() == 3 and torch.is_tensor(xv) and xv.dim() == 3 and xv.shape[0] == matrix.shape[0]
    product = call(aten.bmm.default if bmm else aten.matmul.default, (constant(matrix), x), like.contiguous())
    if order == list(range(like.dim())):
        return product
    # the solve's strides (column-major, as LAPACK writes), which the views after it were
    # recorded with: the product laid out in that order
    laid_out = call(aten.permute.default, (product, order), like.permute(order))
    laid_out = call(aten.clone.default, (laid_out,), like.permute(order).contiguous(),
                    memory_format=torch.contiguous_format)
    return call(aten.permute.default, (laid_out, _inverse_permutation(order)), like)


def _dense_order(t: torch.Tensor):
    """The dimensions of ``t`` from the largest stride to the smallest if ``t`` is
    ``permute(order)`` of a contiguous tensor (``list(range(t.dim()))`` when it is contiguous
    itself), else ``None``."""
    if t.is_contiguous():
        return list(range(t.dim()))
    order = sorted(range(t.dim()), key=lambda i: -t.stride(i))
    return order if t.permute(order).is_contiguous() else None


def _inverse_permutation(order):
    return sorted(range(len(order)), key=order.__getitem__)


def _scaled_product(gm, node, products):
    """``(k * M, y)`` if ``node`` is ``k * p`` for a product ``p = M @ y`` in ``products``
    (``p -> (M, y)``, ``M`` float64) and constant factors ``k`` (through a chain of ``mul``
    nodes of unchanged shape) that are scalars or scale rows only (last dimension 1), so that
    ``k * (M @ y) == (k * M) @ y``; else ``None``."""
    scale = torch.ones((), dtype=torch.float64)
    while node not in products:
        if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target in _MULS
                and len(node.args) == 2 and not node.kwargs):
            return None
        factors = []
        for arg in node.args:
            k = _constant(gm, arg) if isinstance(arg, torch.fx.Node) else arg
            if isinstance(k, (int, float)) and not isinstance(k, bool):
                k = torch.tensor(float(k), dtype=torch.float64)
            rows_only = torch.is_tensor(k) and k.is_floating_point() and (k.numel() == 1 or k.shape[-1] == 1)
            factors.append(k.detach().to(torch.float64) if rows_only else None)
        if factors.count(None) != 1:
            return None
        rest = node.args[factors.index(None)]
        if not (torch.is_tensor(_val(node)) and torch.is_tensor(_val(rest)) and _val(node).shape == _val(rest).shape):
            return None
        scale = scale * next(f for f in factors if f is not None)
        node = rest
    matrix, source = products[node]
    if broadcast_shape(scale.shape, matrix.shape) != matrix.shape:
        return None
    return scale * matrix, source


# comparisons ``x <op> y`` that the ranges of ``x`` and ``y`` (a number's: itself) decide:
# (op name, (x's range, y's range) -> value or None); NaN aside (see fold_decided_comparisons)
_DECIDED_COMPARISONS = {
    "lt": lambda x, y: True if x[1] < y[0] else False if x[0] >= y[1] else None,
    "le": lambda x, y: True if x[1] <= y[0] else False if x[0] > y[1] else None,
    "gt": lambda x, y: True if x[0] > y[1] else False if x[1] <= y[0] else None,
    "ge": lambda x, y: True if x[0] >= y[1] else False if x[1] < y[0] else None,
    "eq": lambda x, y: False if x[1] < y[0] or x[0] > y[1] else None,
    "ne": lambda x, y: True if x[1] < y[0] or x[0] > y[1] else None,
}
_MASKED_FILLS = {aten.masked_fill.Scalar, aten.masked_fill_.Scalar}
_COMPARISON_OPS = {getattr(getattr(aten, name), overload) for name in _DECIDED_COMPARISONS for overload in ("Scalar", "Tensor")}
# ops whose every value lies in a fixed range, whatever their input (NaN aside)
_BOUNDED = {aten.exp.default: (0.0, math.inf), aten.sigmoid.default: (0.0, 1.0), aten.tanh.default: (-1.0, 1.0)}
# ops whose values are some of their first input's
_SAME_VALUES = _RESHAPES | _PERMUTES | {aten.slice.Tensor, aten.select.int, aten.flip.default, aten.clone.default,
                                        aten.diagonal.default}


_VALUES_WITHOUT_KWARGS = set(_BOUNDED) | _SHAPE_ONLY | _SAME_VALUES  # (dtype, device, memory_format, ...)


def _in_dtype(number: float, dtype: torch.dtype) -> float:
    """``number`` rounded to ``dtype``, as an op on a tensor of ``dtype`` takes a number:
    ``clamp(x, max=1 - 1e-9)`` on float32 clamps at 1."""
    return float(torch.tensor(number, dtype=torch.float64).to(dtype))


def _value_ranges(gm: torch.fx.GraphModule) -> Dict[torch.fx.Node, Tuple[float, float]]:
    """A closed range ``(lo, hi)`` holding every value of each node for which one follows from
    the ops alone, whatever the graph's inputs (NaN aside: a range says nothing about NaN):
    constants, ``exp``, ``sigmoid`` and ``tanh``, ``clamp``, ``c - x``, sums and products,
    ``x ** 2``, ``sqrt``, ``log``, fills, pads, writes and views. Pyro's transforms bound their
    results this way (``clamp(sigmoid(x), tiny, 1 - eps)`` for a simplex, ``low + (high -
    low) * clamp(sigmoid(x), ...)`` for a ``Uniform`` site, ``clamp(tanh(x), -1 + eps, 1 -
    eps)`` for a correlation matrix), so the gradients' guards against zeros, and the support
    checks, are decided. ``-``, ``+``, ``*`` and ``sqrt`` are correctly rounded, so monotone
    in each operand: their bounds are the op at the corners of the operands' ranges,
    computed in the dtype as the graph computes it, and so exact; ``log``'s (within a unit
    in the last place) are widened by two units, and ``addcmul``'s product (fused with the
    sum or not) by one. Every bound is widened by the dtype's smallest normal number too
    (results that underflow, or are flushed to zero). Numbers are taken in the dtype, as the
    ops take them (:func:`_in_dtype`). Nodes whose memory an in-place op writes get no
    range: their values change."""
    written = _written_storage(gm.graph.nodes)
    ranges = {}

    def computed(fn, dtype, *operands):  # as the op computes it: in the dtype, rounded
        return float(fn(*(torch.tensor(x, dtype=dtype) for x in operands)))

    def widened(bounds, dtype, ulps=0):
        if bounds is None or any(math.isnan(b) for b in bounds):
            return None  # (inf - inf, 0 * inf: nothing to say)
        info = torch.finfo(dtype)
        return tuple(b + sign * (ulps * info.eps * abs(b) + info.tiny) for b, sign in zip(bounds, (-1, 1)))

    def corners(fn, dtype, a, b):  # (None where one is NaN: min and max would pass it over)
        values = [computed(fn, dtype, x, y) for x in a for y in b]
        return None if any(math.isnan(v) for v in values) else (min(values), max(values))

    def hull(*found):
        return None if any(r is None for r in found) else (min(r[0] for r in found), max(r[1] for r in found))

    def of(arg, dtype):  # a number as the op uses it: in the tensor's dtype
        if isinstance(arg, (int, float)) and not isinstance(arg, bool):
            number = _in_dtype(arg, dtype)
            return number, number
        return ranges.get(arg) if isinstance(arg, torch.fx.Node) else None

    for node in gm.graph.nodes:
        value = getattr(gm, node.target) if node.op == "get_attr" else _val(node)
        if node in written or not (torch.is_tensor(value) and value.is_floating_point()):
            continue
        target, args, dtype, found = node.target, node.args, value.dtype, None
        first = of(args[0], dtype) if args else None  # the first operand's range
        if node.op == "get_attr":
            if value.numel() and not value.isnan().any():
                found = float(value.min()), float(value.max())
        elif node.op != "call_function" or (node.kwargs and target not in _VALUES_WITHOUT_KWARGS):
            continue  # (a keyword may change the values: rsub's alpha, a pad's value)
        elif target in _BOUNDED:
            found = _BOUNDED[target]
        elif target in _SHAPE_ONLY:
            fill = _SHAPE_ONLY_FILL[target]
            found = of(fill(args) if callable(fill) else fill, dtype)
        elif target in _SAME_VALUES:
            found = first
        elif target is aten.clamp.default:  # (an input of unknown range: the bounds')
            lo, hi = first or (-math.inf, math.inf)
            low, high = (list(args[1:]) + [None, None])[:2]
            found = (lo if low is None else max(lo, _in_dtype(low, dtype)),
                     hi if high is None else min(hi, _in_dtype(high, dtype)))
        elif target is aten.rsub.Scalar and len(args) == 2 and None not in (first, of(args[1], dtype)):
            (lo, hi), (c, _) = first, of(args[1], dtype)
            found = widened((computed(operator.sub, dtype, c, hi), computed(operator.sub, dtype, c, lo)), dtype)
        elif target is aten.pow.Tensor_Scalar and args[1] == 2 and first is not None:
            lo, hi = first
            squares = corners(operator.mul, dtype, (lo, hi), (lo, hi))
            found = None if squares is None else widened((0.0 if lo <= 0 <= hi else squares[0], squares[1]), dtype)
        elif target is aten.sqrt.default and first is not None and first[1] >= 0:
            lo, hi = first
            found = widened((computed(torch.sqrt, dtype, max(lo, 0.0)), computed(torch.sqrt, dtype, hi)), dtype)
        elif target in (aten.add.Tensor, aten.mul.Tensor) and None not in (first, of(args[1], dtype)):
            found = widened(corners(operator.add if target is aten.add.Tensor else operator.mul, dtype,
                                    first, of(args[1], dtype)), dtype)
        elif target is aten.addcmul.default and len(args) == 3 and None not in (of(a, dtype) for a in args):
            # the product widened by a unit, which a fused multiply-add adds unrounded
            product = widened(corners(operator.mul, dtype, of(args[1], dtype), of(args[2], dtype)), dtype, ulps=1)
            found = widened(None if product is None else corners(operator.add, dtype, first, product), dtype)
        elif target is aten.log.default and first is not None and first[1] > 0:
            lo, hi = first  # (log(0) is -inf; of a negative number NaN)
            found = widened((math.log(lo) if lo > 0 else -math.inf, math.log(hi)), dtype, ulps=2)
        elif target is aten.constant_pad_nd.default:
            found = hull(first, of(args[2] if len(args) > 2 else 0.0, dtype))
        elif target is aten.index_put.default and not (len(args) > 3 and args[3]):  # written, not added
            found = hull(first, of(args[2], dtype))
        elif target is aten.where.self:
            found = hull(of(args[1], dtype), of(args[2], dtype))
        elif target in (aten.cat.default, aten.stack.default):
            found = hull(*(of(x, dtype) for x in args[0]))
        if found is not None and not (found[0] <= found[1]):
            found = None  # clamp(x, 1, 0) and the like: nothing to say
        if found is not None:
            ranges[node] = found
    return ranges


@_graph_pass
def fold_decided_comparisons(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Replace each comparison with a number that the compared values' range decides
    (:func:`_value_ranges`) by a constant mask; :func:`fold_constants` then folds what the
    mask fed, and drops the masking it does (:func:`_unmasked`).

    What these are: distributions' support checks on values in the support by construction
    (a positive site reaches its distribution as ``exp`` of the unconstrained value, and
    ``HalfCauchy.log_prob`` masks ``value < 0`` to ``-inf``, ``HalfNormal``'s takes a
    ``where(value >= 0, ...)``, their gradients mask again: 3-4 operations per positive
    site, in every gradient), and the guard of ``cumprod``'s gradient against zeros in its
    input, ~25 operations of masks, scans and scatters computing the derivative where a
    factor is 0, which Pyro's simplex and correlation transforms rule out by clamping (a
    Dirichlet prior's gradient 76 -> 48 operations).

    NaN: a comparison with NaN is false (``!=``: true). Folded to false (true for ``!=``),
    a mask is exact for NaN too. Folded to true, it differs where the value is NaN, where
    e.g. a check ``exp(x) >= 0`` would have made the log density ``-inf`` (the potential
    ``+inf``) and now leaves it NaN: both non-finite, so both a divergence for the samplers."""
    graph = gm.graph
    ranges = _value_ranges(gm)
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _COMPARISON_OPS or not torch.is_tensor(_val(node)):
            continue
        x, y = node.args[:2]
        if isinstance(y, (int, float)) and not isinstance(y, bool) and x in ranges:
            y = (_in_dtype(y, _val(x).dtype),) * 2
        elif isinstance(y, torch.fx.Node) and y in ranges and x in ranges:
            y = ranges[y]
        else:
            continue
        value = _DECIDED_COMPARISONS[node.target.overloadpacket.__name__](ranges[x], y)
        if value is None:
            continue
        with graph.inserting_before(node):
            attr = _constant_node(gm, "_decided_mask_", torch.full(_val(node).shape, value, device=_val(node).device))
        node.replace_all_uses_with(attr)
        graph.erase_node(node)


@_graph_pass
def fold_constant_solves(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Triangular solves against constant matrices become products with the inverse, computed
    once in float64, and a product of such constants applied to another is composed into
    one: ``L^{-T} (L^{-1} x)`` is one matrix-vector product.

    This is the gradient of every Gaussian with a fixed covariance (Pyro's
    ``MultivariateNormal`` solves with its Cholesky factor forward, and back in the gradient):
    the classic question's 2-D Gaussian goes from two triangular solves per gradient to one
    small product. Only well-conditioned matrices are inverted (``cond(A) * eps`` at most
    1e-5 in the graph's dtype), so the result agrees with the solves to well inside the
    engine's validation tolerance.
    """
    graph = gm.graph
    inverse_of = {}  # node -> the constant matrix M (float64) with node == M @ input, and the input
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linalg_solve_triangular.default:
            continue
        args = dict(zip(("A", "B", "upper", "left", "unitriangular"), node.args))
        args.update(node.kwargs)
        A, x, out = _constant(gm, args["A"]), args["B"], _val(node)
        order = _dense_order(out) if torch.is_tensor(out) else None  # the layout the product must have
        if (A is None or _constant(gm, x) is not None or not args.get("left", True)
                or args.get("unitriangular", False) or order is None or A.dim() < 2):
            continue
        A64 = A.detach().to(torch.float64)
        if not (torch.linalg.cond(A64).max() * torch.finfo(out.dtype).eps <= _FOLDED_SOLVE_ERROR):
            continue
        eye = torch.eye(A.shape[-1], dtype=torch.float64, device=A.device).expand(A64.shape)
        matrix = torch.linalg.solve_triangular(A64, eye, upper=args["upper"])
        inner = _scaled_product(gm, x, inverse_of)
        if inner is not None:  # M2 @ (k * (M1 @ y)) = (M2 (k M1)) @ y; the inner product stays if used elsewhere
            inner_matrix, x = inner
            matrix = matrix @ inner_matrix
        with graph.inserting_before(node):
            product = _product(gm, matrix, x, out, order)
        node.replace_all_uses_with(product)
        graph.erase_node(node)
        inverse_of[product] = (matrix, x)
    _eliminate_dead_code(graph)


@_graph_pass
def lay_out_matrices_for_products(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Lay out each constant matrix of a matrix-vector product (``mv``) along its longer
    dimension: a tall ``(N, D)`` matrix column by column, a wide one row by row. The values
    are the same; only the product's summation order changes, so its result may differ in
    the last bits.

    Why: a regression's design matrix, ``N`` rows of ``D`` predictors stored row by row, is
    the product ``X @ w`` of every gradient, and BLAS runs a row-major ``mv`` as ``N`` dot
    products of length ``D``, short ones when ``D`` is small, while column by column it is
    ``D`` long ``axpy`` sweeps. On this package's 2-core machine (MKL, one thread), float32:
    5,000 x 25 21 -> 6 µs, 50,000 x 5 114 -> 16 µs, 1,000 x 10 3.1 -> 1.3 µs; float64
    1.0-1.4x faster; never slower beyond noise. The gradient's transposed product
    ``X^T r`` reads a wide matrix, already row by row (:func:`fold_constants` makes it
    contiguous), and ``X`` column by column is a view of it: one copy of the data. Square
    matrices, broadcast ones, constants written in place, and graphs that read layouts
    (:func:`_reads_layouts`) are left alone."""
    graph = gm.graph
    if _reads_layouts(graph):
        return
    written = _written_storage(graph.nodes)
    laid_out = {}  # constant node -> it laid out along its longer dimension (a copy, or a view)
    for node in list(graph.nodes):
        if node.target is not aten.mv.default or node.args[0] in written:
            continue
        matrix = _constant(gm, node.args[0])
        if matrix is None or matrix.dim() != 2 or matrix.shape[0] == matrix.shape[1] or 0 in matrix.stride():
            continue  # (a broadcast matrix, laid out, would take memory for every element)
        tall = matrix.shape[0] > matrix.shape[1]
        if (matrix.t() if tall else matrix).is_contiguous():
            continue  # already along its longer dimension
        if node.args[0] not in laid_out:
            if not tall:
                copy = matrix.contiguous()
            elif (copy := _stored_transpose(gm, matrix)) is None:
                copy = matrix.t().contiguous().t()
            with graph.inserting_before(node):
                laid_out[node.args[0]] = _constant_node(gm, "_laid_out_", copy.detach())
        node.replace_input_with(node.args[0], laid_out[node.args[0]])
    _eliminate_dead_code(graph)


def _stored_transpose(gm: torch.fx.GraphModule, matrix: torch.Tensor) -> Optional[torch.Tensor]:
    """``matrix`` laid out column by column as a view of a constant of ``gm`` that holds its
    transpose row by row (the gradient's ``X^T``, which :func:`fold_constants` made
    contiguous), so that the graph keeps one copy of a design matrix, not two; else ``None``."""
    for node in gm.graph.nodes:
        other = _constant(gm, node)
        if (other is not None and other.shape == matrix.shape[::-1] and other.dtype == matrix.dtype
                and other.device == matrix.device and other.is_contiguous() and torch.equal(other.t(), matrix)):
            return other.t()
    return None


def target_is_check(node) -> bool:
    return node.target is torch.ops.aten._linalg_check_errors.default


@_graph_pass
def copy_written_constants(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Give every constant that an in-place op writes, directly or through a view
    (``c = torch.tensor([1., 2.]); c[0] += f(z)``), a fresh copy at every call, which all its
    readers read: written into directly, the constant would keep one call's writes for the
    next, where the model makes a new tensor at every run."""
    graph = gm.graph
    for constant in [n for n in _written_storage(graph.nodes) if n.op == "get_attr"]:
        with graph.inserting_after(constant):
            fresh = graph.call_function(aten.clone.default, (constant,))
        fresh.meta.update(constant.meta)
        constant.replace_all_uses_with(fresh, delete_user_cb=lambda user: user is not fresh)


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


_MERGED_CONSTANT_SIZE = 16  # elements: larger constants (data) are not compared


@_graph_pass
def merge_duplicate_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Compute once what is computed twice: an op with the same target and the same inputs as
    an earlier one (Pyro's distributions broadcast their parameters anew at every site, so a
    loop of sites expands a shared scale once per site), unless either result is written in
    place or either reads a tensor that is written in place (the graph reads such a tensor by
    its node before and after the write alike). Small constants equal bit for bit are one
    constant first (each step of a loop folds its own ``0.9`` or ``1 / 0.3 ** 2``): the ops
    that read them then merge too, and :func:`vectorize_alike_ops` sees one operand shared by
    the steps."""
    graph, seen = gm.graph, {}
    for node in list(graph.nodes):
        value = getattr(gm, node.target) if node.op == "get_attr" else None
        if not (torch.is_tensor(value) and value.numel() <= _MERGED_CONSTANT_SIZE) or _written_through(node):
            continue
        flat = value.detach().new_empty(value.numel()).copy_(value.detach().reshape(-1))  # unit strides
        bits = flat.view(torch.uint8).cpu().numpy().tobytes()
        earlier = seen.setdefault(("constant", value.dtype, value.shape, value.device, bits), node)
        if earlier is not node:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
    written = _written_storage(graph.nodes)
    for node in list(graph.nodes):
        target = node.target
        if (node.op != "call_function" or not isinstance(target, torch._ops.OpOverload)
                or target._schema.is_mutable or torch.Tag.nondeterministic_seeded in target.tags
                or target_is_check(node) or _written_through(node) or written.intersection(node.all_input_nodes)):
            continue  # (two reads of a tensor written in place may see different values)
        try:
            key = (target, _hashable(node.args), _hashable(node.kwargs))
            earlier = seen.setdefault(key, node)
        except TypeError:  # an argument that cannot be compared
            continue
        if earlier is not node:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
    _eliminate_dead_code(graph)


_MIN_GROUP = 4  # fewer alike ops are left as they are: stacking their operands costs about as much
# the second round's groups (independent ops anywhere): with 4, the hierarchical benchmark
# model's gradient grew from 76 to 89 operations (its scalar ops grouped kept the later
# passes from folding them); a loop's groups have one member per step
_MIN_INDEPENDENT_GROUP = 8


@_graph_pass
def vectorize_alike_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Compute alike elementwise ops that do not depend on each other as one op on stacked
    operands. A model written as a Python loop of one sample site per step (``for t in
    pyro.markov(range(T))``) computes each site's log-density, and its gradient, with the same
    few scalar ops, T times over: T x ~35 operations, each costing a microsecond of dispatch.
    Ops are alike when they are elementwise (torch's ``pointwise`` tag), sums over the same
    dimensions, or matrix functions (:data:`_MATRIX_FUNCTIONS`), with the same target and
    non-tensor arguments, position by position operands
    of the same shape and dtype, of one dtype (masks aside), and of the result's shape unless
    one node broadcast for them all; they are independent when at the
    same depth (longest path from the graph's inputs). A group's operand is the one node all
    its members share, the rows of an earlier group's result (reordered by an
    ``index_select`` where needed), or else a ``stack`` of the members' operands; each member's
    result is then a row of the group's (a ``select``, dropped where no one needs it). The
    ops are then reordered so that each comes after its operands, keeping every in-place
    write after the reads before it and before the reads after it. Where that is impossible,
    or the graph would not cost less (:func:`cost`), the round leaves it as it was.

    A second round groups alike ops that are independent wherever they lie (no path from
    one to another) and computed alike (the same ops three back), at least
    ``_MIN_INDEPENDENT_GROUP`` of them: where a recursion computes each step's state from
    the last (``h = mu + phi * (h - mu) + sigma * z``), each step's ops lie at a depth of
    their own, but those that only read a state (its observation's log-density, and its
    gradient) do not depend on each other. Groups made so can order each other both ways;
    those that would are left out (the first round's, by depth, never do)."""
    for grouping in (_groups_at_equal_depths, _groups_of_independent_ops):
        _vectorize_groups(gm, grouping)


def _alike_candidates(nodes: list, written: set) -> Dict[tuple, list]:
    """The nodes that may be vectorized (none reading a tensor in ``written``), by what must
    be alike among a group's (graph order)."""
    candidates: Dict[tuple, list] = {}
    for node in nodes:
        key = _alike_key(node)
        if key is not None and not written.intersection(node.all_input_nodes) and not _written_through(node):
            candidates.setdefault(key, []).append(node)
    return candidates


def _groups_at_equal_depths(nodes: list, candidates: Dict[tuple, list]) -> List[list]:
    """Alike nodes at the same depth (longest path from the graph's inputs), by depth."""
    depth = {}
    for node in nodes:
        depth[node] = 1 + max((depth[a] for a in node.all_input_nodes), default=-1)
    groups: Dict[tuple, list] = {}
    for key, members in candidates.items():
        for node in members:
            groups.setdefault((depth[node],) + key, []).append(node)
    return [groups[key] for key in sorted(groups, key=lambda k: k[0])]


def _groups_of_independent_ops(nodes: list, alike: Dict[tuple, list]) -> List[list]:
    """Alike nodes computed alike (the same ops, three back: the same place in each step's
    ops) that do not depend on each other, greedily in graph order (each joins the first
    group holding none of its ancestors), by their first member's position; less the groups
    that would order each other both ways."""
    candidates: Dict[tuple, list] = {}  # the same op at the same place of each step's ops
    for key, members in alike.items():
        for node in members:
            candidates.setdefault((key, _provenance(node, 3)), []).append(node)
    bit = {node: 1 << i for i, node in enumerate(n for members in candidates.values() for n in members)}
    ancestors = {}  # node -> the bits of its candidate ancestors
    for node in nodes:
        mask = 0
        for a in node.all_input_nodes:
            mask |= ancestors[a] | bit.get(a, 0)
        ancestors[node] = mask
    position = {node: i for i, node in enumerate(nodes)}
    groups = []
    for members in candidates.values():
        formed = []  # [member bits, members]
        for node in members:
            for group in formed:
                if not ancestors[node] & group[0]:
                    group[0] |= bit[node]
                    group[1].append(node)
                    break
            else:
                formed.append([bit[node], [node]])
        groups.extend(group[1] for group in formed if len(group[1]) >= _MIN_INDEPENDENT_GROUP)
    return _without_cycles(nodes, sorted(groups, key=lambda group: position[group[0]]))


def _provenance(node, levels: int):
    """What computed ``node``, ``levels`` ops back: its op and, recursively, its operands'."""
    if node.op != "call_function" or levels == 0:
        return node.op
    return (str(node.target), tuple(_provenance(a, levels - 1) for a in node.all_input_nodes))


def _without_cycles(nodes: list, groups: List[list]) -> List[list]:
    """``groups`` less those that, each made one node, would close a cycle: while the graph
    with every group as one node cannot be ordered, the last group that cannot be placed is
    given up."""
    groups = list(groups)
    while groups:
        unit = {member: i for i, group in enumerate(groups) for member in group}
        before = {}  # unit -> the units it reads
        for node in nodes:
            u = unit.get(node, node)
            before.setdefault(u, set()).update(unit.get(a, a) for a in node.all_input_nodes)
            before[u].discard(u)
        placed = set(_topological_order(before, lambda u: 0))
        stuck = [i for i in range(len(groups)) if i not in placed]
        if not stuck:
            return groups
        groups.pop(stuck[-1])
    return groups


def _vectorize_groups(gm: torch.fx.GraphModule, grouping) -> None:
    """One round of :func:`vectorize_alike_ops` on the groups that ``grouping(nodes,
    candidates)`` forms of the candidates (lists of alike, independent nodes, in an order
    where a group's operands come from groups before it)."""
    nodes = list(gm.graph.nodes)
    written = _written_storage(nodes)
    groups = {i: members for i, members in enumerate(grouping(nodes, _alike_candidates(nodes, written)))
              if len(members) >= _MIN_GROUP and _broadcast_operands_shared(members)}
    if not groups:
        return
    # rewritten on a copy of the graph (the constants are shared, not copied), kept only if
    # its ops can be ordered and there are fewer
    work = _GraphInProgress(gm, copy.deepcopy(gm.graph))
    copies = dict(zip(nodes, work.graph.nodes))
    rank = {copies[node]: i for i, node in enumerate(nodes)}
    graph = work.graph
    # a node that is a row of a tensor -> (the tensor, index); not of one written in place,
    # whose rows are worth reading only where they were read
    row_of = _rows(graph, {copies[node] for node in written})
    concatenated = {}
    for members in groups.values():
        members = [copies[m] for m in members]
        with graph.inserting_before(members[0]):
            args = [_stacked_operand(graph, [m.args[i] for m in members], row_of, concatenated)
                    for i in range(len(members[0].args))]
            # numbers are equal in a group (its key); tensor operands may all be one node
            shared = all(not isinstance(a, torch.fx.Node) or all(m.args[i] is a for m in members)
                         for i, a in enumerate(args))
            target, kwargs = members[0].target, dict(members[0].kwargs)
            if target in _SUMS and not shared:  # the same dimensions of each row
                target, args, kwargs = aten.sum.dim_IntList, [args[0], [d + 1 for d in _summed_dims(members[0])],
                                                              _keeps_dims(members[0])], {}
            result = graph.call_function(target, tuple(args), kwargs)
            result.meta["val"] = _val(members[0]) if shared else torch.stack([_val(m) for m in members])
            for i, member in enumerate(members):
                # the same op on the same operands (e.g. a scale's log in every step's density): once
                row = result if shared else graph.call_function(aten.select.int, (result, 0, i))
                row.meta["val"] = _val(member)
                member.replace_all_uses_with(row)
                if not shared:
                    row_of[row] = (result, i)
                rank.setdefault(row, rank[member])
                del rank[member]
        for member in members:  # after the inserts before the first of them
            graph.erase_node(member)
    _concatenate_rows_at_once(graph, row_of)
    if not _reorder(graph, rank):
        return
    _eliminate_dead_code(graph)
    # once the rows that no one reads are gone: where a group was the steps of several sums
    # at once (a loop of sites: the potential's and its gradient's), each step of the
    # vectorized sum had them as users until then, so it was no chain of adds used once
    _sum_rows_at_once(graph, row_of)
    _eliminate_dead_code(graph)
    if cost(graph) >= cost(gm.graph):
        return
    for name, buffer in work.named_buffers():
        if not hasattr(gm, name):
            gm.register_buffer(name, buffer)
    gm.graph = graph


def operations(graph: torch.fx.Graph) -> int:
    """How many operations ``graph`` runs (its calls): what its fixed cost in a program is
    proportional to, at about a microsecond of dispatch each."""
    return sum(node.op == "call_function" for node in graph.nodes)


def cost(graph: torch.fx.Graph) -> int:
    """What running ``graph`` costs, in operations of dispatch: :func:`operations`, with each
    matrix function (:data:`_MATRIX_FUNCTIONS`) counted as :data:`_MATRIX_FUNCTION_COST`."""
    return sum(_MATRIX_FUNCTION_COST if node.target in _MATRIX_FUNCTIONS else 1
               for node in graph.nodes if node.op == "call_function")


def broadcast_shape(a: Sequence[int], b: Sequence[int]) -> Optional[torch.Size]:
    """The shape that shapes ``a`` and ``b`` broadcast to, ``None`` where they do not:
    ``torch.broadcast_shapes`` without the import of sympy that its first call makes (through
    ``torch.fx.experimental.symbolic_shapes``, ~0.5 s of a run that has no other use for it)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + tuple(a), (1,) * (n - len(b)) + tuple(b)
    if any(x != y and 1 not in (x, y) for x, y in zip(a, b)):
        return None
    return torch.Size(y if x == 1 else x for x, y in zip(a, b))


def _same_shape(a, b) -> bool:
    return torch.is_tensor(_val(a)) and torch.is_tensor(_val(b)) and _val(a).shape == _val(b).shape


def _is_plain_add(node) -> bool:
    return node.op == "call_function" and node.target is aten.add.Tensor and not node.kwargs and len(node.args) == 2


def _sum_rows_at_once(graph: torch.fx.Graph, row_of: dict) -> None:
    """Rewrite each tree of additions (intermediate sums used once) whose terms include
    several rows of one vectorized result as a sum of those rows (one ``sum``, after an
    ``index_select`` where they are not all its rows) plus the other terms: the sum of the
    sites' log-densities, and the gradient's accumulation over the sites that use a value."""
    for root in list(graph.nodes):
        if not _is_plain_add(root) or not torch.is_tensor(_val(root)):
            continue
        users = list(root.users)
        if len(users) == 1 and _is_plain_add(users[0]) and _same_shape(users[0], root):
            continue  # not a root: part of its user's tree
        terms, pending = [], [root]
        while pending:
            node = pending.pop()
            for a in node.args:
                inner = isinstance(a, torch.fx.Node) and _is_plain_add(a) and len(a.users) == 1
                if inner and _same_shape(a, root):
                    pending.append(a)
                else:
                    terms.append(a)
        by_rows: Dict[torch.fx.Node, list] = {}  # tensor -> [(term, its rows' indices)]
        for t in terms:
            picked = _rows_picked(t, row_of)
            if picked is not None and _val(t).shape == _val(root).shape:
                by_rows.setdefault(picked[0], []).append((t, picked[1]))
        by_rows = {rows: ts for rows, ts in by_rows.items() if len(ts) >= 2}
        if not by_rows:
            continue
        with graph.inserting_before(root):
            kept = []  # the sums first: a term may be a number, which cannot start an add
            for rows, ts in by_rows.items():
                ts.sort(key=lambda term: term[1])
                picked = _pick_rows(graph, rows, [i for _, indices in ts for i in indices])
                shape = [len(ts)] + list(_val(root).shape)
                if list(_val(picked).shape) != shape:  # blocks of rows: one block per term
                    picked = graph.call_function(aten.view.default, (picked, shape))
                    picked.meta["val"] = _val(picked.args[0]).view(shape)
                total = graph.call_function(aten.sum.dim_IntList, (picked, [0]))
                total.meta["val"] = _val(picked).sum(0)
                kept.append(total)
            summed = {t for ts in by_rows.values() for t, _ in ts}
            kept += [t for t in terms if t not in summed]
            acc = kept[0]
            for t in kept[1:]:
                acc = graph.call_function(aten.add.Tensor, (acc, t))
                acc.meta["val"] = _val(root)
        root.replace_all_uses_with(acc)


def _rows_picked(term, row_of: dict):
    """``(tensor, [indices])`` where ``term`` is rows of ``tensor``: a row of a vectorized
    result (``row_of``), or a block of rows picked by an ``index_select`` of a constant index
    along the first dimension (a group's operand where the ops vectorized were steps of
    several sums at once: the potential's and its gradient's over a loop of sites); else
    ``None``."""
    if not isinstance(term, torch.fx.Node):
        return None
    if term in row_of:
        return row_of[term][0], [row_of[term][1]]
    if term.target is aten.index_select.default and term.args[1] == 0 and not term.kwargs:
        index = term.args[2]
        if isinstance(index, torch.fx.Node) and index.op == "get_attr" and isinstance(term.args[0], torch.fx.Node):
            value = getattr(index.graph.owning_module, index.target, None)
            if torch.is_tensor(value) and value.dim() == 1:
                return term.args[0], value.tolist()
    return None


def _concatenate_rows_at_once(graph: torch.fx.Graph, row_of: dict) -> None:
    """In each concatenation of numbers made vectors of one element (the gradient assembled
    from its sites' parts), pick each run of consecutive rows of one vector by one
    ``index_select`` (the vector itself where the run is all of it, in order)."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.cat.default or len(node.args) != 1 or node.kwargs:
            continue
        runs = []  # [source or None, [operands], [indices]]
        for piece in node.args[0]:
            row = piece.args[0] if (isinstance(piece, torch.fx.Node) and piece.target is aten.view.default
                                    and list(piece.args[1]) == [1]) else None
            source, index = row_of.get(row, (None, None))
            if source is not None and _val(source).dim() != 1:
                source = None
            if source is not None and runs and runs[-1][0] is source:
                runs[-1][1].append(piece)
                runs[-1][2].append(index)
            else:
                runs.append([source, [piece], [index]])
        if all(source is None or len(pieces) == 1 for source, pieces, _ in runs):
            continue
        parts = []
        with graph.inserting_before(node):
            for source, pieces, indices in runs:
                if source is None or len(pieces) == 1:
                    parts.extend(pieces)
                else:
                    parts.append(_pick_rows(graph, source, indices))
            if len(parts) == 1:
                whole = graph.call_function(aten.clone.default, (parts[0],))  # cat's result is its own tensor
            else:
                whole = graph.call_function(aten.cat.default, (parts,))
            whole.meta["val"] = _val(node)
        node.replace_all_uses_with(whole)


def _broadcast_operands_shared(members: list) -> bool:
    """Whether every operand that a group's ops broadcast to their result's shape is the same
    node for all of them (stacked, different ones would broadcast along the wrong axes)."""
    shape = _val(members[0]).shape
    for i, a in enumerate(members[0].args):
        if isinstance(a, torch.fx.Node) and _val(a).shape != shape and members[0].target not in _SUMS:
            if any(m.args[i] is not a for m in members):
                return False
    return True


_SUMS = {aten.sum.dim_IntList, aten.sum.default}
# Functions of a matrix that map over leading dimensions: k of them on stacked matrices are
# one batched call. torch's matrix exponential costs 120-175 us a call on the CPU for a
# 2 x 2 or 4 x 4 matrix, and about as much for a batch of them.
_MATRIX_FUNCTIONS = {aten.linalg_matrix_exp.default}
_MATRIX_FUNCTION_COST = 100  # operations of ~1 us


def _summed_dims(node) -> list:
    """The dimensions (non-negative, sorted) that a ``sum`` node sums over."""
    rank = _val(node.args[0]).dim()
    dims = node.args[1] if node.target is aten.sum.dim_IntList and len(node.args) > 1 else None
    return sorted(d % rank for d in dims) if dims else list(range(rank))


def _keeps_dims(node) -> bool:
    return bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))


def _alike_key(node):
    """What must be equal for ``node`` to be computed with others in one op, or ``None``."""
    out = _val(node)
    if not torch.is_tensor(out):
        return None
    if node.target in _SUMS:  # k sums over the same dimensions of alike tensors: one sum
        x = node.args[0]
        if (not isinstance(x, torch.fx.Node) or not torch.is_tensor(_val(x)) or _val(x).dim() == 0
                or len(node.args) > 3 or set(node.kwargs) - {"keepdim"}):  # no dtype argument
            return None
        return ("sum", tuple(_val(x).shape), _val(x).dtype, tuple(_summed_dims(node)), _keeps_dims(node))
    if node.target in _MATRIX_FUNCTIONS:
        x = node.args[0]
        if (len(node.args) > 1 or node.kwargs or not isinstance(x, torch.fx.Node) or not torch.is_tensor(_val(x))
                or _val(x).shape != out.shape):
            return None
        return (node.target, tuple(out.shape), out.dtype, (("tensor", out.dtype, tuple(out.shape)),), ())
    if not _is_pointwise(node):  # elementwise: k of them on stacked operands are one op
        return None
    pattern, dtypes = [], set()
    for a in node.args:
        if isinstance(a, torch.fx.Node):
            v = _val(a)
            if not torch.is_tensor(v) or (v.shape != out.shape and v.dim() > out.dim()):
                return None
            # an operand broadcast to the result's shape must be one node for the whole group
            pattern.append(("tensor", v.dtype, tuple(v.shape)))
            if v.dtype != torch.bool:  # masks take no part in type promotion
                dtypes.add(v.dtype)
        elif isinstance(a, (int, float, bool)) or a is None:
            pattern.append(("number", type(a), a))
        else:
            return None
    if len(dtypes) > 1:  # a 0-d operand shared by the group would promote differently
        return None
    kwargs = tuple(sorted(node.kwargs.items()))
    if any(isinstance(v, torch.fx.Node) for _, v in kwargs):
        return None
    return (node.target, tuple(out.shape), out.dtype, tuple(pattern), kwargs)


def _stacked_operand(graph, operands: list, row_of: dict, concatenated: dict):
    """One operand of a group computed at once: the node all members share, else the
    members' operands as the rows of one tensor: picked from the tensors they are rows of
    (concatenated first where several, once for all groups that pick from the same ones:
    ``concatenated``, ``{sources: their cat}``) by one ``index_select``, or else stacked."""
    first = operands[0]
    if not isinstance(first, torch.fx.Node) or all(o is first for o in operands):
        return first
    others = list(dict.fromkeys(o for o in operands if o not in row_of))
    if len(others) * 2 > len(operands):  # mostly not rows: a stack is the cheapest
        return _stack(graph, list(operands))
    row_of = dict(row_of)
    if others:  # the few that are not rows become the rows of their own stack
        stacked = _stack(graph, others)
        row_of.update((o, (stacked, i)) for i, o in enumerate(others))
    sources, offsets = [], {}
    for o in operands:
        source = row_of[o][0]
        if source not in offsets:
            offsets[source] = sum(_val(s).shape[0] for s in sources)
            sources.append(source)
    indices = [offsets[row_of[o][0]] + row_of[o][1] for o in operands]
    rows = sources[0]
    if len(sources) > 1:
        rows = concatenated.get(tuple(sources))
        if rows is None:
            rows = concatenated[tuple(sources)] = graph.call_function(aten.cat.default, (sources,))
            rows.meta["val"] = torch.cat([_val(s) for s in sources])
    return _pick_rows(graph, rows, indices)


def _stack(graph: torch.fx.Graph, nodes: list) -> torch.fx.Node:
    stacked = graph.call_function(aten.stack.default, (nodes,))
    stacked.meta["val"] = torch.stack([_val(n) for n in nodes])
    return stacked


def _pick_rows(graph: torch.fx.Graph, rows: torch.fx.Node, indices: list):
    """The rows ``indices`` of ``rows``, in that order: ``rows`` itself where that is all of
    them in order, else one ``index_select`` by a constant index."""
    if indices == list(range(_val(rows).shape[0])):
        return rows
    index = torch.tensor(indices, device=_val(rows).device)
    picked = graph.call_function(aten.index_select.default, (rows, 0, _constant_node(graph.owning_module, "_rows_", index)))
    picked.meta["val"] = _val(rows).index_select(0, index)
    return picked


def _rows(graph: torch.fx.Graph, written: set) -> dict:
    """The nodes that are rows of another, ``{row: (tensor, index)}``, not counting tensors in
    ``written``: ``x.select(0, i)``, and the pieces of a vector split into sites
    (``split_with_sizes``, then a view to the site's shape). One-element pieces are rows of
    the vector; a run of pieces of one size, rows of a view of that part of it as a matrix
    (added to ``graph``, where unused it is dropped with the dead code)."""
    rows, blocks = {}, {}
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.select.int and node.args[1] == 0:
            source = _val(node.args[0])
            if torch.is_tensor(source) and node.args[0] not in written:
                rows[node] = (node.args[0], node.args[2] % source.shape[0])
            continue
        if node.op != "call_function" or node.target is not aten.view.default or not node.args:
            continue
        piece = node.args[0]
        if not (isinstance(piece, torch.fx.Node) and piece.target is operator.getitem
                and piece.args[0].target is aten.split_with_sizes.default):
            continue
        split = piece.args[0]
        vector, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else 0
        v, j, out = _val(vector), piece.args[1], _val(node)
        if not (torch.is_tensor(v) and v.dim() == 1 and dim in (0, -1) and torch.is_tensor(out)) or vector in written:
            continue
        size = sizes[j]
        if size == 1 and out.dim() == 0:
            rows[node] = (vector, sum(sizes[:j]))
            continue
        if out.numel() != size:
            continue
        first, last = j, j  # the run of pieces of this size around this one
        while first > 0 and sizes[first - 1] == size:
            first -= 1
        while last + 1 < len(sizes) and sizes[last + 1] == size:
            last += 1
        key = (split, first, tuple(out.shape))
        if key not in blocks:
            start, count = sum(sizes[:first]), last - first + 1
            with graph.inserting_before(node):
                part = graph.call_function(aten.slice.Tensor, (vector, 0, start, start + count * size))
                part.meta["val"] = v[start:start + count * size]
                block = graph.call_function(aten.view.default, (part, [count] + list(out.shape)))
                block.meta["val"] = _val(part).view([count] + list(out.shape))
            blocks[key] = block
        rows[node] = (blocks[key], j - first)
    return rows


def _reorder(graph: torch.fx.Graph, rank: dict) -> bool:
    """Reorder ``graph``'s nodes so that each comes after its inputs, and every in-place
    write after the nodes of lower ``rank`` that read what it writes (or a view of it) and
    before those of higher rank; otherwise by ``rank`` (nodes without one rank with their first user).
    ``False``, and the graph unchanged, where that order does not exist."""
    nodes = list(graph.nodes)

    def rank_of(node):
        """The graph is not in order here: follow the users, depth first, with a stack of our
        own (a sum over a thousand sites in a Python loop is a chain of a thousand adds)."""
        stack = [node]
        while stack:
            top = stack[-1]
            unranked = [u for u in top.users if u not in rank]
            if unranked:
                stack.extend(unranked)
                continue
            rank.setdefault(top, min((rank[u] for u in top.users), default=len(nodes)))
            stack.pop()

    for node in nodes:
        rank_of(node)
    before = {node: set(node.all_input_nodes) for node in nodes}
    for writer in nodes:
        for target in set().union(*map(_aliases, _written_inputs(writer))):
            for reader in target.users:
                if reader is not writer:
                    (before[writer] if rank[reader] < rank[writer] else before[reader]).add(
                        reader if rank[reader] < rank[writer] else writer)
    order = _topological_order(before, rank.__getitem__)
    if len(order) < len(nodes):
        return False
    previous = order[0]
    for node in order[1:]:
        previous.append(node)
        previous = node
    return True


def _topological_order(before: dict, priority) -> list:
    """The keys of ``before`` (``{node: the nodes it must come after}``) in an order where each
    comes after those, the ready one of lowest ``priority`` first; the nodes on a cycle, and
    after one, are left out."""
    after = {node: [] for node in before}
    for node, preds in before.items():
        for p in preds:
            after[p].append(node)
    waiting = {node: len(preds) for node, preds in before.items()}
    ready = [(priority(n), i, n) for i, n in enumerate(before) if waiting[n] == 0]
    heapq.heapify(ready)
    order, serial = [], len(before)
    while ready:
        _, _, node = heapq.heappop(ready)
        order.append(node)
        for user in after[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                serial += 1
                heapq.heappush(ready, (priority(user), serial, user))
    return order


def _written_arguments(op, args, kwargs) -> list:
    """The arguments that the aten overload ``op`` writes in place (its schema's mutable ones)."""
    if not op._schema.is_mutable:
        return []
    return [
        args[i] if i < len(args) else kwargs.get(argument.name)
        for i, argument in enumerate(op._schema.arguments)
        if argument.alias_info is not None and argument.alias_info.is_write
    ]


def _written_inputs(node) -> set:
    """The input nodes that ``node``'s op writes to in place."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return set()
    return {v for v in _written_arguments(node.target, node.args, node.kwargs) if isinstance(v, torch.fx.Node)}


def _written_storage(nodes) -> set:
    """The nodes among ``nodes`` (and their views) whose memory some in-place op writes."""
    return set().union(*(_aliases(w) for node in nodes for w in _written_inputs(node)))


def _written_through(node) -> bool:
    """Whether an in-place op writes ``node``'s result, directly or through a view of it: then
    ``node`` must stay a tensor of its own (not be replaced by an input it equals, nor made a
    row of a tensor shared with others)."""
    pending, seen = [node], {node}
    while pending:
        current = pending.pop()
        for user in current.users:
            if current in _written_inputs(user):
                return True
            if user not in seen and _returns_view(user):
                seen.add(user)
                pending.append(user)
    return False


def _aliases(node) -> set:
    """``node`` and every node that shares its memory through view ops (views of it, what it
    is a view of, their other views)."""
    found, pending = {node}, [node]
    while pending:
        current = pending.pop()
        linked = [u for u in current.users if _returns_view(u)]
        if _returns_view(current) and isinstance(current.args[0], torch.fx.Node):
            linked.append(current.args[0])
        for other in linked:
            if other not in found:
                found.add(other)
                pending.append(other)
    return found


def _returns_view(node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:  # a piece of a split
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None for r in node.target._schema.returns)


def _eliminate_dead_code(graph: torch.fx.Graph) -> None:
    """Erase the nodes whose results nothing uses, except error checks (:func:`_is_impure`).
    FX's ``eliminate_dead_code`` does the same but first checks the whole graph's
    consistency and asks every node, used or not, about side effects: on the 40,000-node
    graph of a model with 1,000 sample sites, ~0.15 s a call, and the passes call it ~25
    times."""
    for node in reversed(graph.nodes):
        if not node.users and not _is_impure(node):
            graph.erase_node(node)


def _is_impure(node) -> bool:
    """Keep error checks on non-constant inputs (they raise on e.g. a failed Cholesky)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return False
    if target_is_check(node):
        return True
    return node.is_impure()
