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
seeded from its number; the pruner is asked once per trial and epoch (``_KEPT_AT``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
import torch
from optuna.trial import TrialState
from torch import nn

import hftc

from ..errors import SweepError, SweepFileError, SweepWarning
from ..module.padding import own_part, padding_ratio, weight_shapes, width_blocks, widths_key
from ..optim.mixed import MixedOptimizer
from ..optim.slicing import fused_param_names, load_model_slice
from .files import atomic_write, save
from .pruning import Reference, in_sequence, prune_in_sequence
from .sampling import TrialSeededSampler
from .spec import SpecError, SweepSpec, hook_name
from .training import (
    batch_for_hook,
    batches,
    build_model,
    evaluate_all,
    is_finite,
    load_data,
    make_optimizers,
    make_schedulers,
    metric_value,
    round_seed,
    step_losses,
    step_scheduler,
    train_alone,
)

__all__ = ["Sweep", "SweepError", "SweepFileError", "SweepResult", "make_storage"]


def finite_models(fused: nn.Module) -> list[bool]:
    """Per model: are all its weights finite?"""
    n = fused.num_models
    finite = torch.ones(n, dtype=torch.bool)
    with torch.no_grad():
        for p in fused.parameters():
            finite &= torch.isfinite(p.reshape(n, -1)).all(dim=1).cpu()
    return finite.tolist()


@dataclass
class _OptimizerSlot:
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


def _optimizer_slots(run: _Run) -> list[_OptimizerSlot]:
    names = {id(p): name for name, p in run.module.named_parameters()}
    return [_OptimizerSlot(type(o), len(o.param_groups),
                           any(bool(g.get("fused")) for g in o.param_groups),
                           any(bool(g.get("capturable")) for g in o.param_groups),
                           frozenset(names.get(id(p), "?") for g in o.param_groups
                                     for p in g["params"]))
            for o in run.optimizers]


def _optimizers_apart(bucket: list[list[_OptimizerSlot]], slots: list[_OptimizerSlot],
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


def _own_widths(stacked: dict[str, torch.Tensor], index: int,
                module: nn.Module) -> dict[str, torch.Tensor]:
    """Model ``index``'s state from a fused ``state_dict()`` at ``module``'s own widths:
    a padded array (pad_widths) holds each model in the first entries of every dim (of
    each q, k, v block of an attention's packed projection)."""
    own, blocks = module.state_dict(), width_blocks(module)
    return {k: own_part(v[index], own[k].shape, blocks.get(k, 1))
            if k in own and v[index].dim() == own[k].dim() else v[index]
            for k, v in stacked.items()}


def _shapes(module: nn.Module) -> tuple:
    return (type(module).__name__,
            tuple((name, tuple(p.shape)) for name, p in module.named_parameters()))


def _mismatch(a: nn.Module, b: nn.Module, example: Any) -> str:
    """Why hftc.fuse keeps ``b`` from ``a``'s array, in a line: its mismatch message's
    differences: the layer, its out_features 128 vs 64, its parameters' shapes ..."""
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
class _Run:
    """A live trial of this worker: where its weights are and what it has done."""

    trial: optuna.Trial
    params: dict[str, Any]
    seed: int
    module: nn.Module  # the trial's own module (its Python attributes are the trial's)
    # The trial's stock optimizers, for its whole life: current while not in an array;
    # its schedulers are built on them and step them (their lr then goes to the array's).
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    schedulers: list[Any] = field(default_factory=list)
    array: _Array | None = None
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
class _Array:
    """One fused group: trials whose models have one structure, trained as one module."""

    fused: hftc.FusedModule
    optimizers: list[torch.optim.Optimizer]  # fused, one per stock optimizer of a trial
    members: list[_Run]


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


# ---------------------------------------------------------------------- storage


def _retry_callback() -> Any:
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if cls is None:  # optuna < 4.9
        cls = optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental" since 2.8
        return cls(max_retry=3)


def _masked(url: str) -> str:
    head, sep, tail = url.partition("@")
    if not sep or "://" not in head:
        return url
    scheme, _, creds = head.partition("://")
    user = creds.partition(":")[0]
    return f"{scheme}://{user}:***@{tail}"


def _with_driver(url: str) -> str:
    """``postgresql://`` names no driver, and SQLAlchemy's default changed (psycopg2 up to
    2.0, psycopg 3 from 2.1): name the one that is installed, psycopg 3 first."""
    if not url.startswith(("postgresql://", "postgres://")):
        return url
    import importlib.util

    rest = url.split("://", 1)[1]
    for module, dialect in (("psycopg", "postgresql+psycopg"), ("psycopg2", "postgresql+psycopg2")):
        if importlib.util.find_spec(module) is not None:
            return f"{dialect}://{rest}"
    return url


def make_storage(url: str, heartbeat_interval: int = 30,
                 grace_period: int | None = None) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage (``sqlite:///...`` or ``postgresql://...``) with heartbeats
    on, and stale trials retried (same parameters) by whichever worker asks next."""
    kwargs: dict[str, Any] = {"heartbeat_interval": int(heartbeat_interval),
                              "grace_period": int(grace_period or 4 * heartbeat_interval)}
    try:
        import inspect
        accepted = inspect.signature(optuna.storages.RDBStorage).parameters
        key = ("heartbeat_stale_trial_callback" if "heartbeat_stale_trial_callback" in accepted
               else "failed_trial_callback")
    except (TypeError, ValueError):
        key = "failed_trial_callback"
    kwargs[key] = _retry_callback()
    url = _with_driver(url)
    if url.startswith("sqlite"):
        # The heartbeat thread writes while the main thread does: wait for the lock.
        engine_kwargs = {"connect_args": {"timeout": 60}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
    try:
        for attempt in range(4):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    storage = optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs,
                                                         **kwargs)
                break
            except ImportError:
                raise
            except Exception:
                # Workers started together on a fresh database race to create its tables;
                # the losers find them made a moment later.
                if attempt == 3:
                    raise
                time.sleep(0.5 + attempt)
    except ImportError as exc:
        missing = getattr(exc.__cause__, "name", None) or exc.name or "its database driver"
        raise SweepError(
            f"the storage {_masked(url)} needs the Python module {missing!r}: "
            f"pip install 'hftc[sweep]' (it brings psycopg for postgresql:// URLs)"
        ) from exc
    except Exception as exc:
        raise SweepError(f"cannot open the Optuna storage {_masked(url)}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    if storage.engine.name == "sqlite":
        _fast_sqlite(storage)
    return storage


def _fast_sqlite(storage: optuna.storages.RDBStorage) -> None:
    """Write-ahead logging and fsync at checkpoints only: a sweep commits a few times per
    trial and epoch, and a full fsync per commit costs more than the training on a
    small model. A killed process loses nothing (the WAL is in the OS's hands); a power
    cut may lose the last commits, never the database."""
    import sqlalchemy

    def pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", pragmas)
    storage.engine.dispose()  # connections opened before the listener reconnect with it


def _make_sampler(spec: SweepSpec, seed: int) -> optuna.samplers.BaseSampler:
    s = spec.sampler
    if isinstance(s, optuna.samplers.BaseSampler):
        return s
    if s in (None, "tpe"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # constant_liar: an array asks N trials before any finishes.
            return optuna.samplers.TPESampler(seed=seed, constant_liar=True)
    if s == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if callable(s):
        return s(seed)
    raise SweepError(f"unknown sampler {s!r}: use 'tpe', 'random' or an optuna sampler")


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    if isinstance(p, optuna.pruners.BasePruner):
        return p
    if p in (None, "none", False):
        return optuna.pruners.NopPruner()
    if p == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=4,
                                           n_warmup_steps=min(2, spec.epochs - 1))
    if p in ("sha", "asha", "successive_halving"):
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=3)
    if p == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=1, max_resource=spec.epochs,
                                              reduction_factor=3)
    raise SweepError(f"unknown pruner {p!r}: use 'median', 'sha', 'hyperband', 'none' or an "
                     f"optuna pruner")


# ---------------------------------------------------------------------- small helpers


_round_seed = round_seed  # (building models reseeds torch: each round seeds afresh)


def _try_lock(path: Path):
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


def _read_manifest(path: Path) -> dict:
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
_NO_HEARTBEAT_S = 30.0

#: The system attribute that records "the pruner kept trial K at epoch E", as [K, E]: a
#: resumed worker does not ask the pruner again for that epoch (it would see the trials
#: told since, and a pruner that counts or samples would answer anew). K, because a
#: retry inherits the system attributes of the trial it retries.
_KEPT_AT = "hftc_kept_at_epoch"


class _Heartbeat(threading.Thread):
    """Records a heartbeat for every trial this worker holds, every ``interval`` seconds.

    ``study.optimize`` runs one such thread per trial; a fused array holds N trials,
    so one thread beats for all of them."""

    def __init__(self, storage: optuna.storages.RDBStorage, interval: int):
        super().__init__(name="hftc-sweep-heartbeat", daemon=True)
        self.storage, self.interval = storage, interval
        self.ids: set[int] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def add(self, trial_id: int) -> None:
        with self.lock:
            self.ids.add(trial_id)
        self.storage.record_heartbeat(trial_id)

    def discard(self, trial_id: int) -> None:
        with self.lock:
            self.ids.discard(trial_id)

    def run(self) -> None:
        while not self.stopped.wait(self.interval):
            with self.lock:
                ids = list(self.ids)
            for tid in ids:
                with contextlib.suppress(Exception):  # a blip must not kill the beat
                    self.storage.record_heartbeat(tid)

    def stop(self) -> None:
        self.stopped.set()


def _counts(study: optuna.Study) -> dict[str, int]:
    """Trials that use the budget (finished, running, or failed for a reason of their own:
    a heartbeat-stale failure is retried, and its retry counts instead), and waiting ones."""
    c = {"budget": 0, "waiting": 0, "running": 0, "finished": 0}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            c["waiting"] += 1
        elif t.state == TrialState.RUNNING:
            c["running"] += 1
            c["budget"] += 1
        elif t.state in (TrialState.COMPLETE, TrialState.PRUNED) or (
                t.state == TrialState.FAIL and "hftc_fail_reason" in t.user_attrs):
            c["finished"] += 1
            c["budget"] += 1
    return c


# ---------------------------------------------------------------------- the worker


class Sweep:
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
    """

    def __init__(self, spec: SweepSpec, *, out: str | Path | None = None,
                 storage: str | None = None, study_name: str | None = None,
                 resume: bool = False, heartbeat_interval: int = 30,
                 grace_period: int | None = None, progress: bool | None = None,
                 log=None, on_round=None, estimate_serial: int = 3):
        self.spec = spec
        # on_round(sweep) runs after every round, off the clock (the demo times a serial
        # epoch there, so both sides are measured under the same machine load).
        self.on_round = on_round
        self.estimate_serial = estimate_serial
        self.serial_epoch_s: list[float] = []
        self.formations: list[tuple[int, ...]] = []
        self.apart: dict[str, None] = {}  # why trials could not share an array (ordered set)
        #: arrays of padded widths (trials, how many widths, arithmetic over their own) and
        #: of mixed optimizer classes (trials, classes), as formed
        self.padded: list[tuple[list[int], int, float]] = []
        self.mixed: list[tuple[list[int], list[str]]] = []
        self._apart_cache: dict[tuple, str] = {}  # (structure, structure) -> why apart
        self._example: Any = None  # a training batch's inputs, for tracing
        self.excluded_s = 0.0
        self.study_name = study_name or spec.name
        self.out = Path(out if out is not None else Path("sweeps") / self.study_name).resolve()
        self.default_storage = storage is None
        self.storage_url = storage or f"sqlite:///{self.out / 'study.db'}"
        self.resume = resume
        self.heartbeat_interval = max(1, int(heartbeat_interval))
        self.grace_period = grace_period
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.log = log if log is not None else (lambda msg: None)
        self.live: list[_Run] = []
        #: the sampler asked the study to stop (GridSampler, its grid used up): ask no more
        self.sampler_stopped = False
        self._silent_since: dict[int, float] = {}  # trial id -> first seen without a heartbeat
        self.arrays: list[_Array] = []
        self.round = 0
        self.train_s = 0.0
        self.trial_epochs = 0
        # Where the wall clock went: training, fusing, Optuna (ask/report/tell), checkpoints.
        self.timings = {"train": 0.0, "fuse": 0.0, "optuna": 0.0, "checkpoint": 0.0,
                        "on_epoch": 0.0}
        self._loss = hftc.per_model(spec.loss)
        self._view: tuple[list, list] | None = None  # (complete, running elsewhere): _decide
        self._out_now: set[int] = set()  # trials pruned or failed in this round's decisions

    # ------------------------------------------------------------------ set-up

    def _open(self) -> None:
        # The spec's data first: a spec error stops the sweep before it writes anything.
        self.data = load_data(self.spec)
        if self.resume and self.default_storage and not (self.out / "study.db").exists():
            raise self._nothing_to_resume()
        self._make_folders()
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
                raise SweepError(
                    f"the study {self.study_name!r} in {_masked(self.storage_url)} is "
                    f"{'/'.join(d.name.lower() for d in directions)}, but the spec says "
                    f"{self.spec.direction}; pick another --study name"
                )
        # Every draw is reseeded from (spec.seed, trial number, what is drawn): trial k
        # gets the parameters it gets in an uninterrupted sweep, from any process
        # (sampling.py). The construction seed matters only to a sampler whose random
        # state the sweep cannot find: past the trials already there, and apart from other
        # workers when the storage is shared, it does not repeat their samples.
        seed = self.spec.seed + n_before
        if not self.default_storage:
            seed += uuid.uuid4().int % 1_000_000
        sampler = _make_sampler(self.spec, seed)
        if not isinstance(sampler, TrialSeededSampler):
            sampler = TrialSeededSampler(sampler, self.spec.seed)
        self.study = optuna.create_study(
            study_name=self.study_name, storage=self.storage, load_if_exists=True,
            direction=self.spec.direction, sampler=sampler, pruner=make_pruner(self.spec),
        )
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # Made under a hidden name, locked, then renamed: no other worker ever sees this
        # folder unlocked (and takes it for a dead one).
        self.dir = self.out / "workers" / self.worker_id
        hidden = self.dir.with_name(f".{self.worker_id}")
        try:
            hidden.mkdir(parents=True)
            (hidden / "lock").touch()
            self._lock = _try_lock(hidden / "lock")
            os.rename(hidden, self.dir)
        except OSError as exc:
            raise self._unwritable(hidden.parent, exc) from exc
        if self.default_storage and self._others_alive():
            # Another worker on this folder's study started with the same seed (both
            # counted the same trials before them): a sampler whose random state the
            # sweep cannot reseed per trial samples apart from it.
            with contextlib.suppress(NotImplementedError):
                self.study.sampler.reseed_rng()
        self.heartbeat = _Heartbeat(self.storage, self.heartbeat_interval)
        self.heartbeat.start()

    def _nothing_to_resume(self) -> SweepError:
        db = self.out / "study.db"
        if not self.default_storage:
            where = _masked(self.storage_url)
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

    def _dead_workers(self) -> list[tuple[Path, Any, dict]]:
        """This folder's workers that died with a manifest: (folder, held lock, manifest)."""
        found = []
        root = self.out / "workers"
        for d in sorted(root.iterdir()) if root.exists() else []:
            if d == self.dir or not d.is_dir() or d.name.startswith("."):
                continue
            lock = _try_lock(d / "lock")
            if lock is None:
                continue  # alive (or being adopted by someone else)
            try:
                manifest = _read_manifest(d / "manifest.json")
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

    def _warn(self, message: str) -> None:
        warnings.warn(message, SweepWarning, stacklevel=3)
        self.log(f"warning: {message}")

    # ------------------------------------------------------------------ trials

    def _params(self, trial: optuna.Trial) -> dict[str, Any]:
        params = self.spec.space(trial)
        if params is None:
            params = dict(trial.params)
        if not isinstance(params, dict):
            raise SweepError(f"spec.space(trial) returned a {type(params).__name__}; return "
                             f"a dict of hyper-parameters (or None for trial.params)")
        return params

    def _seed(self, trial: optuna.Trial, params: dict[str, Any]) -> int:
        if "seed" in params:
            return int(params["seed"])
        attrs = trial.user_attrs
        if "hftc_seed" in attrs:  # a retry keeps the seed of the trial it retries
            return int(attrs["hftc_seed"])
        return self.spec.seed + trial.number

    def _new_run(self, trial: optuna.Trial) -> _Run:
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
            with contextlib.suppress(TypeError, ValueError):
                trial.set_user_attr("hftc_params", json.loads(json.dumps(params)))
        module = build_model(self.spec, params, seed)
        optimizers = make_optimizers(self.spec, params, module)
        schedulers = make_schedulers(self.spec, params, optimizers)
        return _Run(trial, params, seed, module, optimizers, schedulers)

    def _refill(self) -> bool:
        """Ask trials until the array is full or the budget is spent; True if any came."""
        spec, came = self.spec, False
        room = 0
        while len(self.live) < spec.per_array and not self.sampler_stopped:
            if room == 0 or not self.default_storage:
                # On a shared storage, count before every ask: other workers ask too.
                c = _counts(self.study)
                # Waiting trials (retries, enqueued ones) run first and use the budget too.
                room = c["waiting"] + max(0, spec.n_trials - c["budget"] - c["waiting"])
            exhausted = getattr(self.study.sampler, "is_exhausted", None)
            if room == 0 or (exhausted is not None and exhausted(self.study)):
                break  # (a GridSampler whose every point is taken would repeat one)
            room -= 1
            trial = self.study.ask()
            self.heartbeat.add(trial._trial_id)
            try:
                run = self._new_run(trial)
            except Exception as exc:
                self._fail(trial, f"error while starting the trial: {type(exc).__name__}: {exc}")
                with contextlib.suppress(AttributeError):
                    exc.hftc_trial = trial.number
                raise
            self.live.append(run)
            came = True
            # At once, not after the last ask: asking can take a while (the sampler), and a
            # trial in the manifest is re-attached by --resume instead of failed and retried.
            self._write_manifest()
            self.log(f"trial {trial.number} started: {run.params}")
        return came

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

    # ------------------------------------------------------------------ arrays

    def _take_out(self, array: _Array) -> None:
        """Dissolve an array: each live member gets its weights and its stock optimizers'
        state back (its schedulers, built on them, stay as they are)."""
        states = [o.state_dict() for o in array.optimizers]
        names = [fused_param_names(array.fused, o) for o in array.optimizers]
        live = {id(r) for r in self.live}
        for j, run in enumerate(array.members):
            if id(run) not in live or run.array is not array:
                continue
            # Into the trial's own module, not fused.unfuse_model(j): unfuse rebuilds every
            # model from model 0's template, so per-model attributes (Dropout.p) would be lost.
            run.module.load_state_dict(array.fused.model_state_dict(j))
            for k, optimizer in enumerate(run.optimizers):
                load_model_slice(states[k], names[k], j, optimizer, run.module)
            run.array = None
        self.arrays.remove(array)

    def _regroup(self) -> None:
        """Fuse the live trials into arrays, with their state, once any trial joined or
        left: every array is re-formed from the live trials, in their order (grouped by
        structure, hftc.fuse_groups), never only the shrunk ones. So the arrays, and the
        dropout draws that depend on them, are a function of the live trials alone,
        which a resumed worker, fusing all its trials at once, forms alike."""
        live = {id(r) for r in self.live}
        changed = any(r.array is None for r in self.live) or any(
            id(m) not in live for a in self.arrays for m in a.members)
        if not changed:
            return
        for array in list(self.arrays):
            self._take_out(array)
        loose = list(self.live)
        if not loose:
            return
        # One fused optimizer per array and position; trials whose optimizer() picked other
        # classes (a categorical SGD / Adam choice) share it (a MixedOptimizer), those
        # whose optimizers cannot be fused together (other counts of optimizers or param
        # groups) go into other arrays.
        buckets: list[tuple[list[list[_OptimizerSlot]], list[_Run]]] = []
        for r in loose:
            slots = _optimizer_slots(r)
            for bucket_slots, members in buckets:
                if _optimizers_apart(bucket_slots, slots) is None:
                    bucket_slots.append(slots)
                    members.append(r)
                    break
            else:
                buckets.append(([slots], [r]))
        for bucket_slots, members in buckets[1:]:
            self._note_apart(buckets[0][1], members,
                             _optimizers_apart(buckets[0][0], bucket_slots[0]))
        # A batch of the training data as example_inputs: a model symbolic tracing cannot
        # read (a Hugging Face model, say) is traced by torch.export from it.
        if self._example is None:
            self._example = self.data.example(self.spec.batch_size)
        example = self._example
        padding = ({"pad_widths": True, "max_padding": self.spec.max_padding}
                   if self.spec.pad_widths else {})
        for _, same in buckets:
            groups = hftc.fuse_groups([r.module for r in same], example_inputs=example,
                                      **padding)
            for fused, indices in groups[1:]:
                first, other = [same[i] for i in groups[0][1]], [same[i] for i in indices]
                self._note_apart(first, other, self._padding_apart(
                    first, other, str(getattr(fused, "grouping", ""))), example)
            for fused, indices in groups:
                members = [same[i] for i in indices]
                optimizers = [hftc.optim.fuse_optimizers(fused, [r.optimizers[k] for r in members])
                              for k in range(len(members[0].optimizers))]
                array = _Array(fused, optimizers, members)
                for j, r in enumerate(members):
                    r.array, r.slot = array, j
                self.arrays.append(array)
                self._note_array(array)
        # In the order of the trials: a resumed worker, which fuses all its trials at once,
        # runs the arrays (and draws their dropout) in the order the dead worker did.
        position = {id(r): k for k, r in enumerate(self.live)}
        self.arrays.sort(key=lambda a: position[id(a.members[0])])
        self.formations.append(tuple(len(a.members) for a in self.arrays))
        sizes = ", ".join(str(len(a.members)) for a in self.arrays)
        self.log(f"arrays re-formed: {len(self.live)} trials in {len(self.arrays)} fused "
                 f"array(s) of {sizes}")

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
                losses = self._step(a, xb, yb)
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
                run.history.append(metric_value(spec, out[j], targets))
                run.weights_finite = finite[j]
                run.train_loss = None if loss_sum is None else float(loss_sum[j]) / n_batches
                run.orders.append(key)
                run.epoch += 1
                self.trial_epochs += 1
                self._step_schedulers(run)
        self.train_s += time.perf_counter() - start

    def _step(self, a: _Array, xb: tuple[torch.Tensor, ...], yb: torch.Tensor,
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
        losses = self._loss(a.fused(*xb), yb)
        losses.sum().backward()
        for optimizer in a.optimizers:
            optimizer.step()
        return losses.detach()

    def _step_schedulers(self, run: _Run) -> None:
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

    def _on_epoch(self, runs: list[_Run]) -> None:
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
        self.spec.on_epoch(logs)

    def _estimate_serial(self, runs: list[_Run]) -> None:
        """Off the clock, train one of this round's trials alone for its last epoch (stock
        model, optimizers, schedulers, the spec's train_step): a sample of the one-by-one
        time the summary compares with."""
        if len(self.serial_epoch_s) >= self.estimate_serial or not runs:
            return
        run = runs[len(self.serial_epoch_s) % len(runs)]
        with torch.random.fork_rng(devices=[]):  # the sweep's random draws stay its own
            start = time.perf_counter()
            train_alone(self.spec, run.params, run.seed, run.orders[-1:], self.data)
            self.serial_epoch_s.append(time.perf_counter() - start)

    def _padding_apart(self, first: list[_Run], other: list[_Run], grouping: str) -> str | None:
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

    def _note_array(self, array: _Array) -> None:
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

    def _note_apart(self, first: list[_Run], other: list[_Run], reason: str | None,
                    example: Any = None) -> None:
        """Record why ``other`` could not share ``first``'s array: the reason given, or
        what hftc.fuse says of their models (once per pair of structures)."""
        if reason is None:
            pair = (_shapes(first[0].module), _shapes(other[0].module))
            if pair not in self._apart_cache:
                self._apart_cache[pair] = _mismatch(first[0].module, other[0].module, example)
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

    # ------------------------------------------------------------------ decisions

    def _model_state(self, run: _Run) -> dict[str, torch.Tensor]:
        if run.array is not None:
            return run.array.fused.model_state_dict(run.slot)
        return {k: v.detach().clone() for k, v in run.module.state_dict().items()}

    def _decide(self, runs: list[_Run]) -> None:
        """Report each trial's new metrics, then complete, prune or keep it."""
        done: list[_Run] = []
        # The complete and running trials, read once per round (other workers finish some
        # too); the trials this round prunes or fails are out of the later ones' reference.
        self._view, self._out_now = None, set()
        for run in sorted(runs, key=lambda r: r.number):
            trial = run.trial
            try:
                for step in range(run.reported + 1, run.epoch + 1):
                    trial.report(run.history[step - 1], step)
                run.reported = run.epoch
                value = run.history[-1]
                if not is_finite(value) or not run.weights_finite:
                    # (a model whose weights went NaN can still score an accuracy: argmax)
                    weights = "" if run.weights_finite else ", its weights not finite,"
                    self._record(run)
                    self._fail(trial, f"diverged: {self.spec.metric_name} is {value}{weights} "
                                      f"after epoch {run.epoch}")
                    self._out_now.add(run.number)
                    done.append(run)
                    self.log(f"trial {run.number} failed (diverged) at epoch {run.epoch}")
                elif run.epoch >= self.spec.epochs:
                    self._save_if_best(run, value)
                    self._record(run)
                    self._tell(trial, value)
                    done.append(run)
                    self.log(f"trial {run.number} complete: {value:.6g}")
                elif self._should_prune(run):
                    self._record(run)
                    self._tell(trial, state=TrialState.PRUNED)
                    self._out_now.add(run.number)
                    done.append(run)
                    self.log(f"trial {run.number} pruned at epoch {run.epoch}: {value:.6g}")
                else:  # kept: recorded, for a resumed worker (see _KEPT_AT)
                    self.storage.set_trial_system_attr(run.trial_id, _KEPT_AT,
                                                       [run.number, run.epoch])
            except (optuna.exceptions.UpdateFinishedTrialError, ValueError) as exc:
                state = self.storage.get_trial(run.trial_id).state
                if state == TrialState.RUNNING:
                    raise
                # Finished elsewhere: our heartbeat lapsed and another worker took it over.
                self.log(f"trial {run.number} was {state.name} in the storage ({exc}); dropped")
                done.append(run)
        for run in done:
            self.heartbeat.discard(run.trial_id)
            self.live.remove(run)

    def _should_prune(self, run: _Run) -> bool:
        """``trial.should_prune()``; for the pruners that compare with complete trials
        (median, percentile), against the trials a one-at-a-time study would have
        finished before this one (pruning.py: the complete ones, and those numbered
        below it still training, here or elsewhere), with one storage read per round."""
        pruner = self.study.pruner
        if isinstance(pruner, optuna.pruners.NopPruner):
            return False
        if not in_sequence(pruner):
            return run.trial.should_prune()
        if self._view is None:
            trials = self.study.get_trials(deepcopy=False,
                                           states=(TrialState.COMPLETE, TrialState.RUNNING))
            mine = {r.trial_id for r in self.live}
            self._view = ([t for t in trials if t.state == TrialState.COMPLETE],
                          [Reference(t.number, t.intermediate_values) for t in trials
                           if t.state == TrialState.RUNNING and t._trial_id not in mine])
        complete, elsewhere = self._view
        here = [Reference(r.number, {k + 1: v for k, v in enumerate(r.history)})
                for r in self.live if r.number not in self._out_now and r is not run]
        return prune_in_sequence(pruner, self.study, run.number, run.trial_id,
                                 {k + 1: v for k, v in enumerate(run.history)},
                                 complete, here + elsewhere)

    def _record(self, run: _Run) -> None:
        """What it takes to retrain the trial alone: the data order keys of its epochs."""
        run.trial.set_user_attr("hftc_orders", run.orders)
        run.trial.set_user_attr("hftc_worker", self.worker_id)

    def _save_if_best(self, run: _Run, value: float) -> None:
        try:
            best = self.study.best_value
        except ValueError:
            best = None
        better = best is None or (value >= best if self.spec.direction == "maximize"
                                  else value <= best)
        if better:
            save(self._model_state(run), self.out / "trials" / f"trial-{run.number}.pt")

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
                module.load_state_dict(_own_widths(saved["model"], j, module))
                states, names = saved["optimizer"], saved["param_names"]
                if isinstance(states, dict):  # written by a sweep of one optimizer per trial
                    states, names = [states], [names]
                for k, optimizer in enumerate(optimizers):
                    load_model_slice(states[k], names[k], j, optimizer, module)
                scheduler_states = saved["schedulers"][j] if "schedulers" in saved else []
                for scheduler, state in zip(schedulers, scheduler_states):
                    if scheduler is not None and state is not None:
                        scheduler.load_state_dict(state)
            run = _Run(trial, params, seed, module, optimizers, schedulers, epoch=epoch,
                       history=list(entry["history"][:epoch]),
                       orders=list(entry["orders"][:epoch]),
                       reported=max(frozen.intermediate_values, default=0))
            self.live.append(run)
            adopted.append(run)
            if epoch > 0 and frozen.system_attrs.get(_KEPT_AT) != [frozen.number, epoch]:
                undecided.append(run)
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

    # ------------------------------------------------------------------ main loop

    def run(self) -> SweepResult:
        """Run this worker until the study has ``n_trials`` finished trials and none
        is running anywhere; then write the results. Returns a :class:`SweepResult`."""
        start = time.perf_counter()
        verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            wall, files, board = self._run(start, verbosity)
        except BaseException:
            # The folder stays (manifest and checkpoints, for --resume); the lock goes, as
            # it would with the process.
            if getattr(self, "_lock", None) is not None:
                self._lock.close()
            raise
        shutil.rmtree(self.dir, ignore_errors=True)
        if getattr(self, "_lock", None) is not None:
            self._lock.close()
        return SweepResult(self.study, self.out, wall, self.train_s, self.trial_epochs,
                           files, board, dict(self.timings), self.spec.metric_name,
                           list(self.serial_epoch_s), list(self.formations), list(self.apart),
                           list(self.padded), list(self.mixed))

    def _run(self, start: float, verbosity: int) -> tuple[float, dict[str, Path], str]:
        from .report import write_results

        with warnings.catch_warnings():
            # Heartbeats and ask-and-tell are experimental in Optuna's eyes; we use both.
            warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", message=".*Heartbeat of storage.*")
            warnings.filterwarnings("ignore", message=".*already reported.*")
            warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
            try:
                self._open()
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
            wall = time.perf_counter() - start - self.excluded_s
            files, board = write_results(self)
        return wall, files, board

    def _others_alive(self) -> bool:
        """Does another live worker use this folder? (Its lock is held.)"""
        root = self.out / "workers"
        for d in root.iterdir() if root.exists() else []:
            if d != self.dir and d.is_dir() and not d.name.startswith("."):
                lock = _try_lock(d / "lock")
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
          it for ``_NO_HEARTBEAT_S`` or the grace period, whichever is longer (timed on
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
        wait = max(_NO_HEARTBEAT_S, self.grace_period or 4 * self.heartbeat_interval)
        return [t for t in trials if t._trial_id in silent
                and now - seen.setdefault(t._trial_id, now) >= wait]

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
                    c = _counts(self.study)
                    if c["running"] == 0 and c["waiting"] == 0:
                        break
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
        except Exception as exc:
            # A bug in the spec (or ours) would fail the same way on every retry: fail the
            # live trials for good, with the reason, instead of leaving them to be retried.
            culprit = getattr(exc, "hftc_trial", None)  # set where one trial's code raised
            for run in list(self.live):
                reason = f"error: {type(exc).__name__}: {exc}"
                if culprit is not None and culprit != run.number:
                    reason = f"the sweep stopped on trial {culprit}'s {reason}"
                self._fail(run.trial, reason)
            self.live.clear()
            raise
        finally:
            bars.close()
