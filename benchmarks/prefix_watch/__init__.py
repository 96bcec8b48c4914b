"""What AutoCache's validity check costs per step on the 12-layer model (CPU).

Run from the repository root: ``python -m benchmarks.prefix_watch`` (see README.md).
"""
