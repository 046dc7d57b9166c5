"""Hunt 3, trainers: saving and resuming under the Hugging Face Trainer and Lightning, each
model's checkpoints its own, against stock Lightning / transformers runs."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc

pytest.importorskip("lightning")
import hftc.lightning as hl  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

LRS = [0.05, 0.01, 0.002]


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _models():
    torch.manual_seed(0)
    return [MLP().double() for _ in LRS]


def _loaders(shuffle=True):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    data = torch.utils.data.TensorDataset(x, y)
    return (torch.utils.data.DataLoader(data, batch_size=16, shuffle=shuffle,
                                        generator=torch.Generator().manual_seed(3)),
            torch.utils.data.DataLoader(data, batch_size=32))


class Fused(hl.FusedLightningModule):
    def _losses(self, batch):
        x, y = batch
        out = self(x)
        return torch.stack([F.cross_entropy(out[j], y) for j in range(len(self.model_ids))])

    def training_step(self, batch, _):
        losses = self._losses(batch)
        self.log_per_model("train_loss", losses)
        return losses.sum()

    def validation_step(self, batch, _):
        self.log_per_model("val_loss", self._losses(batch))

    def configure_optimizers(self):
        opt = hftc.optim.Adam(self.fused.parameters(), lr=LRS)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def _trainer(folder, epochs, callbacks=()):
    return pl.Trainer(max_epochs=epochs, default_root_dir=folder, logger=False,
                      callbacks=[ModelCheckpoint(dirpath=folder, save_last=True), *callbacks],
                      enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", deterministic=True)


def test_a_best_and_a_last_per_model_checkpoint_resume_side_by_side(tmp_path):
    """Two PerModelCheckpoints (each model's best by val_loss, and its last state), as
    users keep two ModelCheckpoints: Lightning refused the pair ("more than one stateful
    callback of type PerModelCheckpoint"); after fit(ckpt_path="last") each keeps its own
    bests, the files those of the uninterrupted run."""
    def run(name, epochs, ckpt_path=None):
        torch.manual_seed(5)
        best = hl.PerModelCheckpoint(tmp_path / name / "best", monitor="val_loss")
        last = hl.PerModelCheckpoint(tmp_path / name / "last")
        train, val = _loaders(shuffle=False)  # (Lightning's resume reshuffles)
        _trainer(tmp_path / name, epochs, [best, last]).fit(Fused(_models()), train, val,
                                                              ckpt_path=ckpt_path)
        return best

    whole = run("whole", 4)
    run("resumed", 2)
    resumed = run("resumed", 4, "last")
    assert resumed.best == whole.best
    for k in range(len(LRS)):
        for kind in ("best", "last"):
            mine = torch.load(tmp_path / "resumed" / kind / f"model_{k}.pt")
            theirs = torch.load(tmp_path / "whole" / kind / f"model_{k}.pt")
            for name, value in theirs.items():
                torch.testing.assert_close(mine[name], value, rtol=0, atol=0)


# ---------------------------------------------------------------- the Hugging Face Trainer

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import hftc.hf as hftc_hf  # noqa: E402  (after the skips: it needs both)

transformers.logging.set_verbosity_error()
VOCAB, HF_LRS = 40, [3e-2, 3e-3]


def _berts():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3)
    torch.manual_seed(0)
    return [transformers.BertForSequenceClassification(config).double() for _ in HF_LRS]


def _rows():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (6,), generator=g),
             "labels": torch.tensor(i % 3)} for i in range(16)]


def _accuracy(prediction):
    return {"accuracy": float((prediction.predictions.argmax(-1)
                               == prediction.label_ids).mean())}


def _hf_args(folder, **kwargs):
    options = dict(output_dir=str(folder), per_device_train_batch_size=8, max_steps=8,
                   logging_steps=1, report_to=[], use_cpu=True, seed=7, disable_tqdm=True,
                   eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                   metric_for_best_model="accuracy")
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


def _checkpoints(folder):
    return {path.name for path in folder.glob("checkpoint-*")}


BEST_CHECKPOINT_CASES = {
    "limit_1_load_best": dict(save_total_limit=1, load_best_model_at_end=True),
    "limit_2": dict(save_total_limit=2),
    "saves_every_other_evaluation": dict(eval_steps=2, save_steps=4, load_best_model_at_end=True),
}


@pytest.mark.parametrize("case", sorted(BEST_CHECKPOINT_CASES))
def test_each_models_best_checkpoint_is_its_own_trainers(tmp_path, case):
    """Each model's best checkpoint as its own Trainer keeps it (the folders are the union
    of theirs, trainer.best_checkpoints[k] its best_model_checkpoint, each model ends with
    its own Trainer's weights).  save_total_limit: the Trainer's rotation kept the one best
    of trainer_state.json and deleted the other models' (and was refused with
    load_best_model_at_end); a best step evaluated between saves has no folder: it was
    recorded all the same, and load_best_model_at_end failed at the end of training."""
    extra = BEST_CHECKPOINT_CASES[case]
    rows = _rows()
    models = _berts()
    fused = hftc.fuse(models, example_inputs=(rows[0]["input_ids"][None],))
    trainer = hftc_hf.FusedTrainer(
        model=fused, args=_hf_args(tmp_path / "fused", **extra), train_dataset=rows,
        eval_dataset=rows[:12], compute_metrics=_accuracy,
        optimizers=(hftc.optim.AdamW(fused.parameters(), lr=HF_LRS, weight_decay=0.0), None))
    trainer.train()
    kept = set()
    for k, model in enumerate(models):
        alone = transformers.Trainer(
            model=model, args=_hf_args(tmp_path / f"alone{k}", learning_rate=HF_LRS[k], **extra),
            train_dataset=rows, eval_dataset=rows[:12], compute_metrics=_accuracy)
        alone.train()
        kept |= _checkpoints(tmp_path / f"alone{k}")
        assert trainer.best_steps[k] == alone.state.best_global_step
        theirs = alone.state.best_model_checkpoint
        mine = trainer.best_checkpoints[k]
        assert (mine and os.path.basename(mine)) == (theirs and os.path.basename(theirs))
        for name, p in model.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name)[k].detach(), p.detach(),
                                       rtol=1e-9, atol=1e-12, msg=name)
    assert len(set(trainer.best_steps)) == 2, trainer.best_steps  # (the bests differ)
    assert _checkpoints(tmp_path / "fused") == kept


def test_each_saved_model_folder_holds_the_tokenizer(tmp_path):
    """save_model with a processing_class: one model's Trainer writes the tokenizer beside
    the model; FusedTrainer wrote it only in output_dir, so AutoTokenizer / pipeline on
    output_dir/model_k silently made a default BertTokenizer without the vocabulary (every
    word [UNK]). Each model folder loads alone as one model's output_dir does."""
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(VOCAB - 5))]
    tokenizer = transformers.BertTokenizer(vocab={word: i for i, word in enumerate(words)})
    assert tokenizer("w1 w7")["input_ids"] == [2, 6, 12, 3]
    rows = _rows()
    fused = hftc.fuse(_berts(), example_inputs=(rows[0]["input_ids"][None],))
    trainer = hftc_hf.FusedTrainer(
        model=fused, train_dataset=rows, processing_class=tokenizer,
        args=_hf_args(tmp_path / "fused", max_steps=1, eval_strategy="no", save_strategy="no",
                      metric_for_best_model=None))
    trainer.train()
    trainer.save_model()
    for k in range(fused.num_models):
        loaded = transformers.AutoTokenizer.from_pretrained(hftc_hf.model_dir(tmp_path / "fused", k))
        assert loaded("w1 w7")["input_ids"] == tokenizer("w1 w7")["input_ids"]


