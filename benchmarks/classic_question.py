"""The classic question, timed: HMC on the 2-D correlated Gaussian, 10 leapfrog steps of
0.25, no adaptation, ``--iterations`` transitions (10,000 in the forum thread).

Each contender runs in a fresh Python process (so one-time costs, tracing and compiling,
are counted end to end) with one thread, and the contenders alternate within each
repetition so that load changes on a shared machine hit them alike. Reported: median wall
time per contender (setup included), median microseconds per gradient, and the ratios.

    python benchmarks/classic_question.py --iterations 10000 --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CONTENDERS = ("hand_written_backward", "pyro_hmc", "pyro_hmc_jit", "pyro_hmc_potential_fn",
              "ours_model", "ours_potential_fn")


def run_one(name: str, iterations: int) -> dict:
    """Runs in the child process: returns wall seconds for the whole run and gradients done."""
    import pyro
    import pyro.distributions as dist
    import torch
    from pyro.infer import HMC as PyroHMC
    from pyro.infer import MCMC

    torch.set_num_threads(1)
    pyro.set_rng_seed(0)
    precision = torch.tensor([[10.25, -9.74], [-9.74, 10.25]])

    def model():
        pyro.sample("q", dist.MultivariateNormal(torch.zeros(2), precision_matrix=precision))

    def potential_fn(params):
        q = params["q"]
        return 0.5 * q.matmul(precision).dot(q)

    start = time.perf_counter()
    if name == "hand_written_backward":  # the forum post's loop, made a correct HMC
        pos = torch.tensor([0.1, 0.1], requires_grad=True)
        for _ in range(iterations):
            vel = torch.randn(2)
            grad = torch.autograd.grad(potential_fn({"q": pos}), pos)[0]
            for _ in range(10):
                vel = vel - 0.125 * grad
                pos = (pos + 0.25 * vel).detach().requires_grad_(True)
                grad = torch.autograd.grad(potential_fn({"q": pos}), pos)[0]
                vel = vel - 0.125 * grad
        return {"wall_s": time.perf_counter() - start, "gradients": iterations * 11}
    kwargs = dict(step_size=0.25, num_steps=10, adapt_step_size=False, adapt_mass_matrix=False)
    initial = None
    if name.startswith("ours"):
        from pyro_hmc_plus import HMC
    else:
        HMC = PyroHMC
    if name == "pyro_hmc_jit":
        kwargs["jit_compile"] = True
    if name.endswith("potential_fn"):
        kernel = HMC(potential_fn=potential_fn, **kwargs)
        initial = {"q": torch.tensor([0.1, 0.1])}
    else:
        kernel = HMC(model, **kwargs)
    mcmc = MCMC(kernel, num_samples=iterations, warmup_steps=0, initial_params=initial, disable_progbar=True)
    mcmc.run()
    return {"wall_s": time.perf_counter() - start, "gradients": iterations * 10}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=10000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=list(CONTENDERS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_one(args.child, args.iterations)))
        return
    results = {name: [] for name in args.only}
    for rep in range(args.reps):
        for name in args.only:
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, "--iterations", str(args.iterations)],
                capture_output=True, text=True, check=True,
                env={**__import__("os").environ, "OMP_NUM_THREADS": "1"},
            )
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = statistics.median(r["wall_s"] for r in results.get("pyro_hmc", results[args.only[0]]))
    print(f"classic question, {args.iterations} iterations x 10 leapfrog steps, median of {args.reps} fresh processes")
    print(f"{'contender':<24} {'wall s':>8} {'us/grad':>9} {'speed-up vs Pyro HMC(model)':>28}")
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        per_grad = statistics.median(r["wall_s"] / r["gradients"] * 1e6 for r in runs)
        print(f"{name:<24} {wall:>8.2f} {per_grad:>9.1f} {base / wall:>28.1f}")


if __name__ == "__main__":
    main()
