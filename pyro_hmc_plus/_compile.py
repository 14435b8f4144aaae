"""Backends that turn a traced FX graph into a callable. The one place that touches
private torch entry points, each with a public fallback (tested in tests/test_compile.py
so a torch upgrade that breaks them is caught).

- :func:`torchscript`: ``torch.jit.trace`` of the graph. Milliseconds to build; removes
  FX's Python interpreter from every op.
- :func:`inductor`: ``torch._inductor.compile`` with the C++ wrapper, which skips
  ``torch.compile``'s front end (guards, frame evaluation: 14-37 us per call on CPU, more
  than a small model's whole gradient). If that private function is missing, the public
  ``torch.compile(fullgraph=True, dynamic=False)``.
"""

from __future__ import annotations

import warnings

import torch


def torchscript(gm: torch.fx.GraphModule, example_inputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.jit.trace(gm, tuple(example_inputs), check_trace=False, strict=False)


def inductor(gm: torch.fx.GraphModule, example_inputs):
    for node in gm.graph.nodes:
        node.meta = {}  # fake tensors from the nested make_fx calls confuse inductor
    compile_fx = getattr(getattr(torch, "_inductor", None), "compile", None)
    if compile_fx is None:
        import importlib

        compile_fx = getattr(importlib.import_module("torch._inductor"), "compile", None)
    if compile_fx is not None:
        options = {"cpp_wrapper": True} if example_inputs[0].device.type == "cpu" else {}
        fn = compile_fx(gm, list(example_inputs), options=options)
        return lambda *xs: fn(*xs)
    return torch.compile(gm, fullgraph=True, dynamic=False)
