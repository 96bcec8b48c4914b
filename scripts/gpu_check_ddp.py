"""Part 3 of the GPU check: two GPUs, ``pipe_len=2``, ``precision="16-mixed"``, K 2 -> 1 at epoch 1.

Lightning starts one process per GPU (this script again, for rank 1). Epoch 0 runs one pipeline
replica over both GPUs (rank 1 idle); AutoFreeze freezes 2 of 4 blocks at epoch 1 and, with
``frozen_cost=0``, the planner compresses K 2 -> 1: rank 1 joins as a replica (it receives the
weights, the optimizer state and the loss scale). ``batch_policy="global"`` keeps the global batch,
so the run equals one process on the same batches. Rank 0 then trains that one-process reference
itself and compares: the two replicas bit-identical, and the reference within mixed-precision
rounding. Prints one line, the verdict.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check_trainers as check  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy  # noqa: E402

SCHEDULE = {1: 2}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    module = check.Classifier("bert")
    strategy = PipeTransformerStrategy(pipe_len=2, frozen_cost=0.0, batch_policy="global", timeout=120)
    trainer = pl.Trainer(
        accelerator="gpu", devices=2, strategy=strategy, precision="16-mixed", max_epochs=2,
        callbacks=[AutoFreeze(schedule=SCHEDULE)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(module, check.data())
    plan = trainer.strategy.plan
    torch.save({k: v.cpu() for k, v in module.state_dict().items()}, out / f"rank{trainer.global_rank}.pt")
    trainer.strategy.barrier()
    if trainer.global_rank != 0:
        return
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    identical = all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])
    torch.distributed.destroy_process_group()
    os.environ.pop("LOCAL_RANK", None)
    reference = check.Classifier("bert")
    ref_trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy="auto", precision="16-mixed", max_epochs=2,
        callbacks=[AutoFreeze(schedule=SCHEDULE)], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    pl.seed_everything(0, verbose=False)
    ref_trainer.fit(reference, check.data())
    rtol, atol = check.TOLERANCE["16-mixed"]
    worst = max(float((ranks[0][k].float() - v.float().cpu()).abs().max()) for k, v in reference.state_dict().items() if v.numel())
    close = all(torch.allclose(ranks[0][k].float(), v.float().cpu(), rtol=rtol, atol=atol) for k, v in reference.state_dict().items())
    verdict = "pass" if identical and close and plan.pipe_len == 1 and plan.num_replicas == 2 else "FAIL"
    print(
        f"{verdict}: final plan K={plan.pipe_len}, {plan.num_replicas} replicas; replicas bit-identical: {identical}; "
        f"max |w - w_one_process| {worst:.2e} (tolerance rtol {rtol}, atol {atol})"
    )
    if verdict != "pass":
        raise SystemExit(1)


if __name__ == "__main__":
    main()
