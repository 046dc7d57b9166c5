"""Each model's hyper-parameters: scalar-or-list arguments checked and expanded into one
param group per model, and read back on every step::

    SGD(fused.parameters(), lr=[0.1, 0.01], momentum=0.9)
        -> param_groups = [{"lr": 0.1, "momentum": 0.9, "params": [P, ...]},
                           {"lr": 0.01, "momentum": 0.9, "params": []}]

The mixin :class:`HyperParameterGroups` of :class:`~hftc.optim.optimizer.FusedOptimizer`.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor
from torch.optim import Optimizer
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from ..errors import (
    FusionArgumentError,
    FusionNotImplementedError,
    FusionTypeError,
    UsageWarning,
    user_line,
    user_stacklevel,
)

__all__ = ["HyperParameterGroups", "warn_of_grouping_by_stacked_dims"]


def _is_number(x: Any) -> bool:
    if isinstance(x, Tensor):
        return x.dim() == 0
    return isinstance(x, numbers.Real)


def _is_sequence(x: Any) -> bool:
    if isinstance(x, (str, bytes, dict)):
        return False
    if isinstance(x, Tensor):
        return x.dim() == 1
    return isinstance(x, Sequence) or hasattr(x, "__len__") and hasattr(x, "__getitem__")


def _as_float(name: str, value: Any, model: int | None = None) -> float:
    where = f"{name}[{model}]" if model is not None else name
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise FusionArgumentError(
                f"{where} must be a number, got a tensor of shape {list(value.shape)}")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FusionTypeError(f"{where} must be a number, got {type(value).__name__}: {value!r}")
    return float(value)


def _as_flag(name: str, value: Any, model: int | None = None) -> bool:
    where = f"{name}[{model}]" if model is not None else name
    if isinstance(value, Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (bool, numbers.Integral)):
        raise FusionTypeError(f"{where} must be a bool, got {type(value).__name__}: {value!r}")
    return bool(value)


def _as_pair(name: str, value: Any, model: int | None = None) -> tuple[float, float]:
    where = f"{name}[{model}]" if model is not None else name
    if not _is_sequence(value) or len(value) != 2 or not all(_is_number(v) for v in value):
        raise FusionTypeError(f"{where} must be a pair of numbers, got {value!r}")
    return (_as_float(name, value[0], model), _as_float(name, value[1], model))


def _check_one_models_values(cls: str, key: str, kind: str, values: list[Any]) -> None:
    """A scheduler written for one model (nanoGPT's ``for param_group in
    optimizer.param_groups: param_group['lr'] = lr``) given the N models' values, ``lr`` a
    list or tensor ``[N]``, put all N in every model's group: refused naming the loop that
    gives group i (model i's) its own value, not as "lr[0] must be a number"."""
    n = len(values)
    for i, v in enumerate(values):
        many = (_is_sequence(v) and not (kind == "pair" and len(v) == 2)) \
            or (isinstance(v, Tensor) and v.numel() > 1)
        if many:
            raise FusionTypeError(
                f"{cls}: param_groups[{i}][{key!r}] holds {len(v)} values ({v!r:.80}){user_line()}"
                f"; param_groups[i] is model i's (one group per model, {n} models), its "
                f"{key!r} one model's value. Give each model its own: `for i, param_group "
                f"in enumerate(optimizer.param_groups): param_group[{key!r}] = "
                f"values[i]`")


def _warn_of_grouping_by_stacked_dims(cls: str, groups: list[dict],
                                      overrides: list[dict]) -> None:
    """(the check below on a fused optimizer's param-group dicts)"""
    params = [[p for p in ([g["params"]] if isinstance(g["params"], Tensor)
                           else list(g["params"])) if isinstance(p, Tensor)] for g in groups]
    warn_of_grouping_by_stacked_dims(cls, params, overrides)


def warn_of_grouping_by_stacked_dims(cls: str, params: list[list[Tensor]],
                                     overrides: list[dict]) -> None:
    """nanoGPT's ``configure_optimizers`` verbatim on a fused module (``p.dim() >= 2``
    decays, the rest not) puts every parameter in the decay group: a stacked parameter's
    ``dim()`` counts the model dim, so each model's biases and norms (1-d in the model)
    are 2-d there, and the no-decay group is empty.  It trains as written, each model's
    biases decayed unlike its own run.  timm's ``param_groups_weight_decay`` (``p.ndim <=
    1 or name.endswith(".bias")``, what ``create_optimizer_v2`` groups by) leaves the
    biases alone and decays each model's norm weights, 2-d there.  A :class:`UsageWarning`
    at the user's line, where a group holds only each model's 1-d parameters (or none),
    another holds some with its matrices, and the groups' values differ."""
    one_d = [k for k, ps in enumerate(params) if all(p.dim() - 1 < 2 for p in ps)]
    mixed = [k for k, ps in enumerate(params)
             if any(p.dim() - 1 < 2 for p in ps) and any(p.dim() - 1 >= 2 for p in ps)]
    differ = [(e, m) for e in one_d for m in mixed if overrides[e] != overrides[m]]
    if not differ:
        return
    e, m = differ[0]
    keys = [key for key in {**overrides[e], **overrides[m]}
            if overrides[e].get(key) != overrides[m].get(key)]

    def spelled(k: int) -> str:
        return ", ".join(f"{key}={overrides[k][key]!r}" if key in overrides[k] else
                         f"{key}: the constructor's" for key in keys)

    held = "is empty" if not params[e] else "holds only 1-d parameters"
    warnings.warn(
        f"{cls}: param group {e} ({spelled(e)}) {held} and param group {m} "
        f"({spelled(m)}) holds each model's 1-d parameters (biases, norms) with its "
        f"matrices: they get group {m}'s values. If the groups were made by p.dim() "
        f"(nanoGPT's p.dim() >= 2, timm's p.ndim <= 1 for no weight decay) on the fused "
        f"module's parameters: a stacked parameter's dim() counts the model dim "
        f"([N, *shape]), so every bias and norm weight is 2-d there. Group by each model's "
        f"dims, p.dim() - 1 >= 2 on fused.parameters(), or by the names of a plain "
        f"model's parameters ({{n for n, p in models[0].named_parameters() if p.dim() >= "
        f"2}}); by name or class on purpose (biases only), this warning is moot",
        UsageWarning, stacklevel=user_stacklevel())


class HyperParameterGroups(Optimizer):
    """Hyper-parameters per model: validation, expansion into param groups, the
    implementation flags (one for all models), and their current values each step."""

    _hyperparameters: ClassVar[dict[str, str]]
    _flags: ClassVar[dict[str, Any]]
    _capturable_supported: ClassVar[bool]

    def _split_groups(self, items: list[Any], flags: dict[str, Any] | None = None
                      ) -> tuple[list[Any], list[int], list[dict]]:
        """Param-group dicts, as torch takes them, -> one flat list of parameters, each
        parameter's group index, and each group's hyper-parameters (``[]`` for none)::

            AdamW([{"params": matrices, "weight_decay": 0.1},      # nanoGPT's grouping
                   {"params": biases_and_norms, "weight_decay": 0.0}], lr=[...])

        A group's values (one shared, or N per model) hold for its parameters, the
        constructor's for the rest.  Not ``lr``: ``param_groups[i]`` is model i, whose
        learning rate its scheduler sets for all of its parameters.  A group may name a
        flag (``foreach``, ...) only with the optimizer's value: it holds for all of them."""
        if not any(isinstance(x, dict) for x in items):
            return items, [0] * len(items), [{}]
        cls = type(self).__name__
        if not all(isinstance(x, dict) for x in items):
            raise FusionTypeError(f"{cls} takes stacked parameters or param-group dicts, not both")
        flat, group_of, overrides = [], [], []
        for k, group in enumerate(items):
            if "params" not in group:
                raise FusionTypeError(f"{cls}: param group {k} has no 'params'")
            params = group["params"]
            params = [params] if isinstance(params, Tensor) else list(params)
            extra = {key: value for key, value in group.items() if key != "params"}
            group_flags = {key: extra.pop(key) for key in self._flags if key in extra}
            if group_flags and flags is not None:
                checked = self._check_flags({**flags, **group_flags}, f"param group {k}: ")
                if checked != flags:
                    differ = sorted(key for key in group_flags if checked[key] != flags[key])
                    raise FusionArgumentError(
                        f"{cls}: param group {k} sets "
                        f"{', '.join(f'{key}={group_flags[key]!r}' for key in differ)}, "
                        f"which picks how the update runs for all parameters and models at "
                        f"once; give it to the constructor instead")
            if "lr" in extra:
                raise FusionTypeError(
                    f"{cls}: param group {k} sets lr; param_groups[i] of a fused optimizer "
                    f"is model i, whose learning rate (and its scheduler) holds for all its "
                    f"parameters. Give those parameters a second fused optimizer instead")
            unknown = sorted(set(extra) - set(self._hyperparameters))
            if unknown:
                raise FusionTypeError(
                    f"{cls}: param group {k} has unknown hyper-parameter(s) "
                    f"{unknown}; {cls} takes {sorted(self._hyperparameters)}")
            flat += params
            group_of += [k] * len(params)
            overrides.append(extra)
        _warn_of_grouping_by_stacked_dims(cls, items, overrides)
        return flat, group_of, overrides

    def _infer_num_models(self, names, tensors, num_models, hyperparameters) -> int:
        cls = type(self).__name__
        for name, t in zip(names, tensors):
            if t.dim() == 0:
                raise FusionArgumentError(
                    f"{cls}: parameter {name} is a 0-dim tensor; fused parameters are "
                    f"stacked [N, *shape] (N = number of models): build the optimizer on "
                    f"the fused module's parameters, {cls}(fused.parameters(), ...)"
                )
        leading = {t.shape[0] for t in tensors}
        if len(leading) > 1:
            shapes = ", ".join(f"{n}: {list(t.shape)}" for n, t in zip(names, tensors))
            raise FusionArgumentError(
                f"{cls}: fused parameters must all be stacked [N, *shape] with one N, "
                f"but their leading dims differ ({shapes}); these look like one model's "
                f"parameters: build the optimizer on the fused module's, "
                f"{cls}(fused.parameters(), ...)"
            )
        n = leading.pop()
        if num_models is not None and num_models != n:
            bad = next(name for name, t in zip(names, tensors) if t.shape[0] != num_models)
            shape = list(tensors[names.index(bad)].shape)
            raise FusionArgumentError(
                f"{cls}: num_models={num_models}, but parameter {bad} has shape {shape}: "
                f"each fused parameter must be [N, *shape] with N = {num_models}"
            )
        for key, kind in self._hyperparameters.items():
            value = hyperparameters[key]
            if self._is_per_model(kind, value) and len(value) != n:
                raise FusionArgumentError(
                    f"{cls}: {key} has {len(value)} values but there are {n} models "
                    f"(the parameters' leading dim); give one value per model or one shared value"
                )
        return n

    @staticmethod
    def _is_per_model(kind: str, value: Any) -> bool:
        if kind == "pair":
            # (0.9, 0.999) is one shared pair; [(0.9, 0.999), (0.8, 0.99)] is one per model.
            return _is_sequence(value) and len(value) > 0 and all(_is_sequence(v) for v in value)
        return _is_sequence(value)

    def _expand(self, key: str, kind: str, value: Any, n: int) -> list[Any]:
        convert = {"float": _as_float, "flag": _as_flag, "pair": _as_pair}[kind]
        if self._is_per_model(kind, value):
            return [convert(key, v, i) for i, v in enumerate(value)]
        return [convert(key, value)] * n

    def _default_of(self, key: str, value: Any) -> Any:
        # optimizer.defaults only has to name the hyper-parameters (OneCycleLR and
        # CyclicLR look for "momentum" / "betas" there); model 0's value stands in.
        return self._expand(key, self._hyperparameters[key], value, 1)[0]

    def _check_hyperparameters(self, hp: dict[str, Any], model: int) -> None:
        """Raise ``ValueError`` for model ``model``'s bad values, as the stock class would."""
        for key in ("lr", "eps", "weight_decay", "momentum", "lr_decay",
                    "initial_accumulator_value", "alpha"):
            if key in hp and not hp[key] >= 0.0:
                raise FusionArgumentError(
                    f"Invalid {key} for model {model}: {hp[key]} (must be >= 0)")
        if "betas" in hp:
            for k, b in enumerate(hp["betas"]):
                if not 0.0 <= b < 1.0:
                    raise FusionArgumentError(
                        f"Invalid beta parameter at index {k} for model {model}: {b} "
                        f"(must be in [0, 1))"
                    )

    @classmethod
    def _check_flags(cls, flags: dict[str, Any], where: str = "") -> dict[str, Any]:
        """The constructor's implementation flags, checked: one bool (or ``None``) each;
        ``fused`` as a bool.  What hftc cannot honour raises ``FusionArgumentError``
        saying what to do instead: ``differentiable=True``, ``capturable=True``, and
        ``fused=True`` with ``foreach=True`` (which torch refuses too)."""
        name = cls.__name__
        out: dict[str, Any] = {}
        for key, value in flags.items():
            if isinstance(value, Tensor) and value.numel() == 1:
                value = value.item()
            if value is not None and not isinstance(value, (bool, numbers.Integral)):
                raise FusionArgumentError(
                    f"{name}: {where}{key} takes one bool (or None) for all N models: it "
                    f"picks how the update runs, not a value per model; got {value!r}")
            out[key] = value if value is None else bool(value)
        if "fused" in out:
            out["fused"] = bool(out["fused"])
        if out.get("differentiable"):
            raise FusionArgumentError(
                f"{name}: {where}differentiable=True is not supported: the fused step "
                f"updates the stacked parameters in place under torch.no_grad(), so autograd "
                f"cannot differentiate through it. Pass differentiable=False (the default). "
                f"To differentiate through optimizer steps (meta-learning), step each of "
                f"fused.unfuse()'s models with torch.optim.{name}(..., differentiable=True), "
                f"or write the update functionally (torch.func)")
        if out.get("capturable") and not cls._capturable_supported:
            raise FusionArgumentError(
                f"{name}: {where}capturable=True is not supported: each model's step count "
                f"stays on the CPU and every step prepares the models' coefficients on the "
                f"host (as torch.optim.{name} does with capturable=False), which a CUDA graph "
                f"replay would not repeat. Pass capturable=False (the default): the step "
                f"already runs each op once for all N models, and a torch.compile'd training "
                f"step runs it eagerly")
        if out.get("capturable") and out.get("fused"):
            raise FusionArgumentError(
                f"{name}: {where}capturable=True and fused=True cannot both be set: the "
                f"fused kernels take each model's learning rate as a host number, which a "
                f"CUDA graph replay would not update. Pass capturable=True alone (its step "
                f"runs each op once for all N models)")
        if out.get("fused") and out.get("foreach"):
            raise FusionArgumentError(
                f"{name}: {where}fused=True and foreach=True cannot both be set "
                f"(torch.optim.{name} refuses them together too); pass one of them")
        return out

    def _flag(self, key: str) -> bool:
        """Flag ``key`` (``fused``) as every param group holds it: it picks how the whole
        update runs, so the N models' groups must agree (a user or a loaded state dict
        could set one group's)."""
        groups = self.param_groups
        value = bool(groups[0].get(key))
        for g in groups:
            if bool(g.get(key)) is not value:
                raise FusionArgumentError(
                    f"{type(self).__name__}: the param groups (one per model) disagree on "
                    f"{key} ({[g.get(key) for g in groups]}); it picks how the update runs "
                    f"for all N models at once: set one value in every group")
        return value

    def hyperparameters(self) -> dict[str, list[Any]]:
        """Each hyper-parameter's current value per model: ``{"lr": [lr_0, ..., lr_{N-1}], ...}``.

        Read from ``param_groups`` on every step, so schedulers' changes apply at once.
        """
        out = {}
        groups = self.param_groups
        for key, kind in self._hyperparameters.items():
            values = [g[key] for g in groups]
            # The common case, plain Python values, needs no conversion; checking it is
            # far cheaper than converting, which runs every step.
            if kind == "float" and all(type(v) is float for v in values):
                out[key] = values
                continue
            if kind == "flag" and all(type(v) is bool for v in values):
                out[key] = values
                continue
            if kind == "pair" and all(type(v) is tuple and len(v) == 2 and type(v[0]) is float
                                      and type(v[1]) is float for v in values):
                out[key] = values
                continue
            _check_one_models_values(type(self).__name__, key, kind, values)
            convert = {"float": _as_float, "flag": _as_flag, "pair": _as_pair}[kind]
            out[key] = [convert(key, v, i) for i, v in enumerate(values)]
        return out

    def _note_group_bases(self) -> None:
        """Record each model's current value of every key a param-group dict overrides
        (``_group_overrides``), which :meth:`_check_group_bases` compares at each step."""
        keys = sorted({key for extra in self._group_overrides for key in extra})
        hp = self.hyperparameters() if keys else {}
        self._group_bases = {key: list(hp[key]) for key in keys}

    def _check_group_bases(self, hp: dict[str, list[Any]]) -> None:
        """Refuse a change of ``param_groups[i][key]`` where a param-group dict sets its
        own ``key``: stock's model i has one group per dict, and what changed it (torch's
        OneCycleLR and CyclicLR cycle ``momentum`` / ``betas``) would have written every
        one of them, or only some (code that schedules the decaying groups' weight decay);
        the fused group cannot tell which, so the step would silently keep the group's
        own value where stock took the new one, or the reverse."""
        bases = self.__dict__.get("_group_bases")
        if bases is None:  # a pickle of hftc before the check: from now on
            self._note_group_bases()
            return
        for key, before in bases.items():
            now = hp[key]
            if now == before:
                continue
            if len(now) != len(before):  # (models cut or added by code that did not say)
                self._note_group_bases()
                return
            i = next(i for i, (a, b) in enumerate(zip(before, now)) if a != b)
            groups = [k for k, extra in enumerate(self._group_overrides) if key in extra]
            values = ", ".join(f"param group {k}: {self._group_overrides[k][key][i]!r}"
                               for k in groups)
            raise FusionArgumentError(
                f"{type(self).__name__}.step: param_groups[{i}][{key!r}] (model {i}) changed "
                f"from {before[i]!r} to {now[i]!r} since the optimizer was built, and the "
                f"param-group dicts it was built with set their own {key} ({values}). A "
                f"stock optimizer's scheduler writes each of its groups (OneCycleLR and "
                f"CyclicLR cycle momentum / betas in all of them); param_groups[{i}] is all "
                f"of model {i}'s parameters, so hftc cannot tell which groups the change is "
                f"for. Give those parameters a second fused optimizer (with its own "
                f"scheduler), leave {key!r} out of the group dicts, or pass "
                f"cycle_momentum=False to OneCycleLR / CyclicLR")

    def _stock_foreach(self, params: list[Tensor]) -> list[bool]:
        """Per model, whether its stock optimizer would run its ``foreach`` update on
        ``params`` rather than its for-loop one (``torch.optim.optimizer.
        _default_to_fused_or_foreach``: ``foreach=None`` means foreach where every
        parameter is on a device with foreach kernels, CUDA, not the CPU).

        For the classes whose two updates round differently (NAdam, RAdam): each model
        gets the one its group's ``foreach`` picks (``fuse_optimizers`` copies it per model).
        """
        default = all(p.device.type in _get_foreach_kernels_supported_devices() for p in params)
        return [default if g.get("foreach") is None else bool(g["foreach"])
                for g in self.param_groups]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only used while constructing: groups are models, so none can be added later."""
        if getattr(self, "_groups_frozen", True):
            raise FusionNotImplementedError(
                f"{type(self).__name__}.add_param_group{user_line()}: param_groups[i] is "
                f"model i's hyper-parameters, so groups cannot be added. To train "
                f"parameters left out so far (a backbone unfrozen), make a new fused "
                f"optimizer over all of them (hftc.optim.{type(self).__name__}(fused."
                f"parameters(), ...)) and go on with it; its param_groups[i] are model i's")
        super().add_param_group(param_group)
