"""AutoPipe: block costs, balanced partitions, the plan per freeze step, and the pipeline executor."""
