

def test_untrainable_prefix_counts_leading_blocks_without_trainable_parameters():
    from torch import nn

    from lightning_pipetransformer.freeze.apply import untrainable_prefix
    from lightning_pipetransformer.stack.discovery import find_block_stack

    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)]))
    stack = find_block_stack(model, "1")
    assert untrainable_prefix(stack) == 0
    stack.blocks[0].requires_grad_(False)
    stack.blocks[2].requires_grad_(False)  # not leading: block 1 still trains
    assert untrainable_prefix(stack) == 1
    stack.blocks[1].requires_grad_(False)
    assert untrainable_prefix(stack) == 3


def test_tied_outside_names_the_head_that_shares_the_embeddings():
    from torch import nn

    from lightning_pipetransformer.freeze.apply import tied_outside
    from lightning_pipetransformer.stack.discovery import find_block_stack

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embed.weight

    model = LM()
    assert tied_outside(find_block_stack(model), model) == [("embed.weight", "head.weight")]
    model.head.weight = nn.Parameter(model.embed.weight.detach().clone())
    assert tied_outside(find_block_stack(model), model) == []
