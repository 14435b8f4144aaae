"""NUTS side by side: ESS per second and ESS per gradient, Pyro's NUTS vs ours, in one run.

Models: the classic question's 2-D Gaussian, eight schools (non-centered), a logistic
regression (N=5,000, D=25), a hierarchical linear model with 100 latent dimensions
(``hierarchical``: 96 group intercepts, a slope, and three scales/means) and, not run by
default, ``ar_loop`` (``pyro_hmc_plus.models.ar1_loop``): an AR(1) latent series of 20 steps
observed with noise, written as a Python loop over ``pyro.markov`` with one sample site per
step, as Pyro's time-series tutorials write models (slow for Pyro, so run it with fewer
draws, e.g. ``--warmup 200 --samples 200``), and ``seq_plate``
(``pyro_hmc_plus.models.sequential_plate_regression``): a linear regression with one
observation site per row of 1,000, in a sequential plate, as Pyro's introductory tutorials
write models (Pyro's NUTS takes ~400 s for 200 + 200 draws: ``--reps 1``), and
``hierarchical_large``: the hierarchical model with 2,000 groups of 5 observations (D=2,004),
where the arithmetic of a gradient and of the tree's bookkeeping on ``D``-vectors, not the
per-operation overhead, sets the pace (Pyro's NUTS takes ~110 s for 200 + 200 draws).

Each contender runs one chain in a fresh Python process with one thread (so tracing and
compiling are counted), ``--warmup`` + ``--samples`` iterations, and the contenders alternate
within each repetition so that load changes on a shared machine hit them alike. *Cold* is
the default: clear ``$PYRO_HMC_PLUS_CACHE`` (default ``~/.cache/pyro_hmc_plus``) first for an
empty compile cache. ``--warm`` first runs every contender once, untimed, which fills the
on-disk caches (our ``"aot"`` engine's compiled programs; Pyro keeps none), and then times
fresh processes. Reported, median over ``--reps``:

* ESS/s: the minimum bulk ESS (ArviZ) over all scalar latent parameters, divided by the
  wall time of the whole run (setup, compile and warmup included);
* ESS/grad: the same ESS divided by all leapfrog steps of the run (warmup included).
  Repetition ``k`` uses seed ``first_seed + k`` (``--first-seed``, default 0) for every
  contender, so ESS medians are over seeds too; ``ESS/grad mean`` is the mean over the seeds
  with its standard error, for telling two samplers' mixing apart (many seeds: ``--reps 48``).
  Pyro's steps are counted as model executions (one per gradient; not available with
  ``jit_compile``, which runs the model once).

    python benchmarks/nuts.py --reps 3
    python benchmarks/nuts.py --models eight_schools --contenders pyro ours --reps 5

``--device cuda`` puts the model's data on the GPU and makes it torch's default device (as a
Pyro user moves a model there), for Pyro's kernels and ours alike; NumPyro runs on JAX's
default device (the GPU where its CUDA plugin is installed). The 2-D Gaussian, whose
precision matrix is a CPU constant of ``pyro_hmc_plus.models``, stays on the CPU.

``numpyro`` (NumPyro's NUTS on the same models and data, written in NumPyro; install it with
``pip install -e ".[bench]"``) is a reference column: like Pyro, its framework is imported
before the clock starts; its wall time includes JAX's compilation. Its JAX runs on one
thread (``XLA_FLAGS``), float32 like the others. It runs ``warmup()`` then ``run()`` so that
the warmup's leapfrog steps can be counted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

MODELS = ("gauss2d", "eight_schools", "logistic", "hierarchical", "ar_loop", "seq_plate", "hierarchical_large")
DEFAULT_MODELS = MODELS[:4]
CONTENDERS = ("pyro", "pyro_jit", "ours", "ours_aot", "ours_inductor", "numpyro")
SINGLE_THREAD_XLA = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def make_problem(name: str):
    """``(model, args, calls)`` for a Pyro model of ``pyro_hmc_plus.models`` with this
    benchmark's data (fixed by a seeded generator); ``calls["n"]`` counts model executions."""
    import torch

    from pyro_hmc_plus import models

    g = torch.Generator().manual_seed(0)
    calls = {"n": 0}

    def counted(fn):
        def model(*args):
            calls["n"] += 1
            return fn(*args)

        return model

    if name == "gauss2d":
        return counted(models.classic_gaussian), (), calls
    if name == "eight_schools":
        return counted(models.eight_schools_non_centered), (models.EIGHT_SCHOOLS_Y, models.EIGHT_SCHOOLS_SIGMA), calls
    if name == "logistic":
        n, d = 5000, 25
        x = torch.randn(n, d, generator=g)
        w = torch.randn(d, generator=g) * 0.5
        y = torch.bernoulli(torch.sigmoid(x @ w), generator=g)
        return counted(models.logistic_regression), (x, y), calls
    if name in ("hierarchical", "hierarchical_large"):  # radon-like: 96 groups of 10, or 2,000 groups of 5
        groups, per_group = (96, 10) if name == "hierarchical" else (2000, 5)
        group = torch.arange(groups).repeat_interleave(per_group)
        x = torch.randn(groups * per_group, generator=g)
        a = 1.0 + 0.7 * torch.randn(groups, generator=g)
        y = a[group] - 0.6 * x + 0.8 * torch.randn(groups * per_group, generator=g)
        return counted(models.hierarchical_intercepts), (x, group, y), calls
    if name == "ar_loop":  # phi = 0.8, s = 0.5, 20 steps
        x, states = torch.tensor(0.0), []
        for _ in range(20):
            x = 0.8 * x + 0.5 * torch.randn((), generator=g)
            states.append(x)
        return counted(models.ar1_loop), (torch.stack(states) + 0.3 * torch.randn(20, generator=g),), calls
    if name == "seq_plate":  # a = 1, b = 2, s = 0.5, 1,000 observations
        x = torch.randn(1000, generator=g)
        return counted(models.sequential_plate_regression), (x, 1.0 + 2.0 * x + 0.5 * torch.randn(1000, generator=g)), calls
    raise ValueError(name)


