"""hftc.sweep under faults: SIGKILL at any point, a full disk, damaged files, a --resume
with nothing to resume, a spec whose splits disagree.

The promise: a resumed sweep gives what the uninterrupted one gives (dropout on),
nothing lost and nothing run twice; a fault of the output folder stops the sweep with a
message that names it and leaves every trial resumable; a damaged file is named, and
completed results are kept.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import TrialState

import hftc.sweep as hs
from hftc.__main__ import main

ROOT = Path(__file__).resolve().parents[1]

SPEC_SOURCE = '''
"""pytorch/examples' MNIST MLP in small: Linear, ReLU, Dropout, Linear; float64."""
import optuna
import torch
import torch.nn.functional as F
from torch import nn

name = "faults"
metric = "loss"
epochs = 3
batch_size = 32
n_trials = 4
per_array = 2
dtype = torch.float64


class Net(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.dropout = nn.Dropout(p)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.dropout(F.relu(self.fc1(x))))


class PruneTrialZeroAfterOneEpoch(optuna.pruners.BasePruner):
    """So that trial 2 joins trial 1 mid-way: an array of trials at different epochs."""

    def prune(self, study, trial):
        return trial.number == 0 and max(trial.intermediate_values, default=0) >= 1


pruner = PruneTrialZeroAfterOneEpoch()


def space(trial):
    return {"lr": trial.suggest_float("lr", 0.02, 0.3, log=True), "momentum": 0.5,
            "weight_decay": 1e-4, "dropout": trial.suggest_float("dropout", 0.2, 0.5)}


def model(params):
    return Net(params["dropout"])


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 12, generator=g)
    y = (x @ torch.randn(12, 3, generator=g)).argmax(1)
    return (x[:160], y[:160]), (x[160:], y[160:])
'''

# The sweep of SPEC_SOURCE, round by round (5 batches a round):
#   round 0: trials 0 and 1 fused (hftc.fuse call 1); checkpoint 1; trial 0 pruned
#   ask trial 2 (a manifest with it at epoch 0); fuse 1 and 2 (call 2)
#   round 1: batches 6-10; checkpoint 2 (array file, then manifest write 5) ...
#   round 2: trial 1 completes; ask trial 3; rounds 3-5: trials 2 and 3 complete.
# Each kill point: the runs killed one after the other, (where, at its nth pass, --resume?).
KILL_POINTS = {
    "fusing": [("fuse", 2, False)],
    "mid-epoch": [("batch", 8, False)],
    "checkpoint write": [("array-file", 2, False)],
    "manifest write": [("manifest-file", 5, False)],
    "adoption": [("adopted", 1, False)],
    # The resumer too, after its own checkpoint, before the dead folder goes: two folders.
    "while resuming": [("batch", 8, False), ("rmtree", 1, True)],
}

DRIVER = '''
import os, signal, sys
from pathlib import Path

import hftc
import hftc.sweep as hs
from hftc.sweep import engine

spec, out, point, nth, resume = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), \
    sys.argv[5] == "resume"
count = 0


def reached():
    global count
    count += 1
    if count == nth:
        os.kill(os.getpid(), signal.SIGKILL)


if point == "fuse":  # an array fused, before its fused optimizers
    fuse = hftc.fuse
    def _fuse(*args, **kwargs):
        fused = fuse(*args, **kwargs)
        reached()
        return fused
    hftc.fuse = _fuse
elif point == "batch":  # before the nth training batch
    batches = engine.batches
    def _batches(*args):
        for idx in batches(*args):
            reached()
            yield idx
    engine.batches = _batches
elif point in ("array-file", "manifest-file"):  # written in full, not yet renamed
    replace = os.replace
    def _replace(src, dst):
        name = Path(dst).name
        if name.startswith("array-") if point == "array-file" else name == "manifest.json":
            reached()
        return replace(src, dst)
    os.replace = _replace
elif point == "adopted":  # a new trial in the manifest at epoch 0, next to older ones
    write_manifest = engine.Sweep._write_manifest
    def _write_manifest(self):
        write_manifest(self)
        if self.round >= 1 and any(r.epoch == 0 for r in self.live):
            reached()
    engine.Sweep._write_manifest = _write_manifest
