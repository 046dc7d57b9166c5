"""hftc.hf.FusedTrainer: N tiny transformers models (BERT, GPT-2, Llama, built from configs,
never downloaded) trained by one ``transformers.Trainer`` over the fused module equal N
Trainers, one per model: the same weights after k steps, each model's logged losses and
gradient norms, ``save_model`` folders that ``from_pretrained`` reads back, float64.

The Trainer calls the fused module as it calls a model (``model(input_ids=...,
labels=...)``, no attention_mask), which the export front-end exports again for.
"""

from __future__ import annotations

import pytest
import torch

import hftc

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
import hftc.hf as hftc_hf  # noqa: E402  (after the skips: it needs both)

transformers.logging.set_verbosity_error()

N, VOCAB, LENGTH, STEPS = 2, 40, 6, 3
LRS = [2e-3, 5e-3]


def _bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=3))


def _gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=8, n_layer=1, n_head=2, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))


def _llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
        use_cache=False))


def _dataset(kind: str, size: int = 12) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(size):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        rows.append({"input_ids": ids,
                     "labels": torch.tensor(i % 3) if kind == "classify" else ids.clone()})
    return rows


def _args(tmp_path, name: str, **kwargs) -> transformers.TrainingArguments:
    options = dict(output_dir=str(tmp_path / name), per_device_train_batch_size=4,
                   per_device_eval_batch_size=5, max_steps=STEPS, logging_steps=1,
                   report_to=[], use_cpu=True, save_strategy="no", seed=7,
                   disable_tqdm=True)
    options.update(kwargs)
    return transformers.TrainingArguments(**options)


def _models(make):
    torch.manual_seed(0)
    return [make().double() for _ in range(N)]


