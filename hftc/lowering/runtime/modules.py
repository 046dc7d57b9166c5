"""The fused module's tree: the originals' module paths, holding stacked tensors.

``fused.layer1[0].conv1.weight`` is ``torch.stack`` of the N models'
``layer1[0].conv1.weight``: same path, same name, a leading model dim.  Every
module of model 0 with parameters or buffers becomes a :class:`StackedModule`
at its path (it computes nothing: the fused graph reads its tensors and its
``training`` flag); a module with neither is copied as it is (``nn.ReLU``,
``nn.Dropout``, ``nn.MaxPool2d``), since it can run on fused data unchanged or
lends its hyper-parameters to a rule.

This module holds the tree's classes; :mod:`hftc.module.stacking` builds the tree (it compares
the models, which the runtime does not).  It also knows which parameters are stacked (their
mark, the live fused modules): what torch's clipping as patched by :mod:`hftc.patches` and
the refusals of coupling optimizers ask.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ... import ir
from ...errors import (
    FusionArgumentError,
    FusionNotImplementedError,
    FusionTypeError,
    UnsupportedOperatorError,
    user_line,
)


class ContainerAccess:
    """Indexing, ``len()`` and iteration as the container a module mirrors
    (``_container``: "list" for ``nn.Sequential`` / ``nn.ModuleList``, "dict" for
    ``nn.ModuleDict``, None for other modules, which support none of them)."""

    _container: str | None = None
    source_type: str = ""

    @staticmethod
    def container_kind(source: nn.Module) -> str | None:
        return ("list" if isinstance(source, (nn.Sequential, nn.ModuleList))
                else "dict" if isinstance(source, nn.ModuleDict) else None)

    def _container_of(self, what: str) -> str:
        container = self.__dict__.get("_container")
        if container is None:
            raise FusionTypeError(
                f"'{self.source_type}' (stacked by hftc) does not support {what}{user_line()}, "
                f"as one {self.source_type} does not; {self._not_a_container_hint()}")
        return container

    def _not_a_container_hint(self) -> str:
        """What a user reaching for one model's share of this module takes instead."""
        path = self.__dict__.get("_hftc_path")
        name = next((name for name, _ in self.named_parameters()), "weight")
        return (f"each of its tensors is stacked [N, *shape], model i's at index i "
                f"(fused.{path}.{name}[i]), and model i itself is fused.unfuse_model(i)")

    def __getitem__(self, key: int | str) -> nn.Module:
        """``fused.blocks[0]`` as ``model.blocks[0]`` (``fused.heads["a"]`` for a ModuleDict):
        the freeze-the-first-k-blocks habit on the fused module."""
        if self._container_of("indexing") == "list" and isinstance(key, int):
            names = list(self._modules)
            if not -len(names) <= key < len(names):
                raise IndexError(f"index {key} is out of range for {len(names)} modules")
            return self._modules[names[key]]
        if isinstance(key, str) and key in self._modules:
            return self._modules[key]
        raise KeyError(key)

    def __len__(self) -> int:
        self._container_of("len()")
        return len(self._modules)

    def __bool__(self) -> bool:  # a module is true, container or not (``__len__`` raises)
        return True

    def __iter__(self):
        if self._container_of("iteration") == "dict":
            return iter(self._modules)
        return iter(self._modules.values())


def refuse_model_attribute(owner: nn.Module, where: str, name: str, value: Any,
                           template: nn.Module | None, mirrored: Any = ()) -> None:
    """Refuse ``fused.temperature = 0.5`` (``where`` names the module: ``"fused"``,
    ``"fused.attn"``) where ``name`` is a plain attribute of the models' module there
    (``template``, model 0's): the program was built from each model's own value and
    nothing hftc runs reads the fused module's, so the assignment changed nothing while a
    read of it gave the new value back.  A name the fused module holds itself (its own
    options, ``training``) or a private one is set as usual."""
    if template is None or name.startswith("_"):
        return
    cls = type(template).__name__
    if name in owner._modules and isinstance(value, nn.Module) \
            and value is not owner._modules[name]:
        raise FusionArgumentError(
            f"{where}.{name} = {type(value).__name__}(...) would not be each model's: the "
            f"fused program was built from each model's own `{name}` "
            f"({type(owner._modules[name]).__name__} of {cls}) and reads the fused "
            f"module's tree, the models one by one and unfuse() each model's own, copied "
            f"when fused" + _at_user_line() +
            "\nSet it on each model (models = fused.unfuse()) and fuse them again")
    if (name == "training" or (name in owner.__dict__ and name not in mirrored)
            or hasattr(type(owner), name)
            or name not in vars(template) or isinstance(value, nn.Module)):
        return
    raise FusionArgumentError(
        f"{where}.{name} = {value!r} would change nothing: the fused program was built "
        f"from each model's own `{name}` (a plain attribute of {cls}; model 0's is "
        f"{getattr(template, name)!r}) and does not read the fused module's"
        + _at_user_line() +
        f"\nTo change it between calls, keep it in a buffer "
        f"(self.register_buffer('{name}', torch.tensor(...)) in {cls}.__init__): the fused "
        f"module holds it stacked, one per model, and {where}.{name}.fill_(v) or "
        f"{where}.{name}[i] = v sets model i's. Or set it on each model "
        f"(models = fused.unfuse()) and fuse them again")


