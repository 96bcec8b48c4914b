"""``python -m benchmarks.executor_overhead``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
