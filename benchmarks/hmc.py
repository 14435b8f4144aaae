"""HMC side by side (issue #2): the classic question's problem as written, and a 100-D
hierarchical model with plates, for the hand-written ``backward()`` loop, Pyro's
``HMC(model)`` with ``jit_compile`` off and on, Pyro's ``HMC(potential_fn)``, and ours
(model and potential_fn, inside ``pyro.infer.MCMC``; and the model in this package's own
``pyro_hmc_plus.MCMC``, which skips Pyro's per-draw JSON logging), all in one run.

``--problem classic``: the 2-D Gaussian of the forum thread (precision ``[[10.25, -9.74],
[-9.74, 10.25]]``), 10 leapfrog steps of 0.25, no adaptation, ``--iterations`` transitions
(10,000 in the thread). ``--problem hierarchical``: ``pyro_hmc_plus.models.hierarchical_intercepts``
with 96 groups of 10 observations (D=100: 96 intercepts, two scales, a mean, a slope), 10
steps of 0.02 (acceptance ~0.9 on this posterior), no adaptation. Every contender starts
from the same unconstrained point (all zeros for the hierarchical model). Its potential_fn and
hand-written loop use the same log density written by hand over the unconstrained
parameters (scales through ``exp``, with their log-Jacobians), checked against Pyro's.

Each contender runs in a fresh Python process with one thread (tracing and compiling are
counted end to end), the contenders alternate within each repetition so that load changes
on a shared machine hit them alike, and repetition ``k`` seeds every contender with ``k``.
Reported, median over ``--reps``: wall time of the whole run (setup included), steady-state
microseconds per gradient (the second half of the run: its wall time over its gradients),
acceptance rate, and the ratios to Pyro's ``HMC(model)``.

``--warm`` adds ``ours_aot``: ours with ``engine="aot"``, timed after one untimed run has
filled the on-disk cache of compiled programs (``$PYRO_HMC_PLUS_CACHE``); every contender
also gets that untimed first run (Pyro keeps no cache, so for it this changes nothing).

    python benchmarks/hmc.py --problem classic --iterations 10000 --reps 3
    python benchmarks/hmc.py --problem hierarchical --iterations 2000 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONTENDERS = ("hand_written_backward", "pyro_hmc", "pyro_hmc_jit", "pyro_hmc_potential_fn",
              "ours_model", "ours_potential_fn", "ours_model_our_mcmc")
NUM_STEPS = 10
STEP_SIZE = {"classic": 0.25, "hierarchical": 0.02}


def make_problem(name: str):
    """``(model, args, potential_fn, initial_params)`` of the problem, with its data."""
    import torch

    from pyro_hmc_plus import models

    if name == "classic":
        precision = models.CLASSIC_PRECISION

        def potential_fn(params):
            q = params["q"]
            return 0.5 * q.matmul(precision).dot(q)

        return models.classic_gaussian, (), potential_fn, {"q": torch.tensor([0.1, 0.1])}
    g = torch.Generator().manual_seed(0)
    groups, per_group = 96, 10
    group = torch.arange(groups).repeat_interleave(per_group)
    x = torch.randn(groups * per_group, generator=g)
    a = 1.0 + 0.7 * torch.randn(groups, generator=g)
    y = a[group] - 0.6 * x + 0.8 * torch.randn(groups * per_group, generator=g)
    log_2pi = torch.log(torch.tensor(2 * torch.pi))

    def normal_lp(value, loc, scale):
        return (-0.5 * ((value - loc) / scale) ** 2 - torch.log(scale) - 0.5 * log_2pi).sum()

    def potential_fn(params):
        """-log p of ``hierarchical_intercepts`` over Pyro's unconstrained sites (the scales'
        HalfNormal(2) through ``exp``, log-Jacobian included)."""
        sigma_a, sigma_y = params["sigma_a"].exp(), params["sigma_y"].exp()
        two = torch.tensor(2.0)
        lp = normal_lp(params["mu_a"], 0.0, torch.tensor(5.0)) + normal_lp(params["beta"], 0.0, torch.tensor(5.0))
        lp = lp + normal_lp(sigma_a, 0.0, two) + torch.log(two) + params["sigma_a"]  # HalfNormal + Jacobian
        lp = lp + normal_lp(sigma_y, 0.0, two) + torch.log(two) + params["sigma_y"]
        lp = lp + normal_lp(params["a_raw"], 0.0, torch.tensor(1.0))
        intercept = params["mu_a"] + sigma_a * params["a_raw"]
        lp = lp + normal_lp(y, intercept[group] + params["beta"] * x, sigma_y)
        return -lp

    initial = {"mu_a": torch.tensor(0.0), "sigma_a": torch.tensor(0.0), "beta": torch.tensor(0.0),
               "sigma_y": torch.tensor(0.0), "a_raw": torch.zeros(groups)}
    return models.hierarchical_intercepts, (x, group, y), potential_fn, initial


def run_one(problem: str, name: str, iterations: int, seed: int) -> dict:
    """Runs in the child process: wall seconds of the whole run, of its second half, the
    gradients of each, and the acceptance rate."""
    import pyro
    import torch
    from pyro.infer import HMC as PyroHMC
    from pyro.infer import MCMC

    torch.set_num_threads(1)
    pyro.set_rng_seed(seed)
    model, args, potential_fn, initial = make_problem(problem)
    step_size = STEP_SIZE[problem]
    half = iterations // 2
    stamps = {}

    start = time.perf_counter()
    if name == "hand_written_backward":  # the forum post's loop, made a correct HMC
        names = sorted(initial)
        pos = {k: initial[k].clone().requires_grad_(True) for k in names}

        def energy_and_grad(pos):
            U = potential_fn(pos)
            return U.detach(), torch.autograd.grad(U, [pos[k] for k in names])

        U, grad = energy_and_grad(pos)
        accepted = 0
        for i in range(iterations):
            if i == half:
                stamps["half"] = time.perf_counter()
            q = {k: v.detach() for k, v in pos.items()}
            vel = [torch.randn_like(v) for v in q.values()]
            H0 = U + 0.5 * sum((v * v).sum() for v in vel)
            U0, grad0, new = U, grad, dict(pos)
            for _ in range(NUM_STEPS):
                vel = [v - 0.5 * step_size * g for v, g in zip(vel, grad)]
                new = {k: (new[k] + step_size * v).detach().requires_grad_(True) for k, v in zip(names, vel)}
                U, grad = energy_and_grad(new)
                vel = [v - 0.5 * step_size * g for v, g in zip(vel, grad)]
            H = U + 0.5 * sum((v * v).sum() for v in vel)
            if torch.rand(()) < torch.exp(H0 - H):
                pos, accepted = new, accepted + 1
            else:
                U, grad = U0, grad0
        end = time.perf_counter()
        return {"wall_s": end - start, "half_s": end - stamps["half"], "gradients": iterations * NUM_STEPS + 1,
                "half_gradients": (iterations - half) * NUM_STEPS, "acceptance": accepted / iterations}

    kwargs = dict(step_size=step_size, num_steps=NUM_STEPS, adapt_step_size=False, adapt_mass_matrix=False)
    if name.startswith("ours"):
        from pyro_hmc_plus import HMC

        if name == "ours_aot":
            kwargs["engine"] = "aot"
    else:
        HMC = PyroHMC
    if name == "pyro_hmc_jit":
        kwargs.update(jit_compile=True, ignore_jit_warnings=True)
    kernel = HMC(potential_fn=potential_fn, **kwargs) if name.endswith("potential_fn") else HMC(model, **kwargs)

    def hook(kernel, params, stage, i):
        if i == half:
            stamps["half"] = time.perf_counter()

    if name == "ours_model_our_mcmc":
        from pyro_hmc_plus import MCMC as OurMCMC

        mcmc = OurMCMC(kernel, num_samples=iterations, warmup_steps=0, initial_params=initial, disable_progbar=True,
                       hook_fn=hook, warn_on_problems=False)
    else:
        mcmc = MCMC(kernel, num_samples=iterations, warmup_steps=0, initial_params=initial, disable_progbar=True,
                    hook_fn=hook)
    mcmc.run(*args)
    end = time.perf_counter()
    return {"wall_s": end - start, "half_s": end - stamps["half"], "gradients": iterations * NUM_STEPS,
            "half_gradients": (iterations - half - 1) * NUM_STEPS,
            "acceptance": mcmc.diagnostics()["acceptance rate"]["chain 0"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problem", choices=("classic", "hierarchical"), default="classic")
    parser.add_argument("--iterations", type=int, default=10000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=list(CONTENDERS), choices=CONTENDERS + ("ours_aot",))
    parser.add_argument("--warm", action="store_true", help="add ours_aot; one untimed run per contender first")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, seed = args.child
        print(json.dumps(run_one(args.problem, name, args.iterations, int(seed))))
        return
    contenders = list(args.only) + (["ours_aot"] if args.warm and "ours_aot" not in args.only else [])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = {name: [] for name in contenders}
    for rep in range(-1 if args.warm else 0, args.reps):
        for name in contenders:
            cmd = [sys.executable, __file__, "--child", name, str(max(rep, 0)), "--problem", args.problem,
                   "--iterations", str(args.iterations)]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                print(f"{name} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            if rep >= 0:  # rep -1: the untimed run of --warm
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def median(runs, f):
        return statistics.median(f(r) for r in runs) if runs else float("nan")

    def steady(r):
        return r["half_s"] / r["half_gradients"] * 1e6

    base = results.get("pyro_hmc", [])
    base_wall, base_steady = median(base, lambda r: r["wall_s"]), median(base, steady)
    print(f"HMC, {args.problem}, {args.iterations} iterations x {NUM_STEPS} leapfrog steps of "
          f"{STEP_SIZE[args.problem]}, {'warm' if args.warm else 'cold'} start, median of {args.reps} fresh processes")
    print(f"{'contender':<24} {'wall s':>8} {'us/grad':>9} {'steady us/grad':>15} {'accept':>7} "
          f"{'wall vs Pyro':>13} {'steady vs Pyro':>15}")
    for name, runs in results.items():
        wall = median(runs, lambda r: r["wall_s"])
        print(f"{name:<24} {wall:>8.2f} {median(runs, lambda r: r['wall_s'] / r['gradients'] * 1e6):>9.1f} "
              f"{median(runs, steady):>15.1f} {median(runs, lambda r: r['acceptance']):>7.3f} "
              f"{base_wall / wall:>13.1f} {base_steady / median(runs, steady):>15.1f}", flush=True)


if __name__ == "__main__":
    main()
