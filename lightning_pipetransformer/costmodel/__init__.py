"""The cost model: predicted per-epoch throughput and speed-up of a PipeTransformer run, and its command."""
