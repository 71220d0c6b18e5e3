"""Example models for the bench, the tests and ``fedge partition`` (random weights; torch imported here only).

Every factory returns ``(model, example_input)``, the form ``fedge partition --model MODULE:FACTORY`` expects.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ChainCNN", "ResNet18", "TiedTransformer", "chain_cnn", "resnet18", "tied_transformer", "wide_mlp"]


class ChainCNN(nn.Module):
    """A plain chain of conv-BN-ReLU blocks with pooling, then a classifier (no residuals)."""

    def __init__(self, width: int = 32, blocks: int = 6, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for k in range(blocks):
            c_out = width * (2 ** (k // 2))
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), nn.BatchNorm2d(c_out), nn.ReLU()]
            if k % 2 == 1:
                layers.append(nn.MaxPool2d(2))
            c_in = c_out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class _Basic(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """ResNet-18's layout (11.7M parameters at 1,000 classes): residual blocks make cuts carry two tensors."""

    def __init__(self, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, c_in = [], 64
        for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [_Basic(c_in, c_out, stride), _Basic(c_out, c_out, 1)]
            c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(x)))


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        att = torch.softmax(q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.ff(self.ln2(x))


class TiedTransformer(nn.Module):
    """A stack of pre-norm transformer blocks whose output projection is the token embedding (tied)."""

    def __init__(
        self, vocab: int = 2000, dim: int = 256, depth: int = 6, heads: int = 4, seq: int = 64
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # GPT-style: logits of order 1, not of order sqrt(dim)
        self.pos = nn.Parameter(torch.randn(1, seq, dim) * 0.02)
        self.blocks = nn.Sequential(*[_Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.embed(tokens) + self.pos)
        return self.norm(x) @ self.embed.weight.t()  # tied: the embedding matrix is read twice


def chain_cnn(size: int = 64) -> tuple[nn.Module, torch.Tensor]:
    """A :class:`ChainCNN` and a random ``(2, 3, size, size)`` input."""
    torch.manual_seed(0)
    return ChainCNN().eval(), torch.randn(2, 3, size, size)


def resnet18(size: int = 224) -> tuple[nn.Module, torch.Tensor]:
    """A :class:`ResNet18` and a random ``(2, 3, size, size)`` input."""
    torch.manual_seed(0)
    return ResNet18().eval(), torch.randn(2, 3, size, size)


def tied_transformer(seq: int = 64) -> tuple[nn.Module, torch.Tensor]:
    """A :class:`TiedTransformer` and random ``(2, seq)`` token ids."""
    torch.manual_seed(0)
    return TiedTransformer(seq=seq).eval(), torch.randint(0, 2000, (2, seq))


def wide_mlp(width: int = 2048, depth: int = 6) -> tuple[nn.Module, torch.Tensor]:
    """An MLP of ``depth`` square layers (``width``² weights each): big weights, small activations."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).eval(), torch.randn(2, width)
