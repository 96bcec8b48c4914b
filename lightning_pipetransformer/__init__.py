"""lightning-pipetransformer: PipeTransformer (ICML 2021) for PyTorch Lightning.

Importing this package registers the ``"pipetransformer"`` strategy name with Lightning.
"""

__version__ = "0.1.0.dev0"
