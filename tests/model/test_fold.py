"""F.fold (aten.col2im) captured with rules of its own (theory/conv.py): MobileViTv2's patches back into a map."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import engine


class Patches(nn.Module):
    """MobileViTv2's unfolding and folding around a per-patch projection; and an overlapping fold (stride 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(2, 4, 1), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)  # (batch, 4, 4, 6)
        b, c, hh, ww = h.shape
        patches = F.unfold(h, kernel_size=2, stride=2).reshape(b, c, 4, -1)
        patches = self.fc(patches.transpose(1, 3)).transpose(1, 3).reshape(b, c * 4, -1)
        image = F.fold(patches, output_size=(hh, ww), kernel_size=2, stride=2)
        overlapped = F.fold(F.unfold(image, kernel_size=(2, 3), padding=(1, 0)), (hh, ww), (2, 3), padding=(1, 0))
        return image.pow(2).mean() + overlapped.tanh().mean()


def test_fold_captures_with_rules_that_hold_on_uneven_shards_and_computes_torchs_values_and_gradients() -> None:
    from test_ecosystem import assert_lowered_like_torch

    torch.manual_seed(0)
    module, x = Patches(), torch.randn(3, 2, 4, 6, requires_grad=True)
    g = engine.load_model(module, (x,), fallback="strict")
    folds = [n for n in g.nodes if n.op == "col2im"]
    assert len(folds) == 2 and engine.theory.missing_rules(g) == []
    for n in folds:
        assert {r.name for r in engine.theory.op_rules(n, g)} >= {"batch", "channels", "partial"}
    assert_lowered_like_torch(g, module, (x,), [x, module.fc.weight], checked=("col2im",))