def _at_user_line() -> str:
    line = ir.user_frame_trace()
    return f"\n  {line}" if line else ""


def _called_from(function: str, file: str, skip: int, frames: int) -> bool:
    """Whether torch's ``function`` (defined in a file whose name ends with ``file``) runs
    one of ``frames`` frames above the ``skip`` innermost of the frames that call this
    (``skip=1``: above the caller's own)."""
    frame = sys._getframe(skip + 1)
    for _ in range(frames):
        if frame is None:
            return False
        if frame.f_code.co_name == function and frame.f_code.co_filename.endswith(file):
            return True
        frame = frame.f_back
    return False


def _registering_parametrization() -> bool:
    """Whether torch's ``register_parametrization`` is the caller (via is_parametrized)."""
    return _called_from("register_parametrization", "parametrize.py", skip=2, frames=3)


def _where(module: nn.Module) -> str:
    path = module.__dict__.get("_hftc_path")
    return f"fused.{path}" if path else "fused"


class RefusedQConfig:
    """The ``qconfig`` of a fused module and of its stacked modules: none to read, and
    none to set.

    ``torch.ao.quantization`` (``quantize_dynamic``, ``prepare``/``convert``) sets a
    ``qconfig`` on every module, then swaps the modules whose exact class it maps: a
    stacked one is none of them, so the fused module came back unquantized, its float
    results as if quantized.  Refused at the first ``qconfig`` set, before any swap.

    ``nn.SyncBatchNorm.convert_sync_batchnorm`` reads it (``hasattr(module, "qconfig")``)
    after building the SyncBatchNorm that would replace a stacked batch norm, holding its
    stacked tensors: the fused program runs its own batch norm, which syncs nothing, so
    that read is refused too, before the fused tree changes."""

    def __get__(self, module: nn.Module | None, owner: type | None = None) -> Any:
        if module is None:
            return self
        if _called_from("convert_sync_batchnorm", "batchnorm.py", skip=1, frames=1):
            raise UnsupportedOperatorError(
                f"nn.SyncBatchNorm.convert_sync_batchnorm on {_where(module)} "
                f"({module.source_type}, stacked by hftc) would put a SyncBatchNorm holding "
                f"the N models' stacked statistics in the fused module, whose program runs "
                f"its own batch norm: no statistics would be synced across processes"
                + _at_user_line() + "\nConvert each model before fusing (models = "
                "[nn.SyncBatchNorm.convert_sync_batchnorm(m) for m in models]; then "
                "hftc.fuse(models), and DDP(fused)): each model's SyncBatchNorm then syncs "
                "its own statistics")
        raise AttributeError("qconfig")

    def __set__(self, module: nn.Module, value: Any) -> None:
        name = getattr(module, "source_type", type(module).__name__)
        given = "None" if value is None else f"{type(value).__name__}(...)"
        raise UnsupportedOperatorError(
            f"torch.ao.quantization on the fused module ({_where(module)}.qconfig = "
            f"{given} on {name}): its quantized modules would replace modules holding the "
            f"N models' stacked [N, ...] tensors, which torch's module swap does not "
            f"recognise, so the fused module would stay unquantized, giving float results "
            f"as if quantized" + _at_user_line() +
            "\nQuantize each model (models = fused.unfuse(); "
            "torch.ao.quantization.quantize_dynamic(m, {nn.Linear}) for m in models): hftc "
            "fuses float models")


