"""``python -m shardplug explain ...``: see :mod:`shardplug.explain.cli`."""

import sys

from .explain.cli import main

sys.exit(main())
