"""A model file (the build_model/example_inputs contract) with an operator that has no sharding rule:
`torch.cumprod` on the activations, which the replicate fallback runs unsharded."""
import torch
import torch.nn as nn


class CumprodMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.cumprod(torch.sigmoid(self.fc1(x)), dim=-1)  # (B, 16): no rule, replicated
        return nn.functional.mse_loss(self.fc2(h), y)


def build_model() -> nn.Module:
    return CumprodMLP()


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(12, 8), torch.randn(12, 4)
