"""The private torch entry points we rely on, so a torch upgrade that moves them is caught."""

import importlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from pyro_hmc_plus import _compile


def test_private_entry_points_exist():
    assert callable(getattr(importlib.import_module("torch._inductor"), "compile", None))
    import inspect

    assert "_error_on_data_dependent_ops" in inspect.signature(make_fx).parameters
    # pausing a torch.jit.trace recording (batched gradient graphs built mid-recording)
    assert callable(getattr(torch._C, "_get_tracing_state", None))
    assert callable(getattr(torch._C, "_set_tracing_state", None))
    # pausing a make_fx trace (the same, inside a compiler's fake-tensor trace)
    from torch.utils import _python_dispatch

    assert callable(getattr(_python_dispatch, "_disable_current_modes", None))
    assert callable(getattr(torch._C, "_len_torch_function_stack", None))
    assert callable(getattr(torch.overrides, "_pop_mode", None))
    assert callable(getattr(torch.overrides, "_push_mode", None))
    from torch._inductor import config

    assert hasattr(config.cpp, "vec_isa_ok")
    # calling a loaded AOTInductor program on a flat list of tensors
    assert hasattr(torch._C._aoti.AOTIModelPackageLoader, "boxed_run")
    # Static Runtime for traced programs on the CPU
    assert callable(getattr(torch._C, "_jit_to_static_module", None))
    # rewriting a recorded program's numbers as tensor constants (tracing._tidied)
    assert callable(getattr(torch._C, "_create_function_from_graph", None))
    for name in ("copy", "insert_point_guard", "insertConstant", "create"):
        assert callable(getattr(torch._C.Graph, name, None)), name
    for name in ("t", "insertBefore", "destroy", "inputsAt", "inputsSize", "outputsSize", "mustBeNone"):
        assert callable(getattr(torch._C.Node, name, None)), name
    for name in ("toIValue", "unique", "replaceAllUsesWith"):
        assert callable(getattr(torch._C.Value, name, None)), name
    # taking apart the tuples inside a recorded program and dropping what nothing reads
    # (tracing._without_inner_tuples)
    for name in ("_jit_pass_lower_all_tuples", "_jit_pass_dce"):
        assert callable(getattr(torch._C, name, None)), name
    assert callable(getattr(torch._C.Graph, "makeMultiOutputIntoTuple", None))


def test_static_runtime_runs_a_traced_program_with_the_same_results():
    """The executor reuses its intermediate buffers from call to call: a first call's
    outputs must survive a second call, and equal the TorchScript program's."""

    def fn(z, r):
        y = torch.where(z > 0, z.exp(), -z) * r
        return y.sum(), torch.cat([y, y.cumsum(0)])

    x1, x2 = (torch.randn(5), torch.randn(5)), (torch.randn(5), torch.randn(5))
    traced = torch.jit.trace(fn, x1)
    program = _compile.static_runtime(traced, x1)
    first = program(*x1)
    second = program(*x2)
    for got, expected in zip(first + second, traced(*x1) + traced(*x2)):
        assert torch.equal(got, expected)
    assert all(t.is_inference() for t in first)  # run under InferenceMode: callers must know


@pytest.mark.slow
def test_inductor_backend_compiles_a_traced_graph():
    gm = make_fx(lambda z: ((z * z).sum(), 2 * z))(torch.randn(3))
    fn = _compile.inductor(gm, (torch.randn(3),))
    U, g = fn(torch.ones(3))
    assert torch.allclose(U, torch.tensor(3.0)) and torch.allclose(g, 2 * torch.ones(3))
    # an input with other strides than the example's (a slice of a larger tensor, as a NUTS
    # tree's ends are): compiled code specialised to contiguous inputs must not misread it
    sliced = torch.arange(6.0).reshape(3, 2)[:, 1]
    U, g = fn(sliced)
    assert torch.allclose(U, (sliced**2).sum()) and torch.equal(g, 2 * sliced)


