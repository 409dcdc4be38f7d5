"""ViT-MoE for `bench/overlap.py` (HiDup §6 trains ViT-MoE beside BERT-MoE): the zoo's ViT whose
every second block has the zoo BERT-MoE's top-2 gated experts as its MLP (GShard routing per
image, a group = the image's tokens). A model file of the build_model()/example_inputs()
contract (see engine.model.source), so the zoo stays as it is.

Size: ViT-Base-like width and depth cut to 6 blocks, 8 experts, 224 px images in 16 px patches,
batch 256 (32 per device of the paper's testbed, as for BERT-MoE).
"""
import torch
import torch.nn as nn

from engine.model.zoo import bert_moe, vit

VIT = vit.ViTConfig(batch=256, layers=6, hidden=768, heads=12, mlp=3072, classes=1000)
TOKENS = (VIT.image_size // VIT.patch) ** 2 + 1
MOE = bert_moe.BertMoEConfig(hidden=VIT.hidden, heads=VIT.heads, ffn=VIT.mlp, seq_len=TOKENS, batch=VIT.batch,
                             experts=8, top_k=2, dropout=0.0)
"""The experts' knobs: the MoE layer's capacity follows from seq_len (the image's tokens)."""


class MoEBlock(vit.Block):
    """A ViT block whose MLP is a mixture of experts."""

    def __init__(self) -> None:
        super().__init__(VIT)
        del self.fc, self.fc_proj
        self.moe = bert_moe.MoEFeedForward(MOE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.moe(self.ln2(x))


def build_model() -> nn.Module:
    model = vit.ViT(VIT)
    model.blocks = nn.ModuleList(MoEBlock() if (i + 1) % 2 == 0 else vit.Block(VIT) for i in range(VIT.layers))
    return model


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(VIT.batch, VIT.channels, VIT.image_size, VIT.image_size)
    return images, torch.randint(0, VIT.classes, (VIT.batch,))


