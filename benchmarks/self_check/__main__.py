"""``python -m benchmarks.self_check``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
