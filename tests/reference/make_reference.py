"""Reference posteriors from long runs of Pyro's own NUTS, for tests/test_nuts.py.

Run ``python tests/reference/make_reference.py`` (about 15 minutes on 2 cores); it writes
``pyro_nuts.json``: per model and parameter, the posterior mean, standard deviation and the
Monte Carlo standard error of the mean (ArviZ), from 4 chains x 2,000 draws after 1,000
warmup steps.
"""

import json
import pathlib
import sys

import arviz as az
import numpy as np
import pyro
from pyro.infer import MCMC, NUTS

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent))
from models import EIGHT_SCHOOLS_SIGMA, EIGHT_SCHOOLS_Y, eight_schools, logistic_data, logistic_regression  # noqa: E402


def reference(model, *args, chains=4, draws=2000, warmup=1000, seed=0):
    samples = {}
    for chain in range(chains):
        pyro.set_rng_seed(seed + chain)
        mcmc = MCMC(NUTS(model), num_samples=draws, warmup_steps=warmup, disable_progbar=True)
        mcmc.run(*args)
        for k, v in mcmc.get_samples().items():
            samples.setdefault(k, []).append(v.reshape(draws, -1).numpy())
    out = {}
    for k, v in samples.items():
        x = np.stack(v)  # (chains, draws, size)
        for j in range(x.shape[-1]):
            name = f"{k}[{j}]" if x.shape[-1] > 1 else k
            out[name] = {
                "mean": float(x[..., j].mean()),
                "sd": float(x[..., j].std()),
                "mcse_mean": float(az.mcse(x[..., j])),
            }
    return out


if __name__ == "__main__":
    result = {
        "eight_schools_noncentered": reference(eight_schools, EIGHT_SCHOOLS_Y, EIGHT_SCHOOLS_SIGMA),
        "logistic_regression": reference(logistic_regression, *logistic_data()),
    }
    path = pathlib.Path(__file__).with_name("pyro_nuts.json")
    path.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
