"""The 12-layer setting of the time-to-accuracy benchmark (issue 34), without the pretrained weights: the preset,
the EarlyStopping row, what MPNet's rows freeze (on a tiny random MPNet), and the one-pass final evaluation."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import MPNetConfig, MPNetForSequenceClassification

from benchmarks.time_to_accuracy import cli
from benchmarks.time_to_accuracy.estimate import planned_frozen
from benchmarks.time_to_accuracy.models import MODELS
from benchmarks.time_to_accuracy.runner import correct_by_position, evaluate, lora_config, lower_blocks_finetuning
from benchmarks.time_to_accuracy.variants import Variant, early_stopping_variants, peer_variants, sub_epoch_variants
from lightning_pipetransformer.stack.discovery import find_block_stack


def test_the_preset_fills_what_the_command_line_leaves_open():
    args = cli.parse_args(["--model", "mpnet-base"])
    assert (args.train_size, args.val_size, args.epochs, args.seed_list, args.threads) == (1500, 1500, 3, [0, 1, 2], 1)
    assert args.kinds == ["full", "es", "cache", "sub", "lora", "bft"] and args.val_subset == 250
    assert args.docs.name == "benchmarks_34.md" and args.json.name == "time_to_accuracy_34.json"
    assert [v.name for v in sub_epoch_variants(args)] == ["freeze+cache autofreeze p50, every 0.25 epoch"]
    assert [v.name for v in early_stopping_variants(args)] == ["full fine-tuning, EarlyStopping patience 2"]
    assert [v.name for v in peer_variants(args)] == ["LoRA r=8 (q, v) lr=0.0005", "BaseFinetuning (embeddings + 6 lower blocks)"]
    given = cli.parse_args(["--model", "mpnet-base", "--train-size", "96", "--seeds", "0,1,2,3,4", "--device", "cuda"])
    assert given.train_size == 96 and given.seed_list == [0, 1, 2, 3, 4] and given.accelerator == "cuda" and given.epochs == 3
    smoke = cli.parse_args(["--model", "mpnet-base", "--smoke"])
    assert smoke.seed_list == [0] and smoke.train_size < 100 and "outputs" in smoke.docs.parts
    minilm = cli.parse_args([])  # the 6-block benchmark keeps its defaults and rows
    assert (minilm.model, minilm.train_size, minilm.epochs) == ("minilm-l6", 3000, 5) and "es" not in minilm.kinds


def test_records_of_the_other_model_are_not_resumed(tmp_path: Path):
    saved = tmp_path / "records.json"
    args = cli.parse_args(["--model", "mpnet-base", "--resume", str(saved)])
    theirs = cli._jsonable({**vars(args), "model": "minilm-l6"})
    saved.write_text(json.dumps({"args": theirs, "records": []}))
    with pytest.raises(SystemExit, match="model='minilm-l6' here 'mpnet-base'"):
        cli.resumed_records(args, [Variant("full")])


def test_the_early_stopping_row_needs_checks_inside_the_run():
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "mpnet-base", "--val-every", "1", "--val-subset", "all"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--model", "mpnet-base", "--es-patience", "0"])


class Module(nn.Module):
    """What AutoFreeze's paths start from: the LightningModule, whose ``model`` is the HF model."""

    def __init__(self) -> None:
        super().__init__()
        config = MPNetConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, intermediate_size=64,
                             max_position_embeddings=64, num_labels=2)  # fmt: skip
        torch.manual_seed(0)
        self.model = MPNetForSequenceClassification(config)


def test_mpnets_pre_names_the_embeddings_and_the_relative_position_bias():
    module = Module()
    stack = find_block_stack(module, pre=list(MODELS["mpnet-base"].pre or ()))
    assert stack.path == "model.mpnet.encoder.layer" and len(stack) == 4
    pre = dict(stack.pre)
    assert set(pre) == {"model.mpnet.embeddings", "model.mpnet.encoder.relative_attention_bias"}
    assert pre["model.mpnet.encoder.relative_attention_bias"] is module.model.mpnet.encoder.relative_attention_bias
    assert "model.mpnet.encoder.relative_attention_bias" not in {p for p, _ in stack.post}


def test_base_finetuning_freezes_the_bias_with_the_embeddings_and_the_lower_blocks():
    module = Module()
    callback = lower_blocks_finetuning(2, backbone="mpnet")
    callback.freeze_before_training(module)  # type: ignore[arg-type]
    mpnet = module.model.mpnet
    frozen = [mpnet.embeddings, mpnet.encoder.relative_attention_bias, *mpnet.encoder.layer[:2]]
    assert all(not p.requires_grad for m in frozen for p in m.parameters())
    assert all(p.requires_grad for m in (*mpnet.encoder.layer[2:], module.model.classifier) for p in m.parameters())


