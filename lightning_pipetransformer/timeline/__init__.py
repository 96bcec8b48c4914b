"""The per-epoch timeline of a fit: frozen blocks, plan, cache hits, throughput, the metric.

:class:`PipeTransformerTimeline` is the callback (also exported from the package's face);
:mod:`.records` words the rows (table, summary, JSON), :mod:`.plot` draws them.
"""

from lightning_pipetransformer.timeline.callback import PipeTransformerTimeline
from lightning_pipetransformer.timeline.records import EpochRecord, format_table

__all__ = ["EpochRecord", "PipeTransformerTimeline", "format_table"]
