"""Ray as the engine of a fused sweep over many GPUs and machines (``pip install hftc[ray]``).

Two ways in:

* :func:`sweep` (``python -m hftc sweep SPEC --ray [ADDRESS] --workers K``): K Ray
  actors, each holding one device (``num_gpus=1`` where the cluster has GPUs, else one
  CPU), each running the sweep worker of :mod:`hftc.sweep` (fused arrays, pruning,
  re-fusing, checkpoints) on one shared Optuna study::

      driver:  create the study in STORAGE; start K actors (spread over the nodes)
      actor k: hftc.sweep.Sweep(spec, storage=STORAGE, out=OUT).run()   # ask, fuse, train
      driver:  an actor (or its node) dies -> start another with resume=True: it takes
               the dead worker's trials from their checkpoints in OUT (or, where OUT is not
               shared, Optuna's heartbeat fails them and any worker retries them once)
      driver:  every actor done -> results.csv, best.pt, leaderboard in OUT

  The storage is an Optuna RDB every actor reaches: ``sqlite:///OUT/study.db`` (the
  default) where every actor sees OUT (one machine, or nodes on one host as in the tests),
  ``postgresql://...`` across machines.

* :class:`Tuner`, for Ray Tune users: ``tune.Tuner``'s arguments (one configuration's
  ``param_space``, ``TuneConfig(num_samples, scheduler)``) and one result per
  configuration, the configurations trained in arrays of ``per_array``.
  :func:`tune_trainable`, under it, for a Tune script of one's own: each Tune trial
  trains an array of ``per_array`` configurations fused on one device and reports each
  configuration's metric; a Tune scheduler (``ASHAScheduler``) decides per
  configuration, and a stopped configuration leaves its array (:func:`hftc.keep_models`,
  in place).

``import hftc`` never imports Ray; this module imports it on first use, and a missing
Ray raises :class:`hftc.errors.MissingExtraError` naming ``pip install 'hftc[ray]'``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import MissingExtraError, SweepError

__all__ = ["sweep", "tune_trainable", "ARRAY_KEY", "connect", "RayStart", "config_results",
           "array_space", "Tuner", "ConfigResult", "ConfigResults"]

#: The key of a Tune trial's config that holds its array's configurations (a list).
ARRAY_KEY = "configs"
#: The key of a configuration that holds its seed, where :class:`Tuner` drew it.
SEED_KEY = "hftc_seed"


def _import_ray(what: str = "ray") -> Any:
    """``ray`` (or ``ray.tune``), or a :class:`MissingExtraError` saying what to install."""
    import importlib

    try:
        return importlib.import_module(what)
    except ModuleNotFoundError as exc:
        raise MissingExtraError(
            f"hftc.ray needs {exc.name!r} ({what} is not installed): pip install 'hftc[ray]'",
            extra="ray") from exc


def _shippable(spec: Any, where: str) -> Any:
    """The spec as the actors get it: a file made absolute (their working folder is not
    ours); a ``SweepSpec`` whose functions come from a spec file loaded by path is
    refused (the actors cannot import that module), with what to give instead."""
    if isinstance(spec, (str, Path)):
        return str(Path(spec).resolve()) if Path(spec).exists() else str(spec)
    for name in ("space", "model", "data", "optimizer", "loss", "metric"):
        module = getattr(getattr(spec, name, None), "__module__", None) or ""
        if module.startswith("_hftc_spec_"):
            raise SweepError(
                f"{where}: the spec's {name}() comes from a spec file loaded by path "
                f"({module[len('_hftc_spec_'):]}.py), which Ray's workers cannot import; "
                f"give the file's path ({where}('path/to/spec.py', ...)) instead of the "
                f"loaded SweepSpec, and spec fields as keyword arguments")
    return spec


# ---------------------------------------------------------------------- connecting


@dataclasses.dataclass(frozen=True)
class RayStart:
    """How :func:`connect` reached Ray, and how long it took."""

    #: "attached" (this process already was), "joined" (a running cluster),
    #: "connected" (the address given), "started" (a new local Ray)
    how: str
    seconds: float
    address: str = ""

    def __str__(self) -> str:
        where = f" at {self.address}" if self.address else ""
        what = {"attached": f"already attached to Ray{where}",
                "joined": f"joined the running Ray cluster{where}",
                "connected": f"connected to Ray{where}",
                "started": f"started a local Ray{where} (none was running)"}[self.how]
        return f"Ray: {what}, {self.seconds:.1f} s"


def connect(address: str | None = None, **init_kwargs: Any) -> RayStart:
    """Reach Ray once, reusing what runs: this process's Ray if it is attached; else with
    ``address=None`` a running cluster (``ray.init(address="auto")``: one started by
    ``ray start`` or another driver's), else a new local Ray; a given ``address`` as is.

    ::

        connect()          # -> RayStart("joined", 0.8, "127.0.0.1:6379") or ("started", 9.6)
        connect("ray://head:10001")

    Returns a :class:`RayStart` (``str()``: ``Ray: joined the running Ray cluster at ...,
    0.8 s``), which ``hftc sweep --ray`` prints."""
    ray = _import_ray()
    start = time.perf_counter()
    init_kwargs = {"logging_level": "warning", **init_kwargs}
    if ray.is_initialized():
        how = "attached"
    elif address is None:
        try:
            ray.init(address="auto", **init_kwargs)
            how = "joined"
        except ConnectionError:  # nothing running: Ray's own default, a local instance
            ray.init(**init_kwargs)
            how = "started"
    else:
        _check_reachable(address)
        try:
            ray.init(address=address, **init_kwargs)
        except ConnectionError as exc:  # "auto" with none running, or the GCS refused
            raise SweepError(f"hftc.ray: could not join Ray at {address!r} ({exc}): check "
                             f"that a cluster runs there (`ray status`) and lets this "
                             f"process in, or give no address to start a local Ray"
                             ) from None
        how = "connected"
    gcs = getattr(ray.get_runtime_context(), "gcs_address", "") or ""
    return RayStart(how, time.perf_counter() - start, gcs)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse a ``host:port`` (or ``ray://host:port``) where nothing listens: Ray's own
    ``ray.init`` retries such an address for minutes, printing GCS time-outs, and never
    says what is wrong. ``"auto"`` and other forms are Ray's to resolve."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host or "/" in host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise SweepError(
            f"hftc.ray: no Ray cluster answers at {address!r} ({exc.strerror or exc}): "
            f"check the address (`ray status` on the head prints it; the default port is "
            f"6379, a Ray client's ray://HOST:10001), start one there with `ray start "
            f"--head --port={port}`, or give no address to join a running cluster or start "
            f"a local Ray") from None


# ---------------------------------------------------------------------- sweep on actors


class _SweepActor:
    """One sweep worker in a Ray actor. :meth:`load` loads the spec and reads the data
    before :meth:`run`, so that every worker of a sweep begins asking trials at about
    the same time (and a spec that fails on a node fails before any trial starts)."""

    def __init__(self, spec: Any, overrides: dict[str, Any], options: dict[str, Any],
                 device: str | None):
        self.source, self.overrides, self.options, self.device = (spec, overrides, options,
                                                                   device)
        self.spec = None

    def load(self) -> str:
        from ..sweep.spec import load_spec
        from ..sweep.training import SweepData

        spec = load_spec(self.source).replace(**self.overrides)
        if self.device is not None:
            spec = spec.replace(device=self.device)
        SweepData.from_spec(spec)  # imports and reads the data (a bad data() fails here)
        # The sweep's start-up import (a second or more on a loaded node) paid here too, so
        # that no actor begins asking trials long after the others.
        import torch._dynamo  # noqa: F401
        self.spec = spec
        return self.where()

    def where(self) -> str:
        ray = _import_ray()
        return ray.get_runtime_context().get_node_id()

    def run(self, resume: bool) -> dict[str, Any]:
        from ..sweep.engine import Sweep

        if self.spec is None:
            self.load()
        result = Sweep(self.spec, resume=resume, **self.options).run()
        # what the driver's summary reports of the actors' work (its own final pass
        # trains nothing): the epochs timed alone, the arrays formed
        return {"node": self.where(), "trial_epochs": result.trial_epochs,
                "train_s": result.train_s,
                **{k: getattr(result, k) for k in _MERGED}}


#: the SweepResult fields summed over the actors' results into the sweep's
_MERGED = ("serial_epoch_s", "formations", "apart", "padded", "mixed")


def _check_room(ray: Any, workers: int, resource: str) -> None:
    """Refuse more actors than the cluster has room for: the sweep waits for every
    actor to load before any runs, and an actor Ray cannot place waits for ever (the
    sweep hung, its placed actors idle)."""
    have = ray.cluster_resources().get(resource, 0)
    if workers > have:
        raise SweepError(
            f"hftc.ray.sweep: {workers} workers need {workers} {resource}s (one each), and "
            f"the Ray cluster has {have:g}: give --workers {int(have) or 1} or fewer "
            f"(workers={int(have) or 1}), or add nodes before the sweep starts (the sweep "
            f"does not wait for an autoscaler)")


def _cause_with_its_lines(exc: BaseException) -> BaseException:
    """The exception an actor's code raised, with the traceback it had in the actor as a
    note: Ray ships the exception without its frames, so the cause raised here alone
    would show hftc's driver lines and not the spec's line that raised it."""
    cause = getattr(exc, "cause", None)
    if cause is None:
        return exc
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    lines = text.splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("  File ")), None)
    noted = any(n.startswith("hftc.ray: raised in a Ray actor")
                for n in getattr(cause, "__notes__", []))
    if first is not None and not noted:
        where = lines[0].split(")", 1)[-1].strip(" ()") if first else ""
        cause.add_note(f"hftc.ray: raised in a Ray actor ({where or 'remote'}), where its "
                       f"traceback was (most recent call last):\n"
                       + "\n".join(lines[first:]))
    return cause


def _actor_died(ray: Any, exc: BaseException) -> bool:
    """Did the actor (or its node) die, rather than its code raise?"""
    return isinstance(exc, (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                            ray.exceptions.NodeDiedError))


def sweep(
    spec: Any,
    *,
    address: str | None = None,
    workers: int = 2,
    out: str | Path | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    resume: bool = False,
    heartbeat_interval: int = 30,
    grace_period: int | None = None,
    gpus: bool | None = None,
    max_replacements: int | None = None,
    log=None,
    reached: RayStart | None = None,
    **overrides: Any,
) -> Any:
    """Run a fused sweep on ``workers`` Ray actors sharing one Optuna study.

    Args:
        spec: a spec file or module path (loaded on every actor: the file must exist on
            every node), or a :class:`~hftc.sweep.SweepSpec` whose functions live in an
            importable module (pickled to the actors; one loaded from a file by path is
            refused with a :class:`~hftc.errors.SweepError`).
        address: the Ray cluster (``"auto"``, ``"ray://host:10001"``, ``host:6379``);
            ``None``: the one this process is attached to, else a running cluster
            (``ray.init(address="auto")``), else a new local Ray (:func:`connect`).
        workers: the number of actors; each holds one GPU where the cluster has GPUs
            (``gpus=None``; ``gpus=False`` forces CPUs), else one CPU.
        out: the folder of checkpoints and results (default ``sweeps/<study>``); every
            actor writes its checkpoints there, so that a replacement resumes a dead
            worker's trials where it sees the folder.
        storage: an Optuna RDB URL every actor reaches (default
            ``sqlite:///OUT/study.db``: one machine or a shared folder; PostgreSQL across
            machines).
        reached: the :class:`RayStart` of a :func:`connect` just before (``hftc sweep
            --ray`` prints it first): Ray is not reached again, and the summary says how
            it was and how long it took.
        max_replacements: how many dead actors are replaced (default ``2 * workers``);
            past it the sweep stops with a :class:`~hftc.errors.SweepError` (its trials
            stay in the storage, ``resume=True`` continues them).
        **overrides: spec fields (``n_trials``, ``per_array``, ``epochs``, ``pruner``,
            ``sampler``, ``seed``, ``dtype`` ...), as for :func:`hftc.sweep.run`.

    Returns the :class:`~hftc.sweep.SweepResult` of the study (leaderboard and files), its
    ``timings`` holding ``workers``, ``replaced`` (actors), ``nodes`` (those the finishing
    actors ran on), the actors' summed ``train`` seconds and ``ray_start`` (the seconds
    reaching Ray took: :func:`connect`, whose line ``log`` gets).
    """
    ray = _import_ray()
    from ..sweep.engine import Sweep, make_storage
    from ..sweep.spec import load_spec

    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise SweepError(f"hftc.ray.sweep: workers must be a positive int, got {workers!r}")
    start, before_s = _clock_start(reached)
    spec = _shippable(spec, "hftc.ray.sweep")
    local_spec, study_name, out, storage = _study_made(
        load_spec(spec).replace(**overrides), study_name, out, storage,
        make_storage, heartbeat_interval, grace_period)
    say = log if log is not None else (lambda msg: None)

    if reached is None:
        reached = connect(address, log_to_driver=log is not None)
        say(str(reached))
    if gpus is None:
        gpus = ray.cluster_resources().get("GPU", 0) >= 1
    _check_room(ray, workers, "GPU" if gpus else "CPU")
    options = {"out": str(out), "storage": storage, "study_name": study_name,
               "heartbeat_interval": heartbeat_interval, "grace_period": grace_period,
               "progress": False, "log": print if log is not None else None}
    actors = _Actors(ray, ray.remote(_SweepActor).options(
        num_cpus=1, num_gpus=1 if gpus else 0, scheduling_strategy="SPREAD",
        max_restarts=0), (spec, overrides, options, "cuda" if gpus else None),
        2 * workers if max_replacements is None else max_replacements, say)
    try:
        # Every worker loaded (spec, data, imports) before any asks: they share the work.
        loaded = actors.wait_all({a.load.remote(): a for a in
                                  [actors.start() for _ in range(workers)]}, "load")
        summaries = [s for _, s in actors.wait_all({a.run.remote(resume): a
                                                    for a, _ in loaded}, "run")]
    except ray.exceptions.RayTaskError as exc:  # the sweep's code raised: say what
        raise _cause_with_its_lines(exc) from None
    except Exception as exc:
        if not _actor_died(ray, exc):
            raise
        raise SweepError(
            f"hftc.ray.sweep: {actors.replaced + 1} sweep actors died (the last: "
            f"{type(exc).__name__}); the study {study_name!r} keeps its trials: run again "
            f"with resume=True (--resume) once the cluster is healthy") from exc
    finally:
        actors.kill_all()  # on an error, the others stop too

    # Every trial is done: the results, written once, here.
    final = Sweep(local_spec, out=out, storage=storage, study_name=study_name,
                  heartbeat_interval=heartbeat_interval, grace_period=grace_period,
                  progress=False).run()
    return _merged_result(final, summaries, time.perf_counter() - start, before_s, reached,
                          workers, actors.replaced)


def _clock_start(reached: RayStart | None) -> tuple[float, float | None]:
    """The sweep's clock start and the process's seconds before it: where Ray was
    reached (a ``reached`` given: by a connect() just before the sweep was called)."""
    from ..sweep.clock import before_sweep

    spent = reached.seconds if reached is not None else 0.0
    before_s = before_sweep()
    return time.perf_counter() - spent, (None if before_s is None
                                         else max(0.0, before_s - spent))


def _merged_result(final: Any, summaries: list[dict[str, Any]], wall_s: float,
                   before_s: float | None, reached: RayStart, workers: int,
                   replaced: int) -> Any:
    """The driver's final pass (results written, nothing trained) with what the actors
    did: their training, epochs timed alone and arrays, and how Ray was reached."""
    nodes = len({summary["node"] for summary in summaries})
    timings = {**final.timings, "train": sum(s["train_s"] for s in summaries),
               "workers": workers, "replaced": replaced, "nodes": nodes,
               "ray_start": reached.seconds}
    merged = {k: [x for s in summaries for x in s[k]] for k in _MERGED}
    merged["apart"] = list(dict.fromkeys(merged["apart"]))  # the reasons, each once
    return dataclasses.replace(
        final, wall_s=wall_s,
        train_s=sum(s["train_s"] for s in summaries),
        trial_epochs=sum(s["trial_epochs"] for s in summaries), timings=timings,
        before_s=before_s, **merged,
        cluster=f"{reached}; {workers} Ray actors on {nodes} node(s), {replaced} replaced")



def _study_made(local_spec: Any, study_name: str | None, out: str | Path | None,
                storage: str | None, make_storage: Any, heartbeat_interval: int,
                grace_period: int | None) -> tuple[Any, str, Path, str]:
    """The study's name, folder and storage, and the study made in it before any actor
    starts (a replacement, resume=True, finds it)."""
    import optuna

    study_name = study_name or local_spec.name
    out = Path(out if out is not None else Path("sweeps") / study_name).resolve()
    out.mkdir(parents=True, exist_ok=True)
    storage = storage or f"sqlite:///{out / 'study.db'}"
    optuna.create_study(study_name=study_name, direction=local_spec.direction,
                        storage=make_storage(storage, heartbeat_interval, grace_period),
                        load_if_exists=True)
    return local_spec, study_name, out, storage


class _Actors:
    """The sweep's Ray actors: started with ``arguments``, waited for, and each that dies
    (or whose node does) replaced by a new one, at most ``limit`` times."""

    def __init__(self, ray: Any, actor_class: Any, arguments: tuple, limit: int,
                 say: Any) -> None:
        self.ray, self.actor_class, self.arguments = ray, actor_class, arguments
        self.limit, self.say = limit, say
        self.replaced = 0
        self.every: list[Any] = []

    def start(self) -> Any:
        actor = self.actor_class.remote(*self.arguments)
        self.every.append(actor)
        return actor

    def wait_all(self, calls: dict[Any, Any], again: str) -> list[tuple[Any, Any]]:
        """(actor, result) of each of ``calls`` (ref -> actor); an actor that dies is
        replaced by a new one that calls ``again`` (``run`` with resume=True: it takes
        over the dead worker's trials)."""
        results = []
        while calls:
            # A bounded wait: in between, Python handles signals (Ctrl-C, a timeout's).
            ready, _ = self.ray.wait(list(calls), num_returns=1, timeout=1.0)
            if not ready:
                continue
            done = ready[0]
            actor = calls.pop(done)
            try:
                results.append((actor, self.ray.get(done)))
            except Exception as exc:
                if not _actor_died(self.ray, exc) or self.replaced >= self.limit:
                    raise
                self.replaced += 1
                self.say(f"a sweep actor died ({type(exc).__name__}); starting another "
                         f"({self.replaced} replaced)")
                actor = self.start()
                call = actor.load.remote() if again == "load" else actor.run.remote(True)
                calls[call] = actor
        return results

    def kill_all(self) -> None:
        for actor in self.every:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)


