"""Shared test helpers: tiny models and data (models, lightning_models, families), reference loops
(train_reference) and the launcher of multi-process runs (launch). Import as ``tests.helpers.<module>``."""
