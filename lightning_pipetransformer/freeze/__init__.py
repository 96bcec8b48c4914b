"""AutoFreeze: freeze rules (policies.py, their arithmetic in rules.py, the gradient statistics they
read in statistics.py), applying a frozen prefix (apply.py), smooth freezing (anneal.py, its timing
in anneal_timing.py), the seam to a strategy that follows the freeze points (seam.py), and the
Lightning callback that holds the mechanism (callback.py)."""
