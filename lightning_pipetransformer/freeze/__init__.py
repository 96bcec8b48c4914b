"""AutoFreeze: freeze rules, applying a frozen prefix, and the Lightning callback."""
