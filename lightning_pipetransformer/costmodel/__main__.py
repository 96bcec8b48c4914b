"""``python -m lightning_pipetransformer.costmodel``: predict PipeTransformer's multi-GPU speed-up."""

import sys

from lightning_pipetransformer.costmodel.cli import main

sys.exit(main())
