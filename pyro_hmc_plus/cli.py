"""The ``pyro-hmc-plus`` command line.

``pyro-hmc-plus demo``: the classic question's problem (HMC on a 2-D Gaussian with correlation
0.95, 10 leapfrog steps of 0.25, no adaptation) sampled by Pyro's kernel and by ours side by
side: wall times, speed-up, an ArviZ summary of each against the exact answer, and trace,
pair and energy plots of our run. ``--model`` picks another example problem (sampled with
NUTS by both). ``pyro-hmc-plus bench`` runs the benchmark scripts of a source checkout.
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import time
import warnings

from .models import PROBLEMS, problem


def _sample(library: str, prob, kernel_name: str, num_chains: int, num_samples: int, warmup: int, seed: int):
    import pyro

    if library == "pyro":
        from pyro.infer import HMC, MCMC, NUTS

        options = {}
    else:
        from . import HMC, MCMC, NUTS

        options = {"warn_on_problems": False}  # the demo prints its own diagnostics
    if kernel_name == "hmc":
        kernel = HMC(prob.model, step_size=0.25, num_steps=10, adapt_step_size=False, adapt_mass_matrix=False)
    else:
        kernel = NUTS(prob.model)
    pyro.set_rng_seed(seed)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="num_chains=.*available_cpu")  # Pyro: chains in sequence
        mcmc = MCMC(kernel, num_samples=num_samples, warmup_steps=warmup, num_chains=num_chains,
                    disable_progbar=True, **options)
        mcmc.run(*prob.args)
    return time.perf_counter() - start, mcmc


def _summary(idata, prob):
    import arviz as az

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ: R-hat of a single chain
        table = az.summary(idata, var_names=list(idata.posterior.data_vars)[:12])[["mean", "sd", "ess_bulk", "r_hat"]]
    if prob.exact_mean:
        exact_mean, exact_sd = [], []
        for name in table.index:
            site, _, idx = name.partition("[")
            i = int(idx.rstrip("]")) if idx else None
            exact_mean.append(float(prob.exact_mean[site].reshape(-1)[i or 0]))
            exact_sd.append(float(prob.exact_sd[site].reshape(-1)[i or 0]))
        table["exact mean"], table["exact sd"] = exact_mean, exact_sd
    return table.to_string(float_format=lambda x: f"{x:.3f}")


def demo(args) -> None:
    import arviz as az

    from .inference_data import to_inference_data

    prob = problem(args.model)
    kernel_name = "hmc" if args.model == "classic" else "nuts"
    warmup = 0 if kernel_name == "hmc" else (args.warmup if args.warmup is not None else args.num_samples)
    print(f"{prob.description}: {kernel_name.upper()}, {args.chains} chain(s), {warmup} warmup + "
          f"{args.num_samples} draws each" + (", 10 leapfrog steps of 0.25" if kernel_name == "hmc" else ""))
    pyro_time, pyro_mcmc = _sample("pyro", prob, kernel_name, args.chains, args.num_samples, warmup, args.seed)
    ours_time, ours_mcmc = _sample("ours", prob, kernel_name, args.chains, args.num_samples, warmup, args.seed)
    ours = to_inference_data(ours_mcmc, log_likelihood=False)
    print(f"\npyro.infer.{kernel_name.upper()}: {pyro_time:.1f} s (setup included)")
    print(_summary(az.from_pyro(pyro_mcmc, log_likelihood=False), prob))
    print(f"\npyro_hmc_plus.{kernel_name.upper()}: {ours_time:.1f} s (setup, tracing included)")
    print(_summary(ours, prob))
    print(f"\nspeed-up: {pyro_time / ours_time:.1f}x")
    if not args.no_plots and _plots(ours, args.out):
        print(f"figures: {args.out}/trace.png, pair.png, energy.png")


def _plots(idata, out: pathlib.Path) -> bool:
    import arviz as az

    try:
        import matplotlib
    except ImportError:
        print("(no figures: matplotlib is not installed; pip install matplotlib)")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = list(idata.posterior.data_vars)[:4]
    az.plot_trace(idata, var_names=names)
    plt.tight_layout()
    plt.savefig(out / "trace.png", dpi=80)
    az.plot_pair(idata, var_names=names, divergences=True)
    plt.savefig(out / "pair.png", dpi=80)
    az.plot_energy(idata)
    plt.savefig(out / "energy.png", dpi=80)
    plt.close("all")
    return True


def bench(args) -> None:
    """Run the benchmark scripts of the source checkout this package is installed from."""
    root = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
    if not root.is_dir():
        sys.exit("pyro-hmc-plus bench needs a source checkout (git clone, then pip install -e .): "
                 f"{root} does not exist")
    if args.full:
        runs = [["hmc.py", "--problem", "classic", "--iterations", "10000", "--reps", "3"],
                ["hmc.py", "--problem", "hierarchical", "--iterations", "2000", "--reps", "3"],
                ["nuts.py", "--reps", "3"],
                ["chains.py", "--reps", "3"]]
    else:
        runs = [["hmc.py", "--problem", "classic", "--iterations", "500", "--reps", "1"],
                ["nuts.py", "--models", "gauss2d", "eight_schools", "--contenders", "pyro", "ours", "--reps", "1",
                 "--warmup", "200", "--samples", "200"],
                ["chains.py", "--models", "eight_schools", "--kernels", "nuts", "--chains", "4", "--reps", "1",
                 "--warmup", "200", "--samples", "200"]]
    for script, *options in runs:
        print(f"\n$ python benchmarks/{script} {' '.join(options)}", flush=True)
        subprocess.run([sys.executable, str(root / script), *options], check=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="pyro-hmc-plus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    d = commands.add_parser("demo", help="Pyro's kernel and ours side by side on an example problem")
    d.add_argument("--model", default="classic", choices=PROBLEMS)
    d.add_argument("--chains", type=int, default=2)
    d.add_argument("--num-samples", type=int, default=2000)
    d.add_argument("--warmup", type=int, default=None, help="NUTS models: warmup iterations (default: num-samples)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", type=pathlib.Path, default=pathlib.Path("pyro-hmc-plus-demo"))
    d.add_argument("--no-plots", action="store_true")
    d.set_defaults(func=demo)
    b = commands.add_parser("bench", help="run the benchmark suite (benchmarks/ of a source checkout)")
    mode = b.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a few minutes: small runs, one repetition (default)")
    mode.add_argument("--full", action="store_true", help="the figures of docs/benchmarks.md (about an hour)")
    b.set_defaults(func=bench)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
