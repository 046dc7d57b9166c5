"""Per-model bookkeeping for a user's own loop (issue 46 item 2): ``fused.model_ids``
through keep_models / replace_models, ``hftc.per_model_accuracy``, ``hftc.EarlyStopping``
and ``hftc.BestCheckpoint``, each against the one-model code it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hftc
from hftc.errors import FusionArgumentError


def _models(n=4):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)) for _ in range(n)]


def test_model_ids_follow_keep_models_and_replace_models():
    fused = hftc.fuse(_models())
    assert fused.model_ids == [0, 1, 2, 3]
    hftc.keep_models(fused, [3, 1])
    assert fused.model_ids == [3, 1]
    hftc.keep_models(fused, [1, 0])
    assert fused.model_ids == [1, 3]
    hftc.replace_models(fused, {0: _models(1)[0]})
    assert fused.model_ids == [4, 3]  # a new id: 0..3 named models of before
    hftc.replace_models(fused, {1: _models(1)[0]})
    assert fused.model_ids == [4, 5]
    ids = fused.model_ids
    ids.append(9)  # a copy
    assert fused.model_ids == [4, 5]


def test_model_ids_survive_a_copy_and_a_pickle(tmp_path):
    import copy

    fused = hftc.fuse(_models())
    hftc.keep_models(fused, [2, 0])
    assert copy.deepcopy(fused).model_ids == [2, 0]
    torch.save(fused, tmp_path / "fused.pt")
    assert torch.load(tmp_path / "fused.pt", weights_only=False).model_ids == [2, 0]


def test_per_model_accuracy_is_each_models_own():
    models = _models(3)
    fused = hftc.fuse(models)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    out = fused(x)
    expected = torch.stack([(m(x).argmax(1) == y).float().mean() for m in models])
    torch.testing.assert_close(hftc.per_model_accuracy(out, y), expected)
    counts = hftc.per_model_accuracy(out, y, reduction="sum")
    assert counts.dtype == torch.int64 and counts.tolist() == (expected * 32).round().long().tolist()
    ys = torch.randint(0, 3, (3, 32))  # each model its own target
    assert hftc.per_model_accuracy(out, ys, reduction="sum").tolist() == [
        int((m(x).argmax(1) == ys[i]).sum()) for i, m in enumerate(models)]
    with pytest.raises(FusionArgumentError, match="neither one model's"):
        hftc.per_model_accuracy(out, y[:5])
    with pytest.raises(FusionArgumentError, match=r"\[N, B, C, ...\]"):
        hftc.per_model_accuracy(out[0], y)


def _one_model_early_stopping(values, patience):
    """The epoch (call) at which the habit of one model's loop breaks, or None."""
    best, bad = float("inf"), 0
    for epoch, v in enumerate(values):
        if v < best:
            best, bad = v, 0
        else:
            bad += 1
            if bad >= patience:
                return epoch
    return None


