"""Bad model specs give BatchboundError naming the problem, before anything is built."""

from __future__ import annotations

import pytest

from batchbound.errors import BatchboundError
from batchbound.models import build_model, family_sweep

BAD_SPECS = [
    ("transformer(depth=2)", (64,), "unknown model family 'transformer'; available: alexnet"),
    ("fc(depth=2,widht=8)", (64,),
     "no option 'widht' (did you mean 'width'?); options: depth, width, params"),
    ("fc(depth=2,width=8,params=1000)", (64,), "give width or params, not both"),
    ("fc(depth=2)", (64,), "give width=K or params=P"),
    ("fc(depth=-1,width=3)", (64,), "depth (hidden layers) must be an integer >= 0"),
    ("fc(depth=2.5,width=3)", (64,), "depth (hidden layers) must be an integer >= 0"),
    ("fc(depth=2,width=0)", (64,), "width must be an integer >= 1"),
    ("fc(depth=2,params=0)", (64,), "params (the parameter budget) must be a whole number"),
    ("fc(depth=2,params=1500.5)", (64,), "must be a whole number >= 1, got 1500.5"),
    ("fc(depth=2,width=4,act=gelu)", (64,), "unknown act 'gelu'; choose from relu, tanh"),
    ("fc(depth=2,width=4,bias=1)", (64,), "bias must be true or false"),
    ("fc(depth=0,width=4)", (64,), "depth=0 has no hidden layer"),
    ("linear(depth=2,width=4,bias=true)", (64,), "no option 'bias'"),
    ("fc(depth=2,width=4", (64,), "malformed spec"),
    ("fc(depth=2,width=4,input_shape=3)", (64,), "no option 'input_shape'"),
    ("lenet", (64,), "lenet needs image input of shape (C, H, W), got (64,)"),
    ("lenet(image=[1,8,9])", (64,), "must be [C,H,W] with C·H·W equal to the input size 64"),
    ("lenet", (1, 8, 8), "too small for two 5×5 convolutions"),
    ("lenet(width_mult=0)", (1, 28, 28), "width_mult must be a number > 0"),
    ("lenet(width_mult=1,params=1000)", (1, 28, 28), "not both"),
    ("lenet(head=[0])", (1, 28, 28), "each entry of head must be an integer >= 1"),
    ("lenet(act=sigmoid)", (1, 28, 28), "unknown act 'sigmoid'; choose from relu, tanh"),
    ("resnet(blocks=[])", (3, 32, 32), "blocks needs at least one chunk"),
    ("resnet(blocks=[2,0,2,2])", (3, 32, 32), "each entry of blocks must be an integer >= 1"),
    ("resnet(blocks=two)", (3, 32, 32), "blocks must be a list such as [2,2,2,2]"),
    ("resnet(norm=layer)", (3, 32, 32), "unknown norm 'layer'; choose from batch, group, none"),
    ("resnet(width=8,params=1000)", (3, 32, 32), "not both"),
    ("vgg(cfg=13)", (3, 32, 32), "unknown cfg 13; choose from 11, 16"),
    ("mobilenetv2(dropout=1.5)", (3, 32, 32), "dropout must be in [0, 1)"),
    ("alexnet(width=-1)", (3, 32, 32), "width must be a number > 0"),
    ("cnn1d", (3, 32, 32), "cnn1d needs a sequence input of shape (L,) or (C, L)"),
    ("cnn1d", (1, 2), "too short for 3 stride-2 convolutions"),
]


@pytest.mark.parametrize("spec,shape,message", BAD_SPECS, ids=[s for s, _, _ in BAD_SPECS])
def test_bad_specs_raise_a_named_error(spec, shape, message):
    with pytest.raises(BatchboundError) as caught:
        build_model(spec, shape, 10)
    assert message in str(caught.value)


def test_bad_sweeps_raise_a_named_error():
    with pytest.raises(BatchboundError, match="no depth sweep for family 'vgg'"):
        family_sweep("vgg", 1000, [1], (3, 32, 32), 10)
    with pytest.raises(BatchboundError, match="unknown model family 'mlp'"):
        family_sweep("mlp", 1000, [1], (64,), 10)
    with pytest.raises(BatchboundError, match="width are set by the sweep"):
        family_sweep("fc", 1000, [1], (64,), 10, options={"width": 3})
    with pytest.raises(BatchboundError, match="must be a whole number >= 1"):
        family_sweep("fc", 0, [1], (64,), 10)
    with pytest.raises(BatchboundError, match="count_biases applies to fc only"):
        family_sweep("linear", 1000, [1], (64,), 10, count_biases=True)
    with pytest.raises(BatchboundError, match="unknown act 'gelu'"):
        family_sweep("fc", 1000, [1], (64,), 10, options={"act": "gelu"})


def test_a_budget_written_as_a_float_is_accepted_when_whole():
    model = build_model("resnet(blocks=[1],params=2.5e4)", (3, 8, 8), 10)
    assert model.batchbound_shape.resolved.startswith("resnet(blocks=[1],width=")
