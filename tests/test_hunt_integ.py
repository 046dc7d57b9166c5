"""Bugs found by the integrations hunt (HF Trainer, Lightning, users' training scripts),
each against what the plain run (one Trainer per model, or the uninterrupted run) does."""

from __future__ import annotations

import pytest
import torch

import hftc

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import hftc.hf as hftc_hf  # noqa: E402  (after the skips: it needs both)

transformers.logging.set_verbosity_error()

VOCAB, LENGTH = 40, 6
# model 1's rate is so high that its best evaluation is the first (step 2 of 6)
LRS = [2e-3, 0.3]


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))


def _data():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, VOCAB, (LENGTH,), generator=g),
             "labels": torch.tensor(i % 3)} for i in range(16)]


def _run(tmp_path, out, resume=None, epochs=3, callbacks=(), **extra):
    """An epoch-wise run: evaluated and saved each epoch (2 steps), the best loaded at the
    end, cosine schedule with warmup, 2 batches a step, clipping, a rate per model."""
    data = _data()
    torch.manual_seed(0)
    fused = hftc.fuse([_bert().double() for _ in LRS],
                      example_inputs=(torch.stack([d["input_ids"] for d in data[:2]]),))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / out), per_device_train_batch_size=4,
        per_device_eval_batch_size=5, num_train_epochs=epochs, report_to=[], use_cpu=True,
        seed=7, disable_tqdm=True, eval_strategy="epoch", save_strategy="epoch",
        load_best_model_at_end=True, lr_scheduler_type="cosine", warmup_steps=1,
        gradient_accumulation_steps=2, max_grad_norm=0.3, **extra)
    trainer = hftc_hf.FusedTrainer(
        model=fused, args=args, train_dataset=data, eval_dataset=data[:10],
        optimizers=(hftc.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.0), None),
        callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return fused, trainer


def test_resuming_keeps_each_models_best_checkpoint(tmp_path):
    """Resumed after model 1's best (step 2), load_best_model_at_end still loads its
    checkpoint-2, as the uninterrupted run does (the resumed run forgot the bests it had
    not seen and loaded model 1's last weights)."""
    whole, whole_trainer = _run(tmp_path, "whole")
    assert whole_trainer.best_steps == [6, 2]
    resumed, trainer = _run(tmp_path, "resumed",
                            resume=str(tmp_path / "whole" / "checkpoint-4"))
    assert trainer.best_steps == [6, 2]
    assert trainer.best_metrics == pytest.approx(whole_trainer.best_metrics, rel=1e-12)
    for (name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)


def test_restoring_callback_states_restores_each_models_patience(tmp_path):
    """restore_callback_states_from_checkpoint=True with an EarlyStoppingCallback: the
    Trainer remade the per-model callback from its saved arguments, without its trainer
    (a TypeError from transformers' internals); now each model's counter comes back and
    the resumed run stops the models where the uninterrupted one does."""
    def run(out, resume=None):
        return _run(tmp_path, out, resume=resume, epochs=4,
                    restore_callback_states_from_checkpoint=True,
                    callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=3)])

    _, whole = run("whole")
    assert whole.stopped_models == {1: 8} and whole.best_steps == [8, 2]
    _, resumed = run("resumed", resume=str(tmp_path / "whole" / "checkpoint-4"))
    assert resumed.stopped_models == whole.stopped_models
    assert resumed.best_steps == whole.best_steps
    stopping = [c for c in resumed.callback_handler.callbacks
                if isinstance(c, hftc_hf.PerModelEarlyStopping)]
    assert len(stopping) == 1 and stopping[0].counters == [0, 3]


