"""``python -m benchmarks.partition_quality``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
