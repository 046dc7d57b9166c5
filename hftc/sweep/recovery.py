"""A sweep's recovery: finding this folder's dead workers (their lock is free), re-attaching
their RUNNING trials from their checkpoints (``--resume``), and failing and retrying the
trials that run nowhere, as Optuna's heartbeat would."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import time
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

from ..optim.slicing import load_model_slice
from .arrays import LiveTrial, own_widths
from .decisions import KEPT_AT, KEPT_FILE, kept_decisions
from .files import append_line
from .training import build_model, make_optimizers, make_schedulers

__all__ = ["Recovery", "try_lock", "read_manifest", "NO_HEARTBEAT_S"]


def try_lock(path: Path):
    """An open, exclusively flock-ed file object, or None when a live process holds it."""
    try:
        f = open(path, "a+")
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    if not path.exists():  # removed by the one who held it before us
        f.close()
        return None
    return f


def read_manifest(path: Path) -> dict:
    """A worker's manifest; ``ValueError`` naming what is wrong when it is not one."""
    try:
        manifest = json.loads(path.read_bytes())
    except UnicodeDecodeError as exc:
        raise ValueError(f"not text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from exc
    keys = ("trial_id", "number", "epoch", "history", "orders", "ckpt")
    if not (isinstance(manifest, dict) and isinstance(manifest.get("trials"), list)
            and all(isinstance(e, dict) and all(k in e for k in keys)
                    for e in manifest["trials"])):
        raise ValueError("not a manifest: its trials or their keys are missing")
    return manifest


#: A trial that never recorded a heartbeat is taken for dead (its worker killed while
#: asking it) once this worker has seen it so for this long, or the grace period if
#: longer: asking a trial (the sampler) takes well under it.
NO_HEARTBEAT_S = 30.0


class Recovery:
    """The recovery part of :class:`hftc.sweep.Sweep` (a mixin)."""

    def _dead_workers(self) -> list[tuple[Path, Any, dict]]:
        """This folder's workers that died with a manifest: (folder, held lock, manifest)."""
        found = []
        root = self.out / "workers"
        for d in sorted(root.iterdir()) if root.exists() else []:
            if d == self.dir or not d.is_dir() or d.name.startswith("."):
                continue
            lock = try_lock(d / "lock")
            if lock is None:
                continue  # alive (or being adopted by someone else)
            try:
                manifest = read_manifest(d / "manifest.json")
            except FileNotFoundError:  # died before its first trial: it did no work
                manifest = {"study": self.study_name, "trials": [], "round": 0}
            except (OSError, ValueError) as exc:
                self._warn(
                    f"{d / 'manifest.json'} is damaged ({exc}): the trials that worker "
                    f"held cannot continue from its checkpoints; they are failed and "
                    f"retried from epoch 0 with their parameters and seeds (with --resume, "
                    f"or by any worker once their heartbeat is stale). Completed trials "
                    f"are kept.")
                manifest = {"study": self.study_name, "trials": [], "round": 0}
            if manifest.get("study") != self.study_name:
                lock.close()
                continue
            found.append((d, lock, manifest))
        return found


    # ------------------------------------------------------------------ resume

    def _adopt(self, dead: list[tuple[Path, Any, dict]]) -> None:
        """Re-attach the trials of dead workers that are still RUNNING, from their
        checkpoints; then their folders go."""
        adopted, undecided = [], []
        # A resumer killed while adopting leaves the trials in two folders: take each
        # trial once, from the folder where it got furthest.
        chosen: dict[int, tuple[Path, dict]] = {}
        for folder, _lock, manifest in dead:
            for entry in manifest.get("trials", []):
                seen = chosen.get(entry["trial_id"])
                if seen is None or entry["epoch"] > seen[1]["epoch"]:
                    chosen[entry["trial_id"]] = (folder, entry)
            self.round = max(self.round, int(manifest.get("round", 0)))
        files: dict[tuple[Path, str], dict | None] = {}
        kept: dict[Path, set[tuple[int, int]]] = {}

        def kept_in(folder: Path) -> set[tuple[int, int]]:
            if folder not in kept:
                kept[folder] = kept_decisions(folder)
            return kept[folder]

        # In the order of their numbers, the order the dead worker asked them in and held
        # them live: its arrays (and their dropout draws) and its decisions had that order.
        for folder, entry in sorted(chosen.values(), key=lambda fe: fe[1]["number"]):
            frozen = self.storage.get_trial(entry["trial_id"])
            if frozen.state != TrialState.RUNNING:
                continue  # finished, or failed (stale) and retried: not ours to run
            saved, epoch = None, 0
            if entry.get("ckpt"):
                name, j = entry["ckpt"]
                if (folder, name) not in files:
                    files[folder, name] = self._load_checkpoint(folder / name)
                saved, epoch = files[folder, name], entry["epoch"]
                if saved is None:  # damaged (warned): what the trial did is lost
                    self._retry(frozen, f"its checkpoint {folder / name} is damaged")
                    continue
            trial = optuna.Trial(self.study, entry["trial_id"])
            self.heartbeat.add(entry["trial_id"])
            params = self._params(trial)
            seed = self._seed(trial, params)
            module = build_model(self.spec, params, seed)
            optimizers = make_optimizers(self.spec, params, module)
            schedulers = make_schedulers(self.spec, params, optimizers)
            if saved is not None:
                module.load_state_dict(own_widths(saved["model"], j, module))
                states, names = saved["optimizer"], saved["param_names"]
                if isinstance(states, dict):  # written by a sweep of one optimizer per trial
                    states, names = [states], [names]
                for k, optimizer in enumerate(optimizers):
                    load_model_slice(states[k], names[k], j, optimizer, module)
                scheduler_states = saved["schedulers"][j] if "schedulers" in saved else []
                for scheduler, state in zip(schedulers, scheduler_states):
                    if scheduler is not None and state is not None:
                        scheduler.load_state_dict(state)
            run = LiveTrial(trial, params, seed, module, optimizers, schedulers, epoch=epoch,
                       history=list(entry["history"][:epoch]),
                       orders=list(entry["orders"][:epoch]),
                       reported=max(frozen.intermediate_values, default=0))
            self.live.append(run)
            adopted.append(run)
            if epoch > 0 and (entry["trial_id"], epoch) not in kept_in(folder) and \
                    frozen.system_attrs.get(KEPT_AT) != [frozen.number, epoch]:
                undecided.append(run)
            elif epoch > 0:  # kept there: recorded here too, before that folder goes
                append_line(self.dir / KEPT_FILE, f"{entry['trial_id']} {epoch}\n")
        if adopted:
            self.log(f"resumed {len(adopted)} trial(s): "
                     + ", ".join(f"{r.number}@epoch {r.epoch}" for r in adopted))
            # Finish what the dead worker may not have: report, complete, prune. Not the
            # trials it kept at their epoch: the pruner, asked again, would see the trials
            # told after it decided (and decide otherwise).
            self._decide(undecided)
            self._regroup()
            self._checkpoint()
        for folder, lock, _ in dead:
            shutil.rmtree(folder, ignore_errors=True)
            lock.close()

    def _load_checkpoint(self, path: Path) -> dict | None:
        """A dead worker's checkpoint file, or None (with a warning naming it) when it
        cannot be read: truncated, empty or not a checkpoint."""
        try:
            saved = torch.load(path, weights_only=True, map_location=self.spec.device)
            if not all(k in saved for k in ("model", "optimizer", "param_names")):
                raise ValueError("not a sweep checkpoint: model, optimizer or param_names "
                                 "missing")
            return saved
        except FileNotFoundError:
            reason = "missing"
        except Exception as exc:  # noqa: BLE001 - torch.load's errors name no file
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self._warn(f"the checkpoint {path} cannot be read ({reason}): the trials in it are "
                   f"failed and retried from epoch 0 with their parameters and seeds; "
                   f"completed trials are kept")
        return None

    def _retry(self, frozen: optuna.trial.FrozenTrial, why: str) -> None:
        """Fail a RUNNING trial whose work is lost and enqueue it again, as Optuna's
        heartbeat does for a dead worker's: same parameters and seed, a new number."""
        callback = self.storage.get_heartbeat_stale_trial_callback() if hasattr(
            self.storage, "get_heartbeat_stale_trial_callback") else None
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
            if self.storage.set_trial_state_values(frozen._trial_id, state=TrialState.FAIL):
                if callback is not None:
                    callback(self.study, self.storage.get_trial(frozen._trial_id))
                self.log(f"trial {frozen.number}: {why}; failed and retried")

    def _restart_unstarted(self) -> None:
        """On the default storage with no other worker alive, a RUNNING trial that no
        manifest names was asked by a worker killed before its first manifest: it did no
        work. ``--resume`` runs it from epoch 0 under its own number (without --resume,
        :meth:`_reap_orphans` fails and retries it, as a heartbeat would)."""
        if not self.default_storage or self._others_alive():
            return
        mine = {r.trial_id for r in self.live}
        restarted = []
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if t._trial_id in mine:
                continue
            if t.intermediate_values:
                # It did work that no readable manifest records (its manifest was damaged,
                # warned): from epoch 0 under its own number, its reported epochs would
                # not be the ones it trains again. A retry starts it clean.
                self._retry(t, "its worker's manifest is damaged")
                continue
            # The sampler reads the study's trials afresh, as in study.ask(): the history
            # it conditions on is the storage's, as it was when the dead worker asked.
            with contextlib.suppress(AttributeError):
                self.study._thread_local.cached_all_trials = None
            trial = optuna.Trial(self.study, t._trial_id)
            self.heartbeat.add(t._trial_id)
            self.live.append(self._new_run(trial))
            restarted.append(t.number)
        if restarted:
            self._write_manifest()
            self.log(f"restarted {len(restarted)} trial(s) killed before their first "
                     f"epoch: {restarted}")


    def _others_alive(self) -> bool:
        """Does another live worker use this folder? (Its lock is held.)"""
        root = self.out / "workers"
        for d in root.iterdir() if root.exists() else []:
            if d != self.dir and d.is_dir() and not d.name.startswith("."):
                lock = try_lock(d / "lock")
                if lock is None and (d / "lock").exists():
                    return True
                if lock is not None:
                    lock.close()
        return False

    def _reap_orphans(self) -> bool:
        """Fail and enqueue again, as a heartbeat would, each RUNNING trial that is not
        ours and runs nowhere: its worker died after asking it and before recording its
        first heartbeat (Optuna's heartbeat check skips a trial that never had one, so
        it would stay RUNNING for good and the other workers would wait for it).

        * On the default storage (this folder's SQLite file): any such trial, once no
          other worker is alive.
        * On a shared storage: one that has had no heartbeat while this worker watched
          it for ``NO_HEARTBEAT_S`` or the grace period, whichever is longer (timed on
          this worker's clock: other machines' clocks may differ).
        """
        if self.default_storage and self._others_alive():
            return False
        mine = {r.trial_id for r in self.live}
        running = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                   if t._trial_id not in mine]
        if not self.default_storage:
            running = self._without_heartbeat(running)
        callback = self.storage.get_heartbeat_stale_trial_callback() if hasattr(
            self.storage, "get_heartbeat_stale_trial_callback") else None
        reaped = False
        for t in running:
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                if self.storage.set_trial_state_values(t._trial_id, state=TrialState.FAIL):
                    self.log(f"trial {t.number} was running nowhere; failed and retried")
                    if callback is not None:
                        callback(self.study, self.storage.get_trial(t._trial_id))
                    reaped = True
        return reaped

    def _without_heartbeat(self, trials: list[optuna.trial.FrozenTrial],
                           ) -> list[optuna.trial.FrozenTrial]:
        """Those of ``trials`` that have never recorded a heartbeat and have been seen
        so, by this worker, for long enough to be dead (see :meth:`_reap_orphans`)."""
        try:
            from optuna.storages._rdb.models import TrialHeartbeatModel
            from optuna.storages._rdb.storage import _create_scoped_session

            with _create_scoped_session(self.storage.scoped_session) as session:
                beating = {tid for tid in (t._trial_id for t in trials)
                           if TrialHeartbeatModel.where_trial_id(tid, session) is not None}
        except Exception:  # noqa: BLE001 - another Optuna's internals: leave them to it
            return []
        now = time.monotonic()
        silent = {t._trial_id for t in trials} - beating
        seen = self._silent_since
        for tid in list(seen):
            if tid not in silent:
                del seen[tid]
        wait = max(NO_HEARTBEAT_S, self.grace_period or 4 * self.heartbeat_interval)
        return [t for t in trials if t._trial_id in silent
                and now - seen.setdefault(t._trial_id, now) >= wait]

