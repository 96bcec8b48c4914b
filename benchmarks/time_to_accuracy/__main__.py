"""``python -m benchmarks.time_to_accuracy``: see :mod:`benchmarks.time_to_accuracy` and its README."""

import sys

from .cli import main

sys.exit(main())
