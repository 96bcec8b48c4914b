"""``python -m benchmarks.cache_store``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
