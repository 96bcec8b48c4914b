"""Time-to-accuracy on real data: full fine-tuning vs AutoFreeze (+ AutoCache, smooth freezing, LLRD) vs peers (issues 8, 17, 25).

The pretrained MiniLM-L6 (a 6-block BERT) fine-tuned on Rotten Tomatoes sentiment snippets (split by
movie), with the example's data module and LightningModule (``examples/``). Variants, all in ONE
invocation, interleaved per seed (seed loop outer, variants inner) so they share the machine's noise
(``--variants``, default all of them):

1. ``full``   plain Lightning fine-tuning, single-device strategy: the baseline;
2. ``freeze`` ``AutoFreeze(alpha, rule)`` + ``PipeTransformerStrategy(pipe_len=1, cache=False)``, freeze points at epoch starts;
3. ``cache``  the same with ``cache=True`` (freeze+cache);
4. ``sub``    freeze+cache with freeze points inside epochs (issue 17): ``AutoFreeze(rule, freeze_interval=X)`` for
              every X in ``--intervals`` (default 0.25,0.5 of an epoch) and rule in ``--sub-rules`` (default
              paper,autofreeze), alphas ``--sub-alphas``, ``--percentile`` and ``--sub-min-active``;
4b. ``smooth`` the ``--smooth`` rule@interval freeze+cache rows (default paper@0.25, autofreeze@0.5, autofreeze@0.25: the
              ones that led in issue 17) with ``AutoFreeze(anneal=--anneal)`` (issue 25), each also with ``--llrd``;
4c. ``llrd``  full fine-tuning with layer-wise learning-rate decay (``SentimentClassifier(llrd=--llrd)``), not the baseline;
5. ``lora``   a peer: LoRA through ``peft`` (r=8, lora_alpha=16, dropout 0.1 on the attention query/value
              projections, the classifier trained in full; ``--lora-*``), the same optimizer and schedule shape, peak lr 5e-4 (``--lora-lr``; the LoRA paper's);
6. ``bft``    a peer: Lightning's ``BaseFinetuning``, subclassed to freeze the embeddings and the lower
              ``--bft-blocks`` (3 of 6) blocks for the whole run (see :func:`.runner.lower_blocks_finetuning`).

freeze and freeze+cache share the strategy so that the cache is their only difference: Lightning's
DDP-family strategies (ours included) re-seed torch at fit start (``reset_seed()`` in
``setup_distributed``) and the single-device strategy does not, so the dropout stream of a run under
``"auto"`` differs from one under ``"pipetransformer"`` with the same seed. With one strategy, cache
off and on train bit-for-bit the same model (AutoCache is exact), and their accuracies are equal.

Every variant of a seed sees the same data, the same batches in the same order (a loader with its
own seeded generator) and the same classifier-head initialisation. Reported per variant: total
training time for the epoch budget (validation excluded), time per epoch, final validation accuracy,
time-to-accuracy and the validation time itself. Validation (issue 25): a check every ``--val-every`` (0.25) of an
epoch's optimizer steps, counted across epochs, on a fixed subset of ``--val-subset`` (1,000) validation snippets
drawn with ``--val-subset-seed``, and once more at the end of training; the final accuracy on the whole validation
set after ``fit`` (:class:`.runner.CheckClock`, :func:`.runner.evaluate`). Time to accuracy: the training time of the
first check at or above the baseline's mean last-check accuracy minus 0.3 points (on the same subset), nothing
interpolated. ``--val-every 1 --val-subset all`` is the older schedule (the whole set at every epoch end), the one
of the records before issue 25. Mean and spread over the seeds::

    python -m benchmarks.time_to_accuracy --dry-run                            # the plan and its estimated duration
    python -m benchmarks.time_to_accuracy --smoke --docs outputs/smoke/benchmarks.md --write   # ~30 min on a busy 2-core machine
    python -m benchmarks.time_to_accuracy --threads 2 --write                  # the benchmark (~4 h on an idle 2-core CPU)
    python -m benchmarks.time_to_accuracy --variants full,cache --alphas 1/4,1/3,1/2 --write --docs docs/alpha_sweep.md

``--write`` writes ``docs/benchmarks.md``, ``docs/benchmarks_time_to_accuracy.png`` (accuracy against training
time) and ``docs/benchmarks_speedup_vs_accuracy.png`` (every variant's mean speed-up against its mean final
accuracy, with the goal drawn: issue 25's >= 2x at >= baseline - 0.3 points); ``--docs PATH`` writes the
report elsewhere, its PNGs next to it (``<stem>_time_to_accuracy.png``, ``<stem>_speedup_vs_accuracy.png``),
so a partial run does not overwrite the full benchmark's report. The report says whether the goal is met
and, if not, which variant is closest and what bounds it (seconds spent before the first freeze and at
each frozen count, from :class:`.runner.StepClock`). Without ``full`` in ``--variants`` there is no baseline: no
accuracy target or time-to-accuracy, and freeze+cache's speed-up is against freeze at the same alpha
(cache off vs on); such a run needs its own ``--docs``. Raw per-run records always go to ``--json``
(default ``outputs/benchmarks/time_to_accuracy.json``, or ``<docs stem>.json`` there with another ``--docs`` under
``docs/``, or next to a ``--docs`` outside ``docs/``): ``records`` with ``variant``, ``seed``, ``epochs`` (the
PipeTransformerTimeline's rows: ``train_s``, ``metric``, ...), ``fit_s``, ``freezes``, ``frozen_s`` / ``frozen_steps`` and ``trainable_params``. The cache's footprint (bytes in host memory
and on disk at each epoch end, from the strategy's ``cache_stats``) is in the per-epoch and summary
tables::

    python -m benchmarks.time_to_accuracy --variants freeze,cache --seeds 0 --write --docs docs/cache_benchmark.md

Padding (``--padding``, the same for every variant): ``bucket`` (default) pads each sample to its
own length rounded up to a multiple of 8 and draws each batch from samples of one such length
(random composition each epoch), so a sample's input is identical every epoch: AutoCache's content
keys hit, and batches carry far less padding than with ``trim`` (the example's per-batch trim to the
longest snippet, where a sample's padded length depends on its batch-mates and content keys then
miss) or ``max`` (always ``--max-length`` tokens).

The 12-layer setting (issue 34): ``--model mpnet-base`` fine-tunes MPNet-base (12 blocks) with its own preset (sizes
for about 6 hours of one core, the rows full / ``es`` (EarlyStopping on the checks) / freeze+cache at epoch starts /
autofreeze every 0.25 epoch / LoRA / BaseFinetuning, the time-to-accuracy target from the baseline's plateau), and
every report with a baseline gets a section pairing each row with full fine-tuning of the same seed (per-seed
differences, 95% t-intervals, the frontier: :mod:`.paired`, :mod:`.paired_report`). ``--device cuda`` runs it on a
GPU. docs/benchmarks_12layer.md says what was chosen and why::

    python -m benchmarks.time_to_accuracy --model mpnet-base --dry-run
    bash benchmarks/time_to_accuracy/launch_12layer.sh      # the 3-seed run, background, one core, resumable

Issue 41 (``--issue 41``, the same setting): 5 seeds, the peers (EarlyStopping, LoRA, BaseFinetuning-6) and rows of
ours that freeze otherwise than AutoFreeze's alpha rows: the BaseFinetuning callback under the cache (6 and 8 blocks),
AutoFreeze's ``"plasticity"`` rule + cache, LoRA on the upper blocks + cache; the goal read by :mod:`.verdict`::

    python -m benchmarks.time_to_accuracy --issue 41 --dry-run
    bash benchmarks/time_to_accuracy/launch_41.sh           # the 5-seed run, background, one core, resumable

Modules: :mod:`.data` (the data module, length buckets), :mod:`.models` (the encoders: MiniLM-L6, MPNet-base),
:mod:`.verdict` (issue 41's goal against every peer),
:mod:`.variants` (the rows and a run's record),
:mod:`.runner` (the Trainer of a variant, one fit), :mod:`.estimate` (``--dry-run``'s duration estimate),
:mod:`.summary` (means over seeds, the goal), :mod:`.report` and :mod:`.plots` (the ``--docs`` page and its
PNGs), :mod:`.cli` (the command line; ``__main__`` runs it). Run from the repository root (see
``benchmarks/README.md``).
"""