# ---------------------------------------------------------------------- Ray Tune


class _Config:
    """What a Tune scheduler reads of a trial: its id (one per configuration here)."""

    def __init__(self, trial_id: str):
        self.trial_id = trial_id

    def __repr__(self) -> str:
        return f"config {self.trial_id}"


class _PerConfigScheduler:
    """A Ray actor holding one Tune scheduler that decides for every configuration of
    every array of the run, each configuration being the scheduler's own trial."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self.configs: dict[str, _Config] = {}
        self.stopped: list[tuple[str, int]] = []

    def add(self, config_id: str) -> None:
        self.configs[config_id] = _Config(config_id)
        self.scheduler.on_trial_add(None, self.configs[config_id])

    def result(self, config_id: str, result: dict[str, Any]) -> str:
        """The scheduler's decision (``"CONTINUE"``, ``"STOP"``) on a configuration's
        result; a stopped configuration leaves the scheduler."""
        action = self.scheduler.on_trial_result(None, self.configs[config_id], result)
        if action == "STOP":
            self.scheduler.on_trial_remove(None, self.configs.pop(config_id))
            self.stopped.append((config_id, int(result["training_iteration"])))
        return action

    def complete(self, config_id: str) -> None:
        """A configuration trained to the last epoch leaves the scheduler."""
        if config_id in self.configs:
            self.scheduler.on_trial_remove(None, self.configs.pop(config_id))

    def stopped_configs(self) -> list[tuple[str, int]]:
        return list(self.stopped)


def tune_trainable(spec: Any, *, scheduler: Any = None, epochs: int | None = None,
                   **overrides: Any):
    """A Ray Tune function trainable that trains an array of configurations fused.

    Each Tune trial's config holds its array under :data:`ARRAY_KEY`: a list of N
    parameter dicts (the spec's ``model(params)`` / ``optimizer(params, module)`` read
    them); :func:`array_space` builds that search space. Every epoch,
    the trial trains its live configurations as one fused module, then reports::

        {"config_0/<metric>": ..., "config_1/<metric>": ..., "<metric>": best live value,
         "live": number of live configurations, "config_<j>/stopped": the scheduler
         stopped it here}

    :func:`config_results` turns the run's ``ResultGrid`` (one result per array) into
    one result per configuration.

    ``scheduler`` (Tune's ``ASHAScheduler`` / ``AsyncHyperBandScheduler``: it decides from
    results alone; schedulers that need Tune's trial runner, such as PBT or the median
    stopping rule, are refused) is asked per configuration (its ``on_trial_result``,
    each configuration a scheduler trial ``<tune trial id>/<j>``, ``training_iteration``
    its epochs); a configuration it stops leaves the array (:func:`hftc.keep_models`
    cuts the fused module and optimizer in place) and the others train on, each as if
    alone. The trial ends when its array
    is empty or after ``epochs``. Give the scheduler here, not to ``tune.TuneConfig``
    (where it would stop whole arrays). Call after ``ray.init()``: the scheduler lives
    in an actor of the driver (:func:`connect` reuses a running cluster).

    A configuration's seed is its ``"seed"`` parameter, else the spec's seed plus a hash
    of its trial and position.
    """
    ray = _import_ray()
    from ..sweep.spec import load_spec

    spec = _shippable(spec, "hftc.ray.tune_trainable")
    overrides = {**overrides, "epochs": epochs}
    spec_obj = load_spec(spec).replace(**overrides)
    metric = spec_obj.metric_name
    decider = None
    scheduler = _per_config_scheduler(scheduler, "hftc.ray.tune_trainable",
                                      f"give {type(scheduler).__name__} to tune.TuneConfig "
                                      f"to schedule whole arrays")
    if scheduler is not None:
        # Tune sets a scheduler's metric and mode from TuneConfig; here they are the spec's
        # (a scheduler given its own keeps them).
        scheduler.set_search_properties(metric, spec_obj.direction[:3])
        decider = ray.remote(_PerConfigScheduler).options(num_cpus=0).remote(scheduler)

    def train_array(config: dict[str, Any]) -> None:
        # The spec travels as its file or module path (a spec module loaded from a file
        # cannot be pickled by reference) and is loaded again in the trial.
        _train_array(load_spec(spec).replace(**overrides), config, decider)

    train_array.scheduler_actor = decider
    return train_array


def _per_config_scheduler(scheduler: Any, where: str, instead: str) -> Any:
    """The scheduler that decides per configuration: ASHA as given; None for none or
    Tune's default FIFOScheduler (which never stops a trial: training each configuration
    to its last epoch is what it does); any other is refused, saying ``instead``."""
    if scheduler is None:
        return None
    from ray.tune.schedulers import AsyncHyperBandScheduler, FIFOScheduler

    if type(scheduler) is FIFOScheduler:
        return None
    if not isinstance(scheduler, AsyncHyperBandScheduler):
        raise SweepError(
            f"{where}: {type(scheduler).__name__} decides with Tune's trial runner, which a "
            f"configuration inside an array does not have; per configuration hftc drives "
            f"ASHAScheduler (AsyncHyperBandScheduler): give one, or {instead}")
    return scheduler


def config_results(results: Any, metric: str | None = None,
                   mode: str = "min") -> list[dict[str, Any]]:
    """One result per configuration, not per array: a Tune ``ResultGrid`` of
    :func:`tune_trainable` trials (each an array) -> a row for each configuration, the
    best first (by its last reported ``metric``; ``mode`` "min" or "max")::

        results = tune.Tuner(trainable, param_space=hftc.ray.array_space(space, 4), ...).fit()
        rows = hftc.ray.config_results(results, "loss")
        rows[0] == {"config_id": "<tune trial id>/2", "config": {"lr": 0.03, ...},
                    "loss": 0.41, "best_loss": 0.40, "epochs": 4, "seed": 1234,
                    "stopped": False, "path": ...}

    ``epochs``: how many it trained (fewer where the scheduler stopped it: ``stopped``).
    ``metric`` defaults to the one the trials reported (``config_<j>/<metric>``).
    :class:`Tuner` gives the same as Tune's own results, one per configuration."""
    if mode not in ("min", "max"):
        raise SweepError(f"hftc.ray.config_results: mode is 'min' or 'max', got {mode!r}")
    rows: list[dict[str, Any]] = []
    for result in results:
        if result.error is not None or result.metrics_dataframe is None:
            continue
        for config_id, params, seed, history in _configurations_of(result, metric):
            if not history:
                continue
            values = [h[1] for h in history]
            rows.append({"config_id": config_id, "config": params, history[0][2]: values[-1],
                         f"best_{history[0][2]}": (min if mode == "min" else max)(values),
                         "epochs": len(values), "seed": seed, "stopped": history[-1][3],
                         "path": result.path})
    if rows:
        name = next(k for k in rows[0] if k not in ("config_id", "config"))  # the metric
        rows.sort(key=lambda row: row[name], reverse=mode == "max")
    return rows


