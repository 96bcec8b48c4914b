"""The test suite; its folders mirror the package.

- ``unit/<part>/``: one part of ``lightning_pipetransformer/<part>/`` at a time (stack, freeze, pipe,
  dp, cache, costmodel; the top-level modules directly under ``unit/``).
- ``integration/``: training through Lightning; ``integration/distributed/`` the multi-process
  runs (their worker scripts are in ``integration/scripts/``), ``integration/examples/`` the examples.
- ``helpers/``: tiny models and data, reference loops, the launcher (``from tests.helpers.models import ...``).

Tests that start several processes carry the ``distributed`` marker: ``pytest -m "not distributed"``
is the fast loop.
"""
