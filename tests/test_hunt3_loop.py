"""Hunt 3, a user's own training loop on the fused module, against N stock runs:

- ``torch.nn.init`` on a stacked weight initialises each model's row as torch would its
  own tensor (its fans, the draws a loop over the models makes);
- loops over ``fused.modules()`` with ``isinstance(m, nn.Linear)`` / ``nn.BatchNorm2d``
  (weight-decay groups, freezing batch norms, init, ``reset_parameters``) find the
  stacked layers;
- a hand-written EMA (``copy.deepcopy(fused)``) after ``hftc.keep_models`` is warned of.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import hftc
from hftc.errors import FusionArgumentError, FusionNotImplementedError, UsageWarning

N = 3


class ConvNet(nn.Module):
    """torchvision style: a conv, a batch norm, a linear head and a layer norm."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.fc = nn.Linear(6, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x))).mean((2, 3))
        return self.norm(self.fc(h))


def _models(seed=0):
    torch.manual_seed(seed)
    return [ConvNet().double() for _ in range(N)]


def _stacked(models, name):
    return torch.stack([m.get_parameter(name).detach() for m in models])


def _assert_rows(fused, models, name):
    torch.testing.assert_close(fused.get_parameter(name).detach(), _stacked(models, name),
                               rtol=0, atol=0)


INITS = {
    "kaiming_uniform_": lambda t: nn.init.kaiming_uniform_(t, a=math.sqrt(5)),
    "kaiming_normal_": lambda t: nn.init.kaiming_normal_(t, mode="fan_out",
                                                         nonlinearity="relu"),
    "xavier_uniform_": nn.init.xavier_uniform_,
    "xavier_normal_": nn.init.xavier_normal_,
    "orthogonal_": nn.init.orthogonal_,
    "trunc_normal_": lambda t: nn.init.trunc_normal_(t, std=0.02),
    "sparse_": lambda t: nn.init.sparse_(t, 0.5),
}


@pytest.mark.parametrize("init", sorted(INITS))
@pytest.mark.parametrize("name", ["conv.weight", "fc.weight"])
def test_nn_init_on_a_stacked_weight_gives_each_model_its_own_init_bit_for_bit(init, name):
    # torch read the stacked [N, out, in] as one tensor: a fan-in of out * in (the std
    # off by sqrt(out)), orthogonal rows across the models
    if init == "sparse_" and name == "conv.weight":
        pytest.skip("sparse_ takes a 2-d tensor")
    models = _models()
    fused = hftc.fuse(copy.deepcopy(models))
    torch.manual_seed(7)
    INITS[init](fused.get_parameter(name))
    torch.manual_seed(7)
    for m in models:
        INITS[init](m.get_parameter(name))
    _assert_rows(fused, models, name)


def test_nn_init_on_a_stacked_weights_data_and_a_bound_name_and_the_fan_helper():
    from torch.nn.init import kaiming_normal_  # (bound as a script's imports bind it)

    models = _models()
    fused = hftc.fuse(copy.deepcopy(models))
    torch.manual_seed(3)
    nn.init.xavier_uniform_(fused.fc.weight.data)
    kaiming_normal_(fused.conv.weight)
    torch.manual_seed(3)
    for m in models:
        nn.init.xavier_uniform_(m.fc.weight.data)
    for m in models:
        kaiming_normal_(m.conv.weight)
    _assert_rows(fused, models, "fc.weight")
    _assert_rows(fused, models, "conv.weight")
    stock = nn.init._calculate_fan_in_and_fan_out(models[0].conv.weight)
    assert nn.init._calculate_fan_in_and_fan_out(fused.conv.weight) == stock
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    torch.testing.assert_close(fused(x), torch.stack([m(x) for m in models]))


def test_nn_init_on_a_padded_stacked_weight_is_refused_naming_fused_apply():
    models = [nn.Sequential(nn.Linear(4, w), nn.ReLU(), nn.Linear(w, 2)) for w in (3, 5)]
    fused = hftc.fuse(models, pad_widths=True)
    with pytest.raises(FusionNotImplementedError, match=r"fused\.apply\(init_fn\)"):
        nn.init.kaiming_uniform_(fused[0].weight)


def _timm_init(m):
    # timm / HF _init_weights, as `for m in model.modules(): init(m)` runs it
    if isinstance(m, nn.Linear):
        nn.init.trunc_normal_(m.weight, std=0.02)
        nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv2d):
        nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
    elif isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