AOT_SCRIPT = """
import sys, torch, pyro
from pyro.infer import MCMC
from pyro_hmc_plus import NUTS

def potential(params):
    return 0.5 * (params["x"] ** 2).sum()

pyro.set_rng_seed(0)
kernel = NUTS(potential_fn=potential, step_size=0.2, adapt_step_size=False, adapt_mass_matrix=False,
              max_tree_depth=3, max_unroll=4, engine=sys.argv[1])
mcmc = MCMC(kernel, num_samples=20, warmup_steps=0, initial_params={"x": torch.zeros(2)}, disable_progbar=True)
mcmc.run()
print(kernel.engine_name, kernel._engine.cached_programs, mcmc.get_samples()["x"].sum().item(),
      "torch._inductor" in sys.modules)
"""


@pytest.mark.slow
def test_aot_cache_compiles_once_and_later_processes_load(tmp_path):
    """engine="aot" compiles into the on-disk cache; a later process (engine="auto") loads
    the programs from it without importing torch._inductor (which imports torch._dynamo,
    seconds of a fresh process), and its draws equal those of the plain traced engine. The
    trees go past the fused start into chunked doublings, whose compiled programs take the
    fused start's outputs (views with their own strides) as inputs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYRO_HMC_PLUS_CACHE": str(tmp_path)}

    def run(engine):
        out = subprocess.run([sys.executable, "-c", AOT_SCRIPT, engine], env=env, capture_output=True,
                             text=True, check=True)
        name, cached, total, imported_inductor = out.stdout.split()
        return name, int(cached), float(total), imported_inductor == "True"

    name, cached, aot_total, _ = run("aot")
    assert name == "aot" and cached == 0
    packages = list(tmp_path.rglob("*.pt2"))
    # the first doubling, the first two at once, the 2-state doubling, the 4-state chunk and
    # the start, merge and extend of chunked doublings
    assert len(packages) == 7
    name, cached, warm_total, imported_inductor = run("auto")
    assert cached == 4 and not imported_inductor  # the fused start, then chunk, start, extend
    _, _, trace_total, _ = run("trace")
    assert abs(warm_total - trace_total) < 1e-4 and abs(aot_total - trace_total) < 1e-4


def test_a_compiled_program_that_fails_validation_falls_back_to_the_trace(tmp_path, monkeypatch):
    """A cached/compiled program that disagrees with Pyro's potential (e.g. float sums
    reordered by the C++ compiler) is replaced by the traced program, not by eager autograd."""
    import warnings

    from pyro_hmc_plus import GradientEngine, from_potential_fn

    monkeypatch.setenv("PYRO_HMC_PLUS_CACHE", str(tmp_path))
    flat = from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.zeros(3)}, None)
    engine = GradientEngine(flat, "aot")

    def slightly_wrong(gm, examples, key):
        return lambda *xs: tuple(y * 1.01 if y.is_floating_point() else y for y in gm(*xs))

    monkeypatch.setattr(_compile, "aot_compile", slightly_wrong)

    def fn(value_and_grad, z):
        return value_and_grad(z)

    z = torch.tensor([0.5, -1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback-to-eager warning
        program = engine.program(fn, (z,), [(z,), (z + 1,)], cache_key=("test",))
    U, g = program(z)
    assert torch.allclose(U, 0.5 * (z**2).sum()) and torch.allclose(g, z)
    assert engine.rejected_compiled_programs == 1 and engine.name == "aot"


@pytest.mark.parametrize("engine_name, compiler, named", [("aot", "aot_compile", "AOTInductor"),
                                                           ("inductor", "inductor", "TorchInductor")])
def test_a_compiler_that_fails_leaves_the_traced_program_and_says_why(tmp_path, monkeypatch, engine_name, compiler,
                                                                      named):
    """Where the C++ compiler fails on a program (no compiler on the machine, a compile
    error), the program runs traced, one warning names the compiler and its error, and the
    engine traces from then on instead of failing again at every program."""
    import warnings

    from pyro_hmc_plus import EngineFallbackWarning, GradientEngine, from_potential_fn

    monkeypatch.setenv("PYRO_HMC_PLUS_CACHE", str(tmp_path))
    flat = from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.zeros(3)}, None)
    engine = GradientEngine(flat, engine_name)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("C++ compile error: g++: command not found")

    monkeypatch.setattr(_compile, compiler, no_compiler)

    def fn(value_and_grad, z):
        return value_and_grad(z)

    z = torch.tensor([0.5, -1.0, 2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = engine.program(fn, (z,), [(z,), (z + 1,)], cache_key=("test",))
    said = [str(w.message) for w in caught if issubclass(w.category, EngineFallbackWarning)]
    assert len(said) == 1 and named in said[0] and "g++: command not found" in said[0]
    U, g = program(z)
    assert torch.allclose(U, 0.5 * (z**2).sum()) and torch.allclose(g, z)
    assert engine.name == "trace"


def test_compilations_trust_the_cpu_isa_without_changing_the_users_settings():
    from torch._inductor import config

    before = config.cpp.vec_isa_ok
    with _compile._trusted_cpu_isa():
        assert config.cpp.vec_isa_ok is True
    assert config.cpp.vec_isa_ok == before


def test_a_program_the_compilers_cannot_trace_runs_traced_and_says_so_once(monkeypatch):
    """With ``engine="aot"``/``"inductor"`` the user asked for compiled programs: a program
    whose fake-tensor trace fails still runs (traced), and one warning says why."""
    import warnings

    from pyro_hmc_plus import EngineFallbackWarning, GradientEngine, from_potential_fn, tracing

    flat = from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.zeros(3)}, None)
    engine = GradientEngine(flat, "inductor")
    trace = tracing.trace

    def fake_trace_fails(fn, examples, check_escapes=True, fake=False):
        if fake:
            raise tracing.UntraceableModel("tracing failed: DataDependentOutputException")
        return trace(fn, examples, check_escapes=check_escapes)

    monkeypatch.setattr(tracing, "trace", fake_trace_fails)

    def fn(value_and_grad, z):
        return value_and_grad(z)

    z = torch.tensor([0.5, -1.0, 2.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        programs = [engine.program(fn, (z,), [(z,), (z + 1,)]) for _ in range(2)]
    said = [w for w in caught if issubclass(w.category, EngineFallbackWarning)]
    assert len(said) == 1 and "DataDependentOutputException" in str(said[0].message)
    for program in programs:
        U, g = program(z)
        assert torch.allclose(U, 0.5 * (z**2).sum()) and torch.allclose(g, z)
    assert engine.name == "inductor"


def test_a_batched_gradient_is_recorded_once_per_batch_size(monkeypatch):
    """A program that evaluates the gradient of a batch of points several times inlines one
    batched graph, recorded once: inside ``torch.jit.trace`` a tensor's sizes are tensors
    themselves, and keyed by them the graph was recorded again at every evaluation (~70 ms
    each for eight schools: most of the build time of a many-chain program)."""
    from pyro_hmc_plus import GradientEngine, from_potential_fn, tracing

    flat = from_potential_fn(lambda p: 0.5 * (p["x"] ** 2).sum(), {"x": torch.zeros(3)}, None)
    engine = GradientEngine(flat, "auto")
    trace, recorded = tracing.trace, []

    def counting_trace(fn, examples, **kwargs):
        recorded.append(tuple(examples[0].shape))
        return trace(fn, examples, **kwargs)

    monkeypatch.setattr(tracing, "trace", counting_trace)

    def two_steps(value_and_grad, z):
        U, g = value_and_grad(z)
        return value_and_grad(z - 0.1 * g)

    z = torch.tensor([[0.5, -1.0, 2.0], [1.0, 0.0, -3.0]])
    program = engine.program(two_steps, (z,), [(z,), (z + 1,)])
    U, g = program(z)
    assert recorded == [(2, 3)]
    assert torch.allclose(U, 0.5 * (0.9 * z).pow(2).sum(-1)) and torch.allclose(g, 0.9 * z)


def test_static_shape_reads_numbers_inside_a_recording():
    """Sizes read with ``static_shape`` are constants of a recorded program, not operations
    on recorded sizes (which a program would run at every call)."""

    def fn(x):
        d = _compile.static_shape(x)[-1]
        return (x.reshape(-1, d) * d,)

    recorded = torch.jit.trace(fn, (torch.randn(2, 3),))
    kinds = {node.kind() for node in recorded.graph.nodes()}
    assert not kinds & {"aten::size", "prim::NumToTensor", "aten::Int"}
    assert torch.equal(recorded(torch.ones(2, 3))[0], torch.full((2, 3), 3.0))
    plain = torch.jit.trace(lambda x: (x.reshape(-1, x.shape[-1]) * x.shape[-1],), (torch.randn(2, 3),))
    assert "aten::size" in {node.kind() for node in plain.graph.nodes()}  # what it avoids
