"""hftc.lightning: N MLPs on 8x8 digits trained by one Lightning Trainer around a fused
module equal N Lightning runs, one per model (float64, deterministic=True): each model's
logged validation losses, the epoch its early stopping stops it at (the array shrinks
then, its optimizer state with it), and its checkpoint file, loaded into the original
class, holding the weights its own run ends with.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc

pytest.importorskip("lightning")
pytest.importorskip("sklearn")
import hftc.lightning as hl  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, EarlyStopping  # noqa: E402

from hftc.sweep.digits import data as digits_data  # noqa: E402

# Model 0 learns fast and keeps improving; models 1 and 2 improve by less than MIN_DELTA
# a step, so their patience runs out at different epochs and they leave the array.
LRS = [0.5, 0.004, 0.001]
MOMENTA = [0.9, 0.0, 0.5]
MAX_EPOCHS, PATIENCE, MIN_DELTA = 5, 1, 0.02


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def _models():
    torch.manual_seed(0)
    return [MLP().double() for _ in LRS]


def _loaders():
    (x, y), (xv, yv) = digits_data(n_train=256, n_val=96)
    train = torch.utils.data.TensorDataset(x.double(), y)
    val = torch.utils.data.TensorDataset(xv.double(), yv)
    shuffled = torch.utils.data.DataLoader(train, batch_size=32, shuffle=True,
                                           generator=torch.Generator().manual_seed(3))
    return shuffled, torch.utils.data.DataLoader(val, batch_size=48)


class Fused(hl.FusedLightningModule):
    def _losses(self, batch):
        x, y = batch
        out = self(x)
        return torch.stack([F.cross_entropy(out[j], y) for j in range(len(self.model_ids))])

    def training_step(self, batch, _):
        losses = self._losses(batch)
        self.log_per_model("train_loss", losses, on_step=False, on_epoch=True)
        return losses.sum()

    def validation_step(self, batch, _):
        self.log_per_model("val_loss", self._losses(batch))

    def configure_optimizers(self):
        opt = hftc.optim.SGD(self.fused.parameters(), lr=LRS, momentum=MOMENTA)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


class Alone(pl.LightningModule):
    def __init__(self, model, lr, momentum):
        super().__init__()
        self.model, self.lr, self.momentum = model, lr, momentum

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch, _):
        loss = self._loss(batch)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, _):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=self.momentum)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)]


class Record(Callback):
    """Every epoch's callback metrics and the models in the array."""

    def __init__(self):
        self.epochs = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.epochs.append(({k: float(v) for k, v in trainer.callback_metrics.items()},
                            list(getattr(pl_module, "model_ids", [0]))))


def _trainer(callbacks, tmp_path):
    return pl.Trainer(max_epochs=MAX_EPOCHS, deterministic=True, enable_progress_bar=False,
                      logger=False, enable_checkpointing=False, enable_model_summary=False,
                      default_root_dir=tmp_path, callbacks=callbacks, accelerator="cpu")


def test_a_fused_lightning_run_equals_a_lightning_run_per_model(tmp_path):
    models = _models()
    module = Fused(models)
    stopping = hl.PerModelEarlyStopping("val_loss", patience=PATIENCE, min_delta=MIN_DELTA)
    checkpoints = hl.PerModelCheckpoint(tmp_path / "ckpt")
    fused_record = Record()
    _trainer([stopping, checkpoints, fused_record], tmp_path).fit(module, *_loaders())

    stopped = []
    for k, model in enumerate(models):
        alone = Alone(model, LRS[k], MOMENTA[k])
        record = Record()
        trainer = _trainer([EarlyStopping("val_loss", patience=PATIENCE, min_delta=MIN_DELTA),
                            record], tmp_path)
        trainer.fit(alone, *_loaders())
        ran = len(record.epochs)
        # the epochs model k ran in the fused run, each with its own metrics
        in_array = [metrics for metrics, ids in fused_record.epochs if k in ids]
        assert len(in_array) == ran, (k, len(in_array), ran)
        for epoch, (mine, (theirs, _)) in enumerate(zip(in_array, record.epochs)):
            for name in ("val_loss", "train_loss"):
                assert mine[f"{name}/model_{k}"] == pytest.approx(theirs[name], rel=1e-9), \
                    (k, epoch, name)
        if ran < MAX_EPOCHS:
            assert stopping.stopped_epochs[k] == ran - 1
            stopped.append(k)
        else:
            assert k not in stopping.stopped_epochs
        saved = MLP().double()
        saved.load_state_dict(torch.load(checkpoints.path(k), weights_only=True))
        for name, p in saved.named_parameters():
            torch.testing.assert_close(p, model.get_parameter(name), rtol=1e-9, atol=1e-12,
                                       msg=(k, name))
    # each model's metric under <name>/model_<id> (loggers group them: one chart a name)
    first_epoch = fused_record.epochs[0][0]
    assert {"val_loss/model_0", "val_loss/model_1", "train_loss/model_2"} <= set(first_epoch)
    assert not any(k.startswith(("val_loss_", "train_loss_")) for k in first_epoch)
    # the test means something: models left the array at different epochs, one stayed
    assert len({stopping.stopped_epochs[k] for k in stopped}) == 2, stopping.stopped_epochs
    assert module.model_ids == [0] and module.fused.num_models == 1


