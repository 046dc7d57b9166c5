"""hftc.ray on a local 2-node Ray cluster (127.0.0.1): sweep actors, a killed node, Tune + ASHA.

One cluster for the module (Ray starts slowly on 2 cores): a head and a worker node, 2
CPUs each. Skipped where Ray is not installed (``pip install 'hftc[ray]'``; CI has it).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import hftc.ray as hray
import optuna
import pytest
from optuna.trial import TrialState
from test_sweep import ROOT, SPEC_SOURCE, retrain_alone

import hftc.sweep as hs
from hftc.__main__ import main
from hftc.errors import MissingExtraError, SweepError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'hftc[ray]'")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    worker = c.add_node(num_cpus=2)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="error", log_to_driver=False)
    yield c, worker
    # Bounded: after a failure (pytest -x) nothing times this teardown, and a cluster
    # that does not stop would hang the run; then Ray's own `ray stop --force`.
    stopping = threading.Thread(target=lambda: (ray.shutdown(), c.shutdown()), daemon=True)
    stopping.start()
    stopping.join(120)
    if stopping.is_alive():
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"],
                       timeout=120, check=False)


@pytest.fixture(scope="module")
def tiny_spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "tiny_ray_spec.py"
    # Slow enough (0.2 s per model and epoch) that a node can be killed mid-sweep.
    path.write_text(SPEC_SOURCE.replace('float(os.environ.get("HFTC_TEST_SLOW", "0"))', "0.2"))
    return path


def _digits_study(storage: str, name: str, configs: list[dict]) -> None:
    study = optuna.create_study(study_name=name, storage=storage, direction="maximize")
    for params in configs:
        study.enqueue_trial(params)


DIGITS_CONFIGS = [
    {"lr": lr, "momentum": m, "weight_decay": 1e-4, "dropout": 0.0}
    for lr, m in ((0.05, 0.9), (0.2, 0.5), (0.01, 0.0), (0.1, 0.8))
]


def test_digits_on_two_nodes_gives_the_one_worker_results(cluster, tmp_path: Path, capsys):
    """The digits demo spec (in float64, 3 epochs, no pruning), the same 4 configurations
    (enqueued, so the same trial numbers and seeds): one worker with one array of 4, and
    ``hftc sweep --ray ADDRESS --workers 2`` (2 actors on 2 nodes, arrays of 2) report
    the same accuracies epoch by epoch."""
    c, _ = cluster
    # The digits spec as it is, in float64. Each actor asks its 2 trials before the other
    # has trained them, as the one worker asks its 4 (a trial's data order is its round's):
    # the loss waits, on its first call, until the study has no trial left to ask.
    spec_source = (
        "import time\n\nimport optuna\nimport torch\nfrom optuna.trial import TrialState\n\n"
        "from hftc.sweep.digits import *  # noqa: F403\n\n"
        "dtype = torch.float64\nepochs = 3\npruner = 'none'\nn_trials = 4\n"
        "STORAGE = {storage!r}\nasked = []\n\n\n"
        "def loss(output, target):\n"
        "    deadline = time.monotonic() + 120\n"
        "    while not asked:\n"
        "        trials = optuna.load_study(study_name='digits', storage=STORAGE).trials\n"
        "        if (all(t.state != TrialState.WAITING for t in trials)\n"
        "                or time.monotonic() > deadline):  # (then the orders differ)\n"
        "            asked.append(True)\n"
        "        else:\n"
        "            time.sleep(0.2)\n"
        "    return torch.nn.functional.cross_entropy(output, target)\n")
    values = {}
    for label, per_array in (("one", 4), ("ray", 2)):
        out = tmp_path / label
        out.mkdir()
        storage = f"sqlite:///{out / 'study.db'}"
        _digits_study(storage, "digits", DIGITS_CONFIGS)
        spec_file = out / "digits64.py"
        spec_file.write_text(spec_source.format(storage=storage))
        if label == "one":
            spec = hs.load_spec(spec_file).replace(per_array=per_array)
            hs.Sweep(spec, out=out, storage=storage, progress=False).run()
        else:
            assert main(["sweep", str(spec_file), "--ray", c.address, "--workers", "2",
                         "-n", str(per_array), "--storage", storage, "--out", str(out)]) == 0
            printed = capsys.readouterr().out
            assert "best: trial" in printed and "nothing to train" not in printed
            assert "2 Ray actors on 2 node(s), 0 replaced" in printed
            # this process is attached to the cluster: reused, said at the start
            assert re.match(r"Ray: already attached to Ray at [\d.:]+, \d+\.\d s\n", printed)
            assert (out / "results.csv").exists()
        trials = optuna.load_study(study_name="digits", storage=storage).trials
        assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
        values[label] = {t.number: (t.params, t.user_attrs["hftc_orders"],
                                    [t.intermediate_values[e] for e in sorted(t.intermediate_values)])
                         for t in trials}
    orders = {label: sorted({tuple(o) for _, o, _ in v.values()}) for label, v in values.items()}
    assert orders["ray"] == orders["one"], "an actor trained its trials before the other asked"
    assert values["ray"] == values["one"]


def test_tune_asha_16_configurations_in_arrays_of_4(cluster, tiny_spec: Path, tmp_path: Path):
    """16 configurations, 4 Tune trials of 4 fused each, ASHA per configuration: the run
    completes, ASHA stops some configurations early, each leaves its array at once (the
    next report's array is smaller by the stopped ones), and every configuration's
    reported losses are those of the configuration trained alone (float64)."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    epochs = 4
    asha = ASHAScheduler(time_attr="training_iteration", max_t=epochs, grace_period=1,
                         reduction_factor=2)
    trainable = hray.tune_trainable(tiny_spec, scheduler=asha, epochs=epochs)
    space = {"lr": tune.loguniform(0.01, 0.5), "momentum": tune.uniform(0.0, 0.9),
             "weight_decay": tune.loguniform(1e-5, 1e-2)}
    tuner = tune.Tuner(
        trainable, param_space=hray.array_space(space, 4),
        tune_config=tune.TuneConfig(num_samples=4),
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="asha", verbose=0))
    results = tuner.fit()
    assert len(results) == 4 and not results.errors
    spec = hs.load_spec(tiny_spec)
    data = hs.SweepData.from_spec(spec)
    orders = [spec.seed * 1_000_003 + e for e in range(epochs)]
    stopped_early = 0
    for result in results:
        rows = result.metrics_dataframe.to_dict("records")
        configs = result.config[hray.ARRAY_KEY]
        live_before = 4
        for row in rows:
            assert row["array_size"] == live_before == row["live"]  # stopped ones left
            live_before -= row["stopped"]
        for j, params in enumerate(configs):
            losses = [row[f"config_{j}/loss"] for row in rows
                      if row.get(f"config_{j}/loss") == row.get(f"config_{j}/loss")]
            seed = int(next(row[f"config_{j}/seed"] for row in rows))
            assert 1 <= len(losses) <= epochs
            stopped_early += len(losses) < epochs
            _, alone = hs.train_alone(spec, params, seed, orders[:len(losses)], data)
            assert losses == pytest.approx(alone, abs=1e-9), (j, losses, alone)
    assert stopped_early >= 4  # reduction factor 2 over 16: about half stop at epoch 1
    import ray

    stopped = ray.get(trainable.scheduler_actor.stopped_configs.remote())
    assert len(stopped) == stopped_early

    # one result per configuration, not per array: the best first, each as trained alone
    rows = hray.config_results(results, "loss", mode="min")
    assert len(rows) == 16 and len({row["config_id"] for row in rows}) == 16
    assert [row["loss"] for row in rows] == sorted(row["loss"] for row in rows)
    assert sum(row["stopped"] for row in rows) == stopped_early
    assert {row["config_id"] for row in rows if row["stopped"]} == {c for c, _ in stopped}
    for row in rows[:3]:
        assert row["epochs"] == (dict(stopped).get(row["config_id"]) or epochs)
        _, alone = hs.train_alone(spec, row["config"], row["seed"], orders[:row["epochs"]],
                                  data)
        assert row["loss"] == pytest.approx(alone[-1], abs=1e-9)
        assert row["best_loss"] == pytest.approx(min(alone), abs=1e-9)
    assert hray.config_results(results) == rows  # the metric the trials reported


