"""A fused module's models given back, one at a time or cut to some: each model's
``state_dict`` and a module of its own (:mod:`hftc.module.copies`), ``keep_models``' cut
and ``replace_models``' take-over.

::

    fused.unfuse_model(i)  ->  model i's own copy holding [i] of every stacked tensor
    fused._keep_models([2, 0])  ->  P.data = P[[2, 0]] for every stacked tensor, in place

:class:`Unfusing` is a part of :class:`~hftc.module.fused.FusedModule`.
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .. import ir
from ..errors import (
    FusionArgumentError,
    FusionIndexError,
    FusionNotImplementedError,
    FusionTypeError,
    user_line,
)
from ..lowering.runtime.modules import StackedModule
from ..passes.driver import SHARED_CONSTANT_PREFIX
from .usage import note_copy


def _drop_grad_accumulator(p: torch.Tensor) -> None:
    """Make autograd give ``p`` a new gradient accumulator before its rows are cut.

    A graph still alive from an earlier step (a loss the loop still holds) keeps ``p``'s
    accumulator, which remembers the old shape ``[N, ...]``: the next backward would
    refuse the ``[k, ...]`` gradient.  torch replaces the accumulator when ``.data``
    changes dtype, and not when it changes shape; hence the brief detour."""
    other = torch.float32 if p.dtype != torch.float32 else torch.float64
    p.data = torch.empty(0, dtype=other, device=p.device)


#: ``FusedModule.__dict__`` entries made lazily from its models, dropped where it takes
#: another module's models over (:meth:`FusedModule._become`).
_MADE_FROM_MODELS = ("_shared_one_by_one", "_methods_one_by_one", "_method_modules",
                     "_last_call_program", "_kept_checks")



_TENSOR_SLOTS = frozenset({"_parameters", "_buffers", "_modules"})


def _python_state(model: nn.Module) -> dict[str, tuple[type, dict[str, Any]]]:
    """Each module's class and plain attributes (``eps``, ``training``, its hooks' dicts
    copied), by path: what an ``apply(fn)`` could change besides tensors."""
    return {path: (type(m), {k: copy.copy(v) if isinstance(v, (dict, list, set)) else v
                             for k, v in vars(m).items() if k not in _TENSOR_SLOTS})
            for path, m in model.named_modules(remove_duplicate=False)}


def _changed_python_state(before: dict[str, Any], after: dict[str, Any],
                          index: int) -> str | None:
    """Model ``index``'s first module attribute (``'1.eps'``) or submodule that differs."""
    for path in [*before, *(p for p in after if p not in before)]:
        if path not in before or path not in after or before[path][0] is not after[path][0]:
            return f"model {index}'s submodule {path!r}"
        old, new = before[path][1], after[path][1]
        for key in [*old, *(k for k in new if k not in old)]:
            a, b = old.get(key, _TENSOR_SLOTS), new.get(key, _TENSOR_SLOTS)
            if a is b:
                continue
            try:
                same = bool(a == b)
            except Exception:  # (an object whose == is not a bool)
                same = False
            if not same:
                name = f"{path}.{key}" if path else key
                return f"model {index}'s attribute {name!r}"
    return None


#: What a ``copy.deepcopy`` of a fused module records of its source (a weak reference
#: and the user's line): not pickled, not copied on.
COPY_RECORDS = ("_hftc_copied_from", "_hftc_copied_at")


