"""``python -m lightning_pipetransformer.cache``: list, evict or clear the entries a cache folder keeps."""

import sys

from lightning_pipetransformer.cache.cli import main

sys.exit(main())
