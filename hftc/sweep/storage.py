"""A sweep's Optuna side: the RDB storage (SQLite tuned for many small commits, PostgreSQL
with its driver named), the sampler and pruner a spec names, one heartbeat thread for
every trial a worker holds, and the trial counts that decide how many more to ask."""

from __future__ import annotations

import contextlib
import copy
import inspect
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import optuna
from optuna.storages._cached_storage import _CachedStorage, _StudyInfo
from optuna.trial import TrialState

from ..errors import SpecError, SweepError
from .spec import SweepSpec

__all__ = ["make_storage", "OwnTrialsCache", "one_worker_per_trial", "make_sampler", "make_pruner",
           "Heartbeat",
           "count_trials", "counts_in_budget", "room_for", "SURPLUS", "masked_url",
           "storage_errors", "check_heartbeat"]


# ---------------------------------------------------------------------- storage


#: Seconds to wait for a PostgreSQL server to answer a new connection.
CONNECT_TIMEOUT_S = 20


def _retry_callback() -> Any:
    cls = getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None)
    if cls is None:  # optuna < 4.9
        cls = optuna.storages.RetryFailedTrialCallback
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental" since 2.8
        return cls(max_retry=3)


def storage_errors() -> tuple[type[BaseException], ...]:
    """The errors of the database itself (Optuna's wrapper of a failed commit, SQLAlchemy's
    own): not a trial's, so never a reason to fail one."""
    import sqlalchemy.exc

    return (optuna.exceptions.StorageInternalError, sqlalchemy.exc.SQLAlchemyError)


def masked_url(url: str) -> str:
    """``url`` with its password as ``***``: all between the user's ``:`` and the last
    ``@`` (a password may hold an unencoded ``/`` or ``@``)."""
    import re

    scheme, sep, rest = url.partition("://")
    found = re.match(r"([^:/@]*):(.*)@([^@]*)$", rest) if sep else None
    if found is None:
        return url
    return f"{scheme}://{found.group(1)}:***@{found.group(3)}"


def _check_url(url: str) -> None:
    """A path for a URL, a SQLite file in a folder that is not there, or an unencoded
    ``@`` (SQLAlchemy ends the password at the first, and prints its rest as the host):
    said before SQLAlchemy says it less clearly."""
    from pathlib import Path

    if "://" not in url:
        raise SweepError(
            f"the storage {masked_url(url)!r} is not a database URL: give "
            f"sqlite:///{url if url.endswith('.db') else 'path/to/study.db'} (a file) or "
            f"postgresql://user:password@host/database")
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        folder = Path(url[len("sqlite:///"):].partition("?")[0]).parent
        if not folder.is_dir():
            raise SweepError(f"the storage {url}: its folder {folder} does not exist (make "
                             f"it, or give another path; sqlite:////abs/path for an "
                             f"absolute one)")
    if url.partition("://")[2].count("@") > 1:
        raise SweepError(
            f"the storage URL {masked_url(url)} has more than one '@': write an '@' in the "
            f"user name or password as %40 (percent-encoded)")


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


def check_heartbeat(heartbeat_interval: int, grace_period: int | None) -> None:
    """A grace period a live worker's heartbeats cannot keep is refused: every other worker
    would fail its trials between two beats and train them again; so is an interval under
    a second (Optuna's heartbeat takes whole seconds from 1)."""
    if not heartbeat_interval >= 1:
        raise SweepError(
            f"--heartbeat-interval (heartbeat_interval) {heartbeat_interval} s: give whole "
            f"seconds, at least 1 (Optuna's heartbeat; the default is 30)")
    if grace_period is None:
        return
    if grace_period <= 0 or grace_period <= heartbeat_interval:
        raise SweepError(
            f"--grace-period (grace_period) {grace_period} s must be longer than "
            f"--heartbeat-interval (heartbeat_interval) {heartbeat_interval} s: a live "
            f"worker's trials would be taken for dead between two of its heartbeats, failed "
            f"and trained again by another worker. Leave it out (4 intervals, "
            f"{4 * heartbeat_interval} s) or give a few intervals")


