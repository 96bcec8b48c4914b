"""Block-stack discovery on each supported model family, and the error cases."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_pipetransformer.freeze.apply import apply_freeze, frozen_parameters
from lightning_pipetransformer.stack.declared import block_stack_of
from lightning_pipetransformer.stack.discovery import BlockStackError, find_block_stack, find_candidates
from tests.helpers.models import TextClassifier, TimmStyleViT, TorchEncoderClassifier, tiny_bert, tiny_vit


def names(pairs):
    return [name for name, _ in pairs]


def test_bert_family():
    model = tiny_bert(4)
    stack = find_block_stack(model)
    assert stack.path == "bert.encoder.layer"
    assert len(stack) == 4 and stack.blocks[0] is model.bert.encoder.layer[0]
    assert names(stack.pre) == ["bert.embeddings"]
    assert names(stack.post) == ["bert.pooler", "dropout", "classifier"]


def test_vit_family():
    model = tiny_vit(3)
    stack = find_block_stack(model)
    assert stack.container is model.vit.get_submodule(stack.path.removeprefix("vit."))
    assert len(stack) == 3 and type(stack.blocks[0]).__name__ == "ViTLayer"
    assert names(stack.pre) == ["vit.embeddings"]
    assert "classifier" in names(stack.post)


def test_timm_style_sequential_with_direct_parameters():
    model = TimmStyleViT(depth=3)
    stack = find_block_stack(model)
    assert stack.path == "blocks" and len(stack) == 3
    assert names(stack.pre) == ["patch_embed", "pos_drop"]
    assert names(stack.pre_params) == ["cls_token"]
    assert names(stack.post) == ["norm", "head"]


def test_torch_transformer_encoder():
    model = TorchEncoderClassifier(depth=3)
    stack = find_block_stack(model)
    assert stack.path == "encoder.layers" and len(stack) == 3
    assert names(stack.pre) == ["embed"]
    assert names(stack.post) == ["head"]


def test_lightning_module_paths_are_relative_to_it():
    module = TextClassifier(num_layers=3)
    assert block_stack_of(module).path == "model.bert.encoder.layer"


def test_explicit_path_and_hook():
    module = TextClassifier(num_layers=3)
    assert block_stack_of(module, "model.bert.encoder.layer").container is module.model.bert.encoder.layer
    module.configure_block_stack = lambda: "model.bert.encoder.layer"
    assert len(block_stack_of(module)) == 3
    module.configure_block_stack = lambda: None
    with pytest.raises(BlockStackError, match="returned None"):
        block_stack_of(module)


def test_explicit_pre_overrides_registration_order():
    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(8, 2)  # registered first, but runs last
            self.embed = nn.Linear(4, 8)
            self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    model = HeadFirst()
    assert names(find_block_stack(model).pre) == ["head", "embed"]  # what order alone says
    stack = find_block_stack(model, "blocks", pre=["embed"])
    assert names(stack.pre) == ["embed"] and names(stack.post) == ["head"]


def test_no_stack_is_a_clear_error():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(BlockStackError, match="layers="):
        find_block_stack(model)


def test_two_comparable_stacks_name_both():
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
            self.decoder = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    with pytest.raises(BlockStackError) as err:
        find_block_stack(EncoderDecoder())
    assert "'encoder'" in str(err.value) and "'decoder'" in str(err.value) and "layers=" in str(err.value)
    assert find_block_stack(EncoderDecoder(), "decoder").path == "decoder"


def test_small_second_stack_is_not_ambiguous_and_nested_stacks_are_dropped():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)) for _ in range(4))
            self.head = nn.Sequential(nn.Linear(16, 2), nn.Linear(2, 2))

    candidates = find_candidates(Model())
    assert [c.path for c in candidates] == ["blocks", "head"]  # blocks.0 (nested) dropped
    assert find_block_stack(Model()).path == "blocks"


def test_bad_path():
    with pytest.raises(BlockStackError, match="does not name a submodule"):
        find_block_stack(tiny_bert(2), "bert.encoder.layers")


def test_apply_freeze_covers_pre_and_prefix_only():
    model = TimmStyleViT(depth=3)
    stack = find_block_stack(model)
    model.train()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    apply_freeze(stack, 2, include_pre=True)
    frozen = {id(p) for p in frozen_parameters(stack, 2, True)}
    assert id(model.cls_token) in frozen
    for p in model.parameters():
        assert p.requires_grad == (id(p) not in frozen)
        assert (p.grad is None) == (id(p) in frozen)
    assert not model.blocks[0].training and not model.blocks[1].training and model.blocks[2].training
    assert not model.pos_drop.training and model.head.training
    with pytest.raises(ValueError):
        apply_freeze(stack, 4, include_pre=True)


# ---------------------------------------------------------------------------- shared (tied) blocks


class Block(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class SharedBlocks(nn.Module):
    """ALBERT-style: ``ModuleList([A, A, B, B])`` runs 4 positions with 2 modules."""

    def __init__(self, tied_weights: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        if tied_weights:  # 4 modules, but positions 0 and 2 share one weight
            blocks = [Block() for _ in range(4)]
            blocks[2].linear.weight = blocks[0].linear.weight
        else:
            a, b = Block(), Block()
            blocks = [a, a, b, b]
        self.layers = nn.ModuleList(blocks)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


@pytest.mark.parametrize("tied_weights", [False, True])
def test_shared_blocks_are_refused_at_discovery(tied_weights):
    # Before: children() listed [A, B], so the stack was "2 blocks" while the model ran 4.
    model = SharedBlocks(tied_weights)
    for layers in (None, "layers"):  # found, and named explicitly
        with pytest.raises(BlockStackError, match="'layers'.*shared blocks") as err:
            find_block_stack(model, layers)
        message = str(err.value)
        assert "cannot be frozen or pipelined one position at a time" in message
        assert ("positions 0 and 2 share the parameter" if tied_weights else "positions 0 and 1 are the same Block") in message
    with pytest.raises(BlockStackError, match="shared blocks"):
        block_stack_of(model, model.layers)  # the container itself


class SharedBlocksModule(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = SharedBlocks()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.model(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def shared_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)), batch_size=4)


@pytest.mark.parametrize(
    "strategy",
    ["auto", {"pipe_len": 2}, {"cache": True}],
    ids=["autofreeze-alone", "pipe_len=2", "cache"],
)
def test_shared_blocks_are_refused_before_training(tmp_path, strategy):
    # Before: AutoFreeze alone reported 2 blocks and trained a model of 4 positions; the strategy
    # failed later with a ValueError about "2 blocks that are not the 4 children".
    from lightning_pipetransformer import AutoFreeze, PipeTransformerStrategy

    module = SharedBlocksModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    if isinstance(strategy, dict):
        strategy = PipeTransformerStrategy(cache_dir=str(tmp_path / "cache"), **strategy)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, callbacks=[AutoFreeze(schedule={1: 1})],
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(BlockStackError, match="'model.layers'.*shared blocks.*one position at a time"):
        trainer.fit(module, shared_data())
    assert trainer.global_step == 0
    for key, value in module.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_stack_whose_blocks_train_wins_over_a_larger_frozen_one():
    """Distillation: a frozen teacher larger than the student."""
    from torch import nn

    class TwoModels(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.teacher = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
            self.student = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
            self.teacher.requires_grad_(False)

    model = TwoModels()
    assert find_block_stack(model).path == "student"
    model.teacher.requires_grad_(True)
    assert find_block_stack(model).path == "teacher"  # both train: the larger, as before