def _configurations_of(result: Any, metric: str | None,
                       ) -> Iterator[tuple[str, dict, int | None, list[tuple]]]:
    """``(config id, params, seed, history)`` of each configuration of one Tune result of
    :func:`tune_trainable`, ``history`` its ``(epoch, value, metric, stopped)`` reports."""
    frame = result.metrics_dataframe
    reports = frame.to_dict("records") if frame is not None and len(frame) else []
    metric = metric or (_reported_metric(reports) if reports else None)
    trial_id = (result.metrics or {}).get("trial_id", "trial")
    for j, params in enumerate((result.config or {}).get(ARRAY_KEY, [])):
        mine = [r for r in reports if _present(r.get(f"config_{j}/{metric}"))]
        seed = int(mine[0][f"config_{j}/seed"]) if mine else params.get(SEED_KEY)
        history = [(int(r.get("training_iteration", e + 1)), r[f"config_{j}/{metric}"], metric,
                    bool(r.get(f"config_{j}/stopped", False))) for e, r in enumerate(mine)]
        yield (f"{trial_id}/{j}", {k: v for k, v in params.items() if k != SEED_KEY}, seed,
               history)


def _present(value: Any) -> bool:
    """A reported value (the metrics table holds NaN where a configuration had left)."""
    return value is not None and value == value