class StackedModule(ContainerAccess, nn.Module):
    """N modules' parameters and buffers stacked ``[N, *shape]`` under their own names.

    ``_hftc_template`` (not a submodule: it holds no data) is model 0's module on
    the meta device, used for the one-by-one fallback and for ``unfuse()``.
    """

    def __init__(self, source: nn.Module, num_models: int):
        nn.Module.__init__(self)  # (not a mirrored torch class's __init__: see stacked_module)
        self.source_type = type(source).__name__
        self._source_repr = source.extra_repr()
        self.num_models = num_models
        self.training = source.training
        #: "list" (nn.Sequential, nn.ModuleList), "dict" (nn.ModuleDict) or None: how the
        #: source's children are reached (``fused.blocks[0]``, ``len(fused.blocks)``)
        self._container = self.container_kind(source)

    def extra_repr(self) -> str:
        return f"{self.source_type}({self._source_repr}) x {self.num_models}"

    qconfig = RefusedQConfig()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # (a mirrored class's own, _ConvNd's, would set a missing attribute: refused here)
        nn.Module.__setstate__(self, state)

    def __setattr__(self, name: str, value: Any) -> None:
        # (fused.attn.scale = 2.0: the program holds each model's own scale, not this)
        path = self.__dict__.get("_hftc_path")
        refuse_model_attribute(self, f"fused.{path}" if path else "fused", name, value,
                               self.__dict__.get("_hftc_template"),
                               self.__dict__.get("_hftc_mirrored", ()))
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        # (torch.nn.utils.parametrize.register_parametrization deletes the tensor: the
        # program would go on reading the stale stacked one)
        if name in self._parameters or name in self._buffers:
            self._refuse_parametrization(name)
        super().__delattr__(name)

    @property
    def parametrizations(self) -> Any:
        # register_parametrization asks for ``parametrizations`` first, before its
        # right_inverse (orthogonal's) writes the stacked tensor in place: refused there,
        # the fused module is left as it was.  (A property, not a __getattr__ of its own:
        # every read of a stacked tensor goes through nn.Module.__getattr__.)
        if _registering_parametrization():
            self._refuse_parametrization(None)
        # (torch.ao.quantization.fuse_modules reads it through type_before_parametrizations,
        # then finds no fuser for the stacked classes: a bare AssertionError)
        if _called_from("fuse_known_modules", "fuse_modules.py", skip=1, frames=4):
            raise UnsupportedOperatorError(
                f"torch.ao.quantization.fuse_modules on {_where(self)} ({self.source_type}, "
                f"stacked by hftc): its fusers fold one model's modules (a conv and its batch "
                f"norm) into one of torch's classes, not N models' stacked tensors"
                + _at_user_line() + "\nFuse each model's modules before fusing the models: "
                "models = [torch.ao.quantization.fuse_modules(m, [['conv', 'bn', 'relu']]) "
                "for m in models]; then hftc.fuse(models)")
        raise AttributeError("parametrizations")  # none: is_parametrized() reads False

    def register_parameter(self, name: str, param: Any) -> None:
        # torch.nn.utils.prune renames the weight to ``weight_orig`` first, then would
        # mask it from a hook that never runs (and its mask is over all N models' rows):
        # refused before it changes anything
        frame = sys._getframe(1)
        caller = frame.f_code.co_filename.replace("\\", "/")
        if caller.endswith("nn/utils/weight_norm.py"):
            self._put_back_weight_norms_tensor(frame.f_locals)
            self._refuse_parametrization(None)
        if caller.endswith("nn/utils/prune.py"):
            path = self.__dict__.get("_hftc_path")
            raise UnsupportedOperatorError(
                f"torch.nn.utils.prune on fused.{path} ({self.source_type}, stacked by "
                f"hftc) would mask the stacked [N, ...] tensor from a forward pre-hook the "
                f"fused program never runs, its amounts over all N models' rows at once"
                + _at_user_line() + "\nPrune each model before fusing (for m in models: "
                "prune.l1_unstructured(m.<module>, 'weight', amount); "
                "prune.remove(m.<module>, 'weight'); then hftc.fuse(models))")
        super().register_parameter(name, param)

    def _put_back_weight_norms_tensor(self, apply_locals: dict[str, Any]) -> None:
        """The stacked tensor ``torch.nn.utils.weight_norm`` took out of ``_parameters``
        (``del module._parameters[name]``, before it registers ``name_g``) put back, in
        the models' order of parameters: the fused module as it was before the refusal."""
        name, weight = apply_locals.get("name"), apply_locals.get("weight")
        if name is None or name in self._parameters or not isinstance(weight, nn.Parameter):
            return
        self._parameters[name] = weight
        order = list(getattr(self.__dict__.get("_hftc_template"), "_parameters", {}))
        for key in sorted(self._parameters, key=lambda k: order.index(k) if k in order
                          else len(order)):
            self._parameters[key] = self._parameters.pop(key)

    def _refuse_parametrization(self, name: str | None) -> None:
        path = self.__dict__.get("_hftc_path")
        where = f"fused.{path}" if path else "fused"
        what = f"`del {where}.{name}`, as they do," if name else f"on {where}"
        raise UnsupportedOperatorError(
            f"torch's parametrizations (weight_norm, spectral_norm, orthogonal, "
            f"register_parametrization) {what} ({self.source_type}, stacked by hftc) "
            f"would take model tensors from the fused program, which reads them stacked "
            f"[N, ...]; a parametrization there would see all N models' rows as one "
            f"tensor" + _at_user_line() +
            "\nParametrize each model before fusing (for m in models: "
            "torch.nn.utils.parametrizations.weight_norm(m.<module>); then "
            "hftc.fuse(models)): each model's parametrization then runs on its own")

    # ------------------------------------------------------------ hooks never run

    def _no_hooks(self, *args, **kwargs):
        raise UnsupportedOperatorError(
            f"a hook on a fused module's submodule ({self.source_type}, stacked by hftc) "
            f"would never run: the fused program reads its stacked tensors and does not "
            f"call it. Register hooks on the fused module itself (its outputs are the N "
            f"models' stacked), or on an unfused model (fused.unfuse_model(i))")

    register_forward_hook = _no_hooks
    register_forward_pre_hook = _no_hooks
    register_full_backward_hook = _no_hooks
    register_full_backward_pre_hook = _no_hooks
    register_backward_hook = _no_hooks

    def forward(self, *args, **kwargs):  # (the fused graph never calls it; a user's line may)
        path = self.__dict__.get("_hftc_path") or "<submodule>"
        raise FusionNotImplementedError(
            f"fused.{path}(...){user_line()}: a StackedModule ({self.source_type}) holds "
            f"the N models' stacked tensors for the fused program and computes nothing "
            f"itself. Call the fused module (fused(x): each model's whole forward), fuse "
            f"this part of the models apart (hftc.fuse([m.{path} for m in models]), e.g. a "
            f"backbone's features), or run model i's own: fused.unfuse_model(i).{path}(x)")


