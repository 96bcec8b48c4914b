"""Step time of a MiniLM-L6-shaped BERT on this machine with 0..L-1 leading blocks frozen.

Run from the repository root: ``python -m benchmarks.freeze_step_time`` (see README.md).
"""