def test_lora_adapts_mpnets_q_and_v_and_trains_the_head():
    from peft import get_peft_model

    args = types.SimpleNamespace(model="mpnet-base", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    peft_model = get_peft_model(Module().model, lora_config(args))
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable if ".lora_" in n}
    assert adapted == {"q", "v"}
    assert any("classifier" in n for n in trainable) and len([n for n in trainable if ".lora_A" in n]) == 2 * 4


def test_the_estimate_plans_the_same_share_of_a_deeper_stack():
    args = types.SimpleNamespace(bft_blocks=6, percentile=50.0, sub_min_active=1)
    epoch_level = Variant("cache", 1 / 3, "1/3")
    assert sorted(set(planned_frozen(epoch_level, 3, 50, args, blocks=12))) == [0, 4, 7]
    auto = Variant("cache", 1 / 3, "1/3", rule="autofreeze", interval=0.25, interval_text="0.25")
    plan = planned_frozen(auto, 3, 48, args, blocks=12)
    first = next(i for i, f in enumerate(plan) if f)
    assert plan[first] == 4 and first >= round(0.4 * 3 * 48) and max(plan) <= 11


class Constant(nn.Module):
    """Predicts class 1 where the first token is odd: correctness known per snippet."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.zeros(len(input_ids)), (input_ids[:, 0] % 2).float()], dim=1)


def test_one_pass_over_the_whole_set_gives_the_subsets_accuracy_too():
    n = 23
    ids = torch.arange(n)[:, None].repeat(1, 4)
    labels = torch.tensor([1 if i % 3 else 0 for i in range(n)])
    data = [{"input_ids": ids[i], "attention_mask": torch.ones(4, dtype=torch.long), "labels": labels[i]} for i in range(n)]
    order = list(reversed(range(n)))  # batches in another order than the positions
    batches = [order[i : i + 5] for i in range(0, n, 5)]
    loader = torch.utils.data.DataLoader(data, batch_sampler=batches)
    model = Constant()
    correct = correct_by_position(model, loader)  # type: ignore[arg-type]
    assert sorted(correct) == list(range(n))
    assert all(correct[i] == ((i % 2) == (1 if i % 3 else 0)) for i in range(n))
    assert sum(correct.values()) / n == pytest.approx(evaluate(model, loader))  # type: ignore[arg-type]
    subset = [1, 4, 9, 16]
    sub_loader = torch.utils.data.DataLoader(data, batch_sampler=[subset])
    assert sum(correct[i] for i in subset) / len(subset) == pytest.approx(evaluate(model, sub_loader))  # type: ignore[arg-type]


def test_commit_records_commits_the_records_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    git("config", "user.email", "t@example.com")
    git("config", "user.name", "t")
    (tmp_path / "other.txt").write_text("staged, not ours\n")
    git("add", "other.txt")
    records = tmp_path / "records.json"
    records.write_text("{}\n")
    cli.commit_records(records, "records: 1")
    assert git("show", "--name-only", "--format=%s", "HEAD").split() == ["records:", "1", "records.json"]
    assert git("diff", "--cached", "--name-only").split() == ["other.txt"]  # still staged, not committed
    cli.commit_records(tmp_path / "absent.json", "nothing")  # nothing to commit: no commit, no error
    assert git("rev-list", "--count", "HEAD").strip() == "1"
    records.write_text('{"a": 1}\n')
    (tmp_path / ".git" / "index.lock").write_text("")  # another git process holds the index
    cli.commit_records(records, "records: 2")
    assert "not committed" in capsys.readouterr().out


def test_gpu_runs_wait_for_the_gpu_where_the_clocks_read_and_cpu_runs_do_not(monkeypatch: pytest.MonkeyPatch):
    from benchmarks.time_to_accuracy.runner import CudaSync, eval_device

    waited: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    hook_names = ("on_train_epoch_start", "on_train_epoch_end", "on_validation_start", "on_validation_end")
    gpu, cpu = types.SimpleNamespace(device=torch.device("cuda", 0)), types.SimpleNamespace(device=torch.device("cpu"))
    for name in hook_names:
        getattr(CudaSync(), name)(None, gpu)
        getattr(CudaSync(), name)(None, cpu)
    assert waited == [torch.device("cuda", 0)] * len(hook_names)
    assert eval_device(types.SimpleNamespace(accelerator="cuda")).type == "cuda"
    assert eval_device(types.SimpleNamespace(accelerator="cpu")).type == "cpu"


def test_the_example_loads_the_head_class_of_the_checkpoints_model_type(tmp_path: Path):
    import transformers

    from examples.text_classification import SentimentClassifier, sequence_classifier_class

    Module().model.save_pretrained(tmp_path / "mpnet")
    assert sequence_classifier_class(tmp_path / "mpnet") is transformers.MPNetForSequenceClassification
    loaded = SentimentClassifier(pretrained=str(tmp_path / "mpnet"))
    assert isinstance(loaded.model, transformers.MPNetForSequenceClassification)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="model_type 't5'.*SEQUENCE_CLASSIFIERS"):
        sequence_classifier_class(tmp_path / "other")
