"""The block stack: finding it in a model, and the runners installed in its place."""