# --------------------------------------------------------------------------- torch's classes

#: torch.nn's classes whose stacked module is also one of them: ``isinstance(m,
#: nn.Linear)`` over ``fused.modules()`` (a weight-decay group, an init loop, freezing
#: batch norms with ``m.eval()``) finds it, as it finds the models' own.  Their methods
#: (``reset_parameters``, ``reset_running_stats``) read only the stacked tensors, the
#: attributes mirrored from the models and ``torch.nn.init``, which is per model on
#: stacked parameters (:mod:`hftc.training.weight_init`).  Classes with a state of their own
#: (RNNs' flat weights, attention) or code of the user's stay plain StackedModules.
MIRRORED_CLASSES = (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
    nn.ConvTranspose3d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm,
    nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.GroupNorm, nn.LayerNorm,
    nn.RMSNorm, nn.Embedding)


def _fill_padding_idx_per_model(self: nn.Module) -> None:
    """``nn.Embedding``'s padding row zeroed in each model's table (``weight[:, idx]``;
    torch's ``weight[idx]`` would zero model ``idx``'s whole table)."""
    index = self.__dict__["_hftc_template"].padding_idx
    if index is not None:
        with torch.no_grad():
            self.weight[:, index].fill_(0)


def _padding_idx(self: nn.Module) -> int | None:
    """None where the models have no padding index; else refused: HF's ``_init_weights``
    zeroes ``weight.data[module.padding_idx]``, which in the stacked ``[N, num, dim]``
    weight is model ``padding_idx``'s whole table."""
    index = self.__dict__["_hftc_template"].padding_idx
    if index is None:
        return None
    path = self.__dict__.get("_hftc_path")
    raise FusionArgumentError(
        f"fused.{path}.padding_idx: this nn.Embedding is the {self.num_models} models' "
        f"stacked (weight [N, num_embeddings, embedding_dim]), so "
        f"weight[padding_idx] would be model {index}'s whole table" + _at_user_line() +
        f"\nIndex each model's padding row with weight[:, {index}], or run the init on "
        f"each model's own modules: fused.apply(init_fn)")