def make_storage(url: str, heartbeat_interval: int = 30,
                 grace_period: int | None = None) -> optuna.storages.RDBStorage:
    """An Optuna RDB storage (``sqlite:///...`` or ``postgresql://...``) with heartbeats
    on, and stale trials retried (same parameters) by whichever worker asks next."""
    check_heartbeat(heartbeat_interval, grace_period)
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
    _check_url(url)
    url = _with_driver(url)
    if url.startswith("sqlite"):
        # The heartbeat thread writes while the main thread does: wait for the lock.
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": 60}}
    else:
        engine_kwargs = {"pool_pre_ping": True}
        if url.startswith("postgresql") and "connect_timeout" not in url:
            # (libpq waits for ever on a host that takes the connection and never answers)
            engine_kwargs["connect_args"] = {"connect_timeout": CONNECT_TIMEOUT_S}
    try:
        if not url.startswith("sqlite"):
            _reach(url, engine_kwargs)  # once: a down server is said now, not retried
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
            f"the storage {masked_url(url)} needs the Python module {missing!r}: "
            f"pip install 'hftc[sweep]' (it brings psycopg for postgresql:// URLs)"
        ) from exc
    except Exception as exc:
        raise SweepError(f"cannot open the Optuna storage {masked_url(url)}: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
    if storage.engine.name == "sqlite":
        _fast_sqlite(storage)
    return storage


class OwnTrialsCache(_CachedStorage):
    """Optuna's cache of an RDB storage, which on each read of a study's trials re-reads
    only the unfinished trials that can have changed since its last read::

        Optuna's _CachedStorage:  every unfinished trial, every time
        this one:                 trials made since the last read
                                  + unfinished trials this object wrote since then
                                  + unfinished trials it did not make (another worker's)

    An array of 16 running trials read them all on each of the ~4 reads a trial's ask
    and suggestions make (the sampler's history, the waiting trials): most of a sweep's
    Optuna time. A trial this object made changes only through its own writes (a worker
    owns its trials; hftc fails another's only through the raw storage, and those are
    not this object's), so what a read returns is what Optuna's would: the sampler and
    the pruner see the same trials and draw the same values; ``get_trial`` of a trial it
    made and has not written since is the cached one (``ask`` and ``tell`` read their
    trial). The sweep's own checks of a trial's state read the RDB storage itself."""

    def __init__(self, backend: optuna.storages.RDBStorage):
        super().__init__(backend)
        self._made: set[int] = set()     # trial ids created through this object
        self._written: set[int] = set()  # of those, written since they were last read
        self._read_to: dict[int, int] = {}  # per study: the largest trial id read

    def __getattr__(self, name: str) -> Any:
        # the RDB storage's own attributes (scoped_session, engine, url) for hftc's code
        backend = self.__dict__.get("_backend")
        if backend is None:
            raise AttributeError(name)
        return getattr(backend, name)

    def _wrote(self, trial_id: int) -> None:
        with self._lock:
            self._written.add(trial_id)

    def create_new_trial(self, study_id: int, template_trial: Any = None) -> int:
        trial_id = super().create_new_trial(study_id, template_trial)
        with self._lock:
            self._made.add(trial_id)
        return trial_id

    def set_trial_param(self, trial_id: int, *args: Any, **kwargs: Any) -> None:
        super().set_trial_param(trial_id, *args, **kwargs)
        self._wrote(trial_id)

    def set_trial_state_values(self, trial_id: int, *args: Any, **kwargs: Any) -> bool:
        try:
            return super().set_trial_state_values(trial_id, *args, **kwargs)
        finally:
            self._wrote(trial_id)

    def set_trial_intermediate_value(self, trial_id: int, *args: Any, **kwargs: Any) -> None:
        super().set_trial_intermediate_value(trial_id, *args, **kwargs)
        self._wrote(trial_id)

    def set_trial_intermediate_values(self, writes: list[tuple[int, int, float]]) -> None:
        """``set_trial_intermediate_value(trial_id, step, value)`` for each of ``writes``,
        in ONE transaction (one commit, not one per trial and epoch)::

            a round of 16 trials:  16 x (BEGIN, check, INSERT, COMMIT)
                              ->   BEGIN, 16 x (check, INSERT), COMMIT

        All or none: a trial finished elsewhere (Optuna's UpdateFinishedTrialError) rolls
        back the lot, and the caller reports one at a time to learn which."""
        if not writes:
            return
        from optuna.storages._rdb.storage import _create_scoped_session

        backend = self._backend
        with _create_scoped_session(backend.scoped_session, True) as session:
            _write_intermediate_values(backend, session, writes)
        for trial_id in {w[0] for w in writes}:
            self._wrote(trial_id)

    def set_trial_user_attr(self, trial_id: int, *args: Any, **kwargs: Any) -> None:
        super().set_trial_user_attr(trial_id, *args, **kwargs)
        self._wrote(trial_id)

    def set_trial_system_attr(self, trial_id: int, *args: Any, **kwargs: Any) -> None:
        super().set_trial_system_attr(trial_id, *args, **kwargs)
        self._wrote(trial_id)

    def get_trial(self, trial_id: int) -> Any:
        with self._lock:
            if trial_id in self._made and trial_id not in self._written and \
                    trial_id in self._trial_id_to_study_id_and_number:
                study_id, number = self._trial_id_to_study_id_and_number[trial_id]
                # a copy, as a read gives: optuna.Trial writes into the one it is given
                return copy.deepcopy(self._studies[study_id].trials[number])
        return super().get_trial(trial_id)

    def _read_trials_from_remote_storage(self, study_id: int) -> None:
        with self._lock:
            if study_id not in self._studies:
                self._studies[study_id] = _StudyInfo()
            study = self._studies[study_id]
            unfinished = study.unfinished_trial_ids
            stale = {t for t in unfinished if t not in self._made or t in self._written}
            read_to = self._read_to.get(study_id, -1)
            trials = self._backend._get_trials(study_id, states=None, included_trial_ids=stale,
                                               trial_id_greater_than=read_to)
            self._written -= stale
            if not trials:
                return
            self._add_trials_to_cache(study_id, trials)
            for trial in trials:
                self._written.discard(trial._trial_id)
                read_to = max(read_to, trial._trial_id)
                if trial.state.is_finished():
                    unfinished.discard(trial._trial_id)
                    study.last_finished_trial_id = max(study.last_finished_trial_id,
                                                       trial._trial_id)
                else:
                    unfinished.add(trial._trial_id)
            self._read_to[study_id] = read_to


def _write_intermediate_values(backend: optuna.storages.RDBStorage, session: Any,
                               writes: list[tuple[int, int, float]]) -> None:
    """RDBStorage._set_trial_intermediate_value_without_commit for each of ``writes``
    (the same rows, the same checks and errors), with the trials' states and their
    stored steps read in one SELECT each for all of them, not two per write."""
    from optuna.storages._rdb import models

    ids = sorted({w[0] for w in writes})
    states = dict(session.query(models.TrialModel.trial_id, models.TrialModel.state)
                  .filter(models.TrialModel.trial_id.in_(ids)).all())
    value_model = models.TrialIntermediateValueModel
    stored = {(r.trial_id, r.step): r for r in
              session.query(value_model).filter(value_model.trial_id.in_(ids)).all()}
    for trial_id in ids:  # every check before any row: Optuna's error message reads the
        if trial_id not in states:  # trial in the same scoped session, and commits it
            raise KeyError(models.NOT_FOUND_MSG)
        backend.check_trial_is_updatable(trial_id, states[trial_id])
    for trial_id, step, value in writes:
        number, kind = value_model.intermediate_value_to_stored_repr(value)
        row = stored.get((trial_id, step))
        if row is None:
            row = stored[trial_id, step] = value_model(
                trial_id=trial_id, step=step, intermediate_value=number,
                intermediate_value_type=kind)
            session.add(row)
        else:
            row.intermediate_value, row.intermediate_value_type = number, kind


def _reach(url: str, engine_kwargs: dict[str, Any]) -> None:
    """Connect once and close: its error (refused, timed out, a wrong password) is the
    server's, which waiting for the table-creation race would only delay."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, **engine_kwargs)
    try:
        engine.connect().close()
    finally:
        engine.dispose()


def _fast_sqlite(storage: optuna.storages.RDBStorage) -> None:
    """Write-ahead logging and fsync at checkpoints only: a sweep commits a few times per
    trial (ask, parameters, tell) and once per round for its reports, and a full fsync
    per commit costs more than the training on a small model. A killed process loses
    nothing (the WAL is in the OS's hands); a power cut may lose the last commits, never
    the database."""
    import sqlalchemy

    def pragmas(dbapi_connection, _record) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()

    sqlalchemy.event.listen(storage.engine, "connect", pragmas)
    one_worker_per_trial(storage)


def one_worker_per_trial(storage: Any) -> None:
    """Make every transaction of a SQLite storage begin with ``BEGIN IMMEDIATE`` (the
    write lock first). Optuna pops an enqueued or retried trial with ``SELECT ... FOR
    UPDATE``, which SQLite ignores: two workers asking at once would both read the trial
    WAITING, both set it RUNNING and both train it. Other databases lock the row: left
    as they are. Idempotent; ``storage`` may be the cache Optuna wraps around it."""
    import sqlalchemy

    engine = getattr(getattr(storage, "_backend", storage), "engine", None)
    if (not isinstance(engine, sqlalchemy.engine.Engine) or engine.dialect.name != "sqlite"
            or sqlalchemy.event.contains(engine, "begin", _begin_immediate)):
        return
    sqlalchemy.event.listen(engine, "connect", _no_implicit_begin)
    sqlalchemy.event.listen(engine, "begin", _begin_immediate)
    engine.dispose()  # connections opened before the listeners reconnect with them


def _no_implicit_begin(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # begun by _begin_immediate, not by sqlite3


def _begin_immediate(connection: Any) -> None:
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _an_instance(value: Any, base: type, what: str, **kwargs: Any) -> Any:
    """``sampler = optuna.samplers.TPESampler`` (the class, the parentheses forgotten):
    an instance with its defaults (``seed=`` where it takes one), not ``TPESampler(seed)``,
    which would pass the seed as its first argument (``consider_prior``; CMA-ES's ``x0``)."""
    if not (isinstance(value, type) and issubclass(value, base)):
        return value
    takes = inspect.signature(value).parameters
    try:
        return value(**{k: v for k, v in kwargs.items() if k in takes})
    except TypeError as exc:
        raise SpecError(f"spec.{what} is the class {value.__name__}, which needs arguments "
                        f"({exc}); give an instance: {what} = {value.__module__.split('._')[0]}"
                        f".{value.__name__}(...)") from None


def make_sampler(spec: SweepSpec, seed: int) -> optuna.samplers.BaseSampler:
    s = _an_instance(spec.sampler, optuna.samplers.BaseSampler, "sampler", seed=seed)
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
    raise SweepError(f"unknown sampler {s!r} (the spec's sampler, or --sampler): use 'tpe', "
                     f"'random', an optuna sampler or a function sampler(seed) -> sampler")


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = _an_instance(spec.pruner, optuna.pruners.BasePruner, "pruner")
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
    raise SweepError(f"unknown pruner {p!r} (the spec's pruner, or --pruner): use 'median', "
                     f"'sha', 'hyperband', 'none' or an optuna pruner")


class Heartbeat(threading.Thread):
    """Records a heartbeat for every trial this worker holds, every ``interval`` seconds.

    ``study.optimize`` runs one such thread per trial; a fused array holds N trials,
    so one thread beats for all of them: those :meth:`add` gave it, or, with ``live``,
    the ids ``live()`` returns at each beat (a ``TrialArray``'s live trials), beaten at
    the start too."""

    def __init__(self, storage: optuna.storages.BaseStorage, interval: float,
                 live: Callable[[], Iterable[int]] | None = None):
        super().__init__(name="hftc-sweep-heartbeat", daemon=True)
        self.storage, self.interval, self.live = storage, interval, live
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
        if self.live is not None:
            self._beat()
        while not self.stopped.wait(self.interval):
            self._beat()

    def _beat(self) -> None:
        if self.live is not None:
            ids = list(self.live())
        else:
            with self.lock:
                ids = list(self.ids)
        for tid in ids:
            with contextlib.suppress(Exception):  # a blip must not kill the beat
                self.storage.record_heartbeat(tid)

    def stop(self) -> None:
        self.stopped.set()


#: The user attribute of a trial asked past the budget (workers asking at once) and
#: failed unrun: no count and no report takes it for a trial of the study's.
SURPLUS = "hftc_surplus"


def counts_in_budget(t: optuna.trial.FrozenTrial) -> bool:
    """Finished, running, or failed for a reason of its own (a heartbeat-stale failure is
    retried, and its retry counts instead; a trial asked one too many never ran)."""
    return t.state in (TrialState.RUNNING, TrialState.COMPLETE, TrialState.PRUNED) or (
        t.state == TrialState.FAIL and "hftc_fail_reason" in t.user_attrs)


def count_trials(study: optuna.Study) -> dict[str, int]:
    """Trials that use the budget (:func:`counts_in_budget`), waiting ones, and of those
    the retries (a dead worker's trial again, Optuna's ``failed_trial``)."""
    c = {"budget": 0, "waiting": 0, "running": 0, "finished": 0, "retries": 0}
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.WAITING:
            c["waiting"] += 1
            c["retries"] += "failed_trial" in t.system_attrs
        elif t.state == TrialState.RUNNING:
            c["running"] += 1
            c["budget"] += 1
        elif counts_in_budget(t):
            c["finished"] += 1
            c["budget"] += 1
    return c


def room_for(c: dict[str, int], n_trials: int) -> int:
    """How many trials may still be asked, from :func:`count_trials` ' ``c``: the retries
    always (a dead worker's trials are no new ones: its work, never lost), then new or
    enqueued trials up to ``n_trials`` (``study.enqueue_trial`` of more than the budget
    leaves the rest WAITING, as ``study.optimize(n_trials=...)`` does)."""
    return c["retries"] + max(0, n_trials - c["budget"] - c["retries"])
