"""Each model's own copy: every per-model module hftc makes is built from the model's
own object, never from model 0's with a list of attribute overrides.

::

    models[i]  --meta_copy-->  templates[i]       each model's own Python state: its dicts,
                                                  dataclasses, options objects, closures,
                                                  submodule classes; its tensors on meta
    build(i, fused) = deepcopy(templates[i])
                      + fused's parameters / buffers [i]   under model i's own names
                      + fused's train / eval modes          by model i's own paths

The first-call check's references, the models run one by one, ``unfuse()``, a method fused
anew and the sweep's re-fusing all go through :meth:`ModelCopies.build`: a model whose
config dict says ``scale=3.0`` is run and given back with ``3.0`` wherever it sits among
the N.  :attr:`ModelCopies.checked` lists the models whose Python state differs from model
0's (:func:`hftc.frontends.same_program.program_difference`), which the first-call check
compares besides its sample: a model unlike the others is never left out of the check.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import FusionArgumentError
from ..frontends.same_program import fingerprint, program_difference
from ..frontends.symbolic import deepcopy_module, meta_copy

#: the key torch gives a module's ``get_extra_state()`` in its state dict
EXTRA_STATE_KEY = "_extra_state"


def has_extra_state(module: nn.Module) -> bool:
    """Whether ``module``'s class keeps state besides its tensors (``get_extra_state``),
    which torch saves under ``PATH._extra_state``."""
    return type(module).get_extra_state is not nn.Module.get_extra_state


class ModelCopies:
    """The N models' own objects, kept without their tensors (see the module docstring).

    ``names[i]`` maps a fused tensor name (model 0's) onto model i's name for it, and
    ``paths[i]`` model i's module paths onto the fused module's (``None``: model i's tree
    is model 0's, names and paths alike, the common case)."""

    def __init__(self, models: Sequence[nn.Module], names: Sequence[dict[str, str]],
                 paths: Sequence[dict[str, str]]):
        self.templates = [meta_copy(m) for m in models]
        own_paths = [[p for p, _ in m.named_modules(remove_duplicate=False)] for m in models]
        same = [own_paths[i] == own_paths[0] and all(k == v for k, v in names[i].items())
                for i in range(len(models))]
        self.names: list[dict[str, str] | None] = [
            None if s else dict(n) for s, n in zip(same, names)]
        self.paths: list[dict[str, str] | None] = [
            None if s else dict(p) for s, p in zip(same, paths)]
        #: The models whose Python state differs from model 0's (what the first-call check
        #: compares besides models 0, N // 2 and N - 1).
        first = fingerprint(models[0]) if len(models) > 1 else None
        self.differing = [i for i, m in enumerate(models) if i and (
            fingerprint(m) != first or program_difference(models[0], m) is not None)]

    def __len__(self) -> int:
        return len(self.templates)

    def checked(self, sample: Sequence[int]) -> tuple[int, ...]:
        """``sample`` and every model whose Python state differs from model 0's."""
        return tuple(sorted({*sample, *self.differing}))

    def subset(self, keep: Sequence[int]) -> None:
        """Keep models ``keep`` only, in that order (:func:`hftc.keep_models`)."""
        position = {old: new for new, old in enumerate(keep)}
        self.templates = [self.templates[i] for i in keep]
        self.names = [self.names[i] for i in keep]
        self.paths = [self.paths[i] for i in keep]
        if keep[0] == 0:
            self.differing = sorted(position[i] for i in self.differing if i in position)
        else:  # another model 0: every model is checked (one forward each, at first call)
            self.differing = list(range(1, len(keep)))

    def fused_names(self, index: int) -> dict[str, str] | None:
        """Model ``index``'s tensor names -> the fused names (None: the same)."""
        names = self.names[index]
        return None if names is None else {own: fused for fused, own in names.items()}

    def fused_path(self, index: int, path: str) -> str | None:
        """The fused module's path for model ``index``'s module at ``path`` (None: it
        has none; the module then takes its parent's mode)."""
        paths = self.paths[index]
        return path if paths is None else paths.get(path)

    def build(self, index: int, fused: nn.Module, skip: Sequence[str] = ()) -> nn.Module:
        """Model ``index`` as a module of its own: a deep copy of its own object holding
        its slice of ``fused``'s current parameters and buffers (copies) and ``fused``'s
        modes; ``skip``: fused buffer names that are not the model's (lifted constants)."""
        model = deepcopy_module(self.templates[index])
        # (its modules by path, walked once: get_submodule per tensor walked the path again)
        subs = dict(model.named_modules(remove_duplicate=False))

        def owner_of(path: str) -> nn.Module:
            found = subs.get(path)
            return model.get_submodule(path) if found is None else found  # (its error)

        names = self.names[index]
        own = (lambda name: name) if names is None else (lambda name: names.get(name, name))
        made: dict[int, nn.Parameter] = {}
        for name, p in fused.named_parameters(remove_duplicate=False):
            if id(p) not in made:
                made[id(p)] = nn.Parameter(p.detach()[index].clone(), requires_grad=p.requires_grad)
            owner, _, leaf = own(name).rpartition(".")
            owner_of(owner).register_parameter(leaf, made[id(p)])
        skipped = set(skip)
        for name, b in fused.named_buffers(remove_duplicate=False):
            owner, _, leaf = own(name).rpartition(".")
            if name in skipped or leaf.startswith("_hftc_constant_"):
                continue
            owner_of(owner)._buffers[leaf] = b[index].clone()
        for sub in dict.fromkeys(subs.values()):
            if isinstance(sub, nn.RNNBase):  # (its _flat_weights still held the meta ones)
                sub._init_flat_weights()
        fused_modules = dict(fused.named_modules(remove_duplicate=False))
        modes: dict[str, bool] = {}
        for path, sub in subs.items():
            source = fused_modules.get(self.fused_path(index, path) or "\0")
            mode = (source.training if source is not None
                    else modes.get(path.rpartition(".")[0], fused.training))
            modes[path] = sub.training = mode
        return model

    def own_path(self, index: int, fused_path: str) -> str | None:
        """Model ``index``'s module path for the fused module's ``fused_path`` (None: none)."""
        paths = self.paths[index]
        if paths is None:
            return fused_path
        return next((own for own, fused in paths.items() if fused == fused_path), None)

    def extra_state_paths(self) -> list[str]:
        """The fused module paths (model 0's) whose module keeps extra state in any model."""
        found: dict[str, None] = {}
        for i, template in enumerate(self.templates):
            for path, sub in template.named_modules(remove_duplicate=False):
                fused_path = self.fused_path(i, path)
                if fused_path is not None and has_extra_state(sub):
                    found[fused_path] = None
        return list(found)

    def extra_states(self, path: str, own_model: Callable[[int], nn.Module],
                     live: bool = False, sources: Sequence[nn.Module] | None = None
                     ) -> list[Any]:
        """Each model's ``get_extra_state()`` of its module at fused ``path`` (None where a
        model has none there); ``own_model(i)`` builds model i with its tensors, for an
        extra state that holds or reads them (a template's are on the meta device).
        ``live``: the models' forwards change their Python state (a step counter), which
        the templates keep as fused: each model's own module, as its forwards left it.
        ``sources``: the models' own objects where the templates are not (pad_widths=True:
        the templates are padded, the originals at their own widths)."""
        states = []
        for i, template in enumerate(self.templates if sources is None else sources):
            own = self.own_path(i, path)
            sub = None if own is None else template.get_submodule(own)
            if sub is None or not has_extra_state(sub):
                states.append(None)
                continue
            if live:
                states.append(own_model(i).get_submodule(own).get_extra_state())
                continue
            try:
                state = sub.get_extra_state()
                on_meta = any(isinstance(leaf, torch.Tensor) and leaf.is_meta
                              for leaf in pytree.tree_leaves(state))
            except (RuntimeError, NotImplementedError):  # it read a meta tensor's values
                on_meta = True  # (`int(self.seen)`, `.item()`: "cannot be called on meta")
            if on_meta:
                state = own_model(i).get_submodule(own).get_extra_state()
            states.append(state)
        return states

    def check_extra_states(self, key: str, states: Any) -> None:
        """``states`` (a fused state dict's ``key``) is a list of one per model, or an error
        saying what it should be."""
        n = len(self.templates)
        if not isinstance(states, (list, tuple)) or len(states) != n:
            other_n = isinstance(states, (list, tuple))
            raise FusionArgumentError(
                f"load_state_dict: `{key}` must hold the {n} models' extra states, a list of "
                f"{n} (what fused.state_dict() saves), got {type(states).__name__}"
                + (f" of {len(states)}: a fused module of {len(states)} models saved it; "
                   f"load it into a fused module of as many models"
                   if other_n else
                   "; one model's extra state goes into that model (model.load_state_dict)"))

    def load_extra_states(self, states: dict[str, Sequence[Any]],
                          own_model: Callable[[int], nn.Module],
                          undo: list[Callable[[], None]],
                          into: list[nn.Module] | None = None,
                          ) -> tuple[str | None, dict[int, nn.Module]]:
        """``set_extra_state`` of each model's modules from ``states`` (fused path -> one
        state per model, checked), as torch's load calls it: on model i's own module with
        its tensors (``own_model(i)``: a ``set_extra_state`` may write them, a non-persistent
        scale buffer), whose Python state becomes model i's template::

            model_i = own_model(i); model_i.<path>.set_extra_state(states[path][i]) ...
            templates[i] = meta_copy(model_i)      -> returned: {i: model_i}, to take the tensors

        Returns what that changes of what the fused program was built from, in words
        (None: nothing; else the caller fuses anew), and the models.  ``undo`` gets what
        puts each template back, for a caller whose fusing anew fails.  ``into``: the
        models' own objects where the templates are not (pad_widths=True: the originals)."""
        changed, loaded = None, {}
        into = self.templates if into is None else into
        for i, template in enumerate(list(into)):
            mine = [(own, path) for path in states
                    if (own := self.own_path(i, path)) is not None
                    and has_extra_state(template.get_submodule(own))]
            if not mine:
                continue
            model = own_model(i)
            for own, path in mine:
                model.get_submodule(own).set_extra_state(states[path][i])
            twin = meta_copy(model)
            # (the template's modes, not the fused module's that ``model`` was built with:
            # the modes are the fused module's to set, and no change of the program)
            for (_, sub), (_, was) in zip(twin.named_modules(remove_duplicate=False),
                                          template.named_modules(remove_duplicate=False)):
                sub.training = was.training
            difference = program_difference(template, twin)
            if difference is not None and changed is None:
                changed = f"model {i}'s: {difference}"
            into[i] = twin
            undo.append(functools.partial(into.__setitem__, i, template))
            loaded[i] = model
        return changed, loaded

    def deepcopy_templates(self) -> list[nn.Module]:
        """Fresh copies of the templates (what tracing again runs, so that a forward which
        changes its attributes changes no template)."""
        return [deepcopy_module(t) for t in self.templates]

