"""The benchmark workloads: unmodified models (``zoo.py``), as a researcher would write them.

Each :class:`Workload` says how to build one model, one batch of inputs and
targets, and the loss of one model's output.  The sizes follow the issue
(MLP 64-128-128-10 and LeNet-5 at batch 64, ResNet-18 and MobileNetV2 at 32x32,
a PointNet classifier, a 2-layer Transformer encoder at sequence length 64), then the
models users train (issue 29): ConvNeXt- and EfficientNet-like nets with stochastic
depth, fast_neural_style's TransformerNet, word_language_model's LSTM and nanoGPT;
where the 2-core CPU this suite was written on cannot afford the full size, the
batch, the number of points or the values of N are reduced, and ``note`` says so
(docs/BENCHMARKS.md repeats the notes next to the numbers).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .zoo import (
    GPT,
    MLP,
    ConvNeXt,
    EfficientNet,
    LeNet5,
    MobileNetV2,
    PointNetCls,
    RNNModel,
    StockTransformerClassifier,
    TransformerClassifier,
    TransformerNet,
    resnet18,
)

# --------------------------------------------------------------------------- the table


def _first(out):
    """A model's prediction: PointNet returns (log-probs, transform)."""
    return out[0] if isinstance(out, tuple) else out


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """A language model's loss: cross-entropy over every token (nanoGPT's
    ``F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))``)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def image_pair(w: Workload, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """An image-to-image batch: input images and the target images the loss compares with."""
    x = torch.randn(w.batch, *w.input_shape, generator=g)
    return x, torch.randn(w.batch, *w.input_shape, generator=g)


def next_tokens(w: Workload, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """A language-model batch: token ids ``[batch, *input_shape]`` and the next token of
    each, of the same shape (nanoGPT's ``get_batch``: ``y = data[i + 1: i + 1 + T]``)."""
    data = torch.randint(0, w.num_classes, (w.batch, *w.input_shape[:-1],
                                            w.input_shape[-1] + 1), generator=g)
    return data[..., :-1].contiguous(), data[..., 1:].contiguous()


def next_tokens_seq_first(w: Workload, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """word_language_model's batch: ``get_batch`` of a ``[T, B]`` column-batched corpus,
    the targets flattened to ``[T * B]`` as its ``criterion(output, targets)`` takes them."""
    seq_len = w.input_shape[0]
    data = torch.randint(0, w.num_classes, (seq_len + 1, w.batch), generator=g)
    return data[:-1].contiguous(), data[1:].reshape(-1)


@dataclass
class Workload:
    """One model family of the benchmark and how to feed and score it."""

    name: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]          # one sample, without the batch dim
    batch: int
    num_classes: int
    sizes: tuple[int, ...]                # values of N in the full run
    quick_sizes: tuple[int, ...]          # values of N in --quick
    rounds: int = 10                      # timed rounds in the full run
    warmup: int = 2                       # untimed steps after the first, per contender
    compile_sizes: tuple[int, ...] = ()   # values of N for hftc+compile in the full run
    log_probs: bool = False               # the model ends in log_softmax: NLL loss
    int_input: int | None = None          # token ids in [0, int_input) instead of floats
    note: str = ""
    #: One model's loss ``criterion(prediction, target)``; None: cross-entropy (NLL with
    #: ``log_probs``).  hftc's contender takes it per model with ``hftc.per_model``.
    criterion: Callable[[Tensor, Tensor], Tensor] | None = None
    #: Builds one batch ``(inputs, targets)`` from ``(workload, generator)``; None: random
    #: inputs (token ids with ``int_input``) and class labels.
    batch_fn: Callable[[Workload, torch.Generator], tuple[Tensor, Tensor]] | None = None
    #: The model reads its input's sizes in Python (nanoGPT's ``assert t <= block_size``):
    #: hftc is given the batch as ``example_inputs``, as its error message asks a user to.
    example_inputs: bool = False
    extra: dict = field(default_factory=dict)
    #: What changes on a GPU (``on("cuda")``): the full sizes the CPU cannot afford.
    gpu: dict = field(default_factory=dict)

    def on(self, device: str | torch.device) -> Workload:
        """This workload as run on ``device``: on a GPU, with its ``gpu`` overrides."""
        if torch.device(device).type == "cpu" or not self.gpu:
            return self
        return dataclasses.replace(self, **self.gpu, gpu={})

    def inputs(self, generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        g = generator or torch.Generator().manual_seed(0)
        if self.batch_fn is not None:
            return self.batch_fn(self, g)
        if self.int_input is not None:
            x = torch.randint(0, self.int_input, (self.batch, *self.input_shape), generator=g)
        else:
            x = torch.randn(self.batch, *self.input_shape, generator=g)
        y = torch.randint(0, self.num_classes, (self.batch,), generator=g)
        return x, y

    def loss(self, out, y: Tensor) -> Tensor:
        """One model's loss (stock contenders): :attr:`loss_fn` of its prediction."""
        return self.loss_fn(_first(out), y)

    @property
    def loss_fn(self) -> Callable[..., Tensor]:
        """The criterion: ``criterion``, else cross-entropy, or NLL of log-probs."""
        if self.criterion is not None:
            return self.criterion
        return F.nll_loss if self.log_probs else F.cross_entropy


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    Workload("mlp", MLP, (64,), 64, 10, sizes=(1, 2, 4, 8, 16, 32, 64),
             quick_sizes=(1, 8, 32), rounds=15, compile_sizes=(4, 32)),
    Workload("lenet5", LeNet5, (1, 28, 28), 64, 10, sizes=(1, 2, 4, 8, 16, 32),
             quick_sizes=(1, 16), rounds=10, compile_sizes=(16,)),
    Workload("pointnet", PointNetCls, (3, 128), 8, 40, sizes=(1, 2, 4, 8),
             quick_sizes=(1, 4), rounds=8, log_probs=True, compile_sizes=(4,),
             note="128 points and batch 8 instead of 1024 points and batch 32 (CPU time: "
                  "the full size is 28 GFLOP per model step)",
             gpu={"input_shape": (3, 1024), "batch": 32, "sizes": (1, 2, 4, 8, 16, 32),
                  "note": "1024 points, batch 32"}),
    Workload("resnet18", resnet18, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
             quick_sizes=(2,), rounds=6, warmup=1,
             note="batch 8 (CPU time: 27 GFLOP per model step); N <= 4; no torch.compile "
                  "(minutes of compile per N)",
             gpu={"batch": 128, "sizes": (1, 2, 4, 8, 16), "rounds": 8, "compile_sizes": (4,),
                  "note": "batch 128"}),
    Workload("mobilenet_v2", MobileNetV2, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
             quick_sizes=(2,), rounds=5, warmup=1,
             note="batch 8 (CPU time); N <= 4; no torch.compile (minutes of compile per N)",
             gpu={"batch": 128, "sizes": (1, 2, 4, 8, 16), "rounds": 8, "compile_sizes": (4,),
                  "note": "batch 128"}),
    Workload("transformer", TransformerClassifier, (64,), 16, 10, sizes=(1, 2, 4, 8, 16),
             quick_sizes=(1, 4), rounds=8, int_input=1000, compile_sizes=(4,),
             gpu={"batch": 64, "sizes": (1, 2, 4, 8, 16, 32),
                  "note": "d_model 128, 4 heads, FFN 512, vocab 1000, batch 64"},
             note="d_model 128, 4 heads, FFN 512, vocab 1000, batch 16; attention written "
                  "with nn.Linear + matmul + softmax"),
    Workload("transformer_stock", StockTransformerClassifier, (64,), 16, 10, sizes=(1, 4),
             quick_sizes=(), rounds=4, int_input=1000,
             note="nn.TransformerEncoderLayer, fused by hftc's attention rules "
                  "(nn.MultiheadAttention as batched matmuls over N*heads); no hand-fused "
                  "version"),
    # ----- the models users train (issue 29), sized for one core of the 2-core CPU; N <= 4
    # (hftc's autotuned build takes ~80 s at N = 4 there)
    Workload("convnext", ConvNeXt, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
             quick_sizes=(2,), rounds=6, warmup=1,
             note="ConvNeXt blocks (torchvision's CNBlock: depthwise 7x7, LayerNorm, Linear "
                  "4x, GELU, layer scale, StochasticDepth 'row' up to p = 0.1) in 3 stages "
                  "of 2 blocks, widths 32-64-128, 2x2 stem on 3x32x32, batch 8 (ConvNeXt-"
                  "Tiny: 4 stages of 3-3-9-3 blocks, 96-768, 4x4 stem on 224x224)",
             gpu={"factory": functools.partial(ConvNeXt, ConvNeXt.TINY, stem_stride=4,
                                                num_classes=1000),
                  "input_shape": (3, 224, 224), "num_classes": 1000, "batch": 32,
                  "sizes": (1, 2, 4), "rounds": 5,
                  "note": "ConvNeXt-Tiny (3-3-9-3 blocks, 96-768), 224x224, batch 32"}),
    Workload("efficientnet", EfficientNet, (3, 32, 32), 8, 10, sizes=(1, 2, 4),
             quick_sizes=(2,), rounds=6, warmup=1,
             note="MBConv blocks (1x1 expand, depthwise 3x3/5x5, squeeze-and-excitation, "
                  "1x1 project, BatchNorm, SiLU, StochasticDepth 'row' up to p = 0.2) in 5 "
                  "stages of 1-2-2-2-1 blocks, expansion 4, widths 16-96, head 384, stem "
                  "stride 1 on 3x32x32, batch 8 (EfficientNet-B0: 7 stages of 16 blocks, "
                  "expansion 6, widths 16-320, head 1280, 224x224)",
             gpu={"factory": functools.partial(EfficientNet, EfficientNet.B0, last_channel=1280,
                                                num_classes=1000, stem_stride=2),
                  "input_shape": (3, 224, 224), "num_classes": 1000, "batch": 64,
                  "sizes": (1, 2, 4, 8), "rounds": 5,
                  "note": "EfficientNet-B0, 224x224, batch 64"}),
    Workload("style_transfer", functools.partial(TransformerNet, (16, 32, 64), 3),
             (3, 64, 64), 2, 0, sizes=(1, 2, 4), quick_sizes=(2,), rounds=6, warmup=1,
             criterion=F.mse_loss, batch_fn=image_pair,
             note="fast_neural_style's TransformerNet (ReflectionPad2d convs, "
                  "InstanceNorm2d(affine=True), residual blocks, nearest-upsampling convs) "
                  "with widths 16-32-64 and 3 residual blocks on 64x64 images, batch 2; loss: "
                  "MSE against a target image (the real net: 32-64-128, 5 blocks, 256x256, "
                  "batch 4, VGG perceptual loss)",
             gpu={"factory": TransformerNet, "input_shape": (3, 256, 256), "batch": 4,
                  "note": "TransformerNet 32-64-128, 5 residual blocks, 256x256, batch 4"}),
    Workload("lstm_lm", RNNModel, (35,), 20, 2000, sizes=(1, 2, 4), quick_sizes=(2,),
             rounds=6, warmup=1, log_probs=True, batch_fn=next_tokens_seq_first,
             note="word_language_model's RNNModel: Embedding 200, 2-layer nn.LSTM 200, "
                  "dropout 0.2, Linear decoder, log_softmax + NLL; bptt 35, batch 20, "
                  "vocabulary 2,000 (Wikitext-2: 33,278); every batch from the zero state",
             gpu={"factory": functools.partial(RNNModel, ntoken=33278), "num_classes": 33278,
                  "note": "vocabulary 33,278 (Wikitext-2), bptt 35, batch 20"}),
    Workload("gpt", GPT, (64,), 8, 65, sizes=(1, 2, 4), quick_sizes=(2,), rounds=6,
             warmup=1, criterion=token_cross_entropy, batch_fn=next_tokens,
             example_inputs=True,
             note="nanoGPT (CausalSelfAttention with F.scaled_dot_product_attention("
                  "is_causal=True), GELU MLP, pre-LayerNorm, wte tied to lm_head), 2 layers, "
                  "4 heads, 128 wide, block 64, vocabulary 65 (shakespeare_char), batch 8; "
                  "fused from example inputs (its forward asserts on the sequence length); "
                  "shakespeare_char's config: 6 layers, 6 heads, 384, block 256, batch 64",
             gpu={"factory": functools.partial(GPT, block_size=256, n_layer=6, n_head=6,
                                                n_embd=384, dropout=0.2),
                  "input_shape": (256,), "batch": 64,
                  "note": "shakespeare_char's config: 6 layers, 6 heads, 384, block 256, "
                          "batch 64, dropout 0.2"}),
]}
