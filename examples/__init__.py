"""The examples, importable as a package from the repository root (the benchmarks: ``python -m benchmarks.<name>``).

Each example still runs as a script, ``python examples/text_classification.py fit --config ...``: then
``examples/`` is ``sys.path[0]`` and the modules import each other by their plain names (``rotten_tomatoes``,
``assets``: the names the YAML configs and the tests use). Imported as ``examples.<module>``,
they import each other through this package instead, so each module is loaded once.
"""
