"""Where does progressive freezing lose accuracy? Ablations of AutoFreeze on the time-to-accuracy setting (issue 17).

Run from the repository root: ``python -m benchmarks.freeze_accuracy`` (see README.md).
"""