def test_tuner_gives_one_result_per_configuration_as_tune_does(cluster, tmp_path: Path):
    """hftc.ray.Tuner takes tune.Tuner's arguments with one configuration's space (a grid
    and a random domain, num_samples, ASHA in TuneConfig) and returns one result per
    configuration: 2 grid points x 5 samples = 10 configurations in arrays of 4 (the
    last of 2), each reported as trained alone from its own seed, the best the best, the
    same configurations drawn again by the same script."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    spec_file = tmp_path / "fast_spec.py"
    spec_file.write_text(SPEC_SOURCE)
    epochs = 3
    space = {"lr": tune.loguniform(0.01, 0.5), "momentum": tune.grid_search([0.0, 0.8]),
             "weight_decay": 1e-4}

    def tuner(**tune_config):
        return hray.Tuner(
            spec_file, param_space=space, per_array=4, epochs=epochs,
            tune_config=tune.TuneConfig(num_samples=5, **tune_config),
            run_config=tune.RunConfig(storage_path=str(tmp_path), name="tuner", verbose=0))

    asha = ASHAScheduler(time_attr="training_iteration", max_t=epochs, grace_period=1,
                         reduction_factor=2)
    made = tuner(scheduler=asha, metric="loss", mode="min")
    assert made.configurations() == tuner().configurations()  # the same script, the same
    results = made.fit()
    assert len(results) == 10 and results.num_errors == 0 and results.num_terminated == 10
    assert len(results.grid) == 3  # Tune's own: arrays of 4, 4 and 2
    assert sorted(r.config["momentum"] for r in results) == [0.0] * 5 + [0.8] * 5
    assert len({r.config["lr"] for r in results}) == 10
    assert all(set(r.config) == {"lr", "momentum", "weight_decay"} for r in results)
    spec = hs.load_spec(spec_file)
    data = hs.SweepData.from_spec(spec)
    orders = [spec.seed * 1_000_003 + e for e in range(epochs)]
    for r in results:
        losses = list(r.metrics_dataframe["loss"])
        assert list(r.metrics_dataframe["training_iteration"]) == list(range(1, len(losses) + 1))
        assert r.metrics["stopped"] == (len(losses) < epochs)
        _, alone = hs.train_alone(spec, r.config, r.metrics["seed"], orders[:len(losses)], data)
        assert losses == pytest.approx(alone, abs=1e-9)
        assert r.metrics["loss"] == losses[-1]
    assert any(r.metrics["stopped"] for r in results)  # ASHA stopped some, per configuration
    best = results.get_best_result()
    finished = [r for r in results if not r.metrics["stopped"]]
    assert best.metrics["loss"] == min(r.metrics["loss"] for r in results)
    assert best in finished or best.metrics["loss"] <= min(r.metrics["loss"] for r in finished)
    assert results.get_best_result("loss", "max").metrics["loss"] == max(
        r.metrics["loss"] for r in results)
    frame = results.get_dataframe()
    assert len(frame) == 10 and {"loss", "config/lr", "config/momentum"} <= set(frame.columns)


def test_tuner_an_array_that_fails_gives_its_configurations_the_error(cluster, tmp_path):
    """A configuration whose model cannot be built fails its array (one Tune trial): its
    configurations carry the error, the other array's train, the best is among them."""
    from ray import tune

    spec_file = tmp_path / "failing_spec.py"
    spec_file.write_text(SPEC_SOURCE.replace(
        "def model(params):\n",
        "def model(params):\n    if params['k'] >= 2:\n"
        "        raise ValueError(f\"no model for k={params['k']}\")\n"))
    results = hray.Tuner(
        spec_file, param_space={"lr": 0.1, "momentum": 0.5, "weight_decay": 1e-4,
                                "k": tune.grid_search([0, 1, 2, 3])},
        per_array=2, epochs=2,
        run_config=tune.RunConfig(storage_path=str(tmp_path), name="fails", verbose=0)).fit()
    assert len(results) == 4 and results.num_errors == 2 and results.num_terminated == 2
    assert [r.error is None for r in results] == [True, True, False, False]
    assert all("no model for k=" in str(error) for error in results.errors)
    assert [len(r.metrics_dataframe) for r in results] == [2, 2, 0, 0]
    assert results.get_best_result().config["k"] in (0, 1)


