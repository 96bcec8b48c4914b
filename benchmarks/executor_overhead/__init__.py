"""The pipeline executor's overhead on CPU, against the plain loop over a BERT-shaped stack.

Run from the repository root: ``python -m benchmarks.executor_overhead`` (see README.md).
"""
