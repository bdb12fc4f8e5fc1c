"""Token embedding and LM head (vocab-parallel in vLLM; tensor-parallel size 1 here)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.linear import default_weight_loader, set_weight_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, default_weight_loader)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids.long(), self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"


class ParallelLMHead(VocabParallelEmbedding):
    """hidden `[S, H]` -> logits `[S, vocab]`. With tied embeddings, `tie_to` shares the weight."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
