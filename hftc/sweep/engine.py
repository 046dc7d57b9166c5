"""One sweep worker: Optuna asks, hftc fuses, trains, checkpoints and tells.

::

    loop:   fail stale trials (Optuna heartbeat; a dead worker's trials are retried)
            ask trials until the array holds per_array of them (or the budget is spent)
            group the array's models by what their optimizers allow (classes mix) and by
            structure, fuse each group (hftc.fuse_groups; widths padded with pad_widths)
            train one epoch: every batch through every fused group
            checkpoint every group (fused state_dict + optimizer state_dict) + manifest
            report each trial's metric; complete / prune it (Optuna's pruner decides)
    end:    results.csv, best.pt, curves.png, leaderboard (report.py)

Everything that must survive a crash is in the storage (Optuna's RDB: SQLite by
default, PostgreSQL across machines) or in this worker's folder
``OUT/workers/<id>/`` (checkpoints and ``manifest.json``, which lists each live
trial, its epoch and where its weights are). The folder's ``lock`` file is held
with ``flock`` while the worker lives, so ``--resume`` knows a dead worker's
folder when it sees one (the kernel drops the lock on SIGKILL too).

Never run twice, never lost: ``study.ask()`` hands each trial to one worker
only; a resumed worker re-attaches only trials that are still RUNNING in the
storage, from their checkpoints; a worker that dies without being resumed stops
its heartbeat, Optuna fails its trials after the grace period and
``RetryHeartbeatStaleTrialCallback`` enqueues each again (same parameters, same
seed) for the next ``ask()`` of any worker; a worker whose trial was taken over
(its ``tell`` finds it finished) drops it.

Resumed equals uninterrupted, bit for bit: trial k's parameters depend on the seed, k
and the trials before k only (sampling.py), and a resumed worker asks at the points the
dead one did (after the round's decisions), with the same history; the arrays are a
function of the live trials (:meth:`Sweep._regroup`); each round's random draws are
seeded from its number; the pruner is asked once per trial and epoch (``KEPT_FILE``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import socket
import sys
import time
import traceback
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState

import hftc

from ..errors import SweepError, SweepFileError, SweepWarning
from .arrays import Arrays, FusedArray, LiveTrial, finite_models
from .clock import before_sweep
from .collector import frozen_objects, paused_collection
from .decisions import Decisions
from .fingerprint import ATTR as FINGERPRINT
from .fingerprint import check_same_spec, spec_fingerprint
from .recovery import Recovery, try_lock
from .sampling import TrialSeededSampler, grid_left
from .spec import SpecError, SweepSpec, hook_name, plain_params
from .storage import (
    SURPLUS,
    Heartbeat,
    OwnTrialsCache,
    check_heartbeat,
    count_trials,
    counts_in_budget,
    make_pruner,
    make_sampler,
    make_storage,
    masked_url,
    room_for,
    storage_errors,
)
from .training import (
    batch_failed,
    batch_for_hook,
    batches,
    build_model,
    check_fusable,
    evaluate_all,
    load_data,
    loss_failed,
    make_optimizers,
    make_schedulers,
    metric_value,
    model_output,
    not_a_loss,
    round_seed,
    step_losses,
    step_scheduler,
    train_alone,
)

__all__ = ["Sweep", "SweepError", "SweepFileError", "SweepResult", "make_storage", "make_pruner",
           "finite_models"]

#: the study's user attribute holding the n_trials a run gave (--trials), if any
N_TRIALS = "hftc_n_trials"


#: A running array is refilled once 1 / REFILL_PARTS of its places are free (Sweep._refill).
REFILL_PARTS = 4


@dataclass
class SweepResult:
    """What a worker leaves: the study, the files it wrote and how long it took."""

    study: optuna.Study
    out: Path
    wall_s: float
    train_s: float
    trial_epochs: int
    files: dict[str, Path]
    leaderboard: str
    timings: dict[str, float] = field(default_factory=dict)
    metric: str = "value"
    #: seconds of the epochs trained alone (stock) to estimate the one-by-one time
    serial_epoch_s: list[float] = field(default_factory=list)
    #: the sizes of the fused arrays of every formation, and why trials were kept apart
    formations: list[tuple[int, ...]] = field(default_factory=list)
    apart: list[str] = field(default_factory=list)
    #: per array formed with padded widths: its trials, how many widths, the padded
    #: arithmetic over the models' own; per array of mixed optimizer classes: its trials
    #: and classes
    padded: list[tuple[list[int], int, float]] = field(default_factory=list)
    mixed: list[tuple[list[int], list[str]]] = field(default_factory=list)
    #: the one-at-a-time side, measured: its Optuna share (the same study's trials asked,
    #: reported, pruned and told through stock Optuna, off the clock: serial.replay_optuna),
    #: the trial-epochs it trains for the same learning curves, and the data's loading
    #: (a start-up both sides pay); None where not measured (a study shared or resumed)
    serial_optuna_s: float | None = None
    serial_trial_epochs: int | None = None
    load_s: float = 0.0
    #: the seconds torch._dynamo's import took, which the first step of a stock torch.optim
    #: optimizer makes in any script: charged to the one-at-a-time side (the fused side
    #: skips it, hftc/patches.py); measured before the first epoch trained alone, 0 where
    #: the process had imported it before
    dynamo_import_s: float = 0.0
    #: set where the sweep ran without fusing (too small to gain: serial.too_small)
    note: str = ""
    #: False where the sweep was asked for no speedup estimate (``--no-estimate``)
    estimated: bool = True
    #: the seconds the process ran before the sweep's clock (Python, its imports, the
    #: spec), where the process is the ``hftc`` command (clock.py), else None; and of
    #: them hftc's core import, which a script without hftc does not pay
    before_s: float | None = None
    hftc_import_s: float = 0.0
    #: a sweep on Ray actors (hftc.ray.sweep): how Ray was reached (a running cluster
    #: reused, or started) and how long it took, the actors and nodes; else ""
    cluster: str = ""
    #: what in the fused arrays ran model by model, not fused (exact, not faster): an op
    #: no rule fuses, or a whole forward run the models one by one (fused.plan), with why
    one_by_one: list[str] = field(default_factory=list)

    @property
    def summary(self) -> str:
        """Where the time went, the speedup, the arrays' sizes (report.summary)."""
        from .report import summary

        return summary(self)

    @property
    def best_trial(self) -> optuna.trial.FrozenTrial | None:
        try:
            return self.study.best_trial
        except ValueError:
            return None


