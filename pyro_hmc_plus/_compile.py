"""Backends that turn a traced FX graph into a callable. The one place that touches
private torch entry points, each with a public fallback (tested in tests/test_compile.py
so a torch upgrade that breaks them is caught).

- :func:`inductor`: ``torch._inductor.compile`` with the C++ wrapper, which skips
  ``torch.compile``'s front end (guards, frame evaluation: 14-37 us per call on CPU, more
  than a small model's whole gradient). If that private function is missing, the public
  ``torch.compile(fullgraph=True, dynamic=False)``.
- :func:`static_runtime`: TorchScript's Static Runtime for a traced program on CPU
  (``torch._C._jit_to_static_module``); where it is missing, the TorchScript program itself.
- :func:`outside_traces`: pauses whatever is recording a program -- a ``torch.jit.trace``
  (``torch._C``'s tracing state) or a ``make_fx`` trace (its fake-tensor, proxy and
  torch-function modes) -- so that a graph the program needs (a batched gradient) can be
  recorded on real tensors in the middle of it.
- :func:`aot_compile` / :func:`aot_load`: AOTInductor (``torch.export`` +
  ``torch._inductor.aoti_compile_and_package``) into an on-disk cache keyed by the graph
  (loaded by torch's C++ package loader and called through its ``boxed_run``: neither
  ``torch._inductor``'s imports nor the public wrapper's per-call tree specs), so that a
  later process loads the compiled program in milliseconds instead of compiling it again
  (tens of seconds on a small CPU). ``torch.compile``'s own caches do not serve graphs
  handed to inductor directly ("no shape env"), hence our own.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pathlib
import tempfile
import warnings

import torch


def static_runtime(program: torch.jit.ScriptFunction, example_inputs):
    """``program`` (a ``torch.jit.trace``-d function of tensors returning a tuple of tensors)
    run by TorchScript's Static Runtime; ``None`` where torch lacks it, where the inputs are
    not on the CPU (it is CPU-only), or where it refuses the graph.

    Why: a sampler program is hundreds of small aten ops, and the TorchScript interpreter
    spends more time dispatching each (~1.5 µs, a fresh output allocated every time) than
    the arithmetic takes. Static Runtime, torch's executor for CPU inference, plans the
    program's memory once (intermediates reuse their buffers from call to call) and calls
    the ops' ``out=`` variants without the interpreter's stack: a NUTS doubling or an HMC
    transition runs ~1.3-1.7x faster, with the same results. Its outputs are fresh tensors
    (never its reused buffers), but it runs under ``InferenceMode``, so they are *inference
    tensors*: fine as inputs to any op or program, refused by autograd and by in-place
    updates outside inference mode. The package copies them where they leave for the user
    (the kernels' draws) or enter autograd (the eager potential)."""
    to_static_module = getattr(torch._C, "_jit_to_static_module", None)
    if to_static_module is None or any(x.device.type != "cpu" for x in example_inputs):
        return None
    try:
        module = to_static_module(program.graph)
    except RuntimeError:
        return None
    return lambda *xs: module(*xs)


@contextlib.contextmanager
def outside_traces():
    """Run the body as if nothing were recording: neither a ``torch.jit.trace`` nor a
    ``make_fx`` trace (whose fake-tensor and proxy dispatch modes and torch-function modes
    are taken off their stacks and put back afterwards). Without this, a graph recorded
    inside a compiler's fake-tensor trace sees fake tensors and proxies: folding its
    constants needs their values and fails. Where torch lacks the private accessors and
    something is recording, raise :class:`NotImplementedError`."""
    with _outside_jit_trace(), _outside_tracing_modes():
        yield


def static_shape(x: torch.Tensor) -> torch.Size:
    """``x.shape`` as numbers, also inside a ``torch.jit.trace`` recording, where a size is a
    tensor and arithmetic on it is recorded as operations of the program (~50 of a NUTS round
    of the vectorized chains). The recorded programs are specialised to their inputs' shapes
    anyway."""
    with _outside_jit_trace():
        return x.shape


@contextlib.contextmanager
def _outside_jit_trace():
    get = getattr(torch._C, "_get_tracing_state", None)
    set_ = getattr(torch._C, "_set_tracing_state", None)
    if get is None or set_ is None:
        if torch.jit.is_tracing():
            raise NotImplementedError("cannot pause torch.jit.trace in this torch version")
        yield
        return
    state = get()
    set_(None)
    try:
        yield
    finally:
        set_(state)


@contextlib.contextmanager
def _outside_tracing_modes():
    from torch.utils import _python_dispatch

    disable_dispatch_modes = getattr(_python_dispatch, "_disable_current_modes", None)
    function_modes = getattr(torch._C, "_len_torch_function_stack", None)
    pop, push = getattr(torch.overrides, "_pop_mode", None), getattr(torch.overrides, "_push_mode", None)
    if None in (disable_dispatch_modes, function_modes, pop, push):
        from torch.fx.experimental.proxy_tensor import get_proxy_mode

        if get_proxy_mode() is not None:
            raise NotImplementedError("cannot pause a make_fx trace in this torch version")
        yield
        return
    popped = [pop() for _ in range(function_modes())]  # innermost first
    try:
        with disable_dispatch_modes():
            yield
    finally:
        for mode in reversed(popped):
            push(mode)


@contextlib.contextmanager
def _trusted_cpu_isa():
    """Inductor's settings for our compilations and cache loads: trust the vector
    instructions that ``/proc/cpuinfo`` lists instead of test-compiling a program for each
    of them (~18 s of a fresh process's first compilation on a small CPU, ~1 s of its first
    load from the cache; if the compiler cannot build them after all, the compilation fails
    and the engine keeps the traced program). Scoped, so
    the user's own ``torch.compile`` settings are untouched."""
    try:
        from torch._inductor import config
    except ImportError:  # pragma: no cover - torch without inductor
        yield
        return
    with config.patch({"cpp.vec_isa_ok": True}) if hasattr(config.cpp, "vec_isa_ok") else contextlib.nullcontext():
        yield


def _on_contiguous_inputs(run):
    """``run``, a compiled program of flat tensors, called on contiguous inputs. Compiled
    code is specialised to its example inputs' layout (contiguous: the engine compiles at
    contiguous copies) and reads a tensor with other strides wrongly, without an error: a
    NUTS tree whose ends are slices of one tensor made a compiled doubling run every tree
    to the maximum depth. ``contiguous()`` returns a contiguous tensor itself."""
    return lambda *xs: run(*[x.contiguous() for x in xs])


def inductor(gm: torch.fx.GraphModule, example_inputs):
    for node in gm.graph.nodes:
        node.meta = {}  # fake tensors from the nested make_fx calls confuse inductor
    compile_fx = getattr(getattr(torch, "_inductor", None), "compile", None)
    if compile_fx is None:
        import importlib

        compile_fx = getattr(importlib.import_module("torch._inductor"), "compile", None)
    if compile_fx is not None:
        options = {"cpp_wrapper": True} if example_inputs[0].device.type == "cpu" else {}
        with _trusted_cpu_isa():
            fn = compile_fx(gm, list(example_inputs), options=options)
        return _on_contiguous_inputs(fn)
    return torch.compile(gm, fullgraph=True, dynamic=False)


def aot_cache_dir() -> pathlib.Path:
    """Where compiled programs are kept: ``$PYRO_HMC_PLUS_CACHE`` or
    ``~/.cache/pyro_hmc_plus``, one folder per torch version."""
    root = os.environ.get("PYRO_HMC_PLUS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pyro_hmc_plus")
    return pathlib.Path(root) / f"aot-torch-{torch.__version__}"


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def graph_key(gm: torch.fx.GraphModule, example_inputs) -> str:
    """A digest of everything a traced graph computes: its code, the values of its constants
    (the model's data is baked in as constants), and the inputs' shapes and dtypes."""
    h = hashlib.sha256(gm.code.encode())
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = getattr(gm, node.target)
            h.update(node.target.encode())
            if torch.is_tensor(value):
                h.update(f"{value.dtype}{tuple(value.shape)}".encode())
                t = value.detach().cpu()
                h.update((t.float() if t.dtype == torch.bfloat16 else t).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    for x in example_inputs:
        h.update(f"{x.dtype}{tuple(x.shape)}{x.device.type}".encode())
    return h.hexdigest()[:32]


_SOURCE_DIGEST = []


def source_digest() -> str:
    """A digest of this package's source: a cached program is stale when the code changes."""
    if not _SOURCE_DIGEST:
        folder = pathlib.Path(__file__).parent
        _SOURCE_DIGEST.append(digest(*(p.read_text() for p in sorted(folder.glob("*.py")))))
    return _SOURCE_DIGEST[0]


def aot_load(key: str):
    """The cached compiled program ``key`` as a function of its flat tensors returning a
    tuple, or ``None``.

    Loaded by the C++ package loader itself (``torch._C._aoti.AOTIModelPackageLoader``) and
    called through its ``boxed_run`` on the flat list of tensors. Why not the public
    ``torch._inductor.aoti_load_package``: importing ``torch._inductor`` imports
    ``torch._dynamo`` (~1.7 s of a fresh process, more than a small model's whole warm
    run), and the public runner parses the program's input and output tree specs at every
    call (~150 µs for a batched NUTS state of ~40 tensors, more than the compiled code);
    our programs take and return flat tensors in the traced order. The public path where
    torch lacks the loader or its ``boxed_run``."""
    path = aot_cache_dir() / f"{key}.pt2"
    if not path.exists():
        return None
    loader_class = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader_class is not None and hasattr(loader_class, "boxed_run"):
        # (path, model name, run single-threaded, number of runners, device index)
        boxed_run = loader_class(str(path), "model", False, 1, -1).boxed_run
        return _on_contiguous_inputs(lambda *xs: tuple(boxed_run(list(xs))))
    from torch._inductor import aoti_load_package

    with _trusted_cpu_isa():  # the public loader probes the CPU (~1 s of test compilations per process)
        runner = aoti_load_package(str(path))
    return _on_contiguous_inputs(lambda *xs: tuple(runner(*xs)))


def aot_compile(gm: torch.fx.GraphModule, example_inputs, key: str):
    """Compile ``gm`` with AOTInductor into the cache (atomically) and load it."""
    from torch._inductor import aoti_compile_and_package

    for node in gm.graph.nodes:
        node.meta = {}  # as in :func:`inductor`
    exported = torch.export.export(gm, tuple(example_inputs), strict=False)
    folder = aot_cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=folder)
    os.close(fd)
    inductor_log = logging.getLogger("torch._inductor")
    level = inductor_log.level
    try:
        inductor_log.setLevel(logging.ERROR)  # e.g. "missing a c-shim implementation": harmless
        with warnings.catch_warnings(), _trusted_cpu_isa():
            warnings.simplefilter("ignore")
            aoti_compile_and_package(exported, package_path=tmp)
        os.replace(tmp, folder / f"{key}.pt2")
    finally:
        inductor_log.setLevel(level)
        if os.path.exists(tmp):
            os.remove(tmp)
    return aot_load(key)