def test_tuner_refuses_what_cannot_act_per_configuration(tmp_path: Path):
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    spec_file = tmp_path / "fast_spec.py"
    spec_file.write_text(SPEC_SOURCE)
    with pytest.raises(SweepError, match="search_alg=BasicVariantGenerator.*per Tune trial"):
        hray.Tuner(spec_file, param_space={"lr": 0.1},
                   tune_config=tune.TuneConfig(search_alg=BasicVariantGenerator()))
    with pytest.raises(SweepError, match="report 'loss', best at 'min'"):
        hray.Tuner(spec_file, param_space={"lr": 0.1},
                   tune_config=tune.TuneConfig(metric="accuracy", mode="max"))
    with pytest.raises(SweepError, match="per_array must be a positive int"):
        hray.Tuner(spec_file, param_space={"lr": 0.1}, per_array=0)


def _trials(storage: str, name: str) -> list:
    try:
        return optuna.load_study(study_name=name, storage=storage).trials
    except KeyError:  # not created yet
        return []


def _trials_meanwhile(storage: str, name: str) -> list:
    """The trials, read while the sweep may be creating the database's tables (this
    reader and the sweep may both try to stamp the schema's version: one loses)."""
    import sqlalchemy

    try:
        return _trials(storage, name)
    except (sqlalchemy.exc.OperationalError, sqlalchemy.exc.IntegrityError):
        return []


