"""``python -m benchmarks.freeze_accuracy``: see its README.md."""

import sys

from .bench import main

sys.exit(main())
