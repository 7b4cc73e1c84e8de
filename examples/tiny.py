"""Stand-ins for a real model and dataset, small enough for a laptop: a model,
synthetic (audio, text) rows, a batch."""

from __future__ import annotations

import torch

Rows = list[tuple[torch.Tensor, torch.Tensor]]


class TinyModel(torch.nn.Module):
    """A two-layer regressor with an optional low-rank adapter (the sweep's
    `lora_r`)."""

    def __init__(self, lora_r: int = 0) -> None:
        super().__init__()
        nn = torch.nn
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
        self.lora = None
        if lora_r:
            down = nn.Linear(16, lora_r, bias=False)
            self.lora = nn.Sequential(down, nn.Linear(lora_r, 1, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + self.lora(x) if self.lora is not None else out


def load_model(lora_r: int = 0) -> TinyModel:
    torch.manual_seed(0)
    return TinyModel(lora_r)


def make_rows(n: int = 256) -> Rows:
    """Synthetic rows: a 16-float 'clip' and its target, from a fixed seed."""
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, 16, generator=g)
    ys = xs[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
    return list(zip(xs, ys, strict=True))


def batch(rows: Rows, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*rows, strict=True)
    return torch.stack(xs).to(device), torch.stack(ys).to(device)