def numpyro_model(name: str):
    """The NumPyro transcription of ``pyro_hmc_plus.models``' model ``name`` (same priors,
    likelihood and site names), taking the same arguments as NumPy arrays."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as nd

    from pyro_hmc_plus import models

    if name == "gauss2d":
        precision = jnp.asarray(models.CLASSIC_PRECISION.numpy())

        def model():
            numpyro.sample("q", nd.MultivariateNormal(jnp.zeros(2), precision_matrix=precision))
    elif name == "eight_schools":
        def model(y, sigma):
            mu = numpyro.sample("mu", nd.Normal(0.0, 5.0))
            tau = numpyro.sample("tau", nd.HalfCauchy(5.0))
            with numpyro.plate("school", len(y)):
                theta_raw = numpyro.sample("theta_raw", nd.Normal(0.0, 1.0))
                numpyro.sample("y", nd.Normal(mu + tau * theta_raw, sigma), obs=y)
    elif name == "logistic":
        def model(x, y):
            w = numpyro.sample("w", nd.Normal(jnp.zeros(x.shape[1]), 1.0).to_event(1))
            b = numpyro.sample("b", nd.Normal(0.0, 1.0))
            with numpyro.plate("data", x.shape[0]):
                numpyro.sample("y", nd.Bernoulli(logits=x @ w + b), obs=y)
    elif name in ("hierarchical", "hierarchical_large"):
        def model(x, group, y):
            mu_a = numpyro.sample("mu_a", nd.Normal(0.0, 5.0))
            sigma_a = numpyro.sample("sigma_a", nd.HalfNormal(2.0))
            beta = numpyro.sample("beta", nd.Normal(0.0, 5.0))
            sigma_y = numpyro.sample("sigma_y", nd.HalfNormal(2.0))
            with numpyro.plate("groups", int(group.max()) + 1):
                a_raw = numpyro.sample("a_raw", nd.Normal(0.0, 1.0))
            a = mu_a + sigma_a * a_raw
            with numpyro.plate("data", len(y)):
                numpyro.sample("y", nd.Normal(a[group] + beta * x, sigma_y), obs=y)
    elif name == "ar_loop":
        def model(y):
            s = numpyro.sample("s", nd.HalfNormal(1.0))
            phi = numpyro.sample("phi", nd.Uniform(-1.0, 1.0))
            x = 0.0
            for t in range(len(y)):
                x = numpyro.sample(f"x_{t}", nd.Normal(phi * x, s))
                numpyro.sample(f"y_{t}", nd.Normal(x, 0.3), obs=y[t])
    elif name == "seq_plate":
        def model(x, y):
            a = numpyro.sample("a", nd.Normal(0.0, 10.0))
            b = numpyro.sample("b", nd.Normal(0.0, 10.0))
            s = numpyro.sample("s", nd.HalfNormal(2.0))
            for i in range(len(y)):
                numpyro.sample(f"obs_{i}", nd.Normal(a + b * x[i], s), obs=y[i])
    else:
        raise ValueError(name)
    return model


def run_numpyro(model_name: str, args, warmup: int, samples: int, seed: int) -> dict:
    """NumPyro's NUTS, one chain; wall time from building the kernel to the last draw."""
    import jax
    import numpy as np
    import numpyro
    import torch
    from numpyro.infer import MCMC, NUTS

    model = numpyro_model(model_name)
    np_args = tuple(np.asarray(a.cpu().numpy()) for a in args)
    start = time.perf_counter()
    mcmc = MCMC(NUTS(model), num_warmup=warmup, num_samples=samples, progress_bar=False)
    mcmc.warmup(jax.random.PRNGKey(seed), *np_args, extra_fields=("num_steps",), collect_warmup=True)
    gradients = int(mcmc.get_extra_fields()["num_steps"].sum())
    mcmc.run(jax.random.PRNGKey(seed + 1), *np_args, extra_fields=("num_steps",))
    jax.block_until_ready(mcmc.get_samples())
    wall = time.perf_counter() - start
    gradients += int(mcmc.get_extra_fields()["num_steps"].sum())
    draws = {k: torch.as_tensor(np.array(v)) for k, v in mcmc.get_samples().items()}
    return {"wall_s": wall, "ess": min_bulk_ess(draws), "gradients": gradients, "numpyro": numpyro.__version__}