elif point == "rmtree":  # a resumer, before it removes the dead worker's folder
    rmtree = engine.shutil.rmtree
    def _rmtree(*args, **kwargs):
        reached()
        return rmtree(*args, **kwargs)
    engine.shutil.rmtree = _rmtree
hs.run(spec, out=out, progress=False, resume=resume)
print("the kill point was never reached")
'''


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "faults_spec.py"
    path.write_text(SPEC_SOURCE)
    return path


def _outcome(trials: list[optuna.trial.FrozenTrial]) -> list[tuple]:
    """What a sweep's trials came to, all of it: compared for equality, bit for bit."""
    return [(t.number, t.state, t.params, t.value, t.intermediate_values,
             t.user_attrs.get("hftc_seed"), t.user_attrs.get("hftc_orders")) for t in trials]


@pytest.fixture(scope="module")
def uninterrupted(spec_file: Path, tmp_path_factory) -> list[tuple]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = hs.run(spec_file, out=tmp_path_factory.mktemp("full") / "out", progress=False)
    finally:
        torch.set_num_threads(threads)
    outcome = _outcome(result.study.trials)
    assert [o[1] for o in outcome] == [TrialState.PRUNED] + [TrialState.COMPLETE] * 3
    return outcome


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_anywhere_then_resume_gives_the_uninterrupted_results(
        point: str, spec_file: Path, uninterrupted: list[tuple], tmp_path: Path):
    """With dropout on, a sweep killed with SIGKILL while fusing, mid-epoch, while writing
    a checkpoint or its manifest, or right after a new trial joined at epoch 0, then
    resumed, ends with exactly the uninterrupted sweep's trials: their parameters, every
    epoch's metric, their seeds and data orders. (The resume rebuilt the trials' models,
    which reseeds torch, and restored the random state saved at the previous checkpoint,
    so the dropout draws after the resume were other than the uninterrupted sweep's; and
    the resumed worker's sampler, seeded afresh, asked other parameters.)"""
    out = tmp_path / "out"
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for kind, nth, resume in KILL_POINTS[point]:
        proc = subprocess.run([sys.executable, str(driver), str(spec_file), str(out), kind,
                               str(nth), "resume" if resume else "new"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    if point == "while resuming":
        assert len(list((out / "workers").iterdir())) == 2
    logged: list[str] = []
    resumed = hs.run(spec_file, out=out, progress=False, resume=True, log=logged.append)
    assert any(m.startswith("resumed ") for m in logged), logged
    assert _outcome(resumed.study.trials) == uninterrupted
    assert not list(out.rglob("*.tmp"))


def _read_only_folder(path: Path):
    """``path`` made read-only: by its mode, or for root (whom modes do not stop) by a
    read-only tmpfs mounted on it."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        path.chmod(0o555)
        return contextlib.nullcontext()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("root cannot mount a read-only tmpfs here")
    return _unmounting(path)


@contextlib.contextmanager
def _unmounting(path: Path):
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_read_only_output_folder_is_an_error_naming_it(spec_file: Path, tmp_path: Path,
                                                         capsys):
    """A read-only --out ended in a raw PermissionError traceback from mkdir."""
    from hftc.errors import SweepFileError

    out = tmp_path / "out"
    with _read_only_folder(out):
        with pytest.raises(SweepFileError, match=rf"cannot write in the sweep's folder "
                                                 rf"{out}.*make it writable"):
            hs.run(spec_file, out=out, progress=False)
        assert main(["sweep", str(spec_file), "--out", str(out), "--no-progress"]) == 2
        assert f"cannot write in the sweep's folder {out}" in capsys.readouterr().err


def test_resume_where_there_is_no_sweep_says_so(spec_file: Path, tmp_path: Path, capsys):
    """--resume on a folder with no sweep started a new one without a word."""
    out = tmp_path / "nothing-here"
    with pytest.raises(hs.SweepError, match=rf"no sweep 'faults' to resume in {out}.*leave "
                                            rf"out --resume to start it"):
        hs.run(spec_file, out=out, progress=False, resume=True)
    assert not out.exists()  # nothing started
    assert main(["sweep", str(spec_file), "--out", str(out), "--resume", "--no-progress"]) == 2
    assert "no sweep 'faults' to resume" in capsys.readouterr().err
    # A study.db without the study (its sweep killed before it made it) said "no study.db".
    out.mkdir()
    hs.make_storage(f"sqlite:///{out / 'study.db'}")
    with pytest.raises(hs.SweepError, match=rf"{out / 'study.db'} holds no study 'faults'.*"
                                            rf"leave out --resume to start it"):
        hs.run(spec_file, out=out, progress=False, resume=True)
    # A shared storage without the study: the same.
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    with pytest.raises(hs.SweepError, match=r"no sweep 'other' to resume in sqlite:///"):
        hs.run(spec_file, out=tmp_path / "o2", storage=url, study_name="other",
               progress=False, resume=True)


def test_validation_features_of_another_width_fail_at_the_start(spec_file: Path,
                                                               tmp_path: Path):
    """Validation features 11 wide against training ones 12 wide failed after a whole
    epoch, inside a matmul of the fused model, naming neither data() nor the split."""
    spec = hs.load_spec(spec_file)
    (xt, yt), (xv, yv) = spec.data()
    narrow = spec.replace(data=lambda: ((xt, yt), (xv[:, :11], yv)))
    with pytest.raises(hs.SpecError, match=r"spec\.data\(\): the val split's input 0 has "
                                           r"samples of shape \(11,\).*the train split's "
                                           r"\(12,\)"):
        hs.run(narrow, out=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()  # before anything was written
    two_inputs = spec.replace(data=lambda: (((xt, xt), yt), (xv, yv)))
    with pytest.raises(hs.SpecError, match=r"train split has 2 input\(s\).*val split 1"):
        hs.SweepData.from_spec(two_inputs)
    wide_targets = spec.replace(data=lambda: ((xt, yt), (xv, yv[:, None])))
    with pytest.raises(hs.SpecError, match=r"val split's targets has samples of shape \(1,\)"):
        hs.SweepData.from_spec(wide_targets)


def _fixed_sampler(seed: int) -> optuna.samplers.BaseSampler:
    # A shared storage seeds its workers' samplers apart, at random: fixed here, so that
    # two sweeps can be compared.
    return optuna.samplers.RandomSampler(seed=3)


class _FullDisk:
    """The output folder's disk fills up: a tmpfs filled to the last byte where root may
    mount one, else ``os.write`` failing with ENOSPC (the sweep's files go through it)."""

    def __init__(self, folder: Path, monkeypatch, real: bool):
        self.folder, self.monkeypatch, self.real = folder, monkeypatch, real
        folder.mkdir(parents=True)
        if real and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs",
                                    str(folder)], capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here")

    def fill(self) -> None:
        if not self.real:
            def write(fd, data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.monkeypatch.setattr(os, "write", write)
            return
        with open(self.folder / "filler", "wb", buffering=0) as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 4096)

    def free(self) -> None:
        self.monkeypatch.undo()
        (self.folder / "filler").unlink(missing_ok=True)

    def close(self) -> None:
        if self.real:
            subprocess.run(["umount", "-l", str(self.folder)], check=False)


@pytest.mark.parametrize("real", [True, False], ids=["tmpfs", "injected"])
def test_a_full_disk_stops_the_sweep_and_loses_nothing(real: bool, spec_file: Path,
                                                       tmp_path: Path, monkeypatch):
    """Disk full on --out with the storage elsewhere failed every live trial for good (never
    retried, the budget used up), with torch's 'unexpected pos' naming no file, and left a
    .tmp file. Now: an error naming the folder and saying to free space and --resume, no
    .tmp file, the trials RUNNING; the resume ends as the uninterrupted sweep (dropout on)."""
    from hftc.errors import SweepFileError

    spec = hs.load_spec(spec_file).replace(sampler=_fixed_sampler)
    full = hs.run(spec, out=tmp_path / "full", storage=f"sqlite:///{tmp_path / 'full.db'}",
                  study_name="faults", progress=False).study.trials
    url = f"sqlite:///{tmp_path / 'cut.db'}"
    out = tmp_path / "disk" / "out"
    disk = _FullDisk(out.parent, monkeypatch, real)
    try:
        def fill_after_round_2(sweep):
            if sweep.round == 2:
                disk.fill()

        cut = hs.Sweep(spec, out=out, storage=url, study_name="faults", progress=False,
                       on_round=fill_after_round_2)
        with pytest.raises(SweepFileError, match=rf"no space left on the device of {out}/"
                                                 rf"workers/.*free space.*--resume"):
            cut.run()
        assert not list(out.rglob("*.tmp"))
        study = optuna.load_study(study_name="faults", storage=url)
        states = {t.number: t.state for t in study.trials}
        assert TrialState.FAIL not in states.values(), states
        assert list(states.values()).count(TrialState.RUNNING) == 2, states
        disk.free()
        resumed = hs.run(spec, out=out, storage=url, study_name="faults", progress=False,
                         resume=True)
        assert _outcome(resumed.study.trials) == _outcome(full)
    finally:
        disk.close()


def _cut_after_round_1(spec, out: Path) -> Path:
    """A sweep interrupted after its second round, as if killed: its worker folder."""
    def interrupt(sweep):
        if sweep.round == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hs.Sweep(spec, out=out, progress=False, on_round=interrupt).run()
    (folder,) = (out / "workers").iterdir()
    return folder


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_checkpoint_is_named_and_its_trials_retried(damage: str, spec_file: Path,
                                                              tmp_path: Path,
                                                              uninterrupted: list[tuple]):
    """A truncated or empty checkpoint made every --resume crash with torch's error, naming
    no file, and without --resume hftc said to use --resume: stuck until files were
    deleted by hand. Now --resume warns, naming the file; the trials in it are failed and
    retried from epoch 0 with their parameters and seeds; the completed ones are kept."""
    from hftc.errors import SweepWarning

    out = tmp_path / "out"
    folder = _cut_after_round_1(hs.load_spec(spec_file), out)
    (ckpt,) = folder.glob("array-*.pt")
    data = ckpt.read_bytes()
    ckpt.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"")
    with pytest.warns(SweepWarning, match=rf"the checkpoint {ckpt} cannot be read.*retried "
                                          rf"from epoch 0"):
        trials = hs.run(spec_file, out=out, progress=False, resume=True).study.trials
    by_number = {t.number: t for t in trials}
    assert _outcome([by_number[0]]) == uninterrupted[:1]  # pruned before the kill: kept
    for lost in (1, 2):  # in the damaged checkpoint
        assert by_number[lost].state == TrialState.FAIL
        (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == lost]
        assert retry.state == TrialState.COMPLETE and retry.params == by_number[lost].params
        assert retry.user_attrs["hftc_seed"] == by_number[lost].user_attrs["hftc_seed"]
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    assert len(finished) == 4


def test_a_damaged_manifest_is_named_and_its_trials_retried(spec_file: Path, tmp_path: Path,
                                                            uninterrupted: list[tuple]):
    """A corrupt manifest.json was taken for none: --resume restarted its trials from epoch
    0 under their own numbers without a word, over the epochs they had reported. Now it
    is named, and its trials are failed and retried; the completed ones are kept."""
    from hftc.errors import SweepWarning

    out = tmp_path / "out"
    folder = _cut_after_round_1(hs.load_spec(spec_file), out)
    manifest = folder / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    with pytest.warns(SweepWarning, match=rf"{manifest} is damaged.*retried from epoch 0"):
        trials = hs.run(spec_file, out=out, progress=False, resume=True).study.trials
    by_number = {t.number: t for t in trials}
    assert _outcome([by_number[0]]) == uninterrupted[:1]
    for lost in (1, 2):  # they had reported epochs: not restarted over them
        assert by_number[lost].state == TrialState.FAIL
        (retry,) = [t for t in trials if t.system_attrs.get("failed_trial") == lost]
        assert retry.state == TrialState.COMPLETE and retry.params == by_number[lost].params
    assert len([t for t in trials if t.state != TrialState.FAIL]) == 4

