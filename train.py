#!/usr/bin/env python
"""SAECache-Gym's command line. ``python train.py --help`` lists the subcommands; the code is in sae_env/cli.py."""

import sys

from sae_env.cli import main

if __name__ == "__main__":
    sys.exit(main())
