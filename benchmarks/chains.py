"""Many chains: ESS per second of our vectorized chains vs our sequential chains vs Pyro's
one-process-per-chain chains, in one run.

For each model (from ``benchmarks/nuts.py``), kernel (``nuts``, or ``hmc`` with 10 steps of
initial size 0.25) and number of chains, each contender runs ``--warmup`` + ``--samples``
iterations per chain in a fresh Python process with one torch thread (setup, tracing and
warmup included in the wall time):

* ``vectorized``: ``pyro_hmc_plus.MCMC(..., chain_method="vectorized")``, all chains in one
  batch, each at its own pace; also reports the batch utilisation;
* ``sequential``: ``pyro_hmc_plus.MCMC(..., chain_method="sequential")``, our kernel, one
  chain after another;
* ``parallel``: ``pyro_hmc_plus.MCMC(..., chain_method="parallel")``, our kernel, one worker
  process per chain (forced, as below), reporting its draws in batches;
* ``pyro_parallel``: Pyro's ``MCMC`` with Pyro's kernel and one worker process per chain
  (forced even when there are fewer CPUs than chains, which Pyro would otherwise run
  sequentially: that is the configuration users reach for).

ESS is ArviZ's bulk ESS over all chains together, the minimum over scalar parameters.
Reported: the median over ``--reps`` repetitions (repetition ``k`` uses seed ``k``), and
ESS/s relative to our sequential chains with the same number of chains.

    python benchmarks/chains.py --reps 3
    python benchmarks/chains.py --models gauss2d --kernels nuts --chains 4 --reps 5
    python benchmarks/chains.py --kernels nuts --chains 4 --engine aot --warm   # compiled programs, cached
    python benchmarks/chains.py --kernels nuts --chains 4 --engine aot --warm --leaves-per-call 8
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from nuts import make_problem  # noqa: E402  (the same models as the NUTS benchmark)

CONTENDERS = ("vectorized", "sequential", "parallel", "pyro_parallel")


def min_bulk_ess(samples: dict) -> float:
    """Minimum bulk ESS over scalar parameters, draws grouped by chain ``(C, N, ...)``."""
    import arviz as az
    import numpy as np

    worst = float("inf")
    for v in samples.values():
        draws = v.reshape(v.shape[0], v.shape[1], -1).numpy().astype(np.float64)
        for j in range(draws.shape[2]):
            worst = min(worst, float(az.ess(draws[:, :, j], method="bulk")))
    return worst


def run_one(model_name, kernel_name, contender, num_chains, warmup, samples, seed, engine="auto",
            leaves_per_call=4) -> dict:
    """Runs in the child process."""
    import pyro
    import torch

    torch.set_num_threads(1)
    model, args, _ = make_problem(model_name)
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    if contender == "pyro_parallel":
        import pyro.infer.mcmc.api as pyro_mcmc
        from pyro.infer import HMC, MCMC, NUTS

        pyro_mcmc.mp.cpu_count = lambda: num_chains + 1  # Pyro's rule: parallel if chains < cpus
        options = {}
    else:
        from pyro_hmc_plus import HMC, MCMC, NUTS

        options = {"chain_method": contender, "warn_on_problems": False}  # Pyro's MCMC has no checks either
        if contender == "parallel":
            torch.multiprocessing.cpu_count = lambda: num_chains + 1  # Pyro's rule, which ours follows
        if contender == "vectorized":
            options["leaves_per_call"] = leaves_per_call
    ours = {} if contender == "pyro_parallel" else {"engine": engine}
    kernel = NUTS(model, **ours) if kernel_name == "nuts" else HMC(model, step_size=0.25, num_steps=10, **ours)
    mcmc = MCMC(kernel, num_samples=samples, warmup_steps=warmup, num_chains=num_chains,
                disable_progbar=True, **options)
    mcmc.run(*args)
    wall = time.perf_counter() - start
    ess = min_bulk_ess(mcmc.get_samples(group_by_chain=True))
    return {"wall_s": wall, "ess": ess, "utilisation": getattr(mcmc, "batch_utilisation", None)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["gauss2d", "eight_schools"])
    parser.add_argument("--kernels", nargs="*", default=["nuts", "hmc"], choices=["nuts", "hmc"])
    parser.add_argument("--chains", nargs="*", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--contenders", nargs="*", default=list(CONTENDERS), choices=CONTENDERS)
    parser.add_argument("--max-sequential-chains", type=int, default=16,
                        help="skip sequential and Pyro runs with more chains (they take minutes)")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--engine", default="auto", help="our kernels' engine (e.g. aot, with --warm)")
    parser.add_argument("--leaves-per-call", type=int, default=4,
                        help="vectorized runs' leapfrog steps per chain in one call (MCMC's leaves_per_call)")
    parser.add_argument("--warm", action="store_true", help="one untimed run per contender first (fills on-disk caches)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, kernel_name, contender, num_chains, seed = args.child
        result = run_one(model_name, kernel_name, contender, int(num_chains), args.warmup, args.samples, int(seed),
                         args.engine, args.leaves_per_call)
        print(json.dumps(result))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(f"{args.warmup} warmup + {args.samples} draws per chain, fresh process per run, median of {args.reps}, "
          f"engine {args.engine!r}, {'warm' if args.warm else 'cold'}, {args.leaves_per_call} leaves per call")
    print(f"{'model':<14} {'kernel':<6} {'chains':>6} {'contender':<14} {'wall s':>8} {'min ESS':>8} "
          f"{'ESS/s':>8} {'vs seq.':>8} {'util.':>6}")
    for model_name in args.models:
        for kernel_name in args.kernels:
            for num_chains in args.chains:
                contenders = [c for c in args.contenders
                              if c == "vectorized" or num_chains <= args.max_sequential_chains]
                results = {c: [] for c in contenders}
                for rep in range(-1 if args.warm else 0, args.reps):  # rep -1: the untimed run of --warm
                    for contender in contenders:  # alternate, so load changes hit every contender
                        cmd = [sys.executable, __file__, "--child", model_name, kernel_name, contender,
                               str(num_chains), str(rep % 1000), "--warmup", str(args.warmup),
                               "--samples", str(args.samples), "--engine", args.engine,
                               "--leaves-per-call", str(args.leaves_per_call)]
                        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
                        if out.returncode != 0:
                            print(f"{model_name} {kernel_name} {contender} x{num_chains} failed:\n"
                                  f"{out.stderr[-2000:]}", file=sys.stderr)
                            continue
                        if rep >= 0:
                            results[contender].append(json.loads(out.stdout.strip().splitlines()[-1]))

                def median(runs, f):
                    return statistics.median(f(r) for r in runs) if runs else float("nan")

                base = median(results.get("sequential", []), lambda r: r["ess"] / r["wall_s"])
                for contender, runs in results.items():
                    ess_per_s = median(runs, lambda r: r["ess"] / r["wall_s"])
                    util = median(runs, lambda r: r["utilisation"]) if contender == "vectorized" and runs else None
                    print(
                        f"{model_name:<14} {kernel_name:<6} {num_chains:>6} {contender:<14} "
                        f"{median(runs, lambda r: r['wall_s']):>8.1f} {median(runs, lambda r: r['ess']):>8.0f} "
                        f"{ess_per_s:>8.1f} {ess_per_s / base:>8.2f} "
                        f"{'' if util is None else f'{util:.3f}':>6}",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