def _reported_metric(reports: list[dict[str, Any]]) -> str:
    for key in reports[0]:
        if key.startswith("config_0/") and key != "config_0/seed":
            return key.split("/", 1)[1]
    raise SweepError("hftc.ray.config_results: these results hold no config_<j>/<metric> "
                     "(were they trained by hftc.ray.tune_trainable?)")


def array_space(space: dict[str, Any], per_array: int) -> dict[str, Any]:
    """A Tune ``param_space`` whose every sample is an array of ``per_array``
    configurations, each drawn from ``space`` (a dict of Tune domains)."""
    return {ARRAY_KEY: [dict(space) for _ in range(per_array)]}


# ---------------------------------------------------------------------- Tune's own API


@dataclasses.dataclass
class ConfigResult:
    """One configuration's result, as Tune's ``Result`` says a trial's: ``config`` (its
    parameters), ``metrics`` (its last report: the metric, ``training_iteration`` its
    epochs, ``seed``, ``stopped`` where the scheduler stopped it, ``config_id``),
    ``metrics_dataframe`` (one row per epoch), ``path`` (its array's Tune trial folder),
    ``error`` (its array's, where the array failed)."""

    config: dict[str, Any]
    metrics: dict[str, Any]
    metrics_dataframe: Any
    path: str | None
    error: BaseException | None = None
    checkpoint: Any = None