def min_bulk_ess(samples: dict) -> float:
    import arviz as az
    import numpy as np

    worst = float("inf")
    for v in samples.values():
        draws = v.reshape(v.shape[0], -1).cpu().numpy().astype(np.float64)
        for j in range(draws.shape[1]):
            worst = min(worst, float(az.ess(draws[None, :, j], method="bulk")))
    return worst


def run_one(model_name: str, contender: str, warmup: int, samples: int, seed: int, device: str) -> dict:
    """Runs in the child process."""
    import pyro
    import torch
    from pyro.infer import MCMC

    torch.set_num_threads(1)
    model, args, calls = make_problem(model_name)
    if contender == "numpyro":
        return run_numpyro(model_name, args, warmup, samples, seed)
    if device != "cpu" and model_name != "gauss2d":
        torch.set_default_device(device)
        args = tuple(a.to(device) for a in args)

    def once(seed):
        pyro.set_rng_seed(seed)
        calls["n"] = 0
        start = time.perf_counter()
        if contender.startswith("pyro"):
            from pyro.infer import NUTS

            kernel = NUTS(model, jit_compile=contender == "pyro_jit", ignore_jit_warnings=True)
        else:
            from pyro_hmc_plus import NUTS

            engine = {"ours_aot": "aot", "ours_inductor": "inductor"}.get(contender, "auto")
            kernel = NUTS(model, engine=engine)
        mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, disable_progbar=True)
        mcmc.run(*args)
        wall = time.perf_counter() - start
        if contender.startswith("ours"):
            gradients = sum(kernel.sample_stats[-1]["n_steps"])
        else:
            gradients = calls["n"] if contender == "pyro" else float("nan")
        return mcmc, wall, gradients

    mcmc, wall, gradients = once(seed)
    ess = min_bulk_ess(mcmc.get_samples())
    return {"wall_s": wall, "ess": ess, "gradients": gradients}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=list(DEFAULT_MODELS), choices=MODELS)
    parser.add_argument("--contenders", nargs="*", default=["pyro", "pyro_jit", "ours"], choices=CONTENDERS)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seed of the first repetition")
    parser.add_argument("--warm", action="store_true", help="one untimed run per contender first (fills on-disk caches)")
    parser.add_argument("--device", default="cpu", help="torch device of the models' data (e.g. cuda)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, contender, seed = args.child
        print(json.dumps(run_one(model_name, contender, args.warmup, args.samples, int(seed), args.device)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "XLA_FLAGS": SINGLE_THREAD_XLA}
    print(
        f"NUTS, 1 chain, {args.warmup} warmup + {args.samples} draws, "
        f"{'warm' if args.warm else 'cold'} start, median of {args.reps} fresh processes, device {args.device}"
    )
    print(f"{'model':<14} {'contender':<14} {'wall s':>8} {'min ESS':>8} {'ESS/s':>8} {'ESS/grad':>9} {'ESS/s vs Pyro':>14} "
          f"{'ESS/grad mean':>19}")
    for model_name in args.models:
        results = {c: [] for c in args.contenders}
        for rep in range(-1 if args.warm else 0, args.reps):  # every contender sees the same seeds
            for contender in args.contenders:
                cmd = [sys.executable, __file__, "--child", model_name, contender, str((args.first_seed + rep) % 1000),
                       "--warmup", str(args.warmup), "--samples", str(args.samples), "--device", args.device]
                out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if out.returncode != 0:
                    print(f"{model_name} {contender} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                    continue
                if rep >= 0:  # rep -1: the untimed run of --warm
                    results[contender].append(json.loads(out.stdout.strip().splitlines()[-1]))

        def median(runs, f):
            return statistics.median(f(r) for r in runs) if runs else float("nan")

        def mean_and_se(values):
            values = list(values)
            if any(math.isnan(v) for v in values):  # gradients not counted (Pyro's jit_compile)
                return "nan"
            if len(values) < 2:
                return f"{statistics.fmean(values) if values else float('nan'):.4f}"
            return f"{statistics.fmean(values):.4f} +- {statistics.stdev(values) / len(values) ** 0.5:.4f}"

        base = median(results.get("pyro", []), lambda r: r["ess"] / r["wall_s"])
        for contender, runs in results.items():
            ess_per_s = median(runs, lambda r: r["ess"] / r["wall_s"])
            print(
                f"{model_name:<14} {contender:<14} {median(runs, lambda r: r['wall_s']):>8.1f} "
                f"{median(runs, lambda r: r['ess']):>8.0f} {ess_per_s:>8.1f} "
                f"{median(runs, lambda r: r['ess'] / r['gradients']):>9.4f} {ess_per_s / base:>14.1f} "
                f"{mean_and_se(r['ess'] / r['gradients'] for r in runs):>19}",
                flush=True,
            )


if __name__ == "__main__":
    main()
