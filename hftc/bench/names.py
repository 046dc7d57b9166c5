"""The benchmark suite's workload and contender names, for ``hftc bench --help``: this module
imports nothing, so the help answers without torch (tests/test_cli.py checks the names
against :data:`hftc.bench.workloads.WORKLOADS` and :data:`hftc.bench.contenders.CONTENDERS`).
"""

WORKLOADS = {
    "mlp": "3-layer MLP 64-128-128-10",
    "lenet5": "LeNet-5 on 28x28",
    "pointnet": "PointNet classifier",
    "resnet18": "ResNet-18 on 32x32",
    "mobilenet_v2": "MobileNetV2 on 32x32",
    "transformer": "transformer classifier, attention from nn.Linear + matmul",
    "transformer_stock": "nn.TransformerEncoderLayer classifier",
    "convnext": "ConvNeXt-like blocks with stochastic depth",
    "efficientnet": "EfficientNet-like MBConv net with squeeze-and-excitation",
    "style_transfer": "fast_neural_style TransformerNet (InstanceNorm, upsampling)",
    "lstm_lm": "word_language_model 2-layer LSTM",
    "gpt": "small nanoGPT",
}

CONTENDERS = {
    "serial": "the N models one after another",
    "concurrent": "N processes, one model each",
    "concurrent-mps": "concurrent under CUDA MPS (a GPU's only)",
    "torch.func": "torch.func.stack_module_state + vmap",
    "hand-fused": "models fused by hand, HFTA-style",
    "hftc": "hftc.fuse",
    "hftc+compile": "torch.compile of hftc.fuse's module",
    "hftc+step": "hftc.compile_step: the whole step as one CUDA graph (eager on the CPU)",
    "hftc+ckpt": "hftc.fuse(checkpoint=True): activations recomputed in backward (opt-in)",
    "hftc+defaults": "hftc.fuse(models) with no options, as a new user calls it (opt-in)",
}
