"""A sweep's live trials and the fused arrays they train in: which trials may share an
array (their optimizers, their structures), forming the arrays from the live trials,
dissolving them when trials leave, and their checkpoints and the worker's manifest."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import optuna
import torch
from torch import nn

import hftc

from ..module.group import group_models
from ..module.padding import own_part, padding_ratio, weight_shapes, width_blocks, widths_key
from ..module.usage import source_weights_written
from ..optim.mixed import MixedOptimizer
from ..optim.slicing import fused_param_names, load_model_slice
from .files import atomic_write, save

__all__ = ["LiveTrial", "FusedArray", "Arrays", "finite_models"]


def finite_models(fused: nn.Module) -> list[bool]:
    """Per model: are all its weights finite?"""
    n = fused.num_models
    finite = torch.ones(n, dtype=torch.bool)
    with torch.no_grad():
        for p in fused.parameters():
            finite &= torch.isfinite(p.reshape(n, -1)).all(dim=1).cpu()
    return finite.tolist()


@dataclass
class OptimizerSlot:
    """What one position of a trial's optimizers must agree on with the other trials of
    its array: a class of one array may mix with others (``fuse_optimizers``' mixed path
    gives a MixedOptimizer), but its optimizers need equal param groups and ``fused``
    flags, every class the same parameters, and a capturable one its class alone."""

    cls: type
    groups: int
    fused_flag: bool
    capturable: bool
    params: frozenset[str]

    def text(self) -> str:
        return self.cls.__name__ + (f" ({self.groups} param groups)" if self.groups > 1 else "")


def optimizer_slots(run: LiveTrial) -> list[OptimizerSlot]:
    names = {id(p): name for name, p in run.module.named_parameters()}
    return [OptimizerSlot(type(o), len(o.param_groups),
                           any(bool(g.get("fused")) for g in o.param_groups),
                           any(bool(g.get("capturable")) for g in o.param_groups),
                           frozenset(names.get(id(p), "?") for g in o.param_groups
                                     for p in g["params"]))
            for o in run.optimizers]


def optimizers_apart(bucket: list[list[OptimizerSlot]], slots: list[OptimizerSlot],
                      ) -> str | None:
    """Why a trial of optimizer ``slots`` cannot share fused optimizers with the trials of
    ``bucket`` (their slots), or None when it can (mixed classes included)."""
    first = bucket[0]
    if len(slots) != len(first):
        return f"{len(first)} optimizer(s) per trial vs {len(slots)}"
    for k, slot in enumerate(slots):
        where = f"optimizer {k}: " if len(slots) > 1 else ""
        if slot.params != first[k].params:
            return f"{where}optimizers over other parameters"
        for other in (member[k] for member in bucket):
            if other.cls is slot.cls and other.groups != slot.groups:
                return f"{where}optimizers {other.text()} vs {slot.text()}"
            if other.cls is slot.cls and other.fused_flag != slot.fused_flag:
                return f"{where}{slot.cls.__name__} fused={other.fused_flag} vs {slot.fused_flag}"
            if other.cls is not slot.cls and (other.capturable or slot.capturable):
                return (f"{where}{other.cls.__name__} vs {slot.cls.__name__} with "
                        f"capturable=True (a mixed fused optimizer cannot be captured)")
    return None


def own_widths(stacked: dict[str, torch.Tensor], index: int,
                module: nn.Module) -> dict[str, torch.Tensor]:
    """Model ``index``'s state from a fused ``state_dict()`` at ``module``'s own widths:
    a padded array (pad_widths) holds each model in the first entries of every dim (of
    each q, k, v block of an attention's packed projection)."""
    own, blocks = module.state_dict(), width_blocks(module)
    # (an extra state is a list of the models' own: v[index] is model index's)
    return {k: own_part(v[index], own[k].shape, blocks.get(k, 1))
            if k in own and isinstance(v, torch.Tensor) and v[index].dim() == own[k].dim()
            else v[index] for k, v in stacked.items()}


def _parameter_names(run: LiveTrial) -> frozenset[str]:
    return frozenset(name for name, _ in run.module.named_parameters())


def structure_key(module: nn.Module) -> tuple:
    return (type(module).__name__,
            tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def mismatch_reason(a: nn.Module, b: nn.Module, example: Any, pad_widths: bool = False) -> str:
    """Why hftc.fuse keeps ``b`` from ``a``'s array, in a line: its mismatch message's
    differences: the layer, its out_features 128 vs 64, its parameters' shapes ...; with
    ``pad_widths``, what differs beyond the widths (the layers), which padding cannot
    join (``a`` and ``b`` called model 0 and model 1)."""
    if pad_widths:
        try:
            hftc.fuse([a, b], example_inputs=example, pad_widths=True)
        except hftc.errors.MismatchError as exc:
            return str(exc).splitlines()[0]
        except Exception:  # noqa: BLE001 - not the padding's refusal: the plain reason
            pass
        else:  # (hftc.fuse pads them; the arrays' grouping joins widths of like layers only)
            ours, theirs = dict(a.named_modules()), dict(b.named_modules())
            path = next((p for p in ours if p in theirs and type(ours[p]) is not type(theirs[p])),
                        None)
            if path is not None:
                return (f"pad_widths=True pads widths only, but their modules differ from the "
                        f"others' at `{path}` ({type(ours[path]).__name__} vs "
                        f"{type(theirs[path]).__name__}): the sweep's arrays join models of the "
                        f"same layers, in the same order, of any widths")
    try:
        hftc.fuse([a, b], example_inputs=example)
    except Exception as exc:  # noqa: BLE001 - the reason is the message, whatever raised it
        lines = [ln.strip().replace("model 1's ", "").replace(" differs from model 0's:", ":")
                 for ln in str(exc).splitlines() if "differs from model 0's" in ln]
        parts = "; ".join(lines).split("; ")
        text = "; ".join(parts[:3]) + ("; ..." if len(parts) > 3 else "") if lines else \
            str(exc).splitlines()[0]
        return text + (": different shapes" if "shape" in text else "")
    return "different traced graphs"


@dataclass
class LiveTrial:
    """A live trial of this worker: where its weights are and what it has done."""

    trial: optuna.Trial
    params: dict[str, Any]
    seed: int
    module: nn.Module  # the trial's own module (its Python attributes are the trial's)
    # The trial's stock optimizers, for its whole life: current while not in an array;
    # its schedulers are built on them and step them (their lr then goes to the array's).
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    array: FusedArray | None = None
    slot: int = 0
    epoch: int = 0
    history: list[float] = field(default_factory=list)
    orders: list[int] = field(default_factory=list)
    reported: int = 0  # the last step reported to the storage
    weights_finite: bool = True  # False once a weight is NaN or inf: diverged
    train_loss: float | None = None  # the last epoch's mean training loss, for on_epoch
    ckpt: tuple[str, int] | None = None  # (checkpoint file, index in it)

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def trial_id(self) -> int:
        return self.trial._trial_id


@dataclass
class FusedArray:
    """One fused group: trials whose models have one structure, trained as one module."""

    fused: hftc.FusedModule
    optimizers: list[torch.optim.Optimizer]  # fused, one per stock optimizer of a trial
    members: list[LiveTrial]


class Arrays:
    """The arrays part of :class:`hftc.sweep.Sweep` (a mixin: the worker's state is its)."""

    # ------------------------------------------------------------------ arrays

    def _live_members(self, array: FusedArray) -> list[tuple[int, LiveTrial]]:
        live = {id(r) for r in self.live}
        return [(j, run) for j, run in enumerate(array.members)
                if id(run) in live and run.array is array]

    def _sync_modules(self, array: FusedArray) -> None:
        """Each live member's own module gets its current weights and buffers from the
        array (which keeps training them): what grouping the trials reads is theirs."""
        for j, run in self._live_members(array):
            # Into the trial's own module, not fused.unfuse_model(j): the trial's module is
            # its own object (its Python attributes, Dropout.p, are the trial's).
            run.module.load_state_dict(array.fused.model_state_dict(j))
        source_weights_written(array.fused)  # (on purpose: no warning at the next step)

    def _take_out(self, array: FusedArray) -> None:
        """Dissolve an array: each live member gets its weights and its stock optimizers'
        state back (its schedulers, built on them, stay as they are)."""
        self._sync_modules(array)
        self._release(array)

    def _release(self, array: FusedArray) -> None:
        """:meth:`_take_out` once the members' modules are synced: each live member's
        stock optimizers get their state back, and the array goes."""
        states = [o.state_dict() for o in array.optimizers]
        names = [fused_param_names(array.fused, o) for o in array.optimizers]
        for j, run in self._live_members(array):
            for k, optimizer in enumerate(run.optimizers):
                load_model_slice(states[k], names[k], j, optimizer, run.module)
            run.array = None
        self.arrays.remove(array)

    def _regroup(self) -> None:
        """Fuse the live trials into arrays, with their state, once any trial joined or
        left. The arrays are those a fusing of all the live trials at once makes, in their
        order (grouped by optimizers, then by structure: group_models): a function of the
        live trials alone, which a resumed worker, fusing all its trials at once, forms
        alike, and so are the dropout draws that depend on them. An array whose trials
        are still the trials of its group, in their order, is kept as it is (fusing its
        trials again would make the same array); one that only lost trials is cut
        (:meth:`_cut`); the others are fused anew."""
        live = {id(r) for r in self.live}
        changed = any(r.array is None for r in self.live) or any(
            id(m) not in live for a in self.arrays for m in a.members)
        if not self.live:
            for array in list(self.arrays):
                self._take_out(array)
            return
        if not changed or self._cut_in_place():
            return
        # One fused optimizer per array and position; trials whose optimizer() picked other
        # classes (a categorical SGD / Adam choice) share it (a MixedOptimizer), those
        # whose optimizers cannot be fused together (other counts of optimizers or param
        # groups) go into other arrays.
        buckets: list[tuple[list[list[OptimizerSlot]], list[LiveTrial]]] = []
        for r in self.live:
            slots = optimizer_slots(r)
            for bucket_slots, members in buckets:
                if optimizers_apart(bucket_slots, slots) is None:
                    bucket_slots.append(slots)
                    members.append(r)
                    break
            else:
                buckets.append(([slots], [r]))
        # A batch of the training data as example_inputs: a model symbolic tracing cannot
        # read (a Hugging Face model, say) is traced by torch.export from it.
        if self._example is None:
            self._example = self.data.example(self.spec.batch_size)
        example = self._example
        for bucket_slots, members in buckets[1:]:
            first = buckets[0][1]
            reason = optimizers_apart(buckets[0][0], bucket_slots[0])
            if _parameter_names(first[0]) != _parameter_names(members[0]):
                # Optimizers over other parameters because the models have other layers
                # (suggest_int("n_layers")): said as hftc.fuse says how the models differ.
                reason = None
            self._note_apart(first, members, reason, example)
        # At most per_array trials an array: a worker holds no more, except one resumed
        # with a smaller --per-array (after the arrays ran out of memory) that re-attached
        # more trials than that.
        size = self.spec.per_array
        buckets = [(slots[i:i + size], same[i:i + size]) for slots, same in buckets
                   for i in range(0, len(same), size)]
        if self.spec.pad_widths:
            self._fuse_padded([same for _, same in buckets], example)
        else:
            self._fuse_changed([same for _, same in buckets], example)
        # In the order of the trials: a resumed worker, which fuses all its trials at once,
        # runs the arrays (and draws their dropout) in the order the dead worker did.
        position = {id(r): k for k, r in enumerate(self.live)}
        self.arrays.sort(key=lambda a: position[id(a.members[0])])
        self.formations.append(tuple(len(a.members) for a in self.arrays))
        sizes = ", ".join(str(len(a.members)) for a in self.arrays)
        self.log(f"arrays re-formed: {len(self.live)} trials in {len(self.arrays)} fused "
                 f"array(s) of {sizes}")

    def _fuse_changed(self, buckets: list[list[LiveTrial]], example: Any) -> None:
        """The arrays of ``buckets`` (trials whose optimizers fuse together), grouped by
        structure: those whose trials are an array's, in its order, kept (cut where that
        array lost trials); the others' arrays dissolved and their groups fused anew."""
        for array in self.arrays:  # (a trace that reads a weight reads the trial's own)
            self._sync_modules(array)
        groups: list[list[LiveTrial]] = []
        for same in buckets:
            found = group_models([r.module for r in same], example_inputs=example)
            for indices, _ in found[1:]:
                self._note_apart([same[i] for i in found[0][0]], [same[i] for i in indices],
                                 None, example)
            groups += [[same[i] for i in indices] for indices, _ in found]
        live = {id(r) for r in self.live}
        kept: dict[int, FusedArray] = {}  # position in groups -> the array it keeps
        for k, members in enumerate(groups):
            array = members[0].array
            if array is not None and [m for m in array.members if id(m) in live] == members \
                    and (len(members) == len(array.members) or self._cuttable(array)):
                kept[k] = array
        for array in list(self.arrays):
            if not any(array is a for a in kept.values()):
                self._release(array)  # (its modules synced above)
        for k, members in enumerate(groups):
            if k in kept:
                self._cut(kept[k], live)
                continue
            fused = hftc.fuse([r.module for r in members], example_inputs=example)
            self._add_array(fused, members)

    def _fuse_padded(self, buckets: list[list[LiveTrial]], example: Any) -> None:
        """With padded widths every array is fused anew (its grouping depends on all the
        widths that are live, and a padding that fails splits it)."""
        for array in list(self.arrays):
            self._take_out(array)
        padding = {"pad_widths": True, "max_padding": self.spec.max_padding}
        for same in buckets:
            groups = hftc.fuse_groups([r.module for r in same], example_inputs=example,
                                      **padding)
            for fused, indices in groups[1:]:
                first, other = [same[i] for i in groups[0][1]], [same[i] for i in indices]
                self._note_apart(first, other, self._padding_apart(
                    first, other, str(getattr(fused, "grouping", ""))), example)
            for fused, indices in groups:
                self._add_array(fused, [same[i] for i in indices])

    def _add_array(self, fused: hftc.FusedModule, members: list[LiveTrial]) -> None:
        """A new array of ``members`` (their models fused in ``fused``), with its fused
        optimizers made from the members' stock ones."""
        optimizers = [hftc.optim.fuse_optimizers(fused, [r.optimizers[k] for r in members])
                      for k in range(len(members[0].optimizers))]
        array = FusedArray(fused, optimizers, members)
        for j, r in enumerate(members):
            r.array, r.slot = array, j
        self.arrays.append(array)
        self._note_array(array)

    def _cuttable(self, array: FusedArray) -> bool:
        """Can ``array`` lose trials in place (:meth:`_cut`)? Not with padded widths or
        mixed optimizer classes, whose grouping may change as trials leave."""
        return not self.spec.pad_widths and not any(
            isinstance(o, MixedOptimizer) for o in array.optimizers)

    def _cut(self, array: FusedArray, live: set[int]) -> None:
        """Keep only ``array``'s live trials, in their order, with ``hftc.keep_models`` (its
        fused module and optimizers, in place: a few times cheaper than fusing again).
        The array is then the one a fresh fusing of those trials makes."""
        keep = [j for j, m in enumerate(array.members) if id(m) in live]
        if len(keep) == len(array.members):
            return
        hftc.keep_models(array.fused, keep)
        array.members = [array.members[j] for j in keep]
        for j, r in enumerate(array.members):
            r.slot = j

    def _cut_in_place(self) -> bool:
        """Trials only left (none joined): cut each array that lost trials instead of
        re-forming the arrays (the survivors keep their order and their groups: the
        arrays a fresh fusing of the live trials makes, a resumed worker's). Not where an
        array that lost trials cannot be cut (:meth:`_cuttable`). True when it cut."""
        if not self.live or any(r.array is None for r in self.live):
            return False
        live = {id(r) for r in self.live}
        left = [a for a in self.arrays if any(id(m) not in live for m in a.members)]
        if any(not self._cuttable(a) for a in left):
            return False
        if len(self.arrays) > 1 and any(g.get("capturable") for a in self.arrays
                                        for o in a.optimizers for g in o.param_groups):
            # A capturable optimizer keeps other classes out of its array (optimizers_apart):
            # once it leaves, a fresh fusing may join arrays that cutting keeps apart.
            return False
        for array in left:
            if any(id(m) in live for m in array.members):
                self._cut(array, live)
            else:
                self.arrays.remove(array)
        self.formations.append(tuple(len(a.members) for a in self.arrays))
        self.log(f"arrays cut in place: {', '.join(str(len(a.members)) for a in self.arrays)}"
                 f" trials")
        return True

    def _padding_apart(self, first: list[LiveTrial], other: list[LiveTrial],
                       grouping: str) -> str | None:
        """Why fuse_groups kept ``other``'s models out of ``first``'s array when padding is
        on and it was padding's cost (or its failure: ``grouping`` says); else None (the
        structures differ beyond widths: hftc.fuse says how)."""
        if not self.spec.pad_widths:
            return None
        if grouping.startswith("not padded") or "measured" in grouping:
            return grouping
        if widths_key(first[0].module) != widths_key(other[0].module):
            return None
        ratio = padding_ratio([weight_shapes(r.module) for r in first + other])
        return (f"widths too far apart: padded into one array they would do {ratio:.2f}x "
                f"the models' own arithmetic (> max_padding={self.spec.max_padding})")

    def _note_array(self, array: FusedArray) -> None:
        """Record what an array joins that used to be kept apart: models padded to one
        width (and what that costs), optimizers of several classes."""
        numbers = [r.number for r in array.members]
        padding = getattr(array.fused, "padding", None)
        if padding is not None:
            widths = len({tuple(sorted((k, tuple(v)) for k, v in own.items()))
                          for own in padding.shapes})
            self.padded.append((numbers, widths, padding.arithmetic_ratio))
        classes = [type(o).__name__ for o in array.optimizers[0].parts()] if isinstance(
            array.optimizers[0], MixedOptimizer) else []
        if classes:
            self.mixed.append((numbers, classes))

    def _note_one_by_one(self) -> None:
        """Record what the arrays ran model by model rather than fused (each model exact,
        but nothing saved): an op no rule fuses (fusion_report's fallbacks, with why), or a
        forward that runs the N models one by one (``fused.plan``: the first-call check
        found the fused program wrong, ...), with the trials it was seen in. Said in the
        summary and, when first seen, by ``-v``: a sweep that fuses nothing looks like one
        that does."""
        for array in self.arrays:
            numbers = [r.number for r in array.members]
            for program in list(getattr(array.fused, "_programs", {}).values()):
                found = [f"{r.source}: {r.reason}" for r in program.report.fallbacks]
                plan = program.plan
                if program.one_by_one is not None or (plan is not None
                                                       and plan.chosen == "model_loop"):
                    found = [_whole_forward(program)]
                for what in found:
                    seen = self.one_by_one.setdefault(what, [])
                    if not seen:
                        self.log(f"run model by model in a fused array (exact, not faster): "
                                 f"trials {numbers}: {what}")
                    seen.extend(n for n in numbers if n not in seen)

    def _note_apart(self, first: list[LiveTrial], other: list[LiveTrial], reason: str | None,
                    example: Any = None) -> None:
        """Record why ``other`` could not share ``first``'s array: the reason given, or
        what hftc.fuse says of their models (once per pair of structures)."""
        if reason is None:
            pair = (structure_key(first[0].module), structure_key(other[0].module))
            if pair not in self._apart_cache:
                self._apart_cache[pair] = mismatch_reason(  # (said of "trials B vs A")
                    first[0].module, other[0].module, example, self.spec.pad_widths,
                ).replace("model 1's", "their").replace("model 0's", "the others'")
            reason = self._apart_cache[pair]
        if not any(reason in text for text in self.apart):
            self.apart[f"trials {[r.number for r in other]} vs {[r.number for r in first]}: "
                       f"{reason}"] = None

    def _checkpoint(self) -> None:
        """Every array's fused state, its optimizers' states and its trials' schedulers'
        states, then the manifest that points at them: after a crash, a trial restarts
        from its last completed epoch."""
        for k, a in enumerate(self.arrays):
            name = f"array-{self.round}-{k}.pt"
            save({
                "trials": [r.number for r in a.members],
                "model": a.fused.state_dict(),
                "optimizer": [o.state_dict() for o in a.optimizers],
                "param_names": [fused_param_names(a.fused, o) for o in a.optimizers],
                "schedulers": [[None if s is None else s.state_dict() for s in r.schedulers]
                               for r in a.members],
                "epochs": [r.epoch for r in a.members],
            }, self.dir / name)
            for j, r in enumerate(a.members):
                r.ckpt = (name, j)
        self._write_manifest()

    def _write_manifest(self) -> None:
        manifest = {
            "study": self.study_name,
            "worker": self.worker_id,
            "round": self.round,
            "written": time.time(),
            "trials": [{"number": r.number, "trial_id": r.trial_id, "epoch": r.epoch,
                        "history": r.history, "orders": r.orders,
                        "ckpt": list(r.ckpt) if r.ckpt else None} for r in self.live],
        }
        atomic_write(self.dir / "manifest.json", json.dumps(manifest, indent=1).encode())
        used = {r.ckpt[0] for r in self.live if r.ckpt}
        for f in self.dir.glob("array-*.pt"):
            if f.name not in used:
                f.unlink(missing_ok=True)


def _whole_forward(program: Any) -> str:
    """Why a fused array's forward runs its N models one by one, in words: the first-call
    check's finding (its FusionWarning says where), or the plan's reason."""
    if getattr(program.plan, "reason", None) == "check":
        return ("the whole forward runs the models one by one: the first-call check found "
                "the fused program's outputs differ from the models' own forward (the "
                "FusionWarning says where)")
    return f"the whole forward {program.plan or 'runs the models one by one'}"