class ConfigResults:
    """Tune's ``ResultGrid``, one :class:`ConfigResult` per configuration (in the order
    they were drawn) rather than one per array: ``len``, indexing, iteration,
    :meth:`get_best_result`, :meth:`get_dataframe`, ``errors``, ``num_errors``,
    ``num_terminated``. ``grid`` is Tune's own, one result per array."""

    def __init__(self, results: list[ConfigResult], grid: Any, metric: str, mode: str):
        self._results, self.grid, self.metric, self.mode = results, grid, metric, mode

    def __len__(self) -> int:
        return len(self._results)

    def __getitem__(self, i: int) -> ConfigResult:
        return self._results[i]

    def __iter__(self) -> Iterator[ConfigResult]:
        return iter(self._results)

    @property
    def errors(self) -> list[BaseException]:
        return [r.error for r in self._results if r.error is not None]

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    @property
    def num_terminated(self) -> int:
        return len(self._results) - self.num_errors

    @property
    def experiment_path(self) -> str:
        return self.grid.experiment_path

    def get_best_result(self, metric: str | None = None, mode: str | None = None,
                        scope: str = "last", filter_nan_and_inf: bool = True) -> ConfigResult:
        """The best configuration by ``metric`` (default: TuneConfig's, else the spec's),
        ``mode`` "min" / "max", ``scope`` "last" (its last epoch) or "all" (its best
        epoch), as ``ResultGrid.get_best_result``."""
        metric, mode = metric or self.metric, mode or self.mode
        if mode not in ("min", "max") or scope not in ("last", "all"):
            raise SweepError(f"hftc.ray.ConfigResults.get_best_result: mode is 'min' or "
                             f"'max' and scope 'last' or 'all', got {mode!r}, {scope!r}")
        best = min if mode == "min" else max

        def value(r: ConfigResult) -> float:
            values = list(r.metrics_dataframe[metric])
            return float(values[-1] if scope == "last" else best(values))

        candidates = [r for r in self._results if r.error is None and len(r.metrics_dataframe)
                      and (not filter_nan_and_inf or math.isfinite(value(r)))]
        if not candidates:
            raise SweepError(f"hftc.ray.ConfigResults: no configuration reported a finite "
                             f"{metric!r}")
        return best(candidates, key=value)

    def get_dataframe(self) -> Any:
        """One row per configuration: its last metrics and ``config/<name>`` columns."""
        import pandas as pd

        return pd.DataFrame([{**r.metrics, **{f"config/{k}": v for k, v in r.config.items()}}
                             for r in self._results])


