"""``python -m lightning_pipetransformer.plan``: the cost model's command under its first name.

Kept so that existing commands and docs keep working; the command lives in
:mod:`lightning_pipetransformer.costmodel.cli`.
"""

import sys

from lightning_pipetransformer.costmodel.cli import main

sys.exit(main())