CASES = {
    # the Trainer's own optimizer (torch AdamW) over the stacked parameters; tight clipping
    "bert": (_bert, "classify", False, {"max_grad_norm": 0.05}),
    # hftc.optim.AdamW with a learning rate per model, under the Trainer's linear schedule;
    # Llama: 2 batches a step (each model's loss over both, num_items_in_batch)
    "gpt2": (_gpt2, "lm", True, {}),
    "llama": (_llama, "lm", True, {"max_grad_norm": 0.5, "gradient_accumulation_steps": 2}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_fused_trainer_equals_a_trainer_per_model(name, tmp_path):
    make, kind, per_model_lr, extra = CASES[name]
    data = _dataset(kind)
    example = (torch.stack([row["input_ids"] for row in data[:2]]),)
    models = _models(make)
    fused = hftc.fuse(models, example_inputs=example)

    optimizers = (None, None)
    if per_model_lr:
        optimizers = (hftc.optim.AdamW(fused.parameters(), lr=LRS, weight_decay=0.0), None)
    trainer = hftc_hf.FusedTrainer(model=fused, args=_args(tmp_path, "fused", **extra),
                                   train_dataset=data, eval_dataset=data[:10],
                                   optimizers=optimizers)
    trainer.train()
    assert fused.fusion_report.fallbacks == [], str(fused.fusion_report)  # all of it fused
    fused_eval = trainer.evaluate()
    trainer.save_model()
    fused_logs = [log for log in trainer.state.log_history if "loss/model_0" in log]
    assert len(fused_logs) == STEPS

    for k, model in enumerate(models):
        lr = {"learning_rate": LRS[k]} if per_model_lr else {}
        alone = transformers.Trainer(model=model, args=_args(tmp_path, f"alone{k}", **extra, **lr),
                                     train_dataset=data, eval_dataset=data[:10])
        alone.train()
        alone_eval = alone.evaluate()
        alone_logs = [log for log in alone.state.log_history if "loss" in log]
        for step, (mine, theirs) in enumerate(zip(fused_logs, alone_logs)):
            # (the Trainer sums its logged loss in float32)
            assert mine[f"loss/model_{k}"] == pytest.approx(theirs["loss"], rel=1e-6), step
            assert mine[f"grad_norm/model_{k}"] == pytest.approx(theirs["grad_norm"], rel=1e-9)
            if per_model_lr:
                assert mine[f"learning_rate/model_{k}"] == pytest.approx(theirs["learning_rate"])
        assert fused_eval[f"eval_loss/model_{k}"] == pytest.approx(alone_eval["eval_loss"],
                                                                   rel=1e-6)  # (float32)
        saved = type(model).from_pretrained(hftc_hf.model_dir(tmp_path / "fused", k))
        trained = dict(model.named_parameters())
        for param_name, p in saved.named_parameters():
            torch.testing.assert_close(p.detach(), trained[param_name].detach(),
                                       rtol=1e-9, atol=1e-12, msg=param_name)
            torch.testing.assert_close(fused.get_parameter(param_name)[k].detach(),
                                       trained[param_name].detach(), rtol=1e-9, atol=1e-12)
    # each model's loss is logged, not the models' sum
    assert all("loss" not in log for log in fused_logs) and "eval_loss" not in fused_eval


def test_resuming_from_a_checkpoint_reads_each_models_folder(tmp_path):
    """A checkpoint holds model_0 ... model_{N-1}; resuming from the one at step 2 of 3
    ends with the weights of the uninterrupted run (fresh models otherwise)."""
    data = _dataset("classify")
    example = (torch.stack([row["input_ids"] for row in data[:2]]),)

    def run(out, resume=None):
        fused = hftc.fuse(_models(_bert), example_inputs=example)
        trainer = hftc_hf.FusedTrainer(
            model=fused, train_dataset=data,
            args=_args(tmp_path, out, save_strategy="steps", save_steps=2))
        trainer.train(resume_from_checkpoint=resume)
        return fused

    whole = run("whole")
    checkpoint = tmp_path / "whole" / "checkpoint-2"
    assert sorted(p.name for p in checkpoint.glob("model_*")) == ["model_0", "model_1"]
    resumed = run("resumed", resume=str(checkpoint))
    for (param_name, a), b in zip(whole.named_parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=param_name)


def test_a_model_that_is_not_fused_or_a_loss_per_model_is_refused(tmp_path):
    with pytest.raises(hftc.errors.FusionTypeError, match=r"FusedTrainer trains a fused module"):
        hftc_hf.FusedTrainer(model=_bert(), args=_args(tmp_path, "x"))
    fused = hftc.fuse([torch.nn.Linear(3, 2) for _ in range(2)])
    with pytest.raises(hftc.errors.FusionTypeError, match=r"Linear, not transformers"):
        hftc_hf.FusedTrainer(model=fused, args=_args(tmp_path, "x"))
    data = _dataset("classify")
    fused = hftc.fuse(_models(_bert), example_inputs=(data[0]["input_ids"][None],))
    with pytest.raises(hftc.errors.FusionArgumentError, match=r"label_smoothing_factor"):
        hftc_hf.FusedTrainer(model=fused, args=_args(tmp_path, "x", label_smoothing_factor=0.1))


def _accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    """One model's predictions [samples, classes] (as compute_metrics gets them alone)."""
    assert prediction.predictions.ndim == 2, prediction.predictions.shape
    return {"accuracy": float((prediction.predictions.argmax(-1)
                               == prediction.label_ids).mean()),
            "mean_logit": float(prediction.predictions.mean())}


def test_best_models_early_stopping_and_metrics_act_per_model(tmp_path):
    """EarlyStoppingCallback, metric_for_best_model and load_best_model_at_end per model:
    each model ends as it would with its own Trainer (the same early stop, its own best
    checkpoint loaded), compute_metrics sees one model's predictions, each logged as
    eval_<name>/model_k. The learning rates differ so that the models' bests differ."""
    data = _dataset("classify", size=16)
    example = (torch.stack([row["input_ids"] for row in data[:2]]),)
    lrs = [3e-2, 3e-3]
    extra = dict(max_steps=10, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                 save_steps=1, load_best_model_at_end=True, metric_for_best_model="accuracy",
                 per_device_train_batch_size=8)

    def stopper():
        return transformers.EarlyStoppingCallback(early_stopping_patience=2)

    models = _models(_bert)
    fused = hftc.fuse(models, example_inputs=example)
    trainer = hftc_hf.FusedTrainer(
        model=fused, args=_args(tmp_path, "fused", **extra), train_dataset=data,
        eval_dataset=data[:12], compute_metrics=_accuracy, callbacks=[stopper()],
        optimizers=(hftc.optim.AdamW(fused.parameters(), lr=lrs, weight_decay=0.0), None))
    assert [type(c).__name__ for c in trainer.callback_handler.callbacks].count(
        "PerModelEarlyStopping") == 1
    trainer.train()
    evals = [log for log in trainer.state.log_history if "eval_loss/model_0" in log]
    stops = []
    for k, model in enumerate(models):
        alone = transformers.Trainer(
            model=model, args=_args(tmp_path, f"alone{k}", **extra, learning_rate=lrs[k]),
            train_dataset=data, eval_dataset=data[:12], compute_metrics=_accuracy,
            callbacks=[stopper()])
        alone.train()
        theirs = [log for log in alone.state.log_history if "eval_loss" in log]
        stops.append(alone.state.global_step)
        for mine, their in zip(evals, theirs):  # the same steps, each model's own numbers
            assert mine["step"] == their["step"]
            assert mine[f"eval_loss/model_{k}"] == pytest.approx(their["eval_loss"], rel=1e-6)
            for name in ("accuracy", "mean_logit"):
                assert mine[f"eval_{name}/model_{k}"] == pytest.approx(their[f"eval_{name}"],
                                                                      rel=1e-9, abs=1e-12)
        assert trainer.best_steps[k] == alone.state.best_global_step
        if alone.state.global_step < 10:  # it stopped early, at the fused model's step
            assert trainer.stopped_models[k] == alone.state.global_step
        # the best checkpoint loaded at the end: model k's weights are alone's
        for name, p in model.named_parameters():
            torch.testing.assert_close(fused.get_parameter(name)[k].detach(), p.detach(),
                                       rtol=1e-9, atol=1e-12, msg=name)
    assert min(stops) < max(stops) < 10  # both stopped early, at different steps
    assert trainer.state.global_step == max(stops)  # training stopped once both had
    assert len(set(trainer.best_steps)) == 2, trainer.best_steps  # the bests differ
    assert all("eval_loss" not in log and "eval_accuracy" not in log for log in evals)