def test_killed_node_mid_sweep_loses_and_repeats_nothing(cluster, tiny_spec: Path,
                                                          tmp_path: Path):
    c, worker = cluster
    out = tmp_path / "out"
    storage = f"sqlite:///{out / 'study.db'}"
    n_trials = 6
    box: dict = {}

    def drive():
        try:
            box["result"] = hray.sweep(tiny_spec, workers=2, out=out, storage=storage,
                                       n_trials=n_trials, epochs=4, pruner="none",
                                       heartbeat_interval=1, grace_period=3)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    # Both actors hold trials (3 each at most) and some have trained an epoch.
    while time.monotonic() < deadline and not (
            sum(t.state == TrialState.RUNNING for t in _trials_meanwhile(storage, "tiny")) >= 4
            and any(t.intermediate_values for t in _trials_meanwhile(storage, "tiny"))):
        assert thread.is_alive(), box
        time.sleep(0.2)
    c.remove_node(worker)  # the node dies with its actor and the actor's trials
    thread.join(240)
    assert not thread.is_alive(), "the sweep did not finish after the node was killed"
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert result.timings["replaced"] >= 1  # the killed node's actor was replaced

    trials = _trials(storage, "tiny")
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    assert len(finished) == n_trials, [(t.number, t.state.name) for t in trials]
    # A trial the dead actor held either went on from its checkpoint (the replacement
    # adopted it) or failed on its heartbeat and was retried once, same parameters.
    retries = {t.system_attrs.get("failed_trial"): t for t in finished
               if "failed_trial" in t.system_attrs}
    for t in failed:
        assert t.number in retries, f"trial {t.number} failed and was never retried"
        assert {k: retries[t.number].params[k] for k in t.params} == t.params
    assert len({tuple(sorted(t.params.items())) for t in finished}) == n_trials
    # Each finished trial reported what it reports trained alone, epoch by epoch.
    spec = hs.load_spec(tiny_spec)
    for t in finished:
        fused = [t.intermediate_values[s] for s in sorted(t.intermediate_values)]
        assert fused == pytest.approx(retrain_alone(spec, t), abs=1e-9), t.number


