"""``python -m benchmarks.sweep_cache``: see :mod:`benchmarks.sweep_cache` and its README."""

import sys

from .cli import main

sys.exit(main())
