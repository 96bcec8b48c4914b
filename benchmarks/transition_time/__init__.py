"""Time one AutoDP transition (1 -> 4 replicas) of a BERT-base-sized model on 4 CPU processes.

Run from the repository root: ``python -m benchmarks.transition_time`` (see README.md).
"""