def _stacked_class(base: type) -> type:
    extra = ({"_fill_padding_idx_with_zero": _fill_padding_idx_per_model,
              "padding_idx": property(_padding_idx)} if base is nn.Embedding else {})
    name = f"Stacked{base.__name__}"
    return type(name, (StackedModule, base), {"__module__": __name__, "__qualname__": name,
                                              "__doc__": f"A stacked {base.__name__}.",
                                              **extra})


#: torch's class -> its stacked class (module globals, so pickle finds them by name).
STACKED_CLASSES = {base: _stacked_class(base) for base in MIRRORED_CLASSES}
globals().update({cls.__name__: cls for cls in STACKED_CLASSES.values()})


def _same(values: Sequence[Any]) -> bool:
    try:
        return all(bool(v == values[0]) for v in values[1:])
    except Exception:  # (an object whose == is not a bool)
        return False


def stacked_module(source: nn.Module, num_models: int,
                   peers: Sequence[nn.Module | None] = ()) -> StackedModule:
    """The StackedModule for model 0's ``source`` (``peers``: every model's module at its
    path, None where one has none).  Where ``source`` is (a subclass of) one of
    :data:`MIRRORED_CLASSES`, it is of that class's stacked class, holding the public
    plain attributes every model has alike (``in_features``, ``eps``; one that differs
    is left out: a read of it raises, rather than give model 0's)::

        isinstance(fused.fc, nn.Linear)    # True; fused.fc.weight is [N, out, in]
        fused.fc.in_features = 8           # refused, as for any model attribute
    """
    base = next((c for c in type(source).__mro__ if c in STACKED_CLASSES), None)
    node = StackedModule.__new__(StackedModule if base is None else STACKED_CLASSES[base])
    StackedModule.__init__(node, source, num_models)
    if base is not None:
        others = [p for p in peers if p is not source]
        mirrored = {name: value for name, value in vars(source).items()
                    if not name.startswith("_") and name != "training"
                    and not isinstance(getattr(type(node), name, None), property)
                    and not isinstance(value, (Tensor, nn.Module))
                    and all(p is not None and hasattr(p, name) for p in others)
                    and _same([value, *(getattr(p, name) for p in others)])}
        node.__dict__.update(mirrored)
        node.__dict__["_hftc_mirrored"] = frozenset(mirrored)
    return node


# --------------------------------------------------------------------------- stacked parameters

#: The attribute that marks a fused module's stacked parameters (``FusedModule`` sets it
#: to N): what ``torch.nn.utils.clip_grad_norm_`` clips per model.  An attribute of the
#: tensor, so deepcopy, pickling and ``.to()`` keep it.
STACKED_MARK = "_hftc_num_models"


#: The live fused modules (weakly): their parameters are stacked whatever their marks say
#: (``load_state_dict(..., assign=True)`` puts in new Parameter objects), and the gradients
#: torch's two-step clipping gets carry no mark of their own.  Modules, not their
#: tensors: ``torch.utils.swap_tensors`` (``.to()`` under
#: ``torch.__future__.set_swap_module_params_on_conversion(True)``, ``load_state_dict``)
#: refuses a tensor that has a weak reference.
FUSED_MODULES: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def register_fused(module: nn.Module) -> None:
    """Count ``module``'s parameters as stacked from now on (``FusedModule`` calls it)."""
    FUSED_MODULES.add(module)


def live_stacked() -> dict[int, tuple[Tensor, int]]:
    """``id(parameter) -> (parameter, N)`` for every live fused module's parameters."""
    return {id(p): (p, module.num_models) for module in list(FUSED_MODULES)
            for p in module.parameters()}


def _num_models(p: Tensor, live: dict[int, tuple[Tensor, int]] | None = None) -> int | None:
    """N where ``p`` is a fused module's stacked parameter, else ``None``."""
    mark = getattr(p, STACKED_MARK, None)
    if mark is not None:
        return mark
    entry = (live if live is not None else live_stacked()).get(id(p))
    return None if entry is None or entry[0] is not p else entry[1]


def stacked_counts(params: Sequence[Tensor]) -> list[int | None]:
    live = None if all(_num_models(p, {}) is not None for p in params) else live_stacked()
    return [_num_models(p, live) for p in params]


def mark_stacked(p: Tensor, num_models: int) -> None:
    """Mark ``p`` as a fused module's stacked ``[N, ...]`` parameter (see ``STACKED_MARK``)."""
    setattr(p, STACKED_MARK, num_models)