class Tuner:
    """``ray.tune.Tuner`` for fused arrays: the same arguments, one result per
    configuration::

        tuner = hftc.ray.Tuner("spec.py", param_space={"lr": tune.loguniform(1e-3, 0.3)},
                               tune_config=tune.TuneConfig(num_samples=16,
                                                           scheduler=ASHAScheduler()),
                               per_array=4)
        results = tuner.fit()            # 16 ConfigResults: one per configuration
        best = results.get_best_result() # TuneConfig's metric and mode, else the spec's
        best.config == {"lr": ...}, best.metrics["loss"], best.metrics_dataframe

    ``param_space`` is one configuration's space (Tune domains, ``tune.grid_search``);
    ``num_samples`` configurations are drawn from it (times each grid point), as Tune
    would, with Tune's variant generator seeded by the spec's seed, and each gets its own
    seed: the same script draws and trains the same configurations. They train in
    arrays of ``per_array`` (one Tune trial each, the last smaller); TuneConfig's
    ``scheduler`` (ASHA) decides per configuration, as :func:`tune_trainable` says.
    A ``search_alg`` (Tune's Optuna, HyperOpt ...) suggests per Tune trial, so per array:
    refused here (:func:`hftc.sweep.run` drives Optuna's samplers per trial). ``epochs``
    and ``overrides`` are spec fields."""

    def __init__(self, spec: Any, *, param_space: dict[str, Any], tune_config: Any = None,
                 run_config: Any = None, per_array: int = 4, epochs: int | None = None,
                 **overrides: Any):
        from ..sweep.spec import load_spec

        if not isinstance(per_array, int) or isinstance(per_array, bool) or per_array < 1:
            raise SweepError(f"hftc.ray.Tuner: per_array must be a positive int, got "
                             f"{per_array!r}")
        if not isinstance(param_space, dict):
            raise SweepError(f"hftc.ray.Tuner: param_space is one configuration's space (a "
                             f"dict of Tune domains), got {type(param_space).__name__}")
        tune = _import_ray("ray.tune")
        self.spec, self.param_space, self.per_array = spec, param_space, per_array
        self.tune_config = tune_config if tune_config is not None else tune.TuneConfig()
        self.run_config, self.epochs, self.overrides = run_config, epochs, overrides
        spec_obj = load_spec(_shippable(spec, "hftc.ray.Tuner")).replace(**overrides)
        self.seed = spec_obj.seed
        self.metric, self.mode = _metric_and_mode(self.tune_config, spec_obj)
        # refused here, before Ray starts, rather than in fit()
        _per_config_scheduler(self.tune_config.scheduler, "hftc.ray.Tuner",
                              "to schedule whole arrays give it to tune.Tuner with "
                              "hftc.ray.tune_trainable(spec) and hftc.ray.array_space")
        if self.tune_config.search_alg is not None:
            search = type(self.tune_config.search_alg).__name__
            raise SweepError(
                f"hftc.ray.Tuner: TuneConfig(search_alg={search}) suggests one config per "
                f"Tune trial, and a Tune trial here is "
                f"an array of {per_array}: drop search_alg (Tune's variant generator draws "
                f"the configurations), or run the Optuna sampler per trial with "
                f"hftc.sweep.run / `hftc sweep SPEC --ray`")

    def configurations(self) -> list[dict[str, Any]]:
        """The configurations :meth:`fit` trains, each with its seed (``SEED_KEY``)."""
        import numpy as np
        from ray.tune.search.variant_generator import generate_variants

        from ..sweep.sampling import draw_seed

        random_state = np.random.RandomState(self.seed % 2**32)
        drawn = [config for _ in range(max(1, int(self.tune_config.num_samples)))
                 for _, config in generate_variants(dict(self.param_space),
                                                    random_state=random_state)]
        return [{**config, SEED_KEY: draw_seed(self.seed, "tune", k)}
                for k, config in enumerate(drawn)]

    def fit(self) -> ConfigResults:
        tune = _import_ray("ray.tune")
        configs = self.configurations()
        arrays = [configs[i:i + self.per_array] for i in range(0, len(configs), self.per_array)]
        trainable = tune_trainable(self.spec, scheduler=self.tune_config.scheduler,
                                   epochs=self.epochs, **self.overrides)
        # Tune runs the arrays, one trial each, first in first out; the scheduler is the
        # configurations' (in tune_trainable), and every array is drawn already.
        per_array_config = dataclasses.replace(self.tune_config, scheduler=None, metric=None,
                                               mode=None, num_samples=1)
        grid = tune.Tuner(trainable, param_space={ARRAY_KEY: tune.grid_search(arrays)},
                          tune_config=per_array_config, run_config=self.run_config).fit()
        order = {config[SEED_KEY]: k for k, config in enumerate(configs)}
        results: list[ConfigResult | None] = [None] * len(configs)
        for result in grid:
            for config_id, params, seed, history in _configurations_of(result, self.metric):
                k = order.get(seed)
                if k is not None:
                    results[k] = _config_result(config_id, params, seed, history, result,
                                                self.metric)
        missing = [k for k, r in enumerate(results) if r is None]
        for k in missing:  # an array Tune never reported (it failed before its first epoch)
            results[k] = _config_result("", {n: v for n, v in configs[k].items()
                                              if n != SEED_KEY}, configs[k][SEED_KEY], [],
                                        None, self.metric)
        return ConfigResults(results, grid, self.metric, self.mode)


