"""The classic question, answered: HMC on a 2-D correlated Gaussian (10 leapfrog steps of
0.25, no adaptation), sampled with Pyro's own HMC and with pyro_hmc_plus's, side by side.

This is ``pyro-hmc-plus demo``: it prints both wall times (setup and tracing included), the
speed-up, and an ArviZ summary of each run (mean, sd, ESS, R-hat) next to the exact answer,
and saves trace, pair and energy plots of our run to ``--out``. About 40 s on 2 cores with
the default 2 chains of 2,000 draws (Pyro's kernel takes most of it).

    python examples/classic_question.py [--num-samples N] [--chains C] [--out DIR] [--no-plots]
"""

import sys

from pyro_hmc_plus.cli import main

if __name__ == "__main__":
    main(["demo", "--model", "classic", *sys.argv[1:]])