class Unfusing:
    """(see the module docstring)"""

    def _note_copied_from(self, source: nn.Module) -> None:
        """Record that this module is ``copy.deepcopy(source)`` (an EMA, a teacher, a
        target network): :func:`hftc.keep_models` of ``source`` names it."""
        self.__dict__["_hftc_copied_from"] = weakref.ref(source)
        self.__dict__["_hftc_copied_at"] = user_line()

    def _live_copies(self, modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str]]:
        """The copies (``copy.deepcopy``) of this module among ``modules`` that still hold its
        models, in its order, and the line each was copied at."""
        ids = self.model_ids
        found = []
        for module in modules:
            ref = module.__dict__.get("_hftc_copied_from")
            if ref is not None and ref() is self and module.model_ids == ids:
                found.append((module, module.__dict__.get("_hftc_copied_at", "")))
        return found

    @property
    def model_ids(self) -> list[int]:
        """The original index of each position: ``[0, 1, ..., N-1]`` as fused, then kept
        through :func:`hftc.keep_models` (``keep_models(fused, [3, 1])`` -> ``[3, 1]``)
        and :func:`hftc.replace_models` (a new model gets a new id, never one used
        before)::

            fused = hftc.fuse(models)            # fused.model_ids == [0, 1, 2, 3]
            hftc.keep_models(fused, [3, 1])      # fused.model_ids == [3, 1]
            hftc.replace_models(fused, {0: m})   # fused.model_ids == [4, 1]

        ``out[j]`` of ``fused(x)`` is model ``fused.model_ids[j]``'s.  A copy (a list)."""
        ids = self.__dict__.get("_model_ids")
        return list(range(self.num_models)) if ids is None else list(ids)

    def _set_model_ids(self, ids: Sequence[int]) -> None:
        """Record the original index of each position (and the next id to give)."""
        ids = [int(i) for i in ids]
        self.__dict__["_model_ids"] = ids
        self.__dict__["_next_model_id"] = max(
            [self.__dict__.get("_next_model_id", 0), *(i + 1 for i in ids)])

    def _new_model_ids(self, count: int) -> list[int]:
        """``count`` ids no model of this module ever had (for replace_models)."""
        first = max([self.__dict__.get("_next_model_id", 0), *(i + 1 for i in self.model_ids)])
        return list(range(first, first + count))

    def model_state_dict(self, index: int) -> dict[str, Any]:
        """Model ``index``'s ``state_dict`` (copies), as its own module gives it: its own
        keys (a model of another class names its tensors its own way), persistent buffers
        and extra state (``get_extra_state``), at its own widths (``pad_widths=True``):
        what ``models[index].state_dict()`` would hold had it trained alone, which
        ``load_state_dict`` of a model built as model ``index`` was takes."""
        return self._own_model(self._check_index(index)).state_dict()

    def _refuse_one_models_state(self, state_dict: Any, exc: Exception) -> None:
        """``load_state_dict`` of one model's state dict (each tensor without the leading
        N): a FusionArgumentError saying what to do instead, else nothing (torch's error
        stands)."""
        own = self.state_dict()
        given = [(k, v) for k, v in dict(state_dict).items()
                 if k in own and isinstance(v, torch.Tensor) and own[k].dim() > 0]
        if not given or any(tuple(v.shape) != tuple(own[k].shape[1:]) for k, v in given):
            return
        key, value = next(((k, v) for k, v in given if v.dim() > 0), given[0])
        n = self.num_models
        raise FusionArgumentError(
            f"fused.load_state_dict got one model's state dict (`{key}` is "
            f"{list(value.shape)}, the fused module's {list(own[key].shape)}: every tensor "
            f"stacked over the {n} models). To start every model from it, load it into "
            f"each model before fusing (for m in models: m.load_state_dict(sd); then "
            f"hftc.fuse(models)); to put it in place j: model.load_state_dict(sd); "
            f"hftc.replace_models(fused, {{j: model}}); a fused state dict stacks the "
            f"models': {{k: torch.stack([sd_0[k], ..., sd_{n - 1}[k]]) for k in sd_0}}"
        ) from exc

    def _refuse_other_n_state(self, state_dict: Any, exc: Exception) -> None:
        """``load_state_dict`` of a fused state dict of M models into this one of N (every
        mismatched tensor this one's shape but dim 0: a checkpoint saved before
        EarlyStopping dropped models, or of another sweep): a FusionArgumentError naming
        both counts and how to pick the N, else nothing (torch's error stands)."""
        own = self.state_dict()
        given = [(k, v) for k, v in dict(state_dict).items()
                 if k in own and isinstance(v, torch.Tensor) and own[k].dim() > 0]
        counts = {v.shape[0] if v.dim() == own[k].dim() and v.shape[1:] == own[k].shape[1:]
                  else None for k, v in given}
        m, n = (counts.pop() if len(counts) == 1 else None), self.num_models
        if m is None or m == n:  # (every tensor of M models, or torch's error stands)
            return
        key, value = given[0]
        raise FusionArgumentError(
            f"fused.load_state_dict got the state dict of a fused module of {m} models "
            f"(`{key}` is {list(value.shape)}), but this one holds {n} (its "
            f"{list(own[key].shape)}). Load it into a fused module of {m} models, then keep "
            f"the ones wanted (hftc.keep_models(fused, ids)); or take {n} of its models: "
            f"{{k: v[ids] for k, v in sd.items()}} with ids a list of {n} indices in "
            f"range({m}) (fused.model_ids gives the original index of each model kept)"
        ) from exc

    def _check_index(self, index: int) -> int:
        """``index`` as an int, or an error that says what a model index is."""
        try:
            index = operator.index(index)
        except TypeError:
            raise FusionTypeError(
                f"a model index must be an int, got {index!r} ({type(index).__name__}): "
                f"pass an int in range({self.num_models}), e.g. model_state_dict(0)") from None
        if not -self.num_models <= index < self.num_models:
            raise FusionIndexError(
                f"model index {index} out of range for {self.num_models} models: pass an int "
                f"in range({self.num_models}) (or -{self.num_models} to -1 from the end)")
        return index

    def unfuse(self) -> list[nn.Module]:
        """N modules of the original class holding this module's current weights and buffers."""
        return [self.unfuse_model(i) for i in range(self.num_models)]

    def unfuse_model(self, index: int) -> nn.Module:
        """Model ``index`` alone: a module of the original class with its current weights,
        buffers and hyper-parameters (what ``unfuse()[index]`` is), at its own widths
        (``pad_widths=True``)."""
        index = self._check_index(index)
        model = self._own_model(index)
        note_copy(self, model, self.model_ids[index])  # (a fused step warns if it trains)
        return model

    def apply(self, fn: Any) -> Any:
        """``nn.Module.apply`` as on each model alone: ``fn`` runs over model ``i``'s own
        modules (its ``nn.Linear``, not the stacked module holding all N), models 0, 1, ...
        in turn as a loop would (a random init draws in that order), and the tensors it
        wrote become row ``i``.  torch's ``apply`` gave ``fn`` the stacked modules, which an
        ``isinstance(m, nn.Linear)`` init skips: the weights were silently left as they were."""
        models, changed = [], None
        for i in range(self.num_models):
            model = self._own_model(i)
            before = _python_state(model)
            model.apply(fn)
            changed = changed or _changed_python_state(before, _python_state(model), i)
            models.append(model)
        name = getattr(fn, "__name__", repr(fn))
        self._take_requires_grad(models, name)
        if changed is not None:
            # (``bn.eps = 1e-3``: the program was built from the old value; fused anew, or
            # refused with the fused module as it was)
            self._fuse_own_models_anew(
                f"fused.apply({name}) changed {changed} (not a tensor)", models,
                instead=f"apply it to the models before fusing: for m in models: "
                        f"m.apply({name}); then hftc.fuse(models)")
            return self
        for i, model in enumerate(models):
            self._take_own_tensors(i, model)
        return self

    def _take_requires_grad(self, models: Sequence[nn.Module], fn: str) -> None:
        """A ``requires_grad_`` that ``fn`` set on every model alike, on the stacked
        parameter; one set on some models only is refused (the N share one parameter)."""
        own = [dict(model.named_parameters()) for model in models]
        for name, p in self.named_parameters():
            flags = set()
            for i, params in enumerate(own):
                names = self.model_copies.names[i]
                mine = params.get(name if names is None else names.get(name, name))
                if mine is not None:
                    flags.add(mine.requires_grad)
            if len(flags) > 1:
                raise FusionNotImplementedError(
                    f"fused.apply({fn}) set requires_grad on "
                    f"{name!r} for some models and not others; the {self.num_models} models "
                    f"share one stacked parameter there: freeze it for all of them "
                    f"(fused.get_parameter({name!r}).requires_grad_(False)) or fuse the "
                    f"models whose {name!r} trains apart")
            if flags and flags != {p.requires_grad}:
                p.requires_grad_(flags.pop())

    def _own_model(self, index: int) -> nn.Module:
        """Model ``index``'s own module (:meth:`unfuse_model`'s, not noted as a copy)."""
        padded = self.padded_model(index)
        padding = getattr(self, "padding", None)
        return padded if padding is None else padding.original_model(index, padded)

    def padded_model(self, index: int) -> nn.Module:
        """Model ``index`` as the fused program holds it: with ``pad_widths=True``, padded
        to the widest model (hftc.module.padding's modules); else :meth:`unfuse_model`'s model."""
        index = self._check_index(index)
        model = self.model_copies.build(index, self)
        loop = self.__dict__.get("_shared_one_by_one")
        if loop is not None and self._python_state:
            # the attributes forward changed, as model ``index``'s forwards left them
            shell = loop.shells[index]
            for name in self._python_state[1]:
                path, _, key = name.rpartition(".")
                try:
                    value = getattr(shell.get_submodule(path), key)
                except AttributeError:  # (model ``index``'s tree names it otherwise)
                    continue
                setattr(model.get_submodule(path), key, copy.deepcopy(value))
        return model

    def _keep_models(self, keep: Sequence[int]) -> None:
        """Keep only models ``keep`` (checked, distinct indices), in that order, in place::

            P  [N, ...]  ->  P.data = P[keep]     (the same Parameter objects, their grads too)
            per-model records (graph meta, attribute overrides, shells) -> their rows `keep`

        What :func:`hftc.keep_models` calls; the optimizers are its business.  Compiled
        programs are dropped (they were made for N models): the next call compiles anew."""
        index = torch.tensor(list(keep), dtype=torch.long)
        n = len(keep)
        ids = self.model_ids
        self._set_model_ids([ids[i] for i in keep])
        with torch.no_grad():
            for p in self.parameters():  # (each tied parameter once)
                grad = p.grad
                p.grad = None  # a grad of the old shape would refuse the new data
                kept = p.data.index_select(0, index.to(p.device))
                _drop_grad_accumulator(p)
                p.data = kept
                if grad is not None:
                    p.grad = grad.index_select(0, index.to(grad.device))
            sliced: dict[int, torch.Tensor] = {}
            for module in self.modules():
                for name, b in module._buffers.items():
                    if b is None or name.startswith(SHARED_CONSTANT_PREFIX):
                        continue  # one copy all models share
                    if id(b) not in sliced:
                        sliced[id(b)] = b.index_select(0, index.to(b.device))
                    module._buffers[name] = sliced[id(b)]
        for module in self.modules():
            if isinstance(module, StackedModule):
                module.num_models = n
        self.num_models = n
        self.model_copies.subset(list(keep))
        self.source_parameter_names = [self.source_parameter_names[i] for i in keep]
        if getattr(self, "padding", None) is not None:
            self.padding = self.padding.subset(keep)
        if self._python_state is not None:  # (which model a message names)
            first, names = self._python_state
            self._python_state = (list(keep).index(first) if first in keep else 0, names)
        for graphs in (*self._mode_graphs.values(), *self._retraced_graphs.values()):
            graphs.originals = [graphs.originals[i] for i in keep]
            for node in graphs.graph.nodes:
                per_model = node.meta.get(ir.PER_MODEL)
                if per_model:
                    node.meta[ir.PER_MODEL] = {key: [values[i] for i in keep]
                                               for key, values in per_model.items()}
                ops = node.meta.get(ir.DIFFERING_OPS)
                if ops:
                    node.meta[ir.DIFFERING_OPS] = [ops[i] for i in keep]
        loop = self.__dict__.get("_shared_one_by_one")
        if loop is not None:  # the shells keep the Python attributes forward changed
            loop.subset(keep)
        self._keep_checks(keep)
        self._programs = {}
        self._mark_stacked()

    def _keep_checks(self, keep: Sequence[int]) -> None:
        """The first-call checks the programs passed, for the programs compiled anew after a
        cut to ``keep`` (per program key: ``_compile_program`` takes them instead of
        checking again). The kept models ran these programs on those checks' word, and the
        program for fewer of them is the same graph. Not with padded widths (each model is
        checked against its own widths) nor once a model's forward changed Python state."""
        kept = {}
        if getattr(self, "padding", None) is None and self._python_state is None:
            earlier = self.__dict__.get("_kept_checks", {})
            # (a program compiled since the last cut has its own check; the others' wait)
            found = {**earlier,
                     **{key: program.report.check for key, program in self._programs.items()
                        if program.report is not None and program.report.check is not None}}
            kept = {key: made for key, check in found.items()
                    if (made := check.kept(keep)) is not None}
        self.__dict__["_kept_checks"] = kept

    def _become(self, other: nn.Module) -> None:
        """``other``'s tensors and records in this module, keeping this module's parameter
        objects (optimizers and the user's references hold them): hftc.replace_models and
        the padded-op rewrite fuse anew and take the result over."""
        old = dict(self.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, p in other.named_parameters(remove_duplicate=False):
                keep = old[name]
                if keep is not p:
                    keep.grad = None
                    _drop_grad_accumulator(keep)
                    keep.data = p.data
                    keep.requires_grad_(p.requires_grad)
                owner, _, leaf = name.rpartition(".")
                other.get_submodule(owner)._parameters[leaf] = keep
        # What this module made lazily from its old models (the shells the models run
        # one by one in, fused methods, the last call's program) goes with them: the old
        # shells ran a replaced model with its predecessor's Python attributes.
        for key in _MADE_FROM_MODELS:
            self.__dict__.pop(key, None)
        # (the positions' ids are the caller's to change; the hooks registered on this
        # module, the user's and the load's in progress, stay this module's)
        ids = {key: value for key, value in self.__dict__.items()
               if key in ("_model_ids", "_next_model_id") or "_hook" in key}
        self.__dict__.update(other.__dict__)
        self.__dict__.update(ids)
