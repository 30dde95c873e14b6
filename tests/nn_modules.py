"""Every `torch.nn` module, built with default-ish arguments and given small inputs: the sweep of the `neuron`
device (tests/test_nn_sweep.py; `python -m benchmarks.nn_sweep` with larger inputs).

`MODULES` maps a module's name to a function of a size multiplier `s` returning (module, inputs). Modules that
draw random numbers (dropouts, RReLU, FractionalMaxPool) are listed in `RANDOM`: the device draws its own
numbers, so the sweep runs them in eval mode, or compares only what does not depend on the draw. `NOT_SWEPT`
says why the few remaining classes are not in the table.
"""
from __future__ import annotations

import torch
import torch.nn as nn


def _x(*shape):
    return torch.randn(*shape)


def _pooled(pool, x):
    """(max values, their indices): the inputs of a MaxUnpool."""
    values, indices = pool(x)
    return values, indices


def _classes(n, high):
    return torch.randint(0, high, (n,))


MODULES = {
    # pooling
    "AdaptiveAvgPool1d": lambda s: (nn.AdaptiveAvgPool1d(3), (_x(2, 3, 6 * s),)),
    "AdaptiveAvgPool2d": lambda s: (nn.AdaptiveAvgPool2d((2, 3)), (_x(2, 3, 4 * s, 6 * s),)),
    "AdaptiveAvgPool3d": lambda s: (nn.AdaptiveAvgPool3d(2), (_x(1, 2, 4 * s, 4, 4),)),
    "AdaptiveMaxPool1d": lambda s: (nn.AdaptiveMaxPool1d(3), (_x(2, 3, 6 * s),)),
    "AdaptiveMaxPool2d": lambda s: (nn.AdaptiveMaxPool2d((2, 3)), (_x(2, 3, 4 * s, 6 * s),)),
    "AdaptiveMaxPool3d": lambda s: (nn.AdaptiveMaxPool3d(2), (_x(1, 2, 4 * s, 4, 4),)),
    "AvgPool1d": lambda s: (nn.AvgPool1d(3, 2, 1), (_x(2, 3, 7 * s),)),
    "AvgPool2d": lambda s: (nn.AvgPool2d(2), (_x(2, 3, 4 * s, 4),)),
    "AvgPool3d": lambda s: (nn.AvgPool3d(2), (_x(1, 2, 4 * s, 4, 4),)),
    "MaxPool1d": lambda s: (nn.MaxPool1d(2), (_x(2, 3, 6 * s),)),
    "MaxPool2d": lambda s: (nn.MaxPool2d(3, 2, 1), (_x(2, 3, 6 * s, 6),)),
    "MaxPool3d": lambda s: (nn.MaxPool3d(2), (_x(1, 2, 4 * s, 4, 4),)),
    "LPPool1d": lambda s: (nn.LPPool1d(2, 2), (_x(2, 3, 6 * s).abs() + 0.1,)),
    "LPPool2d": lambda s: (nn.LPPool2d(2, 2), (_x(2, 3, 4 * s, 4).abs() + 0.1,)),
    "LPPool3d": lambda s: (nn.LPPool3d(2, 2), (_x(1, 2, 4 * s, 4, 4).abs() + 0.1,)),
    "FractionalMaxPool2d": lambda s: (nn.FractionalMaxPool2d(2, output_size=(3, 3)), (_x(1, 2, 6 * s, 6),)),
    "FractionalMaxPool3d": lambda s: (nn.FractionalMaxPool3d(2, output_size=(2, 2, 2)), (_x(1, 2, 4 * s, 4, 4),)),
    # convolutions
    "Conv1d": lambda s: (nn.Conv1d(3, 4, 3, padding=1), (_x(2, 3, 8 * s),)),
    "Conv2d": lambda s: (nn.Conv2d(3, 4, 3), (_x(2, 3, 6 * s, 6),)),
    "Conv3d": lambda s: (nn.Conv3d(2, 3, 2), (_x(1, 2, 4 * s, 4, 4),)),
    "ConvTranspose1d": lambda s: (nn.ConvTranspose1d(3, 4, 3, stride=2), (_x(2, 3, 5 * s),)),
    "ConvTranspose2d": lambda s: (nn.ConvTranspose2d(3, 4, 3), (_x(2, 3, 4 * s, 4),)),
    "ConvTranspose3d": lambda s: (nn.ConvTranspose3d(2, 3, 2), (_x(1, 2, 3 * s, 3, 3),)),
    "LazyConv1d": lambda s: (nn.LazyConv1d(4, 3), (_x(2, 3, 8 * s),)),
    "LazyConv2d": lambda s: (nn.LazyConv2d(4, 3), (_x(2, 3, 6 * s, 6),)),
    "LazyConv3d": lambda s: (nn.LazyConv3d(3, 2), (_x(1, 2, 4 * s, 4, 4),)),
    "LazyConvTranspose1d": lambda s: (nn.LazyConvTranspose1d(4, 3), (_x(2, 3, 5 * s),)),
    "LazyConvTranspose2d": lambda s: (nn.LazyConvTranspose2d(4, 3), (_x(2, 3, 4 * s, 4),)),
    "LazyConvTranspose3d": lambda s: (nn.LazyConvTranspose3d(3, 2), (_x(1, 2, 3 * s, 3, 3),)),
    "Fold": lambda s: (nn.Fold((4 * s, 5), (2, 2)), (_x(2, 3 * 4, (4 * s - 1) * 4),)),
    "Unfold": lambda s: (nn.Unfold((2, 3)), (_x(2, 3, 4 * s, 5),)),
    # normalisation
    "BatchNorm1d": lambda s: (nn.BatchNorm1d(3), (_x(4 * s, 3),)),
    "BatchNorm2d": lambda s: (nn.BatchNorm2d(3), (_x(2 * s, 3, 4, 4),)),
    "BatchNorm3d": lambda s: (nn.BatchNorm3d(2), (_x(2 * s, 2, 3, 3, 3),)),
    "LazyBatchNorm1d": lambda s: (nn.LazyBatchNorm1d(), (_x(4 * s, 3),)),
    "LazyBatchNorm2d": lambda s: (nn.LazyBatchNorm2d(), (_x(2 * s, 3, 4, 4),)),
    "LazyBatchNorm3d": lambda s: (nn.LazyBatchNorm3d(), (_x(2 * s, 2, 3, 3, 3),)),
    "SyncBatchNorm": lambda s: (nn.SyncBatchNorm(3), (_x(2 * s, 3, 4, 4),)),  # eval: no process group needed
    "InstanceNorm1d": lambda s: (nn.InstanceNorm1d(3, affine=True), (_x(2, 3, 6 * s),)),
    "InstanceNorm2d": lambda s: (nn.InstanceNorm2d(3), (_x(2, 3, 4 * s, 4),)),
    "InstanceNorm3d": lambda s: (nn.InstanceNorm3d(2, track_running_stats=True), (_x(2, 2, 3 * s, 3, 3),)),
    "LazyInstanceNorm1d": lambda s: (nn.LazyInstanceNorm1d(), (_x(2, 3, 6 * s),)),
    "LazyInstanceNorm2d": lambda s: (nn.LazyInstanceNorm2d(), (_x(2, 3, 4 * s, 4),)),
    "LazyInstanceNorm3d": lambda s: (nn.LazyInstanceNorm3d(), (_x(2, 2, 3 * s, 3, 3),)),
    "GroupNorm": lambda s: (nn.GroupNorm(2, 4), (_x(2, 4, 3 * s, 3),)),
    "LayerNorm": lambda s: (nn.LayerNorm(6), (_x(2, 3 * s, 6),)),
    "RMSNorm": lambda s: (nn.RMSNorm(6), (_x(2, 3 * s, 6),)),
    "LocalResponseNorm": lambda s: (nn.LocalResponseNorm(3), (_x(2, 5, 3 * s, 3),)),
    "CrossMapLRN2d": lambda s: (nn.CrossMapLRN2d(3), (_x(2, 5, 3 * s, 3),)),
    # linear layers, embeddings
    "Identity": lambda s: (nn.Identity(), (_x(2, 3 * s),)),
    "Linear": lambda s: (nn.Linear(5, 4), (_x(3 * s, 5),)),
    "LazyLinear": lambda s: (nn.LazyLinear(4), (_x(3 * s, 5),)),
    "Bilinear": lambda s: (nn.Bilinear(3, 4, 5), (_x(2 * s, 3), _x(2 * s, 4))),
    "Embedding": lambda s: (nn.Embedding(10, 4, padding_idx=0), (torch.randint(0, 10, (2, 3 * s)),)),
    "EmbeddingBag": lambda s: (nn.EmbeddingBag(10, 4, mode="mean"), (torch.randint(0, 10, (2 * s, 3)),)),
    "Flatten": lambda s: (nn.Flatten(), (_x(2, 3, 2 * s),)),
    "Unflatten": lambda s: (nn.Unflatten(1, (2, 3)), (_x(2 * s, 6),)),
    "Sequential": lambda s: (nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2)), (_x(3 * s, 4),)),
    "DataParallel": lambda s: (nn.DataParallel(nn.Linear(4, 3)), (_x(2 * s, 4),)),  # over neuron:0 and neuron:1
    # activations
    "CELU": lambda s: (nn.CELU(), (_x(3, 4 * s),)),
    "ELU": lambda s: (nn.ELU(), (_x(3, 4 * s),)),
    "GELU": lambda s: (nn.GELU(), (_x(3, 4 * s),)),
    "GLU": lambda s: (nn.GLU(), (_x(3, 4 * s),)),
    "Hardshrink": lambda s: (nn.Hardshrink(), (_x(3, 4 * s),)),
    "Hardsigmoid": lambda s: (nn.Hardsigmoid(), (_x(3, 4 * s) * 4,)),
    "Hardswish": lambda s: (nn.Hardswish(), (_x(3, 4 * s) * 4,)),
    "Hardtanh": lambda s: (nn.Hardtanh(), (_x(3, 4 * s) * 2,)),
    "LeakyReLU": lambda s: (nn.LeakyReLU(), (_x(3, 4 * s),)),
    "LogSigmoid": lambda s: (nn.LogSigmoid(), (_x(3, 4 * s),)),
    "LogSoftmax": lambda s: (nn.LogSoftmax(dim=1), (_x(3, 4 * s),)),
    "Mish": lambda s: (nn.Mish(), (_x(3, 4 * s),)),
    "PReLU": lambda s: (nn.PReLU(), (_x(3, 4 * s),)),
    "ReLU": lambda s: (nn.ReLU(), (_x(3, 4 * s),)),
    "ReLU6": lambda s: (nn.ReLU6(), (_x(3, 4 * s) * 5,)),
    "RReLU": lambda s: (nn.RReLU(), (_x(3, 4 * s),)),
    "SELU": lambda s: (nn.SELU(), (_x(3, 4 * s),)),
    "SiLU": lambda s: (nn.SiLU(), (_x(3, 4 * s),)),
    "Sigmoid": lambda s: (nn.Sigmoid(), (_x(3, 4 * s),)),
    "Softmax": lambda s: (nn.Softmax(dim=-1), (_x(3, 4 * s),)),
    "Softmax2d": lambda s: (nn.Softmax2d(), (_x(2, 3, 2 * s, 2),)),
    "Softmin": lambda s: (nn.Softmin(dim=-1), (_x(3, 4 * s),)),
    "Softplus": lambda s: (nn.Softplus(), (_x(3, 4 * s),)),
    "Softshrink": lambda s: (nn.Softshrink(), (_x(3, 4 * s),)),
    "Softsign": lambda s: (nn.Softsign(), (_x(3, 4 * s),)),
    "Tanh": lambda s: (nn.Tanh(), (_x(3, 4 * s),)),
    "Tanhshrink": lambda s: (nn.Tanhshrink(), (_x(3, 4 * s),)),
    "Threshold": lambda s: (nn.Threshold(0.1, 20.0), (_x(3, 4 * s),)),
    "MultiheadAttention": lambda s: (nn.MultiheadAttention(8, 2, batch_first=True),
                                     (_x(2, 3 * s, 8), _x(2, 4, 8), _x(2, 4, 8))),
    # dropout (random: eval mode)
    "AlphaDropout": lambda s: (nn.AlphaDropout(), (_x(3, 4 * s),)),
    "Dropout": lambda s: (nn.Dropout(), (_x(3, 4 * s),)),
    "Dropout1d": lambda s: (nn.Dropout1d(), (_x(2, 3, 4 * s),)),
    "Dropout2d": lambda s: (nn.Dropout2d(), (_x(2, 3, 2 * s, 2),)),
    "Dropout3d": lambda s: (nn.Dropout3d(), (_x(2, 3, 2 * s, 2, 2),)),
    "FeatureAlphaDropout": lambda s: (nn.FeatureAlphaDropout(), (_x(2, 3, 2 * s, 2),)),
    # padding, shuffles, upsampling
    "CircularPad1d": lambda s: (nn.CircularPad1d(2), (_x(2, 3, 4 * s),)),
    "CircularPad2d": lambda s: (nn.CircularPad2d(1), (_x(2, 3, 3 * s, 3),)),
    "CircularPad3d": lambda s: (nn.CircularPad3d(1), (_x(1, 2, 2 * s, 3, 3),)),
    "ConstantPad1d": lambda s: (nn.ConstantPad1d(2, 3.5), (_x(2, 3, 4 * s),)),
    "ConstantPad2d": lambda s: (nn.ConstantPad2d((1, 0, 2, 1), 3.5), (_x(2, 3, 3 * s, 3),)),
    "ConstantPad3d": lambda s: (nn.ConstantPad3d(1, 3.5), (_x(1, 2, 2 * s, 3, 3),)),
    "ReflectionPad1d": lambda s: (nn.ReflectionPad1d(2), (_x(2, 3, 4 * s),)),
    "ReflectionPad2d": lambda s: (nn.ReflectionPad2d(1), (_x(2, 3, 3 * s, 3),)),
    "ReflectionPad3d": lambda s: (nn.ReflectionPad3d(1), (_x(1, 2, 2 * s, 3, 3),)),
    "ReplicationPad1d": lambda s: (nn.ReplicationPad1d(2), (_x(2, 3, 4 * s),)),
    "ReplicationPad2d": lambda s: (nn.ReplicationPad2d(1), (_x(2, 3, 3 * s, 3),)),
    "ReplicationPad3d": lambda s: (nn.ReplicationPad3d(1), (_x(1, 2, 2 * s, 3, 3),)),
    "ZeroPad1d": lambda s: (nn.ZeroPad1d(2), (_x(2, 3, 4 * s),)),
    "ZeroPad2d": lambda s: (nn.ZeroPad2d(1), (_x(2, 3, 3 * s, 3),)),
    "ZeroPad3d": lambda s: (nn.ZeroPad3d(1), (_x(1, 2, 2 * s, 3, 3),)),
    "ChannelShuffle": lambda s: (nn.ChannelShuffle(2), (_x(2, 4, 2 * s, 2),)),
    "PixelShuffle": lambda s: (nn.PixelShuffle(2), (_x(2, 8, 2 * s, 3),)),
    "PixelUnshuffle": lambda s: (nn.PixelUnshuffle(2), (_x(2, 2, 4 * s, 6),)),
    "Upsample": lambda s: (nn.Upsample(scale_factor=2, mode="bilinear"), (_x(2, 3, 3 * s, 3),)),
    "UpsamplingBilinear2d": lambda s: (nn.UpsamplingBilinear2d(scale_factor=2), (_x(2, 3, 3 * s, 3),)),
    "UpsamplingNearest2d": lambda s: (nn.UpsamplingNearest2d(scale_factor=2), (_x(2, 3, 3 * s, 3),)),
    "MaxUnpool1d": lambda s: (nn.MaxUnpool1d(2), _pooled(nn.MaxPool1d(2, return_indices=True), _x(2, 3, 6 * s))),
    "MaxUnpool2d": lambda s: (nn.MaxUnpool2d(2), _pooled(nn.MaxPool2d(2, return_indices=True), _x(1, 2, 4 * s, 4))),
    "MaxUnpool3d": lambda s: (nn.MaxUnpool3d(2), _pooled(nn.MaxPool3d(2, return_indices=True), _x(1, 1, 2 * s, 4, 4))),
    # distances
    "CosineSimilarity": lambda s: (nn.CosineSimilarity(), (_x(3 * s, 5), _x(3 * s, 5))),
    "PairwiseDistance": lambda s: (nn.PairwiseDistance(), (_x(3 * s, 5), _x(3 * s, 5))),
    # losses
    "BCELoss": lambda s: (nn.BCELoss(), (torch.rand(3, 4 * s) * 0.9 + 0.05, torch.rand(3, 4 * s))),
    "BCEWithLogitsLoss": lambda s: (nn.BCEWithLogitsLoss(pos_weight=torch.rand(4 * s)),
                                    (_x(3, 4 * s), torch.rand(3, 4 * s))),
    "CosineEmbeddingLoss": lambda s: (nn.CosineEmbeddingLoss(), (_x(3 * s, 5), _x(3 * s, 5),
                                                                 torch.tensor([1, -1, 1] * s))),
    "CrossEntropyLoss": lambda s: (nn.CrossEntropyLoss(label_smoothing=0.1), (_x(3 * s, 5), _classes(3 * s, 5))),
    "GaussianNLLLoss": lambda s: (nn.GaussianNLLLoss(), (_x(3 * s, 2), _x(3 * s, 2), torch.rand(3 * s, 2) + 0.1)),
    "HingeEmbeddingLoss": lambda s: (nn.HingeEmbeddingLoss(), (_x(3, 4 * s), torch.ones(3, 4 * s).neg())),
    "HuberLoss": lambda s: (nn.HuberLoss(), (_x(3, 4 * s), _x(3, 4 * s))),
    "KLDivLoss": lambda s: (nn.KLDivLoss(reduction="batchmean"), (_x(3, 4 * s).log_softmax(1), _x(3, 4 * s).softmax(1))),
    "L1Loss": lambda s: (nn.L1Loss(), (_x(3, 4 * s), _x(3, 4 * s))),
    "MSELoss": lambda s: (nn.MSELoss(), (_x(3, 4 * s), _x(3, 4 * s))),
    "MarginRankingLoss": lambda s: (nn.MarginRankingLoss(0.1), (_x(4 * s), _x(4 * s), torch.tensor([1.0, -1.0] * 2 * s))),
    "MultiLabelMarginLoss": lambda s: (nn.MultiLabelMarginLoss(), (_x(2 * s, 4), torch.tensor([[3, 0, -1, 1]] * 2 * s))),
    "MultiLabelSoftMarginLoss": lambda s: (nn.MultiLabelSoftMarginLoss(), (_x(3, 4 * s), torch.randint(0, 2, (3, 4 * s)))),
    "MultiMarginLoss": lambda s: (nn.MultiMarginLoss(), (_x(3 * s, 5), _classes(3 * s, 5))),
    "NLLLoss": lambda s: (nn.NLLLoss(ignore_index=1), (_x(4 * s, 5).log_softmax(1), _classes(4 * s, 5))),
    "NLLLoss2d": lambda s: (nn.NLLLoss2d(), (_x(2, 5, 2 * s, 2).log_softmax(1), torch.randint(0, 5, (2, 2 * s, 2)))),
    "PoissonNLLLoss": lambda s: (nn.PoissonNLLLoss(), (_x(3, 4 * s), torch.rand(3, 4 * s) * 3)),
    "SmoothL1Loss": lambda s: (nn.SmoothL1Loss(), (_x(3, 4 * s), _x(3, 4 * s))),
    "SoftMarginLoss": lambda s: (nn.SoftMarginLoss(), (_x(3, 4 * s), torch.tensor([1.0, -1.0]).repeat(3, 2 * s))),
    "TripletMarginLoss": lambda s: (nn.TripletMarginLoss(), (_x(3 * s, 5), _x(3 * s, 5), _x(3 * s, 5))),
    "TripletMarginWithDistanceLoss": lambda s: (nn.TripletMarginWithDistanceLoss(), (_x(3 * s, 5), _x(3 * s, 5),
                                                                                   _x(3 * s, 5))),
    "CTCLoss": lambda s: (nn.CTCLoss(), (_x(6 * s, 2, 4).log_softmax(2), torch.randint(1, 4, (2, 3)),
                                         torch.tensor([6 * s, 5 * s]), torch.tensor([3, 2]))),
    "AdaptiveLogSoftmaxWithLoss": lambda s: (nn.AdaptiveLogSoftmaxWithLoss(8, 10, [4, 7]),
                                             (_x(3 * s, 8), _classes(3 * s, 10))),
    "LinearCrossEntropyLoss": lambda s: (nn.LinearCrossEntropyLoss(6, 5), (_x(3 * s, 6), _classes(3 * s, 5))),
    # recurrent layers
    "RNN": lambda s: (nn.RNN(4, 5, num_layers=2), (_x(3 * s, 2, 4),)),
    "LSTM": lambda s: (nn.LSTM(4, 5, batch_first=True), (_x(2, 3 * s, 4),)),
    "GRU": lambda s: (nn.GRU(4, 5, bidirectional=True), (_x(3 * s, 2, 4),)),
    "RNNCell": lambda s: (nn.RNNCell(4, 5), (_x(2 * s, 4),)),
    "LSTMCell": lambda s: (nn.LSTMCell(4, 5), (_x(2 * s, 4),)),
    "GRUCell": lambda s: (nn.GRUCell(4, 5), (_x(2 * s, 4),)),
    # transformers
    "TransformerEncoderLayer": lambda s: (nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                          (_x(2, 3 * s, 8),)),
    "TransformerDecoderLayer": lambda s: (nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True),
                                          (_x(2, 3 * s, 8), _x(2, 4, 8))),
    "TransformerEncoder": lambda s: (nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 2,
                                                           enable_nested_tensor=False), (_x(3 * s, 2, 8),)),
    "TransformerDecoder": lambda s: (nn.TransformerDecoder(nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0), 2),
                                     (_x(3 * s, 2, 8), _x(4, 2, 8))),
    "Transformer": lambda s: (nn.Transformer(8, 2, 1, 1, 16, dropout=0.0), (_x(3 * s, 2, 8), _x(4, 2, 8))),
}

