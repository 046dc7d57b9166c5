"""A user's own training loop and the trainer integrations, probed as scripts are written
(pytorch/examples' mnist loop, HF Trainer, Lightning): each model's training equal to its
own stock loop, and what a loop does to the fused module (saving it whole, ...) working.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc


class MnistNet(nn.Module):
    """pytorch/examples' mnist Net, small: F.max_pool2d is torch's boolean_dispatch
    function, whose __qualname__ ('boolean_dispatch.<locals>.fn') pickle cannot find."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.adaptive_max_pool2d(x, 6)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


def _mnist_models(n=3):
    torch.manual_seed(0)
    return [MnistNet().double() for _ in range(n)]


def test_torch_save_of_a_fused_mnist_net_after_training_loads_and_trains_on(tmp_path):
    # torch.save(fused) raised "Can't pickle local object 'boolean_dispatch.<locals>.fn'":
    # the kept fx graph's call_function targets were pickled by their qualified name.
    fused = hftc.fuse(_mnist_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3], momentum=0.9)
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 14, 14, dtype=torch.float64), torch.randint(0, 10, (8,))
    for _ in range(2):
        opt.zero_grad()
        hftc.per_model(F.nll_loss)(fused(x), y).sum().backward()
        opt.step()
    torch.save(fused, tmp_path / "fused.pt")
    loaded = torch.load(tmp_path / "fused.pt", weights_only=False)
    assert torch.equal(loaded(x), fused(x))
    twin = copy.deepcopy(fused)  # the original still pickles and copies as before
    assert torch.equal(twin(x), fused(x))
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    # the loaded module trains as the original does, each model its own
    opt2 = hftc.optim.SGD(loaded.parameters(), lr=[0.1, 0.2, 0.3])
    hftc.per_model(F.nll_loss)(loaded(x), y).sum().backward()
    opt2.step()
    alone = fused.unfuse()[2]
    F.nll_loss(alone(x), y).backward()
    torch.optim.SGD(alone.parameters(), lr=0.3).step()
    torch.testing.assert_close(loaded.unfuse()[2](x), alone(x))


def test_lightning_hftc_reduce_lr_on_plateau_follows_each_models_metric(tmp_path):
    # configure_optimizers returning {"scheduler": hftc.optim.ReduceLROnPlateau(opt),
    # "monitor": "val_loss"} was refused by Lightning ("doesn't follow PyTorch's
    # LRScheduler API"), and there is no "val_loss" beside "val_loss/model_k" to read.
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    import test_lightning as tl

    plateau = dict(patience=0, factor=0.5, threshold=0.01, threshold_mode="abs")

    class Fused(tl.Fused):
        def configure_optimizers(self):
            opt = hftc.optim.SGD(self.fused.parameters(), lr=tl.LRS, momentum=tl.MOMENTA)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": hftc.optim.ReduceLROnPlateau(opt, **plateau), "monitor": "val_loss"}}

    class Alone(tl.Alone):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=self.momentum)
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **plateau),
                "monitor": "val_loss"}}

    class Rates(tl.Callback):
        def __init__(self):
            self.epochs = []

        def on_train_epoch_start(self, trainer, pl_module):
            ids = getattr(pl_module, "model_ids", [0])
            groups = trainer.optimizers[0].param_groups
            self.epochs.append(dict(zip(ids, (g["lr"] for g in groups))))

    models = tl._models()
    stopping = tl.hl.PerModelEarlyStopping("val_loss", patience=2, min_delta=tl.MIN_DELTA)
    rates, record = Rates(), tl.Record()
    tl._trainer([stopping, rates, record], tmp_path).fit(Fused(models), *tl._loaders())
    assert stopping.stopped_epochs  # models left the array: the monitor was re-pointed
    reduced = False
    for k, model in enumerate(models):
        alone_rates, alone_record = Rates(), tl.Record()
        early = tl.EarlyStopping("val_loss", patience=2, min_delta=tl.MIN_DELTA)
        tl._trainer([early, alone_rates, alone_record], tmp_path).fit(
            Alone(model, tl.LRS[k], tl.MOMENTA[k]), *tl._loaders())
        mine = [epoch[k] for epoch in rates.epochs if k in epoch]
        theirs = [epoch[0] for epoch in alone_rates.epochs]
        assert mine == pytest.approx(theirs, rel=1e-12), k
        reduced |= theirs[-1] < theirs[0]
        losses = [m[f"val_loss/model_{k}"] for m, ids in record.epochs if k in ids]
        assert losses == pytest.approx([m["val_loss"] for m, _ in alone_record.epochs],
                                       rel=1e-9), k
    assert reduced  # the test means something: some model's rate was cut


