"""The pure core of lightning-pipetransformer: no Lightning imports, each module one concept.

Block-stack discovery, the freeze rules, the partition planner, the pipeline executor, the
activation cache and the cost model live here and are testable without a Trainer. The public
API is re-exported from :mod:`lightning_pipetransformer`.
"""

__all__: list[str] = []