def test_an_init_loop_over_fused_modules_finds_the_stacked_layers():
    # isinstance(m, nn.Linear) was False for the stacked modules: the loop skipped them
    models = _models()
    fused = hftc.fuse(copy.deepcopy(models))
    torch.manual_seed(5)
    for m in fused.modules():
        _timm_init(m)
    torch.manual_seed(5)
    plain = [dict(m.named_modules()) for m in models]
    for name in dict(fused.named_modules()):  # (layer by layer, model by model)
        for modules in plain:
            if name in modules:
                _timm_init(modules[name])
    for name, _ in models[0].named_parameters():
        _assert_rows(fused, models, name)
    # fused.apply runs fn model by model, as models[i].apply(fn) would in turn
    fused_apply = hftc.fuse(copy.deepcopy(models))
    torch.manual_seed(9)
    fused_apply.apply(_timm_init)
    torch.manual_seed(9)
    for m in models:
        m.apply(_timm_init)
    for name, _ in models[0].named_parameters():
        _assert_rows(fused_apply, models, name)


def test_isinstance_modules_hold_the_models_attributes_and_refuse_setting_them():
    fused = hftc.fuse(_models())
    assert isinstance(fused.conv, nn.Conv2d) and isinstance(fused.bn, nn.BatchNorm2d)
    assert (fused.conv.out_channels, fused.conv.kernel_size) == (6, (3, 3))
    assert (fused.fc.in_features, fused.bn.eps) == (6, 1e-5)
    with pytest.raises(FusionArgumentError, match="eps"):
        fused.bn.eps = 1e-3
    assert fused.bn.eps == 1e-5
    # a copy and a pickle keep the classes
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    buffer.seek(0)
    for twin in (copy.deepcopy(fused), torch.load(buffer, weights_only=False)):
        assert type(twin.conv) is type(fused.conv) and twin.conv.out_channels == 6
    # an attribute the models differ in is not given as model 0's
    models = _models()
    models[1].bn.momentum = 0.5
    assert not hasattr(hftc.fuse(models).bn, "momentum")


def test_a_hook_loop_over_fused_modules_is_refused_not_skipped():
    # activation statistics: a hook on every nn.Linear; the stacked ones were skipped
    # (isinstance False), so the hooks silently never ran
    from hftc.errors import UnsupportedOperatorError

    fused = hftc.fuse(_models())
    with pytest.raises(UnsupportedOperatorError, match="Register hooks on the fused module"):
        for m in fused.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(lambda module, args, out: None)


def test_pruning_the_linears_of_fused_modules_is_refused_before_it_changes_anything():
    # found by isinstance now: prune renamed the stacked weight to weight_orig, then a
    # bare KeyError, the fused module's output changed
    import torch.nn.utils.prune as prune

    from hftc.errors import UnsupportedOperatorError

    fused = hftc.fuse(_models())
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    before = fused(x)
    names = [n for n, _ in fused.named_parameters()]
    with pytest.raises(UnsupportedOperatorError, match="Prune each model before fusing"):
        for m in fused.modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                prune.l1_unstructured(m, "weight", amount=0.3)
    assert [n for n, _ in fused.named_parameters()] == names
    torch.testing.assert_close(fused(x), before, rtol=0, atol=0)


def _decay_groups(model, weight_decay):
    # minGPT's configure_optimizers: decay the Linear / Conv weights, not the norms' nor
    # any bias; every parameter in one group
    decay, no_decay = [], []
    for _, m in model.named_modules():
        for pn, p in m.named_parameters(recurse=False):
            if pn.endswith("bias") or isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
                no_decay.append(p)
            elif isinstance(m, (nn.Linear, nn.Conv2d)):
                decay.append(p)
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def test_weight_decay_groups_and_frozen_batch_norms_train_each_model_as_alone():
    models = _models()
    fused = hftc.fuse(copy.deepcopy(models))
    lrs = [0.01, 0.02, 0.03]
    stock = [torch.optim.AdamW(_decay_groups(m, 0.1), lr=lr) for m, lr in zip(models, lrs)]
    fused_opt = hftc.optim.AdamW(_decay_groups(fused, 0.1), lr=lrs)
    x = torch.randn(8, 3, 5, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (8,))

    def freeze_bn(model):  # detectron2 / mmdet: batch norms in eval, their affine frozen
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
                m.weight.requires_grad_(False)
                m.bias.requires_grad_(False)

    for step in range(3):
        for model in (fused, *models):
            model.train()
            if step:
                freeze_bn(model)
        for m, opt in zip(models, stock):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
        fused_opt.zero_grad()
        hftc.per_model(F.cross_entropy)(fused(x), y).sum().backward()
        fused_opt.step()
    for name, _ in models[0].named_parameters():
        torch.testing.assert_close(fused.get_parameter(name).detach(), _stacked(models, name))
    torch.testing.assert_close(fused.bn.running_mean,
                               torch.stack([m.bn.running_mean for m in models]))