def test_resuming_after_a_models_best_checkpoint_was_deleted_goes_on_as_a_trainer_does(tmp_path):
    """Resuming from checkpoint-4 after the other checkpoints were deleted (kept only the
    last to resume from): the Trainer ignores a recorded best_model_checkpoint that no
    longer exists; FusedTrainer kept each model's (trainer.best_checkpoints[k] a deleted
    folder, which load_best_model_at_end reads once any model's best is saved again). Each
    model ends as its own Trainer resumed the same way."""
    rows = _rows()
    extra = dict(max_steps=6, load_best_model_at_end=True)

    def run_and_resume(folder, make_trainer):
        make_trainer(folder, dict(extra, max_steps=4)).train()
        for checkpoint in folder.glob("checkpoint-*"):
            if checkpoint.name != "checkpoint-4":
                shutil.rmtree(checkpoint)
        trainer = make_trainer(folder, extra)
        trainer.train(resume_from_checkpoint=str(folder / "checkpoint-4"))
        return trainer

    def fused_trainer(folder, options):
        fused = hftc.fuse(_berts(), example_inputs=(rows[0]["input_ids"][None],))
        return hftc_hf.FusedTrainer(
            model=fused, args=_hf_args(folder, **options), train_dataset=rows,
            eval_dataset=rows[:12], compute_metrics=_accuracy,
            optimizers=(hftc.optim.AdamW(fused.parameters(), lr=HF_LRS, weight_decay=0.0),
                        None))

    trainer = run_and_resume(tmp_path / "fused", fused_trainer)
    fused = trainer.model
    for k in range(len(HF_LRS)):
        def alone_trainer(folder, options, k=k):
            model = _berts()[k]
            return transformers.Trainer(
                model=model, args=_hf_args(folder, learning_rate=HF_LRS[k], **options),
                train_dataset=rows, eval_dataset=rows[:12], compute_metrics=_accuracy)

        alone = run_and_resume(tmp_path / f"alone{k}", alone_trainer)
        theirs = alone.state.best_model_checkpoint
        mine = trainer.best_checkpoints[k]
        assert (mine and os.path.basename(mine)) == (theirs and os.path.basename(theirs))
        for name, p in alone.model.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name)[k].detach(), p.detach(),
                                       rtol=1e-9, atol=1e-12, msg=name)


