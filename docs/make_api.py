"""Write docs/api.md, the API reference, from the docstrings of the public API.

    python docs/make_api.py          # rewrite docs/api.md
    python docs/make_api.py --check  # exit 1 if docs/api.md is out of date (the tests run this)
"""

import inspect
import pathlib
import re
import sys

import pyro_hmc_plus

OUT = pathlib.Path(__file__).with_name("api.md")
SECTIONS = [
    ("Kernels", ["HMC", "NUTS"]),
    ("Running chains", ["MCMC"]),
    ("ArviZ and diagnostics", ["to_inference_data", "diagnose", "RunDiagnostics", "SamplingWarning"]),
    ("Engines and the model boundary", ["ENGINES", "GradientEngine", "EngineFallbackWarning", "UntraceableModel",
                                        "from_model", "from_potential_fn", "FlatPotential", "SiteLayout"]),
]


def entry(name: str) -> str:
    obj = getattr(pyro_hmc_plus, name)
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return f"### `{name}`\n\n`{obj!r}`\n"
    try:
        signature = re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"\1", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        signature = "(...)"
    kind = "class" if inspect.isclass(obj) else "def"
    doc = inspect.cleandoc(obj.__doc__ or "(undocumented)")
    return f"### `{name}`\n\n```text\n{kind} {name}{signature}\n```\n\n{doc}\n"


def render() -> str:
    names = {n for _, group in SECTIONS for n in group}
    missing = sorted(set(pyro_hmc_plus.__all__) - names)
    if missing:
        raise SystemExit(f"public names without a section in docs/make_api.py: {missing}")
    parts = ["# API reference\n\nGenerated from the docstrings by `python docs/make_api.py`; a test keeps it in sync.\n"]
    for title, group in SECTIONS:
        parts.append(f"## {title}\n")
        parts.extend(entry(n) for n in group)
    return "\n".join(parts)


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if OUT.exists() and OUT.read_text() == text else 1)
    OUT.write_text(text)
