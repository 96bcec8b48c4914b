"""The block stack: finding it in a model, and handing its passes to the runner installed in its place."""
