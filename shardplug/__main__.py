"""``python -m shardplug explain ...``: see :mod:`shardplug.explain.cli`."""

import sys

from .explain.cli import main

if __name__ == "__main__":  # importing the module (the doctests do) runs nothing
    sys.exit(main())