# ---------------------------------------------------------------------- small helpers


_round_seed = round_seed  # (building models reseeds torch: each round seeds afresh)


# ---------------------------------------------------------------------- the worker


class Sweep(Recovery, Arrays, Decisions):
    """One worker of a fused sweep (run the same on every machine to share a study).

    Args:
        spec: the :class:`SweepSpec`.
        out: folder for checkpoints, the default SQLite storage and the results.
        storage: an Optuna RDB URL; default ``sqlite:///OUT/study.db``.
        study_name: default ``spec.name``.
        resume: re-attach the trials of this folder's dead workers from their
            checkpoints (otherwise an interrupted sweep in ``out`` is an error).
        heartbeat_interval / grace_period: seconds; a worker silent for
            ``grace_period`` has its trials failed and retried by another.
        progress: tqdm bars (default: when stderr is a terminal).
        log: a function of one string, for a line per trial event (default: silent).
        on_round: a function of the worker, called after every round off the clock.
        estimate_serial: how many epochs to train alone (stock, off the clock, one after
            each of the first rounds) to estimate the one-by-one time of the summary.
        compare_serial: after the sweep, off its clock, measure the one-at-a-time
            study's Optuna share for these trials (:func:`hftc.sweep.serial.replay_optuna`),
            charged to the one-by-one side of the summary's speedup.
        n_trials_given: ``spec.n_trials`` was given for this run (``--trials``), not the
            spec's own: a later run of the study that gives none (``--resume`` as the
            command was) goes on to this number, not to the spec's.
    """

    def __init__(self, spec: SweepSpec, *, out: str | Path | None = None,
                 storage: str | None = None, study_name: str | None = None,
                 resume: bool = False, heartbeat_interval: int = 30,
                 grace_period: int | None = None, progress: bool | None = None,
                 log=None, on_round=None, estimate_serial: int = 3,
                 compare_serial: bool = True, n_trials_given: bool = False):
        self.spec = spec
        self.n_trials_given = n_trials_given
        # on_round(sweep) runs after every round, off the clock (the demo times a serial
        # epoch there, so both sides are measured under the same machine load).
        self.on_round = on_round
        self.estimate_serial = estimate_serial
        self.compare_serial = compare_serial
        self.load_s, self.fresh, self.dynamo_import_s = 0.0, False, 0.0
        self.serial_epoch_s: list[float] = []
        self.formations: list[tuple[int, ...]] = []
        self.apart: dict[str, None] = {}  # why trials could not share an array (ordered set)
        #: arrays of padded widths (trials, how many widths, arithmetic over their own) and
        #: of mixed optimizer classes (trials, classes), as formed
        self.padded: list[tuple[list[int], int, float]] = []
        self.mixed: list[tuple[list[int], list[str]]] = []
        self._apart_cache: dict[tuple, str] = {}  # (structure, structure) -> why apart
        self.one_by_one: dict[str, list[int]] = {}  # ran model by model, not fused: trials
        self._example: Any = None  # a training batch's inputs, for tracing
        self.excluded_s = 0.0
        self.study_name = study_name or spec.name
        self.out = Path(out if out is not None else Path("sweeps") / self.study_name).resolve()
        self.default_storage = storage is None
        self.storage_url = storage or f"sqlite:///{self.out / 'study.db'}"
        self.resume = resume
        check_heartbeat(heartbeat_interval, grace_period)  # before anything is written
        self.heartbeat_interval = int(heartbeat_interval)
        self.grace_period = grace_period
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.log = log if log is not None else (lambda msg: None)
        self.live: list[LiveTrial] = []
        #: the sampler asked the study to stop (GridSampler, its grid used up): ask no more
        self.sampler_stopped = False
        self._silent_since: dict[int, float] = {}  # trial id -> first seen without a heartbeat
        self.arrays: list[FusedArray] = []
        self.round = 0
        self.train_s = 0.0
        self.trial_epochs = 0
        # Where the wall clock went: training, fusing, Optuna (ask/report/tell),
        # checkpoints, the spec's on_epoch, the result files (csv, curves plot, best).
        self.timings = {"train": 0.0, "fuse": 0.0, "optuna": 0.0, "checkpoint": 0.0,
                        "on_epoch": 0.0, "results": 0.0}
        self._loss = hftc.per_model(spec.loss)
        self._view: tuple[list, list] | None = None  # (complete, running elsewhere): _decide
        self._out_now: set[int] = set()  # trials pruned or failed in this round's decisions

    # ------------------------------------------------------------------ set-up

    def _open(self) -> None:
        # The spec's pruner and sampler names, and its data, first: a spec error stops the
        # sweep before it writes anything.
        make_pruner(self.spec)
        if isinstance(self.spec.sampler, str) and self.spec.sampler not in ("tpe", "random"):
            make_sampler(self.spec, self.spec.seed)  # (its error)
        start = time.perf_counter()
        self.data = load_data(self.spec)
        self.load_s = time.perf_counter() - start
        if self.resume and self.default_storage and not (self.out / "study.db").exists():
            raise self._nothing_to_resume()
        self._make_folders()
        opened = time.perf_counter()
        self.storage = make_storage(self.storage_url, self.heartbeat_interval, self.grace_period)
        existing = None
        with contextlib.suppress(KeyError):
            existing = self.storage.get_study_id_from_name(self.study_name)
        if existing is None and self.resume:
            raise self._nothing_to_resume()
        n_before = 0
        if existing is not None:
            n_before = len(self.storage.get_all_trials(existing, deepcopy=False))
            directions = self.storage.get_study_directions(existing)
            if [d.name.lower() for d in directions] != [self.spec.direction]:
                was = '/'.join(d.name.lower() for d in directions)
                raise SweepError(
                    f"the study {self.study_name!r} in {masked_url(self.storage_url)} is "
                    f"{was}, but the spec's direction is {self.spec.direction!r} (or its "
                    f"metric's default): set direction = {was!r} in the spec to continue "
                    f"it, or pick another --study name"
                )
        # Every draw is reseeded from (spec.seed, trial number, what is drawn): trial k
        # gets the parameters it gets in an uninterrupted sweep, from any process
        # (sampling.py). The construction seed matters only to a sampler whose random
        # state the sweep cannot find: past the trials already there, and apart from other
        # workers when the storage is shared, it does not repeat their samples.
        seed = self.spec.seed + n_before
        self.fresh = n_before == 0 and not self.resume
        if not self.default_storage:
            seed += uuid.uuid4().int % 1_000_000
        sampler = make_sampler(self.spec, seed)
        if not isinstance(sampler, TrialSeededSampler):
            sampler = TrialSeededSampler(sampler, self.spec.seed)
        self.study = optuna.create_study(
            study_name=self.study_name, storage=OwnTrialsCache(self.storage), load_if_exists=True,
            direction=self.spec.direction, sampler=sampler, pruner=make_pruner(self.spec),
        )
        # (the process's first RDB storage: SQLAlchemy's import and the schema, which a
        # one-at-a-time script's create_study pays as well; the replay's, made second, not)
        self.study_made_s = time.perf_counter() - opened
        self._same_spec()
        self._same_n_trials()
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # Made under a hidden name, locked, then renamed: no other worker ever sees this
        # folder unlocked (and takes it for a dead one).
        self.dir = self.out / "workers" / self.worker_id
        hidden = self.dir.with_name(f".{self.worker_id}")
        try:
            hidden.mkdir(parents=True)
            (hidden / "lock").touch()
            self._lock = try_lock(hidden / "lock")
            os.rename(hidden, self.dir)
        except OSError as exc:
            raise self._unwritable(hidden.parent, exc) from exc
        if self.default_storage and self._others_alive():
            # Another worker on this folder's study started with the same seed (both
            # counted the same trials before them): a sampler whose random state the
            # sweep cannot reseed per trial samples apart from it.
            with contextlib.suppress(NotImplementedError):
                self.study.sampler.reseed_rng()
        self.heartbeat = Heartbeat(self.storage, self.heartbeat_interval)
        self.heartbeat.start()

    def _same_n_trials(self) -> None:
        """A study made with ``--trials K`` goes on to K trials when a later run gives no
        ``--trials`` (``--resume``, the command as it was), not to the spec's
        ``n_trials``; a run that gives one records it (a sweep is extended so)."""
        recorded = self.study.user_attrs.get(N_TRIALS)
        if self.n_trials_given:
            if recorded != self.spec.n_trials:
                self.study.set_user_attr(N_TRIALS, self.spec.n_trials)
        elif recorded is not None and recorded != self.spec.n_trials:
            self.log(f"the study was run with --trials {recorded}: going on to {recorded} "
                     f"trials, not the spec's {self.spec.n_trials} (give --trials to change it)")
            self.spec = self.spec.replace(n_trials=int(recorded))

    def _same_spec(self) -> None:
        """The spec the study's trials trained with is this one (fingerprint.py): a resume
        or a rerun after an edit of the spec is refused, not mixed into one study; a new
        study records it."""
        recorded = self.study.user_attrs.get(FINGERPRINT)
        if recorded is None:
            mine = spec_fingerprint(self.spec)
            with contextlib.suppress(*storage_errors()):  # (a unique key: another wrote it)
                self.study.set_user_attr(FINGERPRINT, mine)
            # Read back: a worker started at the same moment may have recorded its spec
            # instead, and this one must then be the same.
            recorded = self.study.user_attrs.get(FINGERPRINT)
            if recorded == json.loads(json.dumps(mine)):
                return
        where = self.out if self.default_storage else masked_url(self.storage_url)
        try:
            constants = check_same_spec(recorded, self.spec, self.study_name, str(where))
        except SweepError as exc:
            failed = self._failed_untrained()
            if failed is None:
                raise
            # Nothing was trained with the first spec (its error failed every trial before
            # an epoch): the edit is the fix, and no study mixes two. The record is this one.
            self.study.set_user_attr(FINGERPRINT, spec_fingerprint(self.spec))
            self._warn(f"the sweep {self.study_name!r} in {where} was started with another "
                       f"spec ({str(exc).split('another spec: ')[-1].split('. Its trials')[0]}),"
                       f" but its trials {failed} all failed before any epoch was trained: "
                       f"it goes on with this spec, and they stay failed (and count in its "
                       f"{self.spec.n_trials} trials: --trials "
                       f"{self.spec.n_trials + len(failed)} for {self.spec.n_trials} trained)")
            return
        if constants:
            self._warn(f"the sweep {self.study_name!r} in {where} was started with other "
                       f"values of the spec's module constants: {'; '.join(constants)}; its "
                       f"resumed and new trials train with these")

    def _failed_untrained(self) -> list[int] | None:
        """The study's trials where every one FAILED before reporting an epoch (a spec
        whose model could not be fused, a data() of the wrong dtype: the whole first
        array failed at once), else None: then no trial was sampled after, trained or
        pruned with the spec recorded, and the edited one may take its place."""
        trials = self.study.get_trials(deepcopy=False)
        if not trials or any(t.state != TrialState.FAIL or t.intermediate_values
                             for t in trials):
            return None
        return [t.number for t in trials]

    def _storage_failed(self, exc: BaseException) -> SweepError:
        """The sweep's database failed mid-sweep: said naming it (password masked), with
        what becomes of the live trials."""
        live = sorted(r.number for r in self.live)
        kept = (f"trials {live} are not failed (their last epoch is checkpointed in "
                f"{self.out}): " if live else "")
        others = ("" if self.default_storage else "; or leave it to the other workers, "
                  "which retry them from epoch 0 once their heartbeat is stale")
        return SweepError(
            f"the Optuna storage {masked_url(self.storage_url)} failed: {type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0]}; {kept}rerun the same command with "
            f"--resume once the database is reachable{others}")

    def _nothing_to_resume(self) -> SweepError:
        db = self.out / "study.db"
        if not self.default_storage:
            where = masked_url(self.storage_url)
        elif db.exists():  # made by a sweep killed before it made its study
            where = f"{self.out} ({db} holds no study {self.study_name!r})"
        else:
            where = f"{self.out} (no {db})"
        return SweepError(
            f"--resume: there is no sweep {self.study_name!r} to resume in {where}; leave "
            f"out --resume to start it, or give the --out / --study of the sweep to resume")

    def _unwritable(self, folder: Path, exc: OSError) -> SweepFileError:
        return SweepFileError(
            f"cannot write in the sweep's folder {folder} ({exc.strerror or exc}): make it "
            f"writable or give another --out", str(folder))

    def _make_folders(self) -> None:
        """``OUT`` and ``OUT/trials``, and a check that files can be written there: a
        read-only folder stops the sweep at the start, not after an epoch."""
        folder = self.out
        try:
            folder.mkdir(parents=True, exist_ok=True)
            folder = self.out / "trials"
            folder.mkdir(exist_ok=True)
            probe = folder / f".write-test-{os.getpid()}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise self._unwritable(folder, exc) from exc

    def _warn(self, message: str) -> None:
        warnings.warn(message, SweepWarning, stacklevel=3)
        self.log(f"warning: {message}")

    # ------------------------------------------------------------------ trials

    def _params(self, trial: optuna.Trial) -> dict[str, Any]:
        params = self.spec.space(trial)
        if params is None:
            params = dict(trial.params)
        if not isinstance(params, dict):
            raise SpecError(f"{hook_name('space', self.spec.space)} returned a "
                            f"{type(params).__name__}; return a dict of hyper-parameters (or "
                            f"None for trial.params)")
        return params

    def _seed(self, trial: optuna.Trial, params: dict[str, Any]) -> int:
        if "seed" in params:
            return int(params["seed"])
        attrs = trial.user_attrs
        if "hftc_seed" in attrs:  # a retry keeps the seed of the trial it retries
            return int(attrs["hftc_seed"])
        return self.spec.seed + trial.number

    def _new_run(self, trial: optuna.Trial) -> LiveTrial:
        # The seed is recorded before the space is sampled: a worker that dies in between
        # leaves a trial whose retry (which copies user attributes) keeps the seed.
        seed = self._seed(trial, {})
        if "hftc_seed" not in trial.user_attrs:
            trial.set_user_attr("hftc_seed", seed)
        params = self._params(trial)
        if "seed" in params and int(params["seed"]) != seed:
            seed = int(params["seed"])
            trial.set_user_attr("hftc_seed", seed)
        if params != trial.params:
            # What space() returned (derived values and constants too, which trial.params
            # lacks): best.json gives these, so model(best["params"]) builds the model.
            if plain_params(params) is not None:
                trial.set_user_attr("hftc_params", plain_params(params))
        self._warn_unread(params)
        module = build_model(self.spec, params, seed)
        self._check_own_module(trial.number, module)
        optimizers = make_optimizers(self.spec, params, module)
        check_fusable(self.spec, optimizers)
        schedulers = make_schedulers(self.spec, params, optimizers)
        return LiveTrial(trial, params, seed, module, optimizers, schedulers)

    def _warn_unread(self, params: dict[str, Any]) -> None:
        """Once per sweep: space() names a field of the whole sweep (batch_size, epochs),
        which the sweep does not read from a trial's params: the trials of an array share
        their batches and epochs, and every trial would train with the spec's value."""
        unread = sorted(set(params) & {"batch_size", "eval_batch_size", "epochs", "dtype",
                                        "device"})
        if not unread or getattr(self, "_warned_unread", False):
            return
        self._warned_unread = True
        self._warn(
            f"{hook_name('space', self.spec.space)} returns {', '.join(unread)}, which the "
            f"sweep does not read from a trial's params: every trial trains with the spec's "
            f"{', '.join(f'{k} = {getattr(self.spec, k)!r}' for k in unread)} (the trials of "
            f"an array share their batches and epochs). Set it in the spec instead (a value "
            f"your own model() / optimizer() / scheduler() reads: give it another name)")

    def _check_own_module(self, number: int, module: torch.nn.Module) -> None:
        """The trial's module, and its trainable parameters, are not a live trial's: a
        module made once at the spec's top level and returned by every model() call would
        have each trial start from (and write back into) the weights of the others."""
        own = {id(p) for p in module.parameters() if p.requires_grad}
        for run in self.live:
            shared = run.module is module or any(id(p) in own for p in run.module.parameters())
            if shared:
                what = "the module" if run.module is module else "trainable parameters"
                raise SpecError(
                    f"{hook_name('model', self.spec.model)} returned, for trial {number}, "
                    f"{what} it returned for trial {run.number} (the same objects): each "
                    f"trial trains weights of its own; build a new module in every call (a "
                    f"module or layer made once at the spec's top level is shared by all)")

    def _refill(self) -> bool:
        """Ask trials until the array is full or the budget is spent; True if any came.

        A running array is refilled once a quarter of its places are free (or all the
        trials the budget has left fit): each refill fuses the array again (tens of
        milliseconds, a few training steps of the whole array), and one free place of
        sixteen costs the array's throughput less than that."""
        spec, came = self.spec, False
        room = 0
        first = True
        while len(self.live) < spec.per_array and not self.sampler_stopped:
            if room == 0 or not self.default_storage:
                # On a shared storage, count before every ask: other workers ask too.
                c = count_trials(self.study)
                # Waiting trials run first: retries always, enqueued ones within the budget.
                room = room_for(c, spec.n_trials)
            if first and self.live and spec.per_array - len(self.live) < min(
                    room, max(1, spec.per_array // REFILL_PARTS)):
                break
            first = False
            if room == 0 or (grid_left(self.study) == 0
                             and count_trials(self.study)["waiting"] == 0):  # (retries run)
                # A GridSampler whose every point is taken, by finished or running trials,
                # would hand out a running one again (its is_exhausted counts the finished
                # only): the grid's points once each, as study.optimize and --serial.
                break
            room -= 1
            trial = self.study.ask()
            if self._over_budget(trial):
                break
            self.heartbeat.add(trial._trial_id)
            try:
                run = self._new_run(trial)
            except optuna.TrialPruned as exc:
                # objective(trial)'s habit for a configuration it will not train (space()
                # or model() raising it): pruned, as study.optimize prunes it; the rest go on
                self._tell(trial, state=TrialState.PRUNED)
                self.heartbeat.discard(trial._trial_id)
                self.log(f"trial {trial.number} pruned before training: {exc}")
                continue
            except Exception as exc:
                self._fail(trial, f"error while starting the trial: {type(exc).__name__}: {exc}")
                with contextlib.suppress(AttributeError):
                    exc.hftc_trial = trial.number
                if not isinstance(exc, SpecError):  # the spec's own code raised: its traceback
                    others = [r.number for r in self.live]
                    kept = (f"; trials {others} are not failed: rerun with --resume to continue "
                            f"them from their last epoch" if others else "")
                    exc.add_note(self._start_note(exc, trial, kept))  # for which trial
                raise
            self.live.append(run)
            came = True
            # At once, not after the last ask: asking can take a while (the sampler), and a
            # trial in the manifest is re-attached by --resume instead of failed and retried.
            self._write_manifest()
            self.log(f"trial {trial.number} started: {run.params}")
        return came

    def _start_note(self, exc: BaseException, trial: optuna.Trial, kept: str) -> str:
        """What a trial's start raised in: the spec's functions, or the sampler that its
        space() suggested through (CmaEsSampler without the cmaes package): not the spec's
        params then."""
        sampler = self.study.sampler
        sampler = getattr(sampler, "wrapped", sampler)  # (TrialSeededSampler's)
        frames = traceback.extract_tb(exc.__traceback__)
        calls = ("sample_relative", "sample_independent", "infer_relative_search_space",
                 "before_trial")  # the sampler's methods, which trial.suggest_* calls
        if any(f.name in calls for f in frames):
            return (f"hftc sweep: raised in the study's sampler ({type(sampler).__name__}) "
                    f"while space() suggested trial {trial.number}'s params (so far "
                    f"{trial.params}; the traceback's last lines); that trial is failed"
                    f"{kept}. Fix the spec's sampler (a package it needs, the space it takes), "
                    f"or use another")
        return (f"hftc sweep: raised while starting trial {trial.number} (params "
                f"{trial.params}) in the spec's space(), model(), optimizer() or "
                f"scheduler() (the traceback's last lines); that trial is failed"
                f"{kept}. Make the spec's function take these params, or leave them "
                f"out of space()")

    def _over_budget(self, trial: optuna.Trial) -> bool:
        """Another worker may ask between this one's count and its ask: a new trial whose
        earlier trials (by id, the order Optuna made them in) already use the whole
        budget is one too many. It is failed unrun, marked so that nothing counts it;
        a trial that was waiting (a retry, an enqueued one) is never one too many."""
        if self.default_storage and not self._others_alive():
            return False  # no one else asks: the count before the ask holds
        frozen = self.storage.get_trial(trial._trial_id)
        if "failed_trial" in frozen.system_attrs or "fixed_params" in frozen.system_attrs:
            return False
        before = [t for t in self.study.get_trials(deepcopy=False)
                  if t._trial_id < trial._trial_id]
        used = sum(counts_in_budget(t) or t.state == TrialState.WAITING for t in before)
        if used < self.spec.n_trials:
            return False
        with contextlib.suppress(Exception):
            trial.set_user_attr(SURPLUS, f"asked once {used} trials used the budget of "
                                         f"{self.spec.n_trials} (another worker asked at once)"
                                         f"; never ran")
            self._tell(trial, state=TrialState.FAIL)
        self.log(f"trial {trial.number} was one too many (another worker asked at once); "
                 f"given back unrun")
        return True

    def _fail(self, trial: optuna.Trial, reason: str) -> None:
        with contextlib.suppress(Exception):
            trial.set_user_attr("hftc_fail_reason", reason)
            self._tell(trial, state=TrialState.FAIL)
        self.heartbeat.discard(trial._trial_id)

    def _tell(self, trial: optuna.Trial, *args: Any, **kwargs: Any) -> None:
        """``study.tell``, where a sampler may ask the study to stop (optuna's GridSampler
        once its grid is used up calls ``study.stop()``, which works only inside
        ``study.optimize``: a RuntimeError here).  Optuna has stored the trial by then;
        the sweep asks for no new trials and finishes the ones it has."""
        try:
            self.study.tell(trial, *args, **kwargs)
        except RuntimeError as exc:
            if "Study.stop" not in str(exc):
                raise
            self.sampler_stopped = True

    # ------------------------------------------------------------------ one round

    def _train_round(self, bar=None) -> None:
        spec, data = self.spec, self.data
        key = spec.seed * 1_000_003 + self.round  # one data order for the whole round
        self.round += 1
        torch.manual_seed(_round_seed(key))
        start = time.perf_counter()
        for a in self.arrays:
            a.fused.train()
        loss_sums: list[torch.Tensor | None] = [None] * len(self.arrays)
        n_batches = 0
        # (engine.batches by name: the fault tests stop the sweep at a chosen batch)
        for xb, yb in data.epoch_batches(key, spec.batch_size, batches):
            for k, a in enumerate(self.arrays):
                try:
                    losses = self._step(a, xb, yb)
                except ValueError as exc:  # (a batch norm on the epoch's last sample)
                    said = batch_failed(spec, exc, xb, getattr(data, "n_train", None))
                    if said is None:
                        raise
                    raise said from exc
                if losses is not None:
                    loss_sums[k] = losses if loss_sums[k] is None else loss_sums[k] + losses
            n_batches += 1
            if bar is not None:
                bar.update(1)
        for a in self.arrays:
            a.fused.eval()
        outs, targets = evaluate_all([a.fused for a in self.arrays], data,
                                     spec.eval_batch_size, batch_dim=1)
        for a, out, loss_sum in zip(self.arrays, outs, loss_sums):
            finite = finite_models(a.fused)
            for j, run in enumerate(a.members):
                run.history.append(metric_value(spec, model_output(out, j), targets))
                run.weights_finite = finite[j]
                run.train_loss = None if loss_sum is None else float(loss_sum[j]) / n_batches
                run.orders.append(key)
                run.epoch += 1
                self.trial_epochs += 1
                self._step_schedulers(run)
        self.train_s += time.perf_counter() - start
        self._note_one_by_one()

    def _step(self, a: FusedArray, xb: tuple[torch.Tensor, ...], yb: torch.Tensor,
              ) -> torch.Tensor | None:
        """One batch through one array: the spec's train_step, or zero_grad, the sum of
        the per-model losses backward (each model gets exactly its own gradient), step.
        Returns the per-model losses, detached (None when train_step gives none)."""
        if self.spec.train_step is not None:
            returned = self.spec.train_step(a.fused, batch_for_hook(xb, yb), a.optimizers,
                                            [r.params for r in a.members])
            return step_losses(self.spec, returned, len(a.members))
        for optimizer in a.optimizers:
            optimizer.zero_grad(set_to_none=True)
        out = a.fused(*xb)
        try:
            losses = self._loss(out, yb)
        except (hftc.errors.FusionTypeError, hftc.errors.FusionArgumentError) as exc:
            # The user wrote spec.loss, not the per_model call: said of the spec's loss on
            # one model's output (what it raises, or returns instead of a scalar)
            raise loss_failed(self.spec, exc, self._first_output(out), yb) from exc.__cause__
        if losses.shape != (len(a.members),):  # per sample: one model's, to say its shape
            first = self._first_output(out)
            error = not_a_loss(self.spec, self.spec.loss(first, yb), first, yb)
            if error is not None:
                raise error
        losses.sum().backward()
        for optimizer in a.optimizers:
            optimizer.step()
        return losses.detach()

    @staticmethod
    def _first_output(out: Any) -> Any:
        """Model 0's output, detached (the spec's loss tried on it, to say what is wrong)."""
        return model_output(torch.utils._pytree.tree_map(
            lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out), 0)

    def _step_schedulers(self, run: LiveTrial) -> None:
        """Step the trial's schedulers (on its stock optimizers, with its metric) and give
        the values they set (lr, and momentum / betas for a one-cycle schedule) to its
        model's group of each fused optimizer."""
        for k, scheduler in enumerate(run.schedulers):
            if scheduler is None:
                continue
            if run.array is not None:
                # The fused optimizer stepped for the stock one (torch warns otherwise).
                run.optimizers[k]._opt_called = True
            step_scheduler(scheduler, run.history[-1])
            stock = run.optimizers[k].param_groups
            if len({g["lr"] for g in stock}) > 1:
                raise SpecError(
                    f"{hook_name('scheduler', self.spec.scheduler)}: trial {run.number}'s "
                    f"scheduler gave its param groups different learning rates "
                    f"({[g['lr'] for g in stock]}); a fused optimizer has one lr per model: "
                    f"schedule all groups alike, or use two optimizers")
            if run.array is not None:
                group = run.array.optimizers[k].param_groups[run.slot]
                for name in ("lr", "momentum", "betas"):
                    if name in group and name in stock[0]:
                        group[name] = stock[0][name]

    def _on_epoch(self, runs: list[LiveTrial]) -> None:
        """The spec's per-epoch callback: one dict per trial that trained this round."""
        if self.spec.on_epoch is None or not runs:
            return
        logs = []
        for run in runs:
            group = (run.array.optimizers[0].param_groups[run.slot] if run.array is not None
                     else run.optimizers[0].param_groups[0])
            logs.append({"trial": run.number, "epoch": run.epoch, "params": run.params,
                         self.spec.metric_name: run.history[-1],
                         "train_loss": run.train_loss, "lr": group["lr"]})
        try:
            self.spec.on_epoch(logs)
        except Exception as exc:
            # A logging hook's error is not the trials': their epoch is checkpointed, and
            # on_epoch is no part of the spec a resume compares (fingerprint.py).
            exc.hftc_keep_trials = True
            exc.add_note(f"hftc sweep: {hook_name('on_epoch', self.spec.on_epoch)} raised; "
                         f"trials {[r.number for r in self.live]} are not failed (their epoch "
                         f"is checkpointed): fix it and rerun with --resume to continue them")
            raise

    def charge_dynamo_import(self) -> None:
        """Before the first epoch trained alone: a stock optimizer's step imports
        torch._dynamo (about a second, once per process; hftc's patches spare the fused
        side), timed here as the one-at-a-time script's start-up, not its first epoch."""
        if "torch._dynamo" not in sys.modules:
            start = time.perf_counter()
            importlib.import_module("torch._dynamo")
            self.dynamo_import_s = time.perf_counter() - start

    def _estimate_serial(self, runs: list[LiveTrial]) -> None:
        """Off the clock, train one of this round's trials alone for its last epoch (stock
        model, optimizers, schedulers, the spec's train_step): a sample of the one-by-one
        time the summary compares with."""
        if len(self.serial_epoch_s) >= self.estimate_serial or not runs:
            return
        run = runs[len(self.serial_epoch_s) % len(runs)]
        self.charge_dynamo_import()
        with torch.random.fork_rng(devices=[]):  # the sweep's random draws stay its own
            start = time.perf_counter()
            train_alone(self.spec, run.params, run.seed, run.orders[-1:], self.data)
            self.serial_epoch_s.append(time.perf_counter() - start)

    # ------------------------------------------------------------------ main loop

    def run(self) -> SweepResult:
        """Run this worker until the study has ``n_trials`` finished trials and none
        is running anywhere; then write the results. Returns a :class:`SweepResult`."""
        start = time.perf_counter()
        before_s = before_sweep()
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        # Collection off while it starts, start-up's objects frozen once started
        # (collector.py)
        with contextlib.ExitStack() as self._collector:
            try:
                wall, files, board = self._run(start, verbosity)
            except BaseException as exc:
                # The folder stays (manifest and checkpoints, for --resume); the lock goes,
                # as it would with the process.
                if getattr(self, "_lock", None) is not None:
                    self._lock.close()
                if isinstance(exc, KeyboardInterrupt):  # (--resume needs the study made)
                    exc.hftc_resumable = getattr(self, "study", None) is not None or (
                        self.resume or (self.default_storage and (self.out / "study.db").exists()))
                if isinstance(exc, storage_errors()):  # opening, resuming, the results
                    raise self._storage_failed(exc) from exc
                raise
            shutil.rmtree(self.dir, ignore_errors=True)
            if getattr(self, "_lock", None) is not None:
                self._lock.close()
            replay = self._replay_serial()
        return SweepResult(self.study, self.out, wall, self.train_s, self.trial_epochs,
                           files, board, dict(self.timings), self.spec.metric_name,
                           list(self.serial_epoch_s), list(self.formations), list(self.apart),
                           list(self.padded), list(self.mixed), *replay, self.load_s,
                           self.dynamo_import_s, estimated=self.estimate_serial > 0,
                           before_s=before_s, hftc_import_s=hftc._CORE_LOAD_S,
                           one_by_one=[f"trials {sorted(n)}: {what}"
                                       for what, n in self.one_by_one.items()])

    def _replay_serial(self) -> tuple[float | None, int | None]:
        """After the sweep, off its clock: the one-at-a-time study's Optuna share and
        trial-epochs for these trials (serial.replay_optuna), where this worker ran the
        whole study (its own folder's storage, started afresh, some epoch timed alone)."""
        if not (self.default_storage and self.fresh and self.trial_epochs
                and self.compare_serial):
            return None, None
        from .serial import replay_optuna

        try:
            with torch.random.fork_rng(devices=[]):
                return replay_optuna(self.spec, self.study.get_trials(deepcopy=False),
                                     self.out / "trials",
                                     first_made_s=getattr(self, "study_made_s", 0.0),
                                     study_name=self.study_name)
        except Exception as exc:  # noqa: BLE001 - a measurement never fails the sweep
            self.log(f"the one-at-a-time Optuna share was not measured: {exc}")
            return None, None

    def _run(self, start: float, verbosity: int) -> tuple[float, dict[str, Path], str]:
        from .report import write_results

        with warnings.catch_warnings():
            # Heartbeats and ask-and-tell are experimental in Optuna's eyes; we use both.
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", message=".*Heartbeat of storage.*")
            warnings.filterwarnings("ignore", message=".*already reported.*")
            warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
            try:
                with paused_collection():
                    self._open()
                    # (frozen before collection resumes: no collection walks start-up's
                    # objects, not even the young one that would follow)
                    self._collector.enter_context(frozen_objects())
                dead = self._dead_workers()
                pending = [d for d in dead if any(
                    self.storage.get_trial(e["trial_id"]).state == TrialState.RUNNING
                    for e in d[2].get("trials", []))]
                if pending and not self.resume:
                    numbers = sorted(
                        e["number"] for d in pending for e in d[2]["trials"]
                        if self.storage.get_trial(e["trial_id"]).state == TrialState.RUNNING)
                    for _, lock, _ in dead:
                        lock.close()
                    raise SweepError(
                        f"{self.out} holds an interrupted sweep (trials {numbers} were "
                        f"running); rerun with --resume to continue them from their "
                        f"checkpoints, or use another --out / --study"
                    )
                self._adopt(dead)
                if self.resume:
                    self._restart_unstarted()
                self._loop()
            finally:
                if hasattr(self, "heartbeat"):
                    self.heartbeat.stop()
                optuna.logging.set_verbosity(verbosity)
            with self._timed("results"):
                files, board = write_results(self)
            wall = time.perf_counter() - start - self.excluded_s
        return wall, files, board

    @contextlib.contextmanager
    def _timed(self, what: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[what] += time.perf_counter() - start

    def _loop(self) -> None:
        from .report import progress_bars

        bars = progress_bars(self)
        try:
            while True:
                with self._timed("optuna"):
                    optuna.storages.fail_stale_trials(self.study)
                    self._refill()
                if not self.live:
                    c = count_trials(self.study)
                    runnable = min(c["waiting"], room_for(c, self.spec.n_trials))
                    if c["running"] == 0 and runnable == 0:
                        break  # (enqueued trials past the budget stay WAITING)
                    if self._reap_orphans():
                        continue
                    # Trials still run elsewhere: wait, and retry them should their worker die.
                    bars.waiting(c["running"])
                    time.sleep(self.heartbeat_interval)
                    continue
                with self._timed("fuse"):
                    self._regroup()
                bars.round_start(self)
                with self._timed("train"):
                    self._train_round(bars.epoch)
                with self._timed("checkpoint"):
                    self._checkpoint()
                trained = [r for a in self.arrays for r in a.members]
                with self._timed("on_epoch"):
                    self._on_epoch(trained)
                with self._timed("optuna"):
                    self._decide(list(self.live))
                bars.round_end(self)
                start = time.perf_counter()
                self._estimate_serial(trained)
                if self.on_round is not None:
                    self.on_round(self)
                self.excluded_s += time.perf_counter() - start
        except KeyboardInterrupt:
            self.log("interrupted: rerun with --resume to continue from the last epoch")
            raise
        except SweepFileError:
            # The output folder failed (disk full, read-only), not the trials: they stay
            # RUNNING, to be resumed from their last checkpoints.
            raise
        except storage_errors() as exc:
            # So did the database (restarted, unreachable): failing the trials for good
            # would lose them; they stay RUNNING, their last epoch checkpointed.
            raise self._storage_failed(exc) from exc
        except Exception as exc:
            # A bug in the spec (or ours) would fail the same way on every retry: fail the
            # live trials for good, with the reason, instead of leaving them to be retried.
            culprit = getattr(exc, "hftc_trial", None)  # set where one trial's code raised
            if isinstance(exc, torch.OutOfMemoryError):
                # The array's size ran out of memory, not a trial: they stay RUNNING, their
                # last epoch checkpointed, for --resume with smaller arrays.
                sizes = sorted({len(a.members) for a in self.arrays}, reverse=True)
                exc.add_note(
                    f"hftc sweep: the fused arrays ({', '.join(map(str, sizes)) or '?'} trials "
                    f"each, per_array={self.spec.per_array}) ran out of memory; trials "
                    f"{sorted(r.number for r in self.live)} are not failed: rerun with "
                    f"--resume and a smaller --per-array to continue them from their last "
                    f"epoch")
                raise
            if getattr(exc, "hftc_keep_trials", False) or (
                    culprit is not None and not isinstance(exc, SpecError)):
                # One trial's params made the spec's code raise (an out-of-memory model, a
                # value it cannot take): that trial alone fails, as in study.optimize, and
                # the others stay RUNNING in the manifest, their last epoch checkpointed
                # (--resume continues them), not failed for another trial's error.
                raise
            if isinstance(exc, hftc.errors.TraceError) and self.live:
                # (its advice is for a fused module called by hand; here the sweep called it)
                exc.add_note(
                    f"hftc sweep: the models of {hook_name('model', self.spec.model)} cannot "
                    f"be fused on a training batch of spec.data (batch_size="
                    f"{self.spec.batch_size}): fix the line named above; trials "
                    f"{sorted(r.number for r in self.live)} are failed, and a rerun with the "
                    f"edited spec goes on in the same study")
            for run in list(self.live):
                reason = f"error: {type(exc).__name__}: {exc}"
                if culprit is not None and culprit != run.number:
                    reason = f"the sweep stopped on trial {culprit}'s {reason}"
                self._fail(run.trial, reason)
            self.live.clear()
            raise
        finally:
            bars.close()

