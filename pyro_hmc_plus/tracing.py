"""Tracing a function of flat tensors into a pure FX graph, safely.

``make_fx`` records every tensor operation a function performs on example inputs; the
result can be re-run (or compiled) at new inputs without Python or Pyro in the way. The
danger is a trace that silently freezes a value which depends on the inputs: a Python
``if`` on a latent, ``.item()``, ``.tolist()``. Pyro's own ``jit_compile=True`` bakes such
values in without a word. We refuse them instead: :class:`LatentTaint` is a
``TorchFunctionMode`` that marks the inputs and every tensor computed from them, and
raises :class:`UntraceableModel` when a marked tensor is turned into a Python value.
Branches on data alone (not derived from the inputs) are allowed and traced as constants.

After tracing, :func:`fold_constants` evaluates once everything that depends only on
constants (a Cholesky of a fixed precision matrix, masks, ``eye``), which can halve the
cost of small models, and removes aliasing no-ops.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten


class UntraceableModel(RuntimeError):
    """The function cannot be traced into a graph that is valid at other inputs."""


_ESCAPES = {
    "__bool__": "a Python `if`/`while` (or `bool()`) on",
    "item": "`.item()` of",
    "tolist": "`.tolist()` of",
    "numpy": "`.numpy()` of",
    "__float__": "`float()` of",
    "__int__": "`int()` of",
    "__index__": "indexing or `range` with",
    "__array__": "a NumPy conversion of",
    "__len__": "`len()` of",
}


class LatentTaint(TorchFunctionMode):
    """Marks tensors computed from the traced inputs and refuses to let them become Python values."""

    def __init__(self):
        super().__init__()
        self._marked = {}  # id -> tensor (kept alive so ids are not reused during the trace)

    def mark(self, tensor):
        self._marked[id(tensor)] = tensor

    def _is_marked(self, obj):
        return torch.is_tensor(obj) and id(obj) in self._marked

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat_in, _ = tree_flatten((args, kwargs))
        tainted = any(self._is_marked(a) for a in flat_in)
        name = getattr(func, "__name__", "")
        if tainted and name in _ESCAPES:
            raise UntraceableModel(
                f"the potential uses {_ESCAPES[name]} a value computed from the latent "
                "variables, so one trace cannot stand for every point"
            )
        out = func(*args, **kwargs)
        if tainted:
            for t in tree_flatten(out)[0]:
                if torch.is_tensor(t):
                    self.mark(t)
            if name.endswith("_") and args and torch.is_tensor(args[0]):
                self.mark(args[0])  # in-place op on an untainted tensor with tainted input
            for t in tree_flatten(kwargs.get("out"))[0]:
                if torch.is_tensor(t):
                    self.mark(t)
        return out


def _shared_fake_mode():
    """One fake-tensor mode for the shape metadata of every node of a trace. Without it,
    real-tensor ``make_fx`` builds a new mode (and captures a Python stack) per node, which is
    most of its cost on graphs of hundreds of ops. Private API: on any problem, a no-op."""
    try:
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode

        return tracing(TracingContext(FakeTensorMode(allow_non_fake_inputs=True)))
    except Exception:  # pragma: no cover - torch internals moved
        import contextlib

        return contextlib.nullcontext()


def trace(fn, example_inputs, check_escapes: bool = True) -> torch.fx.GraphModule:
    """Trace ``fn(*example_inputs)`` (all tensors) into a folded FX graph of aten ops.

    Raises :class:`UntraceableModel` if ``fn`` lets a value derived from its inputs escape
    into Python, or if ``make_fx`` itself cannot follow it. ``check_escapes=False`` skips
    the escape check (it costs as much as the trace itself) for functions known to be pure
    tensor code, such as the sampler's own functions around an already checked gradient;
    those are traced on fake tensors, so no value is computed and a model that fails
    numerically at the example inputs (a Cholesky beyond its support) still traces.
    """

    def tainted_fn(*inputs):
        with LatentTaint() as taint:
            for x in inputs:
                taint.mark(x)
            return fn(*inputs)

    try:
        with _shared_fake_mode():
            if check_escapes:
                gm = make_fx(tainted_fn, _error_on_data_dependent_ops=False)(*example_inputs)
            else:
                gm = make_fx(fn, tracing_mode="fake", _error_on_data_dependent_ops=False)(*example_inputs)
    except UntraceableModel:
        raise
    except Exception as e:  # make_fx failures come in many types; all mean "not traceable"
        raise UntraceableModel(f"tracing failed: {type(e).__name__}: {e}") from e
    fold_constants(gm)
    simplify(gm)
    fold_constants(gm)
    return gm


def to_torchscript(fn, example_inputs) -> torch.jit.ScriptFunction:
    """``fn`` (a function of tensors returning a tuple of tensors) run once at
    ``example_inputs`` under ``torch.jit.trace``: a TorchScript program of every aten op it
    performed, for the sampler's functions around the already traced gradient graph.

    Recording real execution costs about as much as running ``fn`` once (``make_fx`` costs
    ~1 ms per op here, seconds for a NUTS subtree). The price is that the recorder follows
    Python values silently; so every warning by which it says it had to freeze one (a tensor
    turned into a Python number, iterated, or its ``len``) is an error here, raised as
    :class:`UntraceableModel`. Constants made with ``torch.tensor`` from Python numbers are
    fine.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        warnings.filterwarnings("error", category=torch.jit.TracerWarning)
        warnings.filterwarnings("ignore", "torch.tensor results are registered as constants",
                                torch.jit.TracerWarning)
        try:
            return torch.jit.trace(fn, tuple(example_inputs), check_trace=False, strict=False)
        except Exception as e:
            cause = e
            while cause is not None and not isinstance(cause, torch.jit.TracerWarning):
                cause = cause.__cause__ or cause.__context__
            if cause is None:
                raise
            raise UntraceableModel(f"the program cannot be recorded as one trace: {cause}") from e


