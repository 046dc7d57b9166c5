"""Model factories for `hftc inspect` in tests/test_cli.py (the CLI loads them by file path)."""

import torch
from torch import nn


class TinyGPTHead(nn.Module):
    """minGPT's input end and head: token + position embeddings, a block's MLP, lm_head."""

    def __init__(self, vocab: int = 50, block: int = 16, d: int = 32):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.ln_f = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        x = x + self.mlp(self.ln_f(x))
        return self.lm_head(x)


class IdsAndFeatures(nn.Module):
    """Two inputs: token ids [B, T] (long) and dense features [B, F] (float)."""

    def __init__(self, vocab: int = 30, d: int = 16, features: int = 8):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.dense = nn.Linear(features, d)
        self.out = nn.Linear(d, 3)

    def forward(self, ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.out(self.embed(ids).mean(1) + torch.relu(self.dense(feats)))


def tiny_gpt() -> TinyGPTHead:
    return TinyGPTHead()


def ids_and_features() -> IdsAndFeatures:
    return IdsAndFeatures()


class LongNames(nn.Module):
    """Module paths longer than any fixed column (the report's columns must still hold)."""

    def __init__(self):
        super().__init__()
        self.encoder_projection_to_hidden_features_layer = nn.Linear(8, 16)
        self.pool = nn.MaxPool1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.max_pool1d(self.encoder_projection_to_hidden_features_layer(x), 2)
        return h + 1


def long_names() -> LongNames:
    return LongNames()