def _metric_and_mode(tune_config: Any, spec: Any) -> tuple[str, str]:
    """The metric every configuration reports is the spec's; TuneConfig may name it."""
    metric, mode = spec.metric_name, spec.direction[:3]
    if tune_config.metric not in (None, metric) or tune_config.mode not in (None, mode):
        raise SweepError(
            f"hftc.ray.Tuner: TuneConfig(metric={tune_config.metric!r}, "
            f"mode={tune_config.mode!r}), but the spec's configurations report "
            f"{metric!r}, best at {mode!r} (its metric and direction): name those, or none")
    return metric, mode


def _config_result(config_id: str, params: dict, seed: Any, history: list[tuple],
                   result: Any, metric: str) -> ConfigResult:
    import pandas as pd

    frame = pd.DataFrame([{"training_iteration": epoch, metric: value}
                          for epoch, value, _, _ in history],
                         columns=["training_iteration", metric])
    last = {metric: history[-1][1], "training_iteration": history[-1][0]} if history else {}
    error = None if result is None else result.error
    if result is None:
        error = SweepError(f"hftc.ray.Tuner: configuration {params} never reported")
    return ConfigResult(params, {**last, "seed": seed, "config_id": config_id,
                                 "stopped": bool(history and history[-1][3])},
                        frame, None if result is None else result.path, error)