def test_an_error_in_the_spec_stops_the_sweep_with_its_message(cluster, tiny_spec: Path,
                                                               tmp_path: Path):
    with pytest.raises(SweepError, match="unknown pruner 'bogus'"):
        hray.sweep(tiny_spec, workers=2, out=tmp_path / "bad", n_trials=2, pruner="bogus")


def test_connect_reuses_a_running_cluster_from_another_process(cluster):
    """A new driver process with no address: ray.init(address="auto") joins the cluster
    that runs (no second Ray started), and says so and how long it took."""
    code = ("import hftc.ray, ray; s = hftc.ray.connect(); print(s); "
            "print(len(ray.nodes()), s.how, s.seconds >= 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True).stdout
    assert re.search(r"^Ray: joined the running Ray cluster at [\d.:]+, \d+\.\d s$", out, re.M)
    assert out.splitlines()[-1] == "2 joined True"  # the fixture's two nodes


class _FakeRay:
    """ray's init and context as connect() calls them: a cluster runs or not."""

    def __init__(self, running: bool):
        self.running, self.calls = running, []

    def is_initialized(self):
        return False

    def init(self, address=None, **kwargs):
        self.calls.append(address)
        if address == "auto" and not self.running:
            raise ConnectionError("Could not find any running Ray instance.")

    def get_runtime_context(self):
        return type("Context", (), {"gcs_address": "127.0.0.1:6379"})()


@pytest.mark.parametrize("running, address, how, calls", [
    (True, None, "joined", ["auto"]),            # a running cluster: reused
    (False, None, "started", ["auto", None]),    # none: a local Ray, as ray.init() does
    (True, "ray://head:10001", "connected", ["ray://head:10001"])])
def test_connect_joins_else_starts(monkeypatch, running, address, how, calls):
    fake = _FakeRay(running)
    monkeypatch.setattr(hray, "_import_ray", lambda what="ray": fake)
    monkeypatch.setattr(hray, "_check_reachable", lambda address: None)  # no real head
    reached = hray.connect(address)
    assert (reached.how, fake.calls, reached.address) == (how, calls, "127.0.0.1:6379")
    assert str(reached).startswith("Ray: ") and str(reached).endswith(" s")
    if how == "started":
        assert "started a local Ray at 127.0.0.1:6379 (none was running)" in str(reached)


def test_workers_without_ray_is_refused(tiny_spec: Path, capsys):
    assert main(["sweep", str(tiny_spec), "--workers", "2"]) == 2
    assert "--workers is the number of Ray actors: give --ray" in capsys.readouterr().err


def test_a_spec_loaded_from_a_file_is_refused_with_the_path_to_give(tiny_spec: Path):
    loaded = hs.load_spec(tiny_spec)
    with pytest.raises(SweepError, match=r"tiny_ray_spec.py\), which Ray's workers cannot "
                                         r"import; give the file's path"):
        hray.sweep(loaded, workers=2)
    with pytest.raises(SweepError, match="hftc.ray.tune_trainable: the spec's space"):
        hray.tune_trainable(loaded)


def test_a_scheduler_that_needs_tunes_runner_is_refused(tiny_spec: Path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'hftc[ray]'")
    from ray.tune.schedulers import MedianStoppingRule

    with pytest.raises(SweepError, match="MedianStoppingRule decides with Tune's trial runner"
                                         ".*give one, or give MedianStoppingRule to "
                                         "tune.TuneConfig"):
        hray.tune_trainable(str(tiny_spec), scheduler=MedianStoppingRule())


def test_import_hftc_never_imports_ray():
    code = ("import sys, torch, hftc, hftc.sweep, hftc.ray; hftc.fuse; hftc.sweep.Sweep; "
            "assert 'ray' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ModuleNotFoundError
    with pytest.raises(MissingExtraError, match=r"pip install 'hftc\[ray\]'"):
        hray.sweep("hftc.sweep.digits", workers=1)
