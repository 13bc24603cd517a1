"""The models the benchmarks time: an MLP, LeNet-5, a ResNet-8 with BatchNorm, and a
GPT-style transformer written the way nanoGPT writes one (token and position embeddings,
causal self-attention through F.scaled_dot_product_attention, a head tied to the token
embedding), each with its per-example loss and a batch of random inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def lenet5() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(400, 120),
        nn.ReLU(),
        nn.Linear(120, 84),
        nn.ReLU(),
        nn.Linear(84, 10),
    )


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def small_resnet() -> nn.Module:
    """ResNet-8 for 3×32×32 inputs: stem, one basic block per stage (16, 32, 64), head."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16, 1),
        BasicBlock(16, 32, 2),
        BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )



class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads

    def forward(self, x: Tensor) -> Tensor:
        n, steps, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(n, steps, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(n, steps, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """4 layers, width 128, 4 heads, context 64, vocabulary 256, tied head."""

    def __init__(self, vocab: int = 256, context: int = 64, width: int = 128, heads: int = 4,
                 layers: int = 4) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class HFLogits(nn.Module):
    """A stock Hugging Face causal LM as a user calls it, returning the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits


def hf_gpt2() -> nn.Module:
    """transformers' GPT2LMHeadModel from a small config: the GPT-style case's shape (4 layers,
    width 128, 4 heads, context 64, vocabulary 256, tied head), Conv1D layers."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return HFLogits(GPT2LMHeadModel(GPT2Config(
        n_layer=4, n_embd=128, n_head=4, n_positions=64, vocab_size=256, use_cache=False,
        bos_token_id=0, eos_token_id=0)))


def hf_llama() -> nn.Module:
    """transformers' LlamaForCausalLM from a small config: 4 layers, width 128, 4 heads (2 key
    and value heads), SwiGLU width 344, RMSNorm, rotary positions, context 64, vocabulary 256."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return HFLogits(LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=344, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=256, use_cache=False)))


def classification_loss(out: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(out, y, reduction="none")


def token_loss(logits: Tensor, y: Tensor) -> Tensor:
    """Each sequence's mean next-token cross-entropy."""
    return F.cross_entropy(logits.transpose(1, 2), y, reduction="none").mean(dim=1)


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], tuple[Tensor, Tensor]]  # batch size -> (x, y)
    batch: int
    loss: Callable[[Tensor, Tensor], Tensor] = classification_loss


def images(*shape: int) -> Callable[[int], tuple[Tensor, Tensor]]:
    return lambda n: (torch.randn(n, *shape), torch.randint(0, 10, (n,)))


def tokens(n: int) -> tuple[Tensor, Tensor]:
    return torch.randint(0, 256, (n, 64)), torch.randint(0, 256, (n, 64))


CASES = {
    "mlp": Case("MLP 784-512-512-512-10", mlp, images(1, 28, 28), 1024),
    "lenet": Case("LeNet-5", lenet5, images(1, 28, 28), 256),
    "resnet": Case("ResNet-8 (BatchNorm, eval)", small_resnet, images(3, 32, 32), 64),
    "gpt": Case("GPT-style (4×128, tied head)", GPT, tokens, 32, token_loss),
    "hf-gpt2": Case("HF GPT2LMHeadModel (4×128)", hf_gpt2, tokens, 32, token_loss),
    "hf-llama": Case("HF LlamaForCausalLM (4×128)", hf_llama, tokens, 32, token_loss),
}
