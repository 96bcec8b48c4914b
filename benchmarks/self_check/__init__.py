"""The first-batch self-check's cost against a training step (CPU, BERT-shaped stack).

Run from the repository root: ``python -m benchmarks.self_check`` (see README.md).
"""