def test_a_monitored_per_model_checkpoint_after_a_nan_validation_saves_the_next_best(tmp_path):
    """A metric that is NaN at the first validation (an F1 with no positive prediction yet):
    ModelCheckpoint counts it as the worst value and saves the next validation's model;
    PerModelCheckpoint kept NaN as the best, which no value beats, and never saved again."""
    class NanFirst(Fused):
        def validation_step(self, batch, _):
            losses = self._losses(batch)
            self.log_per_model("score", losses * (math.nan if self.current_epoch == 0 else 1))

    torch.manual_seed(5)
    best = hl.PerModelCheckpoint(tmp_path / "best", monitor="score")
    last = hl.PerModelCheckpoint(tmp_path / "last")
    train, val = _loaders(shuffle=False)
    _trainer(tmp_path, 2, [best, last]).fit(NanFirst(_models()), train, val)
    for k in range(len(LRS)):  # epoch 1's validation is the best: the models' last states
        mine = torch.load(best.path(k))
        for name, value in torch.load(last.path(k)).items():
            torch.testing.assert_close(mine[name], value, rtol=0, atol=0)


def test_each_training_log_holds_each_models_values_in_place_of_the_trainers(tmp_path):
    """A training log of one model's Trainer holds loss, grad_norm and learning_rate; the
    fused one held loss/model_k etc. and beside them the norm of all N models' gradients
    as grad_norm and model 0's rate as learning_rate, values of no one model."""
    rows = _rows()
    models = _berts()
    fused = hftc.fuse(models, example_inputs=(rows[0]["input_ids"][None],))
    options = dict(max_steps=2, eval_strategy="no", save_strategy="no", metric_for_best_model=None)
    trainer = hftc_hf.FusedTrainer(
        model=fused, args=_hf_args(tmp_path / "fused", **options), train_dataset=rows,
        optimizers=(hftc.optim.AdamW(fused.parameters(), lr=HF_LRS, weight_decay=0.0), None))
    trainer.train()
    alone = transformers.Trainer(model=models[0], args=_hf_args(tmp_path / "alone", **options),
                                 train_dataset=rows)
    alone.train()
    for mine, theirs in zip(trainer.state.log_history, alone.state.log_history[:-1]):
        per_model = {key for key in theirs if key not in ("epoch", "step")}
        assert set(mine) == {"epoch", "step", *(f"{key}/model_{k}" for key in per_model
                                                for k in range(len(models)))}


class Alone(pl.LightningModule):
    """One model's Lightning run, as Fused trains each."""

    def __init__(self, model, lr):
        super().__init__()
        self.model, self.lr = model, lr

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def training_step(self, batch, _):
        return self._loss(batch)

    def validation_step(self, batch, _):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


def test_a_model_stopped_at_a_validation_within_an_epoch_stops_there(tmp_path):
    """val_check_interval=0.5: EarlyStopping stops a model's own run at the validation
    within the epoch; PerModelEarlyStopping kept the model in the array to the epoch's
    end, so its PerModelCheckpoint file (and its weights) held 4 steps more than its run."""
    def run(module, folder, stopper, callbacks=()):
        torch.manual_seed(5)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(64, 6, generator=g, dtype=torch.float64)
        data = torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long())
        trainer = pl.Trainer(max_epochs=4, default_root_dir=folder, val_check_interval=0.5,
                             callbacks=[stopper, *callbacks], enable_checkpointing=False,
                             logger=False, enable_progress_bar=False,
                             enable_model_summary=False, accelerator="cpu", deterministic=True)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8),
                    torch.utils.data.DataLoader(data, batch_size=32))
        return trainer

    files = hl.PerModelCheckpoint(tmp_path / "last")
    stopping = hl.PerModelEarlyStopping("val_loss", patience=1, min_delta=0.02)
    run(Fused(_models()), tmp_path / "fused", stopping, [files])
    steps = []
    for k, model in enumerate(_models()):
        alone = run(Alone(model, LRS[k]), tmp_path / f"alone{k}",
                    pl.callbacks.EarlyStopping("val_loss", patience=1, min_delta=0.02))
        steps.append(alone.global_step)
        mine = torch.load(files.path(k))
        for name, p in model.named_parameters():
            torch.testing.assert_close(mine[name], p.detach(), rtol=1e-9, atol=1e-12, msg=name)
    assert any(step % 8 for step in steps), steps  # (one stopped within an epoch)