_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
aten = torch.ops.aten
# ops whose value depends only on the (static) shape of their tensor input
_SHAPE_ONLY = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
             aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.unsqueeze.default}
_PERMUTES = {aten.permute.default, aten.t.default, aten.transpose.int}
_IDENTITY_SCALAR = {aten.add.Tensor: 0, aten.sub.Tensor: 0, aten.mul.Tensor: 1, aten.div.Tensor: 1,
                    aten.pow.Tensor_Scalar: 1, aten.mul.Scalar: 1}


def fold_constants(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Evaluate, once, every node whose inputs are all constants; drop aliasing no-ops.

    Random ops (tagged ``nondeterministic_seeded``) are never folded, so a model that draws
    inside its potential keeps drawing. Error checks on constants that passed at trace time
    (``_linalg_check_errors``) are removed; checks on inputs stay.
    """
    graph = gm.graph
    const = {}
    buffer_count = 0
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
        inputs = node.all_input_nodes
        target = node.target
        if target in _SHAPE_ONLY and "val" in node.meta:
            val = node.meta["val"]
            fill = {aten.zeros_like.default: 0, aten.ones_like.default: 1}.get(target)
            fill = node.args[1] if fill is None else fill
            const[node] = torch.full(val.shape, fill, dtype=val.dtype, device=val.device)
            continue
        if not all(n in const for n in inputs):
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
        name = f"_folded_{buffer_count}"
        buffer_count += 1
        gm.register_buffer(name, value.detach().clone() if value._is_view() else value.detach())
        with graph.inserting_before(node):
            attr = graph.get_attr(name)
        for user in users:
            user.replace_input_with(node, attr)
    graph.eliminate_dead_code(is_impure_node=_is_impure)
    graph.lint()
    gm.recompile()
    return gm


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
        if node.target is aten.permute.default:
            perm = list(node.args[1])
        else:
            dims = (0, 1) if node.target is aten.t.default else node.args[1:3]
            perm = list(range(src.dim()))
            if perm:
                a, b = (d % src.dim() for d in dims)
                perm[a], perm[b] = perm[b], perm[a]
        moved = [d for d in perm if src.shape[d] != 1]
        return moved == sorted(moved)
    if node.target is aten.cat.default:
        return len(node.args[0]) == 1
    if node.target in _IDENTITY_SCALAR and len(node.args) == 2:
        other = node.args[1]
        return isinstance(other, (int, float)) and other == _IDENTITY_SCALAR[node.target]
    return False


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


def simplify(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Remove ops that do not change values (reshapes to the same shape, permutations of
    unit dimensions, ``x + 0``, ``x * 1``, ``x ** 1``, one-element ``cat``) and collapse chains of
    reshapes. Each op removed saves a few microseconds per call in the interpreted engines."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
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
            if _val(node.args[0][0]) is not None and _val(node.args[0][0]).shape == _val(node).shape:
                node.replace_all_uses_with(node.args[0][0])
                graph.erase_node(node)
            continue
        if _is_value_identity(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        # view(view(x)) -> view(x): a reshape of a reshape only needs the final shape
        if node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
            src = node.args[0]
            if (isinstance(src, torch.fx.Node) and src.op == "call_function"
                    and src.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)):
                node.args = (src.args[0],) + tuple(node.args[1:])
                node.target = aten.reshape.default
    graph.eliminate_dead_code(is_impure_node=_is_impure)
    gm.recompile()
    return gm


def target_is_check(node) -> bool:
    return node.target is torch.ops.aten._linalg_check_errors.default


def _is_impure(node) -> bool:
    """Keep error checks on non-constant inputs (they raise on e.g. a failed Cholesky)."""
    if node.op == "call_function" and node.target is operator.getitem:
        return False
    if target_is_check(node):
        return True
    return node.is_impure()