def _timm_weight_decay_groups(model, weight_decay):
    # timm.optim.param_groups_weight_decay, what create_optimizer_v2 groups by
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.ndim <= 1 or name.endswith(".bias"):
            no_decay.append(param)
        else:
            decay.append(param)
    return [{"params": no_decay, "weight_decay": 0.0},
            {"params": decay, "weight_decay": weight_decay}]


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, hftc.optim.AdamW])
def test_timms_weight_decay_groups_on_the_stacked_parameters_warn(optimizer):
    # each model's batch / layer norm weights ([N, C] stacked) went to the decay group,
    # silently: decayed unlike the model's own run
    fused = hftc.fuse(_models())
    with pytest.warns(UsageWarning, match=r"holds only 1-d parameters.*p\.dim\(\) - 1") as got:
        optimizer(_timm_weight_decay_groups(fused, 0.05), lr=0.01)
    assert got[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error", UsageWarning)
        optimizer(_decay_groups(fused, 0.05), lr=0.01)  # (by class: each model's own)


def test_reset_parameters_over_fused_modules_zeroes_each_models_padding_row():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(6, 4, padding_idx=2)
            self.bn = nn.BatchNorm1d(4)
            self.head = nn.Linear(4, 3)

        def forward(self, tokens):
            return self.head(self.bn(self.embed(tokens).mean(1)))

    torch.manual_seed(0)
    models = [Tagger() for _ in range(N)]
    fused = hftc.fuse(models)
    fused(torch.randint(0, 6, (5, 7)))  # (running stats moved)
    for m in fused.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    weight = fused.embed.weight.detach()
    assert weight[:, 2].abs().sum() == 0 and (weight[:, [0, 1, 3]] != 0).all()
    assert (fused.bn.running_var == 1).all() and (fused.bn.running_mean == 0).all()
    # each model's bias bound is its own fan-in's (4), not the stacked weight's
    assert fused.head.bias.abs().max() <= 1 / math.sqrt(4)
    assert fused.head.weight.std() > 0.2  # (a fan-in of 3 * 4 would give ~0.17)


def test_hf_init_weights_on_a_stacked_embedding_is_refused_not_given_model_ks_table():
    # HF's _init_weights: weight.data[module.padding_idx].zero_() on the stacked
    # [N, num, dim] weight would zero model padding_idx's whole table
    def init_weights(module):
        if isinstance(module, nn.Embedding):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()

    class Encoder(nn.Module):
        def __init__(self, padding_idx):
            super().__init__()
            self.embed = nn.Embedding(5, 4, padding_idx=padding_idx)

        def forward(self, tokens):
            return self.embed(tokens).sum(1)

    fused = hftc.fuse([Encoder(1) for _ in range(N)])
    with pytest.raises(FusionArgumentError, match=r"weight\[:, 1\]"):
        for m in fused.modules():
            init_weights(m)
    plain = hftc.fuse([Encoder(None) for _ in range(N)])  # (no padding row: as torch)
    for m in plain.modules():
        init_weights(m)
    assert plain.embed.padding_idx is None


def _ema_update(ema, model, decay=0.9):
    with torch.no_grad():
        for p_ema, p in zip(ema.parameters(), model.parameters()):
            p_ema.mul_(decay).add_(p, alpha=1 - decay)


def test_a_hand_written_ema_after_keep_models_is_warned_of_and_the_advice_works():
    # after keep_models left one model, the EMA's update broadcast its weights over every
    # model's average, silently
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
              for _ in range(N)]
    fused = hftc.fuse(copy.deepcopy(models))
    ema = copy.deepcopy(fused)
    plain_emas = copy.deepcopy(models)
    with pytest.warns(UsageWarning, match=r"ema = copy.deepcopy\(fused\).*keep_models\(copy, \[2\]\)"):
        hftc.keep_models(fused, [2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if ema.model_ids != fused.model_ids:  # the advice, as a loop writes it
            hftc.keep_models(ema, [ema.model_ids.index(i) for i in fused.model_ids])
    for _ in range(2):
        _ema_update(ema, fused)
        _ema_update(plain_emas[2], models[2])
    for name, _ in models[2].named_parameters():
        torch.testing.assert_close(ema.get_parameter(name).detach()[0],
                                   plain_emas[2].get_parameter(name).detach())


def test_early_stopping_warns_of_an_ema_copy_at_the_users_line():
    torch.manual_seed(0)
    fused = hftc.fuse([nn.Linear(3, 2) for _ in range(N)])
    ema = copy.deepcopy(fused)
    stopper = hftc.EarlyStopping(fused, patience=1)
    stopper.step([1.0, 1.0, 1.0])
    with pytest.warns(UsageWarning, match="still holds models \\[0, 1, 2\\]") as record:
        stopper.step([0.5, 2.0, 0.5])
    assert record[0].filename == __file__
    assert fused.model_ids == [0, 2] and ema.model_ids == [0, 1, 2]
