"""The benchmarks: one package per benchmark, each run from the repository root as ``python -m benchmarks.<name>``.

``benchmarks/README.md`` lists them: what each measures, its command, where its results go. Run as modules,
they import the examples' code as the ``examples`` package (``from examples.rotten_tomatoes import ...``) and
each other's shared pieces (``from benchmarks.time_to_accuracy.data import BenchData``), with no
``sys.path`` edits.
"""

import os

# No model hub is reachable from our machines: transformers and datasets must read local files only. Set here,
# before any benchmark module imports them (lightning_pipetransformer imports transformers), as the examples
# do for themselves when they run as scripts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
