"""Hunt 4, integrations and torch utilities on a whole fused module: each gives each
model's own result, or an hftc error saying what to do instead of torch's or a library's
own failure (or a silently unchanged module)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import hftc
from hftc.errors import FusionNotImplementedError, FusionTypeError, UnsupportedOperatorError


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def _models(n: int = 3) -> list[nn.Module]:
    torch.manual_seed(0)
    return [Net().eval() for _ in range(n)]


X = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(1))


def _own(models, x=X):
    return torch.stack([m(x) for m in models])


def test_convert_sync_batchnorm_on_a_fused_module_is_refused_and_changes_nothing():
    # torch put a SyncBatchNorm holding the stacked statistics in the fused tree, which the
    # fused program never syncs; converting each model before fusing is what works
    models = _models()
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    with pytest.raises(UnsupportedOperatorError, match=r"convert_sync_batchnorm\(m\) for m in"):
        nn.SyncBatchNorm.convert_sync_batchnorm(fused)
    assert type(fused.bn).__name__ == "StackedBatchNorm2d"
    torch.testing.assert_close(fused(X), _own(models))
    converted = [nn.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(m)) for m in models]
    torch.testing.assert_close(hftc.fuse(converted)(X), _own(converted))


@pytest.mark.parametrize("how", ["dynamic", "static"])
def test_quantization_of_a_fused_module_is_refused_not_silently_float(how):
    # quantize_dynamic's module swap matched no stacked module: float results came back
    fused = hftc.fuse(_models())
    with pytest.raises(UnsupportedOperatorError, match="Quantize each model") as info:
        if how == "dynamic":
            torch.ao.quantization.quantize_dynamic(fused, {nn.Linear}, dtype=torch.qint8)
        else:
            fused.qconfig = torch.ao.quantization.get_default_qconfig("x86")
    assert __file__ in str(info.value)  # the user's line, not typing_extensions' wrapper
    assert not hasattr(fused, "qconfig") and not hasattr(fused.fc, "qconfig")


@pytest.mark.parametrize("called", [False, True])
def test_torch_jit_script_of_a_fused_module_says_what_to_do(called):
    # TorchScript's bare "Unknown type annotation: 'str'" from deep in torch.jit
    models = _models()
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    if called:
        fused(X)
    with pytest.raises(FusionNotImplementedError, match=r"torch\.compile\(fused\)") as info:
        torch.jit.script(fused)
    assert __file__ in str(info.value)
    torch.testing.assert_close(fused(X), _own(models))
    scripted = [torch.jit.script(m) for m in fused.unfuse()]
    torch.testing.assert_close(_own(scripted), _own(models))


def test_a_plain_transformers_trainer_points_to_fused_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import hftc.hf as hftc_hf

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=16,
                                     max_position_embeddings=16, num_labels=3)
    models = [transformers.BertForSequenceClassification(config) for _ in range(2)]
    rows = [{"input_ids": torch.randint(0, 40, (6,)), "labels": torch.tensor(i % 3)}
            for i in range(4)]
    fused = hftc.fuse(models, example_inputs=(torch.stack([r["input_ids"] for r in rows]),))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[],
                                          use_cpu=True, save_strategy="no", disable_tqdm=True)

    class MyTrainer(transformers.Trainer):
        pass

    for trainer in (transformers.Trainer, MyTrainer):
        with pytest.raises(FusionTypeError, match="hftc.integrations.hf.FusedTrainer") as info:
            trainer(model=fused, args=args, train_dataset=rows)
        assert __file__ in str(info.value)

    class MyFusedTrainer(hftc_hf.FusedTrainer):
        pass

    MyFusedTrainer(model=fused, args=args, train_dataset=rows).train()


# ---------------------------------------------------------------- Lightning

def _lightning():
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    import test_lightning

    return test_lightning


def _lightning_trainer(folder, epochs, callbacks):
    import lightning.pytorch as pl

    return pl.Trainer(max_epochs=epochs, default_root_dir=folder, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                      deterministic=True, callbacks=callbacks)


@pytest.mark.parametrize("stock", ["EarlyStopping", "ModelCheckpoint"])
def test_lightnings_own_callbacks_on_a_per_model_metric_name_the_per_model_ones(tmp_path,
                                                                              stock):
    # Lightning's "Early stopping conditioned on metric `val_loss` which is not available"
    # / "could not find the monitored key" over a module logging val_loss/model_k
    tl = _lightning()
    from lightning.pytorch import callbacks

    callback = (callbacks.EarlyStopping("val_loss") if stock == "EarlyStopping"
                else callbacks.ModelCheckpoint(dirpath=tmp_path, monitor="val_loss"))
    per_model = "PerModelEarlyStopping" if stock == "EarlyStopping" else "PerModelCheckpoint"
    with pytest.raises(hftc.errors.FusionArgumentError, match=f"hftc.lightning.{per_model}"):
        _lightning_trainer(tmp_path, 1, [callback]).fit(tl.Fused(tl._models()), *tl._loaders())


def _unshuffled_loaders():
    from hftc.sweep.digits import data as digits_data

    (x, y), (xv, yv) = digits_data(n_train=256, n_val=96)
    train = torch.utils.data.TensorDataset(x.double(), y)
    val = torch.utils.data.TensorDataset(xv.double(), yv)
    return (torch.utils.data.DataLoader(train, batch_size=32),  # (a resume reshuffles)
            torch.utils.data.DataLoader(val, batch_size=48))


def test_resuming_after_per_model_early_stopping_shrank_the_array_goes_on_as_the_whole_run(
        tmp_path):
    # refused with FusionArgumentError before ("resuming after models left the array is
    # not supported"); saved at epoch 3, after models 1 and 2 left at epoch 2
    tl = _lightning()
    import hftc.lightning as hl
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(name, epochs, ckpt_path=None):
        stopping = hl.PerModelEarlyStopping("val_loss", patience=tl.PATIENCE,
                                            min_delta=tl.MIN_DELTA)
        files = hl.PerModelCheckpoint(tmp_path / name / "files")
        module = tl.Fused(tl._models())
        _lightning_trainer(tmp_path / name, epochs, [
            ModelCheckpoint(dirpath=tmp_path / name, save_last=True), stopping, files,
        ]).fit(module, *_unshuffled_loaders(), ckpt_path=ckpt_path)
        return stopping, module, files

    whole, whole_module, whole_files = run("whole", tl.MAX_EPOCHS)
    assert whole.stopped_epochs and whole_module.model_ids != [0, 1, 2]
    run("resumed", 3)
    resumed, module, files = run("resumed", tl.MAX_EPOCHS, "last")
    assert resumed.stopped_epochs == whole.stopped_epochs
    assert module.model_ids == whole_module.model_ids
    assert module.fused.num_models == len(module.model_ids)
    for k in range(len(tl.LRS)):
        mine = torch.load(files.path(k), weights_only=True)
        theirs = torch.load(whole_files.path(k), weights_only=True)
        for name, value in theirs.items():
            torch.testing.assert_close(mine[name], value, rtol=0, atol=0, msg=(k, name))


def test_resuming_into_a_module_of_other_models_says_what_to_make(tmp_path):
    tl = _lightning()
    from lightning.pytorch.callbacks import ModelCheckpoint

    module = tl.Fused(tl._models())
    _lightning_trainer(tmp_path, 1, [ModelCheckpoint(dirpath=tmp_path, save_last=True)]).fit(
        module, *_unshuffled_loaders())
    other = tl.Fused(tl._models()[:2])
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=False)
    with pytest.raises(hftc.errors.FusionArgumentError, match="the same list in the same order"):
        other.on_load_checkpoint(checkpoint)


def test_a_refused_old_style_weight_norm_leaves_the_fused_module_as_it_was():
    # torch.nn.utils.weight_norm took the stacked weight out of _parameters before the
    # refusal (at its hook): the fused module then ran without it, its outputs wrong
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)) for _ in range(3)]
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    names = [name for name, _ in fused.named_parameters()]
    x = torch.randn(2, 4)
    with pytest.warns(FutureWarning), \
            pytest.raises(UnsupportedOperatorError, match="Parametrize each model before"):
        torch.nn.utils.weight_norm(fused[0])
    assert [name for name, _ in fused.named_parameters()] == names
    torch.testing.assert_close(fused(x), _own(models, x))


def test_fuse_modules_on_a_fused_module_says_to_fuse_each_models_first():
    # torch's bare AssertionError "did not find fuser method for: (StackedConv2d, ...)"
    class ConvBnRelu(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU()

        def forward(self, x):
            return self.relu(self.bn(self.conv(x)))

    torch.manual_seed(0)
    models = [ConvBnRelu().eval() for _ in range(3)]
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    with pytest.raises(UnsupportedOperatorError, match=r"Fuse each model's modules before"):
        torch.ao.quantization.fuse_modules(fused, [["conv", "bn", "relu"]], inplace=True)
    assert type(fused.conv).__name__ == "StackedConv2d"
    folded = [torch.ao.quantization.fuse_modules(m, [["conv", "bn", "relu"]]) for m in models]
    torch.testing.assert_close(hftc.fuse(folded)(X), _own(models))


@pytest.mark.parametrize("trace", ["symbolic_trace", "prepare_fx", "optimization.fuse"])
def test_fx_symbolic_tracing_of_a_fused_module_says_what_to_do(trace):
    # torch's "Proxy object cannot be iterated" (forward's *args) from deep in fx
    fused = hftc.fuse(_models())
    with pytest.raises(FusionNotImplementedError, match="Trace each model") as info:
        if trace == "symbolic_trace":
            torch.fx.symbolic_trace(fused)
        elif trace == "prepare_fx":
            from torch.ao.quantization import get_default_qconfig_mapping, quantize_fx

            quantize_fx.prepare_fx(fused, get_default_qconfig_mapping("x86"), (X,))
        else:
            from torch.fx.experimental import optimization

            optimization.fuse(fused)
    assert __file__ in str(info.value)

    class Wrapper(nn.Module):  # (a fused module inside a model traced: its forward)
        def __init__(self) -> None:
            super().__init__()
            self.fused = fused

        def forward(self, x):
            return self.fused(x)

    with pytest.raises(FusionNotImplementedError, match="Trace each model"):
        torch.fx.symbolic_trace(Wrapper())


def test_convert_conv2d_weight_memory_format_leaves_the_stacked_convs_as_fused_to_does():
    # torch's "required rank 4 tensor to use channels_last format" on the 5-d stacked weight
    models = _models()
    fused = hftc.fuse([copy.deepcopy(m) for m in models])
    assert torch.nn.utils.convert_conv2d_weight_memory_format(fused, torch.channels_last) \
        is fused
    torch.testing.assert_close(fused(X), _own(models))
    plain = nn.Sequential(nn.Conv2d(3, 4, 3), fused)  # (torch's own still converts theirs)
    torch.nn.utils.convert_conv2d_weight_memory_format(plain, torch.channels_last)
    assert plain[0].weight.is_contiguous(memory_format=torch.channels_last)
