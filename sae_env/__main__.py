"""``python -m sae_env``: the command line of ``train.py`` and ``saecache-gym``, from any folder.

The agents' commands and learners plug in through the installed entry points (:func:`sae_env.cli.load_extensions`),
so that this package still never imports ``agents`` by name.
"""

import sys

from sae_env.cli import load_extensions, main

if __name__ == "__main__":
    sys.exit(main(extensions=load_extensions(), prog="python -m sae_env"))
