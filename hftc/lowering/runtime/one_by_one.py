"""The N models one by one: each model's own forward on its slice of the stacked parameters
(``strategy="model_loop"``, that word's public spelling; before, this module was
``model_loop.py`` and :class:`OneByOne` ``ModelLoop``: both names still import).

::

    slices = {name: P.unbind(0) for each stacked parameter / buffer P}     (views)
    for i in range(N):
        shell_i.<name> = slices[name][i] for every name      (tied names: the one slice)
        out_i = shell_i(*inputs_i)
    out = stack(out_0, ..., out_N-1)

It is what the serial loop runs, on the fused module's own tensors: the
parameters, their gradients (``unbind``'s backward stacks the N gradients in
one copy; with one model the slice is a ``squeeze``, and no copy is made), the
running statistics (updated in place through the views; a buffer forward assigns
anew is copied into its slice), the state_dict and the fused optimizer stay as they
are; only how the forward runs changes.  :meth:`OneByOne.forward_backward` runs
each model's forward, loss and backward in turn instead (``hftc.compile_step``'s step
one by one, ``step.order.chosen == "in_order"``).
``hftc.fuse(..., autotune=True)`` times it against the fused program and takes
it where the fused program was slower: on a CPU, activations that fit a cache
one model at a time but not N at a time (PointNet's ``[B, 1024, P]`` feature
maps) made every memory-bound op of the fused step slower than the N separate
ones.  The shells are the unfused models (``unfuse_model(i)``), so each
keeps its own plain hyper-parameters (dropout ``p``, ``eps`` ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ...errors import TraceError
from .layout import model_slice


class OneByOne:
    """Runs a fused module's N models one by one (see the module docstring)."""

    def __init__(self, fused: nn.Module):
        self.num_models = fused.num_models
        self.shells: list[nn.Module] = []
        #: per shell: (the registry dict of a module, the key in it, the fused name, the
        #: placeholder that stays there between calls), one per name, tied names included
        self.slots: list[list[tuple[dict[str, Any], str, str, Any]]] = []
        copies = fused.model_copies  # each model's own object (hftc.module.copies)
        for i in range(self.num_models):
            # (pad_widths=True: the padded model, whose shapes the stacked slices have)
            shell = getattr(fused, "padded_model", fused.unfuse_model)(i)
            if i == 0:
                shell_params = dict(shell.named_parameters())
                shell_buffers = dict(shell.named_buffers())
                # Names the shells have (tied parameters once: the slots tie the rest).
                self.param_names = [n for n, _ in fused.named_parameters() if n in shell_params]
                self.buffer_names = [n for n, _ in fused.named_buffers() if n in shell_buffers]
            # one model's copy at a time, never N
            self.slots.append(self._take_tensors(shell, copies.fused_names(i)))
            self.shells.append(shell)
        #: per shell, the fused module's path for each of its modules in ``named_modules``
        #: order, whose train/eval mode each call sets from the fused module's module at
        #: that path (``fused.bn.eval()`` freezes every model's batch norm); a module the
        #: fused module has no path for (a parametrization's) takes its nearest ancestor's
        #: mode.  Shells of one tree share one tuple (and one list of modes a call).
        self.module_paths: list[tuple[str | None, ...]] = []
        for i, shell in enumerate(self.shells):
            paths = tuple(copies.fused_path(i, p) or f"\0{p}"
                          for p, _ in shell.named_modules(remove_duplicate=False))
            self.module_paths.append(next((q for q in self.module_paths if q == paths), paths))
        #: (the fused module's module registry it was read from, per tuple of paths: where
        #: each mode comes from), :meth:`_modes`
        self._mode_sources: tuple[dict, dict[tuple, list[nn.Module | int]]] | None = None
        self.modules = [[sub for _, sub in shell.named_modules(remove_duplicate=False)]
                        for shell in self.shells]

    def _modes(self, fused: nn.Module) -> list[list[bool]]:
        """Each shell's modules' train/eval modes: their fused counterparts' (see
        ``module_paths``).  Where each mode is read from is found once per fused module
        (walking its modules cost ~0.15 ms a call at a small GPT's 40 modules)."""
        if self._mode_sources is None or self._mode_sources[0] is not fused._modules:
            fused_modules = dict(fused.named_modules(remove_duplicate=False))
            by_paths: dict[tuple, list[nn.Module | int]] = {}
            for paths in self.module_paths:
                if paths in by_paths:
                    continue
                # per path: the fused module whose mode it takes, or its parent path's
                # position in the tuple (-1: the fused module's own mode)
                sources: list[nn.Module | int] = []
                position: dict[str, int] = {}
                for k, path in enumerate(paths):
                    position[path] = k
                    sources.append(fused_modules[path] if path in fused_modules
                                   else position.get(path.rpartition(".")[0], -1))
                by_paths[paths] = sources
            self._mode_sources = (fused._modules, by_paths)
        made: dict[int, list[bool]] = {}
        for paths in self.module_paths:
            if id(paths) in made:
                continue
            modes: list[bool] = []
            for source in self._mode_sources[1][paths]:
                if isinstance(source, int):
                    modes.append(modes[source] if source >= 0 else fused.training)
                else:
                    modes.append(source.training)
            made[id(paths)] = modes
        return [made[id(paths)] for paths in self.module_paths]

    def subset(self, keep: Sequence[int]) -> None:
        """Keep shells ``keep`` only, in that order (their Python attributes with them)."""
        for name in ("shells", "slots", "modules", "module_paths"):
            setattr(self, name, [getattr(self, name)[i] for i in keep])
        self.num_models = len(keep)

    def _take_tensors(self, shell: nn.Module, fused_names: dict[str, str] | None
                      ) -> list[tuple[dict[str, Any], str, str, Any]]:
        """Replace the shell's own tensors, which the stacked tensors' slices replace at
        every call, by empty placeholders (a second copy of the model's weights otherwise;
        112 MiB for PointNet at N = 8), and return where each slice goes (``slots``).

        Tied tensors share one placeholder and one fused name, so every name of a tie
        gets the one slice.  Writing the registries directly at each call is what
        ``functional_call`` does, without its per-call name checks and tie search, which
        cost as much as the models' own small forwards (docs/DESIGN_NOTES.md).
        ``fused_names``: the shell's tensor names -> the fused names (None: the same)."""
        replaced = set(self.param_names) | set(self.buffer_names)
        named = list(shell.named_parameters(remove_duplicate=False))
        named += list(shell.named_buffers(remove_duplicate=False))
        fused_name: dict[int, str] = {}
        for name, t in named:
            fused = name if fused_names is None else fused_names.get(name, name)
            if fused in replaced:
                fused_name.setdefault(id(t), fused)
        placeholders: dict[int, Tensor] = {}
        slots = []
        for name, t in named:
            if id(t) not in fused_name:
                continue
            if id(t) not in placeholders:
                empty = t.detach().new_empty(0)
                placeholders[id(t)] = (nn.Parameter(empty, t.requires_grad)
                                       if isinstance(t, nn.Parameter) else empty)
            owner, _, leaf = name.rpartition(".")
            module = shell.get_submodule(owner)
            registry = module._parameters if leaf in module._parameters else module._buffers
            registry[leaf] = placeholders[id(t)]
            slots.append((registry, leaf, fused_name[id(t)], placeholders[id(t)]))
        return slots

    def __call__(self, fused: nn.Module, values: Sequence[Any], batched: Sequence[bool],
                 method: str | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        """The N models' forward (or their ``method``, with ``kwargs`` shared), stacked."""
        tensors = dict(fused.named_parameters())
        tensors.update(fused.named_buffers())
        names = self.param_names + self.buffer_names
        if self.num_models == 1:
            # One model: squeeze's backward is a view, where unbind's stacks a copy of
            # every gradient.
            slices = {name: (tensors[name].squeeze(0),) for name in names}
        else:
            slices = {name: tensors[name].unbind(0) for name in names}
        modes = self._modes(fused)
        outs = []
        for i in range(self.num_models):
            args = tuple(model_slice(v, i) if b else v for v, b in zip(values, batched))
            outs.append(self._run(i, fused, modes, {n: s[i] for n, s in slices.items()},
                                  args, method, kwargs))
        return stack_outputs(outs)

    def forward_backward(self, fused: nn.Module, values: Sequence[Any], batched: Sequence[bool],
                         loss_of: Callable[[Any], Tensor],
                         context: Callable[[], AbstractContextManager] = nullcontext) -> Tensor:
        """The serial loop's order of work on the fused module's tensors: each model's
        forward, loss and backward in turn, its gradients written into the stacked
        ``.grad`` (added to one already there, as backward does); returns the N losses
        ``[N]``, detached::

            for i in range(N):
                leaves = {name: P.detach().unbind(0)[i] (requires_grad as P) ...}
                loss_of(shell_i(*inputs_i)).backward()       (shell_i on the leaves;
                                                             forward and loss in context())
                P.grad[i] = leaves[name].grad                (one copy, as unbind's backward)

        What a module called from a training loop cannot do (the loss's gradient exists
        only after every model's forward): model i's activations are still in the cache
        when its backward reads them.  Each model's gradient is the serial loop's, bit
        for bit; a parameter model i did not use gets zeros in its slice, as the stacked
        backward gives it (``None`` where no model used it)."""
        params = dict(fused.named_parameters())
        tensors = {**params, **dict(fused.named_buffers())}
        names = self.param_names + self.buffer_names
        # N leaf views per stacked tensor, one unbind each (N indexing calls cost 2x)
        views = {name: tensors[name].detach().unbind(0) for name in names}
        trained = [name for name in self.param_names if params[name].requires_grad]
        # each stacked .grad's N slices, once made; a .grad already there is added to
        grads = {name: params[name].grad.unbind(0) for name in trained
                 if params[name].grad is not None}
        accumulate = set(grads)
        filled: dict[str, list[int]] = {name: [] for name in trained}
        modes = self._modes(fused)
        losses = []
        for i in range(self.num_models):
            leaves = {name: views[name][i] for name in names}
            for name in trained:
                leaves[name].requires_grad_(True)
            args = tuple(model_slice(v, i) if b else v for v, b in zip(values, batched))
            with context():
                loss = loss_of(self._run(i, fused, modes, leaves, args))
            loss.backward()
            losses.append(loss.detach())
            for name in trained:
                grad = leaves[name].grad
                if grad is None:
                    continue
                if name not in grads:
                    p = params[name]
                    p.grad = torch.empty_like(p)
                    grads[name] = p.grad.unbind(0)
                if name in accumulate:
                    grads[name][i].add_(grad)
                else:
                    grads[name][i].copy_(grad)
                filled[name].append(i)
        for name, slices in grads.items():
            if name not in accumulate:
                for i in set(range(self.num_models)) - set(filled[name]):
                    slices[i].zero_()
        return torch.stack(losses)

    def _run(self, i: int, fused: nn.Module, modes: list[bool], tensors: dict[str, Tensor],
             args: tuple, method: str | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        """Model i's forward (or ``method``) on ``tensors`` (its slice of each stacked
        tensor, by fused name), its modules in ``modes``.  The slices stay bound after the
        call: a ``torch.utils.checkpoint`` in the model's forward recomputes in backward
        and reads them then (the placeholders, 0 elements, failed its matmuls); the next
        call binds its own, and a copy or pickle of the loop takes the placeholders
        (:meth:`__getstate__`)."""
        shell, slots = self.shells[i], self.slots[i]
        for sub, mode in zip(self.modules[i], modes[i]):
            if sub.training is not mode:  # nn.Module.__setattr__ is slow: write on change
                sub.training = mode
        for registry, key, name, _ in slots:
            registry[key] = tensors[name]
        try:
            out = (call_model(shell, args, fused) if method is None
                   else getattr(shell, method)(*args, **(kwargs or {})))
            self._keep_reassigned(i, slots, tensors, method or "forward")
            return out
        except RuntimeError as exc:
            if "returns multiple views" not in str(exc):
                raise
            raise TraceError(
                f"model {i}'s forward writes into one of its parameters in place "
                f"(nn.Embedding(max_norm=...) renormalizes its weight's rows), and its "
                f"weights are views of the fused module's stacked tensors, which "
                f"autograd does not let a forward modify in place; hftc cannot run these "
                f"models one by one. Fuse them (without the Python state or checks that "
                f"made hftc run them one by one: see the FusionWarning), or renormalize "
                f"in the training loop, outside forward") from exc

    def _unbind(self) -> None:
        """The shells' placeholders back in place of the last call's slices."""
        for slots in self.slots:
            for registry, key, _, placeholder in slots:
                registry[key] = placeholder

    def __getstate__(self) -> dict[str, Any]:
        # A slice of a stacked parameter is no leaf: deepcopy and pickle refuse it, and a
        # copy holding one would share the original's storage.
        self._unbind()
        return self.__dict__

    def _keep_reassigned(self, i: int, slots: list, tensors: dict[str, Tensor],
                         method: str) -> None:
        """Buffers model i's ``method`` (forward) assigned anew (``self.calls = self.calls +
        1``, an average ``self.avg = 0.9 * self.avg + ...``), written into its slice of the
        stacked buffer, as the model keeps them (the shell's registry held the new tensor,
        which putting the placeholder back dropped: the N models' counts stayed 0)::

            registry[key] is not its slice  ->  slice.copy_(registry[key])   (no grad)
        """
        for registry, key, name, _ in slots:
            new, slice_ = registry.get(key), tensors[name]
            if new is slice_:
                continue
            if name not in self.buffer_names or not isinstance(new, Tensor) \
                    or new.shape != slice_.shape or new.dtype != slice_.dtype:
                what = ("None" if new is None else f"a {type(new).__name__}" if not
                        isinstance(new, Tensor) else f"{list(new.shape)} {new.dtype}")
                kind = "buffer" if name in self.buffer_names else "parameter"
                grown = isinstance(new, Tensor) and new.dtype == slice_.dtype and (
                    new.dim() == slice_.dim())
                hint = (" (a cache that forward grows, as transformers' rotary cos/sin "
                        "cache did: make it at its largest size in __init__)") if grown else ""
                raise TraceError(
                    f"model {i}'s {method} assigns its {kind} `{name}` anew ({what}, where "
                    f"the fused module stacks one of {list(slice_.shape)} {slice_.dtype} per "
                    f"model); hftc runs these models one by one on its stacked tensors and "
                    f"can keep only a {kind} of the same shape and dtype. Update it in "
                    f"place ({name.rpartition('.')[2]}.copy_(...), .mul_(...)), or keep "
                    f"its shape and dtype{hint}")
            with torch.no_grad():
                slice_.copy_(new)


#: The earlier name (a pickled fused module may name it).
ModelLoop = OneByOne


def call_model(model: nn.Module, args: Sequence[Any], fused: nn.Module) -> Any:
    """``model(*args)`` as the fused module's current call gives the inputs: its last
    inputs by keyword where the call passed them to forward's ``**kwargs`` (the export
    front-end exported them as keywords: ``fused.__dict__["_call_keywords"]``)::

        keywords ("num_items_in_batch",):  model(ids, ..., labels, num_items_in_batch=n)
    """
    keywords = fused.__dict__.get("_call_keywords", ())
    if not keywords:
        return model(*args)
    positional = len(args) - len(keywords)
    return model(*args[:positional], **dict(zip(keywords, args[positional:])))


def stack_outputs(outs: Sequence[Any]) -> Any:
    """N per-model outputs -> one with every tensor stacked on a new dim 0."""
    def stack(*leaves: Any) -> Any:
        if isinstance(leaves[0], Tensor):
            return torch.stack(leaves)
        if any(leaf != leaves[0] for leaf in leaves[1:]):
            raise ValueError(f"models returned different non-tensor outputs: {leaves}")
        return leaves[0]

    return pytree.tree_map(stack, outs[0], *outs[1:])


def plain_output(out: Any) -> bool:
    """Tensors in tuples, lists and dicts only: what :func:`stack_outputs` rebuilds."""
    leaves = pytree.tree_leaves(out)
    return bool(leaves) and all(isinstance(leaf, Tensor) for leaf in leaves)