def test_early_stopping_stops_each_model_when_its_own_loop_would():
    curves = {0: [5, 4, 3, 2, 1, 0.5], 1: [5, 6, 7, 8, 9, 9], 2: [3, 3, 2, 2, 2, 2],
              3: [1, 2, 0.5, 0.6, 0.7, 0.8]}
    fused = hftc.fuse(_models())
    opt = hftc.optim.SGD(fused.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
    stopper = hftc.EarlyStopping(fused, patience=2)
    for epoch in range(6):
        values = [curves[i][epoch] for i in fused.model_ids]
        if stopper.step(torch.tensor(values)):
            break
    for i, curve in curves.items():
        assert stopper.stopped.get(i) == _one_model_early_stopping(curve, 2), i
    assert fused.model_ids == [0]  # the others were dropped, with their optimizer rows
    assert [g["lr"] for g in opt.param_groups] == [0.1]
    assert stopper.best == {0: 0.5, 1: 5.0, 2: 2.0, 3: 0.5}


def test_early_stopping_resumed_from_its_state_dict_stops_as_uninterrupted(tmp_path):
    curves = {0: [5, 4, 3, 2, 1, 0.5], 1: [5, 6, 7, 8, 9, 9], 2: [3, 3, 2, 2, 2, 2],
              3: [1, 2, 0.5, 0.6, 0.7, 0.8]}
    fused = hftc.fuse(_models())
    stopper = hftc.EarlyStopping(fused, patience=2)
    for epoch in range(3):  # model 1 stops at call 2 and is cut; then the "crash"
        stopper.step([curves[i][epoch] for i in fused.model_ids])
    torch.save({"fused": fused.state_dict(), "ids": fused.model_ids,
                "stopper": stopper.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed = hftc.fuse(_models())
    hftc.keep_models(resumed, saved["ids"])
    again = hftc.EarlyStopping(resumed, patience=2)
    again.load_state_dict(saved["stopper"])
    for epoch in range(3, 6):
        if again.step([curves[i][epoch] for i in resumed.model_ids]):
            break
    for i, curve in curves.items():
        assert again.stopped.get(i) == _one_model_early_stopping(curve, 2), i
    assert resumed.model_ids == [0]
    with pytest.raises(FusionArgumentError, match=r"saved with \(patience, mode, min_delta\)"):
        hftc.EarlyStopping(resumed, patience=3).load_state_dict(saved["stopper"])


def test_early_stopping_done_when_every_model_stopped():
    fused = hftc.fuse(_models(2))
    stopper = hftc.EarlyStopping(fused, patience=1, mode="max")
    assert not stopper.step([0.5, 0.5])
    assert stopper.step([0.4, 0.5])  # both out of patience: the loop ends, nothing cut
    assert stopper.done and fused.model_ids == [0, 1] and stopper.stopped == {0: 1, 1: 1}
    with pytest.raises(FusionArgumentError, match="3 values for 2 models"):
        stopper.step([1.0, 2.0, 3.0])


def test_best_checkpoint_keeps_each_models_best_weights(tmp_path):
    fused = hftc.fuse(_models(3))
    opt = hftc.optim.SGD(fused.parameters(), lr=0.1)
    best = hftc.BestCheckpoint(fused)
    on_disk = hftc.BestCheckpoint(fused, path=str(tmp_path / "best_{model_id}.pt"))
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    expected, lowest = {}, {}  # the one-model habit, by hand
    for values in ([3.0, 2.0, 1.0], [2.0, 3.0, 1.0], [1.0, 1.0, 0.5], [4.0, 4.0, 4.0]):
        improved = [i for i, v in enumerate(values) if v < lowest.get(i, float("inf"))]
        for i in improved:
            lowest[i], expected[i] = values[i], fused.model_state_dict(i)
        assert best.update(values) == improved == on_disk.update(torch.tensor(values))
        opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        opt.step()
    assert best.best == lowest == {0: 1.0, 1: 1.0, 2: 0.5}
    for i in range(3):
        torch.testing.assert_close(best.state_dict(i), expected[i], rtol=0, atol=0)
        torch.testing.assert_close(on_disk.state_dict(i), expected[i], rtol=0, atol=0)
    model = best.model(2)
    assert isinstance(model, nn.Sequential)
    torch.testing.assert_close(model.state_dict(), expected[2], rtol=0, atol=0)
    with pytest.raises(FusionArgumentError, match=r"has no \{model_id\}"):
        hftc.BestCheckpoint(fused, path="best.pt")


def test_best_checkpoint_speaks_in_ids_after_keep_models():
    fused = hftc.fuse(_models(3))
    best = hftc.BestCheckpoint(fused, mode="max")
    best.update([0.1, 0.2, 0.3])
    hftc.keep_models(fused, [2, 0])
    with torch.no_grad():
        fused.get_parameter("0.bias").add_(1.0)
    assert best.update([0.9, 0.05]) == [2]  # model 2 (position 0) improved, model 0 not
    torch.testing.assert_close(best.state_dict(2)["0.bias"],
                               fused.model_state_dict(0)["0.bias"])
    assert best.best == {0: 0.1, 1: 0.2, 2: 0.9}
