"""An LSTM language model: [inefficiency]'s NLP network (PyTorch's word_language_model, the LSTM
it trains on WikiText-2) in miniature, for character-level text.

An embedding of ``emb`` units (default: ``hidden``), an nn.LSTM of ``layers`` layers and
``hidden`` units (batch first, zero initial state), and a linear decoder to the vocabulary
(the data set's output width), tied to the embedding when ``tie=true`` (needs emb = hidden).
No dropout. Weights as the example initialises them: embedding and decoder uniform in
±0.1, decoder bias zero, the LSTM PyTorch's default.

Input (context,) int64 token ids; output (n, context, vocabulary) logits. The engine's
recurrent rule reruns the recurrence step by step, so Δ is exact without a fallback.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from batchbound.errors import BatchboundError
from batchbound.models.gpt import check_tokens, token_input
from batchbound.models.layers import ModelShape, tag
from batchbound.models.options import flag, layer_count, positive_int
from batchbound.models.registry import register_family
from batchbound.spec import Spec


class LSTMLanguageModel(nn.Module):
    def __init__(self, vocabulary: int, emb: int, hidden: int, layers: int, tie: bool) -> None:
        super().__init__()
        self.encoder = nn.Embedding(vocabulary, emb)
        self.rnn = nn.LSTM(emb, hidden, layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocabulary)
        with torch.no_grad():
            self.encoder.weight.uniform_(-0.1, 0.1)
            self.decoder.weight.uniform_(-0.1, 0.1)
            self.decoder.bias.zero_()
        if tie:
            self.decoder.weight = self.encoder.weight

    def forward(self, idx: Tensor) -> Tensor:
        check_tokens("lstm", idx)
        output, _ = self.rnn(self.encoder(idx))
        return self.decoder(output)


@register_family("lstm")
def lstm(
    input_shape: Sequence[int],
    num_outputs: int,
    layers: int = 1,
    hidden: int = 64,
    emb: int | None = None,
    tie: bool = False,
) -> nn.Module:
    """Embedding → nn.LSTM(layers, hidden) → linear decoder; output = vocabulary per token."""
    layers = layer_count("lstm", "layers", layers)
    hidden = positive_int("lstm", "hidden", hidden)
    emb = hidden if emb is None else positive_int("lstm", "emb", emb)
    tie = flag("lstm", "tie", tie)
    token_input("lstm", input_shape)
    if tie and emb != hidden:
        raise BatchboundError(
            f"lstm: tie=true shares the embedding with the decoder, so emb ({emb}) must equal "
            f"hidden ({hidden})"
        )
    vocabulary = positive_int("lstm", "the output width (vocabulary)", num_outputs, minimum=2)
    resolved = Spec("lstm", {"layers": layers, "hidden": hidden, "emb": emb, "tie": tie})
    model = LSTMLanguageModel(vocabulary, emb, hidden, layers, tie)
    return tag(model, ModelShape("lstm", layers, hidden, str(resolved), tokens=True))
