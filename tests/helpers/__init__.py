"""Shared test helpers, each defined once: tiny models and data (models, lightning_models, families),
reference loops (train_reference), the one-device CPU Trainer (trainers), state comparisons
(compare), counters of real block runs (block_runs), one fit with and without the cache
(cached_fits), brute-force partitions (partitions), and launchers of multi-process runs (launch
for scripts, spawn for functions). Import as ``tests.helpers.<module>``."""
