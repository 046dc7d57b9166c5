"""A user's own training loop and the trainer integrations, probed as scripts are written
(pytorch/examples' mnist loop, HF Trainer, Lightning): each model's training equal to its
own stock loop, and what a loop does to the fused module (saving it whole, ...) working.
"""

from __future__ import annotations

import copy
import io

import torch
import torch.nn.functional as F
from torch import nn

import hftc


class MnistNet(nn.Module):
    """pytorch/examples' mnist Net, small: F.max_pool2d is torch's boolean_dispatch
    function, whose __qualname__ ('boolean_dispatch.<locals>.fn') pickle cannot find."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.adaptive_max_pool2d(x, 6)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def _mnist_models(n=3):
    torch.manual_seed(0)
    return [MnistNet().double() for _ in range(n)]


def test_torch_save_of_a_fused_mnist_net_after_training_loads_and_trains_on(tmp_path):
    # torch.save(fused) raised "Can't pickle local object 'boolean_dispatch.<locals>.fn'":
    # the kept fx graph's call_function targets were pickled by their qualified name.
    fused = hftc.fuse(_mnist_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3], momentum=0.9)
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 14, 14, dtype=torch.float64), torch.randint(0, 10, (8,))
    for _ in range(2):
        opt.zero_grad()
        hftc.per_model(F.nll_loss)(fused(x), y).sum().backward()
        opt.step()
    torch.save(fused, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    assert torch.equal(loaded(x), fused(x))
    twin = copy.deepcopy(fused)  # the original still pickles and copies as before
    assert torch.equal(twin(x), fused(x))
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    # the loaded module trains as the original does, each model its own
    opt2 = hftc.optim.SGD(loaded.parameters(), lr=[0.1, 0.2, 0.3])
    hftc.per_model(F.nll_loss)(loaded(x), y).sum().backward()
    opt2.step()
    alone = fused.unfuse()[2]
    F.nll_loss(alone(x), y).backward()
    torch.optim.SGD(alone.parameters(), lr=0.3).step()
    torch.testing.assert_close(loaded.unfuse()[2](x), alone(x))
