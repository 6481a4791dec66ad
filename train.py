#!/usr/bin/env python
"""SAECache-Gym's command line. ``python train.py --help`` lists the subcommands.

The core commands live in sae_env/cli.py; the agents package plugs its learners and subcommands in (agents/cli.py).
"""

import sys

from agents.cli import main

if __name__ == "__main__":
    sys.exit(main())