def test_the_callbacks_refuse_a_plain_lightning_module_and_say_what_to_do(tmp_path):
    alone = Alone(MLP().double(), 0.1, 0.0)
    trainer = _trainer([hl.PerModelEarlyStopping("val_loss")], tmp_path)
    with pytest.raises(hftc.errors.FusionTypeError,
                       match=r"PerModelEarlyStopping works on a hftc.lightning."
                             r"FusedLightningModule.*got a Alone"):
        trainer.fit(alone, *_loaders())
    module = Fused(_models())
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"log_per_model\('x'\): got 2 values for the 3 models"):
        module.log_per_model("x", torch.zeros(2))
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"model id\(s\) \[7\] are not"):
        module.keep_models([0, 7])
    module.keep_models([0, 2])
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    resumed = Fused(_models())  # (a checkpoint after models left: the array cut to them)
    resumed.on_load_checkpoint(checkpoint)
    assert resumed.model_ids == [0, 2] and resumed.fused.num_models == 2
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"holds models \[0, 2\] of the array, the module models \[0, 1\]"):
        Fused(_models()[:2]).on_load_checkpoint(checkpoint)


class RecordValidations(Callback):
    """Each validation's per-model val_loss and each model's state then."""

    def __init__(self):
        self.validations = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validations.append({
                i: (float(trainer.callback_metrics[f"val_loss/model_{i}"]),
                    pl_module.model_state_dict(i)) for i in pl_module.model_ids})


@pytest.mark.parametrize("when", [{"check_val_every_n_epoch": 2}, {"val_check_interval": 3}])
def test_a_monitored_per_model_checkpoint_holds_the_best_validations_model(tmp_path, when):
    """PerModelCheckpoint(monitor=...) writes a model's file after the validation where its
    metric improved, as ModelCheckpoint(monitor=...) does: with validation every other epoch
    it raised (no metric at the first epoch's end), with validation mid-epoch it wrote the
    epoch's last weights, which no validation had seen."""
    record = RecordValidations()
    checkpoints = hl.PerModelCheckpoint(tmp_path / "best", monitor="val_loss")
    trainer = pl.Trainer(max_epochs=4, deterministic=True, enable_progress_bar=False,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         callbacks=[record, checkpoints], accelerator="cpu", **when)
    trainer.fit(Fused(_models()), *_loaders())
    assert len(record.validations) == (2 if "check_val_every_n_epoch" in when else 8)
    for i in range(len(LRS)):
        losses = [validation[i][0] for validation in record.validations]
        best = losses.index(min(losses))
        saved = torch.load(checkpoints.path(i))
        for name, value in record.validations[best][i][1].items():
            torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
        assert checkpoints.best[i] == losses[best]


class Unsummed(Fused):
    def training_step(self, batch, _):
        return self._losses(batch)  # the N losses: forgot .sum()


class UnsummedManual(Fused):
    def __init__(self, models):
        super().__init__(models)
        self.automatic_optimization = False

    def training_step(self, batch, _):
        self.manual_backward(self._losses(batch))


@pytest.mark.parametrize("module", [Unsummed, UnsummedManual])
def test_unsummed_losses_are_refused_naming_the_training_step(tmp_path, module):
    """The N losses returned (or given to manual_backward) unsummed: torch's "grad can be
    implicitly created only for scalar outputs" from deep in Lightning; now the module, the
    training_step's file and line, and the sum to return."""
    trainer = _trainer([], tmp_path)
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=rf"{module.__name__}: .* has shape \[3\], not one number "
                             rf"\(training_step at .*test_lightning.py:\d+\); with 3 models "
                             rf"return their losses' sum, losses.sum\(\)"):
        trainer.fit(module(_models()), *_loaders())
