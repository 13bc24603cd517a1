"""Models written the way their authors write them, not around batchbound's engine.

- ``NanoGPT``: nanoGPT's model.py in miniature: token + position embeddings (``wpe`` of
  ``arange(T)``, broadcast over the batch), causal self-attention with a packed ``c_attn``
  and F.scaled_dot_product_attention, GELU MLP, the head tied to ``wte`` by assignment.
- ``WordLanguageModel``: PyTorch examples' word_language_model: sequence-first (T, n)
  tokens, dropout, an RNN/GRU/LSTM, a decoder on (T, n, H), tied weights optional.
- ``LSTMLanguageModel``: a batch-first character LSTM LM.
- ``MaskedEncoderClassifier``: nn.TransformerEncoder given a key padding mask.
- ``lenet5``: LeNet-5 as an nn.Sequential (padded first convolution, max pooling).
- ``resnet``: torchvision's BasicBlock and Bottleneck with downsample shortcuts.
- ``SwitchMoE``: Switch Transformer's top-1 routing of tokens into ``nn.Linear`` experts, and
  ``ExpertChoiceMoE``, where each expert picks its top tokens (an expert holds exactly n rows
  when the context equals the number of experts).
- ``UnpaddedTokenMLP`` (``fc(x[mask])``) and ``UnpaddingEncoder`` (Hugging Face's
  ``unpad_input``: ``nonzero`` of the attention mask, the tokens gathered, padded back).
- ``BatchCentered`` (``h - h.mean(0)`` in the forward) and ``ContrastiveTowers`` with
  ``info_nce``, a CLIP loss over the batch: examples that interact.
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
def lenet5() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5),
        nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(400, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10))


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


# ---------------------------------------------------------------- data-dependent rows


class SwitchMoE(nn.Module):
    """Switch Transformer's layer: every token goes to its top-1 expert, scaled by the gate
    (``hard``: routed under ``torch.no_grad()``, no gate)."""

    def __init__(self, d: int = 8, hidden: int = 16, experts: int = 4, classes: int = 4,
                 hard: bool = False) -> None:
        super().__init__()
        self.hard = hard
        self.inp = nn.Linear(d, hidden)
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:  # (n, T, d)
        h = self.inp(x)
        n, t, width = h.shape
        flat = h.reshape(-1, width)
        if self.hard:
            with torch.no_grad():
                route = self.router(flat).argmax(-1)
        else:
            gate, route = self.router(flat).softmax(-1).max(-1)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            idx = (route == e).nonzero()[:, 0]
            picked = expert(flat.index_select(0, idx))
            out = out.index_add(0, idx, picked if self.hard else picked * gate[idx, None])
        return self.out(out.reshape(n, t, width).mean(1))


class ExpertChoiceMoE(nn.Module):
    """Expert-choice routing: expert e takes its top n·T/E tokens (index_select, index_add)."""

    def __init__(self, d: int = 6, experts: int = 3, classes: int = 3) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.head = nn.Linear(d, classes)

    def forward(self, x: Tensor) -> Tensor:  # (n, T, d)
        n, t, d = x.shape
        flat = x.reshape(-1, d)
        scores = self.router(flat).softmax(-1)
        capacity = n * t // len(self.experts)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            weight, idx = scores[:, e].topk(capacity)
            out = out.index_add(0, idx, expert(flat.index_select(0, idx)) * weight[:, None])
        return self.head(out.reshape(n, t, d).sum(1))


class UnpaddedTokenMLP(nn.Module):
    """A token MLP on the real tokens only (all-zero rows are padding), scattered back."""

    def __init__(self, d: int = 6, hidden: int = 10, classes: int = 3) -> None:
        super().__init__()
        self.fc = nn.Linear(d, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:  # (n, T, d)
        mask = x.abs().sum(-1) > 0
        tokens = torch.tanh(self.fc(x[mask]))
        out = x.new_zeros(*mask.shape, tokens.shape[-1])
        out[mask] = tokens
        return self.head(out.sum(1))


class UnpaddingEncoder(nn.Module):
    """Hugging Face's unpad_input / pad_input around a token layer, by the ids' padding."""

    def __init__(self, vocab: int = 20, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids: Tensor) -> Tensor:
        n, t = ids.shape
        indices = torch.nonzero((ids != 0).flatten(), as_tuple=False).flatten()
        h = torch.relu(self.fc(self.emb(ids).reshape(n * t, -1)[indices]))
        out = h.new_zeros(n * t, h.shape[-1])
        out[indices] = h
        return self.head(out.reshape(n, t, -1).sum(1))


def padded(n: int, steps: int, d: int, seed: int = 0) -> Tensor:
    """(n, steps, d) features with a random number of trailing all-zero (padding) rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, steps, d, generator=g)
    lengths = torch.randint(1, steps + 1, (n,), generator=g)
    for i, length in enumerate(lengths.tolist()):
        x[i, length:] = 0
    return x


# ------------------------------------------------------------ examples that interact


class BatchCentered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 7), nn.Linear(7, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(torch.tanh(h - h.mean(0)))


class ContrastiveTowers(nn.Module):
    """CLIP's two towers: image and text features, unit-normalised, stacked as (n, 2, d)."""

    def __init__(self, image: int = 6, text: int = 5, d: int = 4) -> None:
        super().__init__()
        self.image, self.text, self.split = nn.Linear(image, d), nn.Linear(text, d), image

    def forward(self, x: Tensor) -> Tensor:
        return torch.stack([F.normalize(self.image(x[:, : self.split]), dim=-1),
                            F.normalize(self.text(x[:, self.split :]), dim=-1)], dim=1)


def info_nce(features: Tensor, _: Tensor) -> Tensor:
    """CLIP's symmetric InfoNCE: example i's image against every text of the batch."""
    image, text = features[:, 0], features[:, 1]
    logits = 10.0 * image @ text.T
    labels = torch.arange(len(image), device=image.device)
    return (F.cross_entropy(logits, labels, reduction="none")
            + F.cross_entropy(logits.T, labels, reduction="none")) / 2