RANDOM = {"AlphaDropout", "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "FeatureAlphaDropout", "RReLU",
          "FractionalMaxPool2d", "FractionalMaxPool3d"}

NOT_SWEPT = {
    "Module": "the base class", "Container": "a deprecated alias of Module", "ModuleDict": "a container",
    "ModuleList": "a container", "ParameterDict": "a container", "ParameterList": "a container",
    "RNNBase": "the base of RNN, LSTM and GRU (swept)", "RNNCellBase": "the base of the cells (swept)",
}

# ops still run on the CPU (with the one warning) when a module runs on the device, and why
ON_THE_CPU = {
    "AdaptiveLogSoftmaxWithLoss": {"aten.nonzero.default": "its output's shape depends on the data",
                                   "aten.index.Tensor_out": "indexing by the rows nonzero found"},
    "CTCLoss": {"aten._ctc_loss.default": "no lowering", "aten._ctc_loss_backward.default": "no lowering"},
    "EmbeddingBag": {"aten._embedding_bag_backward.default": "no lowering"},
    "FractionalMaxPool2d": {"aten.fractional_max_pool2d.output": "random windows without a device recipe",
                            "aten.fractional_max_pool2d_backward.grad_input": "no lowering"},
    "FractionalMaxPool3d": {"aten.fractional_max_pool3d.output": "random windows without a device recipe",
                            "aten.fractional_max_pool3d_backward.default": "no lowering"},
    "MultiLabelMarginLoss": {"aten.multilabel_margin_loss_forward.default":
                             "torch 2.13's decomposition of it disagrees with eager PyTorch",
                             "aten.multilabel_margin_loss_backward.default": "no lowering"},
    "MultiMarginLoss": {"aten.multi_margin_loss_backward.default": "no lowering"},
    "RReLU": {"aten.rrelu_with_noise.default": "a random op without a device recipe"},
}