def test_a_mean_of_each_models_own_losses_is_warned_as_per_models_mean_is():
    # torch.stack([F.nll_loss(o, y) for o in out]).mean() (the Lightning guide's way of
    # making each model's loss, then a mean) divided each model's gradient by N, silently:
    # only hftc.per_model(...)(out, y).mean() was warned of.
    import warnings

    fused = hftc.fuse(_mnist_models())
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 14, 14, dtype=torch.float64), torch.randint(0, 10, (8,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fused(x)
        torch.stack([F.nll_loss(o, y) for o in out]).sum().backward()  # right: no warning
        out = fused(x)
        torch.stack([F.nll_loss(o, y) for o in out]).mean().backward()
        F.nll_loss(fused(x)[0], y, reduction="none").mean().backward()  # a batch mean
    usage = [w for w in caught if issubclass(w.category, hftc.UsageWarning)]
    assert len(usage) == 1, [str(w.message) for w in usage]
    assert usage[0].filename == __file__ and ".sum()" in str(usage[0].message)
    assert "divides each model's gradient by 3" in str(usage[0].message)


def test_an_ema_of_a_fused_module_that_models_left_is_refused_not_broadcast():
    # After hftc.EarlyStopping / keep_models cut the array to [2], an AveragedModel made
    # of the three went on: torch's lerp broadcast model 2's [1, ...] weights into the
    # averages of models 0 and 1 and left model 2's own average as it was.
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    fused = hftc.fuse(_mnist_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    ema = AveragedModel(fused, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 14, 14, dtype=torch.float64), torch.randint(0, 10, (8,))
    hftc.per_model(F.nll_loss)(fused(x), y).sum().backward()
    opt.step()
    ema.update_parameters(fused)  # the same models: torch's own update
    hftc.keep_models(fused, [2], optimizers=[opt])
    before = [p.clone() for p in ema.parameters()]
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"models \[2\].*models \[0, 1, 2\].*keep_models\(ema.module, \[2\]\)"):
        ema.update_parameters(fused)
    assert all(torch.equal(a, b) for a, b in zip(before, ema.parameters()))
    hftc.keep_models(ema.module, [2])  # what it says to do: then each average its own
    ema.update_parameters(fused)
    want = 0.9 * before[0][2] + 0.1 * fused.get_parameter("conv1.weight")[0]
    torch.testing.assert_close(ema.module.get_parameter("conv1.weight")[0], want)


def test_a_compile_step_made_before_early_stopping_cut_the_array_says_to_make_it_again():
    # hftc.EarlyStopping dropped a model; the step made for the three then said "the loss
    # nll_loss gave shape [2] for the 3 fused models ... give a loss reduced to a scalar",
    # which sends the user to the wrong line.
    fused = hftc.fuse(_mnist_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    step = hftc.compile_step(fused, F.nll_loss, opt, clip_grad_norm=[0.1, 0.2, 0.3])
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 14, 14, dtype=torch.float64), torch.randint(0, 10, (8,))
    step(x, y)
    stopper = hftc.EarlyStopping(fused, patience=1)
    stopper.step(torch.tensor([1.0, 1.0, 1.0]))
    stopper.step(torch.tensor([0.5, 2.0, 0.5]))  # model 1 stops, leaves the array
    assert fused.model_ids == [0, 2]
    weights = [p.clone() for p in fused.parameters()]
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"made for models \[0, 1, 2\].*now holds models \[0, 2\].*"
                             r"hftc.compile_step\(fused, "):
        step(x, y)
    assert all(torch.equal(a, b) for a, b in zip(weights, fused.parameters()))
    step = hftc.compile_step(fused, F.nll_loss, opt, clip_grad_norm=[0.1, 0.3])
    assert step(x, y).shape == (2,)


def test_a_grad_scaler_of_the_array_before_keep_models_says_what_to_do():
    # A bare ValueError ("got 2 per-model losses but the scaler has 3 models") from hftc's
    # internals, naming neither keep_models nor the fix.
    fused = hftc.fuse(_mnist_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3])
    scaler = hftc.amp.GradScaler()
    torch.manual_seed(1)
    x, y = torch.randn(8, 1, 14, 14, dtype=torch.float64), torch.randint(0, 10, (8,))
    scaler.scale(hftc.per_model(F.nll_loss)(fused(x), y)).sum().backward()
    scaler.step(opt)
    scaler.update()
    hftc.keep_models(fused, [0, 2], optimizers=[opt])
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"2 per-model losses but the scaler has 3.*keep_models.*"
                             r"hftc.amp.GradScaler"):
        scaler.scale(hftc.per_model(F.nll_loss)(fused(x), y))