def test_the_final_train_loss_is_each_models_not_their_sum(tmp_path):
    """train()'s final log and metrics: ``train_loss/model_k``, each model's mean loss over
    the steps as its own Trainer's ``train_loss`` (it was the N models' summed loss)."""
    data = _data()

    def args(out, **extra):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4, max_steps=3,
            report_to=[], use_cpu=True, seed=7, disable_tqdm=True, save_strategy="no",
            gradient_accumulation_steps=2, **extra)

    torch.manual_seed(0)
    models = [_bert().double() for _ in LRS]
    fused = hftc.fuse(models, example_inputs=(data[0]["input_ids"][None],))
    trainer = hftc_hf.FusedTrainer(
        model=fused, args=args("fused"), train_dataset=data,
        optimizers=(hftc.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.0), None))
    metrics = trainer.train().metrics
    assert "train_loss" not in metrics
    assert "train_loss" not in trainer.state.log_history[-1]
    for k, model in enumerate(models):
        alone = transformers.Trainer(model=model, args=args(f"alone{k}", learning_rate=LRS[k]),
                                     train_dataset=data).train()
        # (the Trainer sums its loss in float32)
        assert metrics[f"train_loss/model_{k}"] == pytest.approx(alone.training_loss, rel=1e-6)
        assert (trainer.state.log_history[-1][f"train_loss/model_{k}"]
                == metrics[f"train_loss/model_{k}"])


def test_reduce_lr_on_plateau_reduces_each_models_rate_on_its_own_loss(tmp_path):
    """lr_scheduler_type="reduce_lr_on_plateau": each model's rate follows its own
    eval_loss/model_k as its own Trainer's follows eval_loss (it was a KeyError from the
    Trainer's internals: no eval_loss), the same rates logged and the same weights."""
    data = _data()
    lrs = [5e-2, 2e-3]  # model 1 improves by less than the threshold: its rate halves

    def args(out, **extra):
        return transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=4,
            per_device_eval_batch_size=5, num_train_epochs=4, logging_steps=1, report_to=[],
            use_cpu=True, seed=7, disable_tqdm=True, save_strategy="no", eval_strategy="epoch",
            lr_scheduler_type="reduce_lr_on_plateau",
            lr_scheduler_kwargs={"patience": 0, "factor": 0.5, "threshold": 0.005}, **extra)

    torch.manual_seed(0)
    models = [_bert().double() for _ in lrs]
    fused = hftc.fuse(models, example_inputs=(data[0]["input_ids"][None],))
    trainer = hftc_hf.FusedTrainer(
        model=fused, args=args("fused"), train_dataset=data, eval_dataset=data[:10],
        optimizers=(hftc.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=0.0), None))
    trainer.train()
    fused_logs = [log for log in trainer.state.log_history if "loss/model_0" in log]
    reduced = []
    for k, model in enumerate(models):
        alone = transformers.Trainer(model=model, args=args(f"alone{k}", learning_rate=lrs[k]),
                                     train_dataset=data, eval_dataset=data[:10])
        alone.train()
        alone_logs = [log for log in alone.state.log_history if "loss" in log]
        assert len(fused_logs) == len(alone_logs) == 16
        for mine, theirs in zip(fused_logs, alone_logs):
            assert mine[f"learning_rate/model_{k}"] == pytest.approx(theirs["learning_rate"],
                                                                     rel=1e-12)
        reduced.append(alone_logs[-1]["learning_rate"] < lrs[k])
        for name, p in model.named_parameters():
            if name.endswith("key.bias"):  # (its gradient is rounding noise, Adam scales it up)
                continue
            torch.testing.assert_close(fused.get_parameter(name)[k].detach(), p.detach(),
                                       rtol=1e-9, atol=1e-12, msg=name)
    assert reduced == [False, True]  # (the models' plateaus differ: a per-model schedule)


def test_reduce_lr_on_plateau_without_a_rate_per_model_is_refused(tmp_path):
    data = _data()
    fused = hftc.fuse([_bert().double() for _ in LRS],
                      example_inputs=(data[0]["input_ids"][None],))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "x"), max_steps=2, report_to=[], use_cpu=True,
        save_strategy="no", eval_strategy="steps", eval_steps=1,
        lr_scheduler_type="reduce_lr_on_plateau")
    trainer = hftc_hf.FusedTrainer(model=fused, args=args, train_dataset=data,
                                   eval_dataset=data[:4])
    with pytest.raises(hftc.errors.FusionArgumentError,
                       match=r"reduce_lr_on_plateau.*AdamW over the stacked parameters.*"
                             r"hftc.optim.AdamW\(fused.parameters\(\)"):
        trainer.train()
