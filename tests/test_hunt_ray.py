"""hftc.ray as a user meets it: a wrong cluster address, a spec that raises inside an
actor, Tune's schedulers given to hftc.ray.Tuner, the summary of a sweep on Ray.

One local Ray for the module (num_cpus=2; Ray starts slowly on 2 cores), started by the
first test that needs it; the tests before it need no cluster.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import types
from pathlib import Path

import hftc.ray as hray
import pytest
from test_sweep import SPEC_SOURCE

from hftc.__main__ import main
from hftc.errors import SweepError
from hftc.sweep.report import summary

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'hftc[ray]'")

pytestmark = pytest.mark.timeout(300)

BAD_MODEL = "def model(params):\n    raise ValueError('no such model in my zoo')\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_wrong_address_is_refused_at_once_with_what_to_do():
    """Nothing listens at the address: Ray's own ray.init retries for minutes printing
    GCS time-outs; hftc says at once that no cluster answers there and what to do."""
    port = _free_port()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(SweepError, match=rf"no Ray cluster answers at '{address}'.*"
                                             rf"ray start --head --port={port}"):
            hray._check_reachable(address, timeout=2.0)
    hray._check_reachable("auto")  # Ray's to resolve


def test_the_cli_refuses_a_wrong_address_with_its_own_error(tmp_path: Path, capsys):
    if ray.is_initialized():  # (connect() would reuse this process's Ray)
        pytest.skip("this process is attached to Ray")
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC_SOURCE)
    port = _free_port()
    assert main(["sweep", str(spec), "--ray", f"127.0.0.1:{port}", "--workers", "1",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"hftc sweep: hftc.ray: no Ray cluster answers at '127.0.0.1:{port}'" in err


def test_tune_default_fifo_scheduler_is_no_scheduler_and_median_is_refused_early(
        tmp_path: Path):
    """FIFOScheduler (Tune's default) never stops a trial: accepted as no scheduler, not
    refused. MedianStoppingRule in hftc.ray.Tuner's TuneConfig is refused when the Tuner
    is made (not in fit(), after Ray started), saying what to do with a Tuner."""
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler, MedianStoppingRule

    spec = tmp_path / "spec.py"
    spec.write_text(SPEC_SOURCE)
    assert hray.tune_trainable(spec, scheduler=FIFOScheduler()).scheduler_actor is None
    hray.Tuner(spec, param_space={"lr": 0.1},
               tune_config=tune.TuneConfig(scheduler=FIFOScheduler()))
    with pytest.raises(SweepError, match=r"hftc.ray.Tuner: MedianStoppingRule decides with "
                                         r"Tune's trial runner.*hftc.ray.tune_trainable"):
        hray.Tuner(spec, param_space={"lr": 0.1},
                   tune_config=tune.TuneConfig(scheduler=MedianStoppingRule()))


def test_summary_does_not_count_a_ray_sweeps_counts_as_seconds():
    """timings holds workers / nodes / replaced beside seconds: "start-up and other" is
    the wall clock less the seconds only; the Ray line says how Ray was reached."""
    result = types.SimpleNamespace(
        wall_s=10.0, trial_epochs=4, note="n", formations=[], padded=[], mixed=[],
        apart=[], before_s=None,
        timings={"train": 3.0, "ray_start": 1.0, "workers": 8, "nodes": 2, "replaced": 1},
        cluster="Ray: joined the running Ray cluster at 1.2.3.4:6379, 1.0 s; 8 Ray actors "
                "on 2 node(s), 1 replaced")
    text = summary(result)
    assert "reaching Ray 1.0 s, start-up and other 6.0 s" in text
    assert "Ray: joined the running Ray cluster at 1.2.3.4:6379, 1.0 s; 8 Ray" in text


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="error",
             log_to_driver=False)
    yield
    stopping = threading.Thread(target=ray.shutdown, daemon=True)
    stopping.start()
    stopping.join(120)
    if stopping.is_alive():
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"],
                       timeout=120, check=False)


def test_a_spec_error_in_an_actor_names_the_spec_and_its_line(local_ray, tmp_path: Path):
    """The spec's model() raises inside the actor: the driver raises the user's own
    exception with the sweep's note and the spec file's line (Ray ships the exception
    without its frames), not a RayTaskError wall nor hftc's driver lines alone."""
    spec = tmp_path / "zoo_spec.py"
    spec.write_text(SPEC_SOURCE.replace("def model(params):\n", BAD_MODEL
                                        + "\n\ndef _unused(params):\n"))
    line = spec.read_text().splitlines().index(
        "    raise ValueError('no such model in my zoo')") + 1
    with pytest.raises(ValueError, match="no such model in my zoo") as info:
        hray.sweep(spec, workers=1, out=tmp_path / "out", n_trials=1, epochs=1)
    assert not isinstance(info.value, ray.exceptions.RayTaskError)
    notes = "\n".join(info.value.__notes__)
    assert "raised while starting trial 0" in notes
    assert f'File "{spec}", line {line}, in model' in notes
    assert "hftc.ray: raised in a Ray actor" in notes


def test_cli_summary_says_how_ray_was_reached_and_what_the_actors_did(
        local_ray, tmp_path: Path, capsys):
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC_SOURCE)
    assert main(["sweep", str(spec), "--ray", "--workers", "1", "-n", "2", "--trials",
                 "2", "--epochs", "2", "--pruner", "none", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Ray: already attached to Ray at ")
    assert "; 1 Ray actors on 1 node(s), 0 replaced" in out
    assert "4 trial-epochs" in out
    # the actors' arrays and epochs timed alone, not the driver's final pass's (none)
    assert "fused arrays: 2 trials per array as formed" in out
    assert "nothing trained" not in out


def test_more_workers_than_the_cluster_holds_is_refused_not_a_hang(local_ray, tmp_path):
    """3 actors of one CPU each on a 2-CPU Ray: the third could never be placed and the
    sweep (which waits for every actor to load) hung for ever; refused, saying why."""
    spec = tmp_path / "spec.py"
    spec.write_text(SPEC_SOURCE)
    with pytest.raises(SweepError, match=r"3 workers need 3 CPUs \(one each\), and the Ray "
                                         r"cluster has 2: give --workers 2 or fewer"):
        hray.sweep(spec, workers=3, out=tmp_path / "out", n_trials=3, epochs=1)
