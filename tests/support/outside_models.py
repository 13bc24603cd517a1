"""Models written the way their authors write them, not around batchbound's engine.

- ``NanoGPT``: nanoGPT's model.py in miniature: token + position embeddings (``wpe`` of
  ``arange(T)``, broadcast over the batch), causal self-attention with a packed ``c_attn``
  and F.scaled_dot_product_attention, GELU MLP, the head tied to ``wte`` by assignment.
- ``WordLanguageModel``: PyTorch examples' word_language_model: sequence-first (T, n)
  tokens, dropout, an RNN/GRU/LSTM, a decoder on (T, n, H), tied weights optional.
- ``LSTMLanguageModel``: a batch-first character LSTM LM.
- ``MaskedEncoderClassifier``: nn.TransformerEncoder given a key padding mask.
- ``resnet``: torchvision's BasicBlock and Bottleneck with downsample shortcuts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int = 40, block_size: int = 8, n_embd: int = 16,
                 n_head: int = 2, n_layer: int = 2, head: str = "tied") -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.head = head
        if head != "matmul":  # "matmul": logits = x @ wte.weight.T, no head module at all
            self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if head == "tied":
            self.transformer.wte.weight = self.lm_head.weight
        for p in self.parameters():  # nanoGPT's N(0, 0.02) init of the matrices
            if p.dim() > 1:
                torch.nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if self.head == "matmul":
            return x @ self.transformer.wte.weight.T
        return self.lm_head(x)


def sequence_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """One loss per sequence: the mean token cross-entropy, (n, T, V) logits."""
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction="none").mean(dim=1)


class WordLanguageModel(nn.Module):
    """pytorch/examples word_language_model's RNNModel, fed (n, T) and returning (n, T, V)
    (the example itself works on (T, n); the transposes are the caller's glue)."""

    def __init__(self, rnn_type: str = "LSTM", ntoken: int = 30, ninp: int = 8, nhid: int = 8,
                 nlayers: int = 2, dropout: float = 0.2, tie_weights: bool = False) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        if rnn_type in ("LSTM", "GRU"):
            self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        else:
            nonlinearity = {"RNN_TANH": "tanh", "RNN_RELU": "relu"}[rnn_type]
            self.rnn = nn.RNN(ninp, nhid, nlayers, nonlinearity=nonlinearity, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.nlayers, self.nhid, self.rnn_type = nlayers, nhid, rnn_type

    def init_hidden(self, bsz: int) -> Tensor | tuple[Tensor, Tensor]:
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid),
                    weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)

    def forward(self, tokens: Tensor) -> Tensor:
        input = tokens.t()  # (T, n), as the example's batchify gives it
        emb = self.drop(self.encoder(input))
        output, _ = self.rnn(emb, self.init_hidden(tokens.shape[0]))
        output = self.drop(output)
        decoded = self.decoder(output)  # (T, n, V)
        return decoded.transpose(0, 1)


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab: int = 30, emb: int = 8, hidden: int = 12, layers: int = 2,
                 bidirectional: bool = False, proj_size: int = 0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True, bidirectional=bidirectional,
                           proj_size=proj_size)
        width = (proj_size or hidden) * (2 if bidirectional else 1)
        self.out = nn.Linear(width, vocab)

    def forward(self, idx: Tensor) -> Tensor:
        h, _ = self.rnn(self.emb(idx))
        return self.out(h)


class MaskedEncoderClassifier(nn.Module):
    """Token ids with 0 as padding; the encoder is told which positions are padding."""

    def __init__(self, vocab: int = 20, d_model: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d_model, nhead=2, dim_feedforward=32,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2)
        self.fc = nn.Linear(d_model, classes)

    def forward(self, idx: Tensor) -> Tensor:
        padding = idx == 0
        h = self.encoder(self.emb(idx) * math.sqrt(16), src_key_padding_mask=padding)
        keep = (~padding).unsqueeze(-1).to(h.dtype)
        return self.fc((h * keep).sum(1) / keep.sum(1))


# torchvision.models.resnet, abridged (torchvision itself cannot be installed here)
def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, block: type, layers: list[int], num_classes: int = 5,
                 width: int = 4) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, layers[0])
        self.layer2 = self._make_layer(block, 2 * width, layers[1], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width * block.expansion, num_classes)

    def _make_layer(self, block: type, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                       nn.BatchNorm2d(planes * block.expansion))
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet(block: str = "basic") -> ResNet:
    """A ResNet with running statistics worth the name, in eval mode."""
    model = ResNet(BasicBlock if block == "basic" else Bottleneck, [1, 1])
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(8, 3, 16, 16))
    return model.eval()
