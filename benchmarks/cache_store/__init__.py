"""AutoCache on CPU: lookup + gather of a batch from memory and from disk, against recomputing the prefix.

Run from the repository root: ``python -m benchmarks.cache_store`` (see README.md).
"""
