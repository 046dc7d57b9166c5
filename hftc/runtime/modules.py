"""The fused module's tree: the originals' module paths, holding stacked tensors.

``fused.layer1[0].conv1.weight`` is ``torch.stack`` of the N models'
``layer1[0].conv1.weight``: same path, same name, a leading model dim.  Every
module of model 0 with parameters or buffers becomes a :class:`StackedModule`
at its path (it computes nothing: the fused graph reads its tensors and its
``training`` flag); a module with neither is copied as it is (``nn.ReLU``,
``nn.Dropout``, ``nn.MaxPool2d``), since it can run on fused data unchanged or
lends its hyper-parameters to a rule.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import MismatchError, UnsupportedOperatorError
from ..match import describe_differences, fixes_for, tensor_signature


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
            raise TypeError(f"'{self.source_type}' (stacked by hftc) does not support {what}")
        return container

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


class StackedModule(ContainerAccess, nn.Module):
    """N modules' parameters and buffers stacked ``[N, *shape]`` under their own names.

    ``_hftc_template`` (not a submodule: it holds no data) is model 0's module on
    the meta device, used for the per-model loop fallback and for ``unfuse()``.
    """

    def __init__(self, source: nn.Module, num_models: int):
        super().__init__()
        self.source_type = type(source).__name__
        self._source_repr = source.extra_repr()
        self.num_models = num_models
        self.training = source.training
        #: "list" (nn.Sequential, nn.ModuleList), "dict" (nn.ModuleDict) or None: how the
        #: source's children are reached (``fused.blocks[0]``, ``len(fused.blocks)``)
        self._container = self.container_kind(source)

    def extra_repr(self) -> str:
        return f"{self.source_type}({self._source_repr}) x {self.num_models}"

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

    def forward(self, *args, **kwargs):  # pragma: no cover - the fused graph never calls it
        raise RuntimeError(
            f"a StackedModule ({self.source_type}) holds stacked tensors for the fused graph; "
            f"call the FusedModule, not its submodules"
        )


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())


def build_module_tree(
    models: Sequence[nn.Module], templates: nn.Module, name_maps: Sequence[dict[str, str]]
) -> tuple[nn.Module, dict[str, nn.Parameter]]:
    """Mirror model 0's module tree with every parameter and buffer stacked over the N models.

    ``name_maps[i]`` maps a tensor name of model 0 onto model i's name for the same
    tensor (identity for same-class models).  Tied tensors (one Parameter under two
    names, such as an embedding shared with an output projection) stay tied: both
    names hold the one stacked Parameter.  Returns the root and, for
    ``fuse_optimizers``, the fused parameter behind each original parameter id.
    """
    num_models = len(models)
    model0 = models[0]
    root = _make_node(model0, templates, num_models)
    nodes: dict[str, nn.Module] = {"": root}
    for path, sub in model0.named_modules(remove_duplicate=False):
        if path == "":
            continue
        parent_path, _, leaf = path.rpartition(".")
        if path in nodes:
            continue
        node = _make_node(sub, templates.get_submodule(path), num_models)
        setattr(nodes[parent_path], leaf, node)
        nodes[path] = node

    named = [dict(m.named_parameters(remove_duplicate=False)) for m in models]
    named_buffers = [dict(m.named_buffers(remove_duplicate=False)) for m in models]
    for kind, tables in (("parameter", named), ("buffer", named_buffers)):
        _check_same_tensors(kind, tables, name_maps)
    stacked: dict[int, torch.Tensor] = {}  # id(model 0's tensor) -> stacked tensor (ties)
    sources: dict[int, nn.Parameter] = {}  # id(any model's parameter) -> fused parameter
    for kind, tables in (("parameter", named), ("buffer", named_buffers)):
        for name, t0 in tables[0].items():
            owner_path, _, leaf = name.rpartition(".")
            owner = nodes[owner_path]
            if not isinstance(owner, StackedModule) and owner is not root:
                continue
            per_model = [table[name_maps[i].get(name, name)] for i, table in enumerate(tables)]
            if id(t0) not in stacked:
                _check_ties(name, per_model, tables, name_maps)
                with torch.no_grad():
                    data = torch.stack([t.detach() for t in per_model])
                if kind == "parameter":
                    fused = nn.Parameter(data, requires_grad=t0.requires_grad)
                    for t in per_model:
                        sources[id(t)] = fused
                else:
                    fused = data
                stacked[id(t0)] = fused
            fused = stacked[id(t0)]
            if kind == "parameter":
                owner.register_parameter(leaf, fused)
            else:
                source_owner = model0.get_submodule(owner_path)
                persistent = leaf not in source_owner._non_persistent_buffers_set
                owner.register_buffer(leaf, fused, persistent=persistent)
    return root, sources


def _check_same_tensors(kind: str, tables: Sequence[dict[str, torch.Tensor]],
                        name_maps: Sequence[dict[str, str]]) -> None:
    """Every model holds the same parameters (or buffers) as model 0, each of the same
    shape, dtype and ``requires_grad``, or a :class:`MismatchError` names the one that is
    not.  Matching compared the tensors forward reads; these are the ones it does not:
    one registered in model i only was dropped from its ``model_state_dict()`` and
    ``unfuse()``, one of another shape crashed in ``torch.stack``."""
    fix = (f"Register the same {kind}s in every model (hftc fuses models of the same "
           f"architecture; hftc.fuse_groups splits a mixed list into groups that can be fused).")
    for i, table in enumerate(tables[1:], start=1):
        mapped = {name: name_maps[i].get(name, name) for name in tables[0]}
        for name, other in mapped.items():
            if other not in table:
                alias = "" if other == name else f" (model 0's `{name}`)"
                raise MismatchError(
                    f"model {i} has no {kind} `{other}`{alias}, which model 0 has "
                    f"({tensor_signature(tables[0][name])}). {fix}")
        extra = sorted(table.keys() - set(mapped.values()))
        if extra:
            listed = ", ".join(f"`{other}` ({tensor_signature(table[other])})" for other in extra)
            raise MismatchError(
                f"model {i} has {kind}(s) that model 0 lacks: {listed}. Forward does not "
                f"read them, and the fused module, built on model 0's {kind}s, would drop "
                f"them from model {i}'s model_state_dict() and unfuse(). {fix}")
        for name, other in mapped.items():
            label = f"{kind} `{other}`"
            texts, kinds = describe_differences({label: tensor_signature(table[other])},
                                                {label: tensor_signature(tables[0][name])})
            if texts:
                theirs = "model 0's" if other == name else f"model 0's `{name}`"
                raise MismatchError(
                    f"model {i}'s {kind} `{other}` differs from {theirs}: "
                    f"{'; '.join(t.partition(': ')[2] for t in texts)}. {fixes_for(kinds)}")


def _check_ties(name, per_model, tables, name_maps) -> None:
    # A tensor tied to another in model 0 must be tied the same way in every model.
    ids0 = [n for n, t in tables[0].items() if t is per_model[0]]
    for i, table in enumerate(tables[1:], start=1):
        ids_i = [n for n, t in table.items() if t is per_model[i]]
        if len(ids_i) != len(ids0):
            raise MismatchError(
                f"`{name}` is shared by {ids0} in model 0 but by {ids_i} in model {i}: "
                f"weight tying differs between the models"
            )


def _make_node(source: nn.Module, template: nn.Module, num_models: int) -> nn.Module:
    if not _has_state(source):
        from ..trace import deepcopy_module

        return deepcopy_module(source)
    node = StackedModule(source, num_models)
    object.__setattr__(node, "_hftc_template", template)
    return node