def test_lightning_stochastic_weight_averaging_over_batch_norms_is_refused(tmp_path):
    # Lightning's SWA callback resets and recomputes batch norms found by class: a fused
    # module's are stacked, so it trained on and ended with the statistics of the last
    # weights, not of the averages (0.03 to 4.4 off a Lightning run per model).
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    import test_lightning as tl
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    class WithNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.bn, self.fc2 = nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Linear(16, 10)

        def forward(self, x):
            return self.fc2(torch.relu(self.bn(self.fc1(x.flatten(1)))))

    torch.manual_seed(0)
    module = tl.Fused([WithNorm().double() for _ in tl.LRS])
    before = {k: v.clone() for k, v in module.fused.state_dict().items()}
    swa = StochasticWeightAveraging(swa_lrs=1e-2, swa_epoch_start=2)
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"StochasticWeightAveraging.*\bbn\b.*AveragedModel.*update_bn"):
        tl._trainer([swa], tmp_path).fit(module, *tl._loaders())
    assert all(torch.equal(v, module.fused.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("which", ["torch", "hftc"])
def test_lightning_16_bit_loss_scaling_of_the_summed_loss_is_refused_before_training(
        tmp_path, which):
    # Lightning's MixedPrecision scales the one summed loss: torch's scaler failed at the
    # first optimizer step, hftc's said "take scaler.scale(losses).sum()" at Lightning's
    # own line, which the user cannot change.
    pytest.importorskip("lightning")
    pytest.importorskip("sklearn")
    import test_lightning as tl
    from lightning.pytorch.plugins import MixedPrecision

    scaler = torch.amp.GradScaler("cpu") if which == "torch" else hftc.amp.GradScaler()
    module = tl.Fused(tl._models())
    trainer = tl._trainer([], tmp_path)
    trainer.strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    before = {k: v.clone() for k, v in module.fused.state_dict().items()}
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"one loss training_step returns.*bf16-mixed.*hftc.amp.GradScaler"):
        trainer.fit(module, *tl._loaders())
    assert all(torch.equal(v, module.fused.state_dict()[k]) for k, v in before.items())


def test_hf_neftune_is_refused_by_the_fused_trainer_not_traced(tmp_path):
    # TrainingArguments(neftune_noise_alpha=5) made the Trainer call
    # fused.get_input_embeddings(), which hftc fused as a method and failed in a long
    # TraceError about Python inspecting values in forward.
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import test_hf_trainer as th

    data = th._dataset("classify")
    fused = hftc.fuse(th._models(th._bert), example_inputs=(data[0]["input_ids"][None],))
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"neftune_noise_alpha.*None"):
        th.hftc_hf.FusedTrainer(model=fused, args=th._args(tmp_path, "f", neftune_noise_alpha=5.0),
                                train_dataset=data)
    assert transformers is not None
