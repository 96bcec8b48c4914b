"""``python -m benchmarks.transition_time``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
