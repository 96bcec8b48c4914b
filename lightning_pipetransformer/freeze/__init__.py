"""AutoFreeze: freeze rules (policies.py, their arithmetic in rules.py, the gradient statistics they
read in statistics.py), when the freeze points fall (clock.py), the arguments (config.py), applying
a frozen prefix (apply.py), the checks of the stack (stack_checks.py), the call order that places
``pre`` (call_order.py), smooth freezing (anneal.py, its timing in anneal_timing.py), the seam to a
strategy that follows the freeze points (seam.py), the mechanism (mechanism.py) and the Lightning
callback that drives it (callback.py)."""
