"""``python -m benchmarks.prefix_watch``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