def _train_array(spec: Any, config: dict[str, Any], decider: Any) -> None:
    """One Tune trial: ``config[ARRAY_KEY]``'s configurations fused, trained epoch by
    epoch, reported per configuration, cut as the scheduler stops them."""
    import hftc

    from ..sweep.training import (
        SweepData,
        batches,
        build_model,
        epoch_order,
        evaluate,
        metric_value,
    )

    ray = _import_ray()
    tune = _import_ray("ray.tune")
    params = config.get(ARRAY_KEY)
    if not isinstance(params, list) or not params or not all(isinstance(p, dict)
                                                              for p in params):
        raise SweepError(f"hftc.ray.tune_trainable: the trial's config needs {ARRAY_KEY!r}: a "
                         f"list of parameter dicts (use hftc.ray.array_space(space, N) as "
                         f"param_space), got {type(params).__name__}")
    trial_id = tune.get_context().get_trial_id() or "trial"
    if ray.get_gpu_ids() and spec.device == "cpu":  # tune.with_resources(..., {"gpu": 1})
        spec = spec.replace(device="cuda")
    data = SweepData.from_spec(spec)
    names = [f"{trial_id}/{j}" for j in range(len(params))]
    seeds = [int(p[SEED_KEY]) if SEED_KEY in p else int(p["seed"]) if "seed" in p else
             spec.seed + zlib.crc32(name.encode()) % 1_000_000 for p, name in zip(params, names)]
    params = [{k: v for k, v in p.items() if k != SEED_KEY} for p in params]
    modules = [build_model(spec, p, s) for p, s in zip(params, seeds)]
    fused = hftc.fuse(modules, example_inputs=tuple(x[:spec.batch_size]
                                                    for x in data.x_train))
    optimizer = hftc.optim.fuse_optimizers(fused, [spec.optimizer(p, m)
                                                   for p, m in zip(params, modules)])
    loss = hftc.per_model(spec.loss)
    live = list(range(len(params)))  # configuration index of each model of the array
    if decider is not None:
        ray.get([decider.add.remote(n) for n in names])
    best = max if spec.direction == "maximize" else min
    for epoch in range(spec.epochs):
        key = spec.seed * 1_000_003 + epoch  # the data order of the sweep's round `epoch`
        fused.train()
        for idx in batches(epoch_order(key, data.n_train), spec.batch_size):
            optimizer.zero_grad(set_to_none=True)
            loss(fused(*(x[idx] for x in data.x_train)), data.y_train[idx]).sum().backward()
            optimizer.step()
        fused.eval()
        out = evaluate(fused, data, spec.eval_batch_size, batch_dim=1)
        values = [metric_value(spec, out[j], data.y_val) for j in range(len(live))]
        report = {f"config_{c}/{spec.metric_name}": v for c, v in zip(live, values)}
        report.update({f"config_{c}/seed": seeds[c] for c in live})
        report.update({spec.metric_name: best(values), "live": len(live),
                       "array_size": fused.num_models})
        keep = list(range(len(live)))
        last = epoch + 1 == spec.epochs
        if decider is not None and not last:
            actions = ray.get([
                decider.result.remote(names[c], {"training_iteration": epoch + 1,
                                                 spec.metric_name: v})
                for c, v in zip(live, values)])
            keep = [j for j, a in enumerate(actions) if a != "STOP"]
        elif decider is not None:
            ray.get([decider.complete.remote(names[c]) for c in live])
        report["stopped"] = len(live) - len(keep)
        report.update({f"config_{c}/stopped": j not in keep for j, c in enumerate(live)})
        tune.report(report)
        if len(keep) < len(live):
            live = [live[j] for j in keep]
            if not live:
                return
            hftc.keep_models(fused, keep, optimizers=[optimizer])
