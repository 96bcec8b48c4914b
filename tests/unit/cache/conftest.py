"""Fixtures of the cache's unit tests: ``async_gpu``, a stand-in GPU whose copies to the host run late."""

from tests.unit.cache.async_copies import async_gpu

__all__ = ["async_gpu"]
