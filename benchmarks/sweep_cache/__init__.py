"""A sweep over seeds that pays for the frozen prefix once (issue 42): each run's training time and the sweep's total,
with the cache kept across runs (``cache_keep=True``), with a cache per run, and full fine-tuning.

Every run of the sweep fine-tunes the same pretrained encoder (``--model``, the time_to_accuracy benchmark's data and
LightningModule) with its embeddings and lower ``--frozen`` blocks frozen from the first step (``AutoFreeze(schedule=
{0: F})``, the static freeze of the 12-layer setting's best frozen row) and another seed (head, data order, dropout).
Rows, interleaved per seed:

- ``full``: full fine-tuning (``strategy="auto"``), the baseline;
- ``per-run``: ``PipeTransformerStrategy(cache=True)`` with a fresh ``cache_dir`` per run (every run pays the prefix);
- ``kept``: ``PipeTransformerStrategy(cache=True, cache_keep=True)`` with one ``cache_dir`` for the whole sweep: the
  first run stores, the others are served from their first step.

Training time is the sum of the training epochs (no validation inside ``fit``); the accuracy is a plain loop over the
validation set after ``fit``. The report gives each run, each row's total over the sweep and its speed-up against
full fine-tuning's total.
"""
