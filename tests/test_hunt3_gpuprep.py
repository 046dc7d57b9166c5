"""The GPU benchmark's preparation, on the CPU: scripts/gpu_bench.sh's merge and tests
part, hftc.bench.report's merge of parts (and of leases), the block each card's runs go
to, and the docs update that must not leave README and BENCHMARKS.md half-written."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hftc.bench import report
from hftc.errors import CommandLineError

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_bench.sh"
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _run(workload: str, ns: list[int], *, card: str | None = H200, started: str = "2026-12-01T10:00:00",
         precision: str = "fp32", step_s: float = 1.0, commit: str = "aaaaaaa",
         cut: bool = False) -> dict:
    """A results JSON as one part of scripts/gpu_bench.sh writes it (``cut``: as its time
    limit left it, saved after its last N: no end load, no wall time)."""
    runs = {c: {"step_s": [step_s * (2 if c == "serial" else 1)] * 3, "peak_mib": 10.0,
                "runtime_mib": 0.0, "error": None, "build_s": 0.1, "first_step_s": 0.1,
                "info": {}} for c in ("serial", "hftc")}
    gpu = card and {"name": card, "memory_gib": 140.0, "cuda": "13.0", "driver": "580",
                    "cudnn": 91900}
    result = {
        "config": {"name": "custom-cuda", "device": "cuda" if card else "cpu",
                   "precision": precision, "adam": "default", "cores": 0 if card else 1,
                   "threads": 1},
        "machine": {"cpu": "x", "cores": 16, "memory_gib": 126, "python": "3.12",
                    "torch": "2.11", "git_commit": commit, "gpu": gpu},
        "threads": 1, "cpus": [], "started": started, "load_start": [1.0, 1.0, 1.0],
        "commands": [f"python -m hftc bench --workloads {workload} --sizes "
                     f"{','.join(map(str, ns))}"],
        "peak_gflops": [50000.0], "max_n": [],
        "workloads": {workload: {"batch": 32, "note": "", "flops_per_model_step": 1e9,
                                 "peak_gflops": [50000.0],
                                 "configs": [{"n": n, "load": [], "contenders": copy.deepcopy(runs)}
                                             for n in ns]}}}
    if not cut:
        result.update(load_end=[1.0, 1.0, 1.0], wall_s=60.0)
    return result


def test_runs_on_two_cards_are_not_merged():
    # The merge command takes the folders of several leases: an H100's and an H200's runs
    # are two measurements, not one table (their peaks and steps were mixed in one block).
    with pytest.raises(ValueError, match="different kinds.*card"):
        report.merge([_run("mlp", [1, 2], card=H200), _run("lenet5", [1, 2], card=H100)])


def test_a_workload_two_runs_measured_keeps_each_n_from_the_later_run():
    # gpu_bench.sh's fp32-b measured PointNet at N = 1, 2, 8 (its limit cut N = 32), and
    # pointnet-32 reran N = 2, 8, 32 later. The merge's glob lists pointnet-32.json first;
    # one run's PointNet replaced the other's whole.
    fp32_b = _run("pointnet", [1, 2, 8], started="2026-12-01T10:00:00", step_s=1.0,
                  commit="old1234", cut=True)
    rerun = _run("pointnet", [2, 8, 32], started="2026-12-01T10:20:00", step_s=0.5,
                 commit="new5678")
    mlp = _run("mlp", [1, 2], started="2026-12-01T09:50:00")
    merged = report.merge([rerun, fp32_b, mlp])  # the glob's (alphabetical) order
    assert list(merged["workloads"]) == ["mlp", "pointnet"]  # in the order they ran
    configs = merged["workloads"]["pointnet"]["configs"]
    assert [c["n"] for c in configs] == [1, 2, 8, 32]
    steps = {c["n"]: c["contenders"]["hftc"]["step_s"][0] for c in configs}
    assert steps == {1: 1.0, 2: 0.5, 8: 0.5, 32: 0.5}
    assert merged["started"] == mlp["started"]
    assert merged["machine"]["git_commit"] == "aaaaaaa, old1234, new5678"
    assert merged["commands"] == mlp["commands"] + fp32_b["commands"] + rerun["commands"]
    text = report.markdown(merged)
    assert "hftc at `aaaaaaa, old1234, new5678`" in text
    # a largest-N part (no configurations) does not take the measured workload away
    search = _run("pointnet", [], started="2026-12-01T10:30:00")
    again = report.merge([fp32_b, rerun, search])
    assert [c["n"] for c in again["workloads"]["pointnet"]["configs"]] == [1, 2, 8, 32]


@pytest.mark.parametrize(("card", "precision", "block"), [
    (H100, "fp32", "cuda"), (H100, "bf16", "cuda-bf16"), (H200, "fp32", "cuda-h200"),
    (H200, "bf16", "cuda-h200-bf16"), ("NVIDIA A100-SXM4-40GB", "fp32", "cuda-a100"),
    ("NVIDIA GeForce RTX 4090", "fp32", "cuda-geforce-rtx-4090"), (None, "fp32", ""),
    (None, "bf16", "bf16")])
def test_each_card_has_its_own_block(card, precision, block):
    # docs/BENCHMARKS.md holds the H100's run (block cuda) and the H200's (cuda-h200):
    # the merge wrote every card's runs into cuda, over the H100's numbers.
    assert report.result_block(_run("mlp", [1], card=card, precision=precision)) == block


def test_the_bench_command_names_the_cards_block(tmp_path):
    from hftc.bench.cli import docs_block
    from hftc.bench.suite import SuiteConfig

    cfg = SuiteConfig(workloads=[], sizes={}, contenders=[], rounds={}, device="cuda",
                      cores=0, threads=1, precision="bf16")
    assert docs_block(cfg) == "cuda-bf16" and docs_block(cfg, H200) == "cuda-h200-bf16"


DOC = """# Benchmarks

## H200

<!-- bench:cuda-h200:begin -->
old H200 tables
<!-- bench:cuda-h200:end -->

## H100

<!-- bench:cuda:begin -->
the H100's tables
<!-- bench:cuda:end -->
"""


def _repo(tmp_path: Path, readme: str = "# hftc\n") -> Path:
    """A checkout to run scripts/gpu_bench.sh merge in: hftc and the script linked, its
    own docs/BENCHMARKS.md and README.md."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "BENCHMARKS.md").write_text(DOC)
    (repo / "README.md").write_text(readme)
    (repo / "hftc").symlink_to(ROOT / "hftc")
    (repo / "scripts").symlink_to(ROOT / "scripts")
    return repo


def _write(folder: Path, name: str, result: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(result))


def _merge(repo: Path, *folders: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", "scripts/gpu_bench.sh", "merge", *map(str, folders)],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)


def test_gpu_bench_merge_writes_the_cards_blocks_from_partial_parts(tmp_path):
    # An H200 lease: a part cut by its limit (no wall time, no end load), a largest-N
    # part, a bf16 part; one folder named that is not there.
    repo, out = _repo(tmp_path), tmp_path / "out"
    _write(out, "mlp", _run("mlp", [1, 2, 8], cut=True))
    search = _run("pointnet", [], started="2026-12-01T10:10:00")
    search["max_n"] = [{"workload": "pointnet", "contender": "hftc", "cap_mib": 143000.0,
                        "largest_n": 64, "probes": [{"n": 64, "fits": True, "peak_mib": 9e4}],
                        "budget_s": 160.0, "exact": False, "smallest_failing": None}]
    _write(out, "max-n-pointnet-hftc", search)
    _write(out, "bf16-mlp", _run("mlp", [1, 8], precision="bf16"))
    (out / "tests.log").write_text("226 passed")
    done = _merge(repo, out, tmp_path / "not-there")
    assert done.returncode == 1 and "merge: no folder" in done.stderr  # said, the rest merged
    body = (repo / "docs" / "BENCHMARKS.md").read_text()
    h200 = body.split("<!-- bench:cuda-h200:begin -->")[1].split("<!-- bench:cuda-h200:end")[0]
    assert "**NVIDIA H200**" in h200 and "### mlp" in h200 and "old H200" not in h200
    assert "| pointnet | hftc | 143000 | **64** (at least" in h200
    assert "<!-- bench:cuda:begin -->\nthe H100's tables\n<!-- bench:cuda:end -->" in body
    # the bf16 block: made, right after the H200's fp32 block, and in bf16
    after = body.split("<!-- bench:cuda-h200:end -->")[1]
    assert after.lstrip().startswith("<!-- bench:cuda-h200-bf16:begin -->")
    assert "device `cuda`, bf16" in after.split("<!-- bench:cuda-h200-bf16:end -->")[0]
    assert {p.name for p in (repo / "docs").glob("*.png")} == {
        f"bench_{b}_{k}.png" for b in ("cuda-h200", "cuda-h200-bf16")
        for k in ("throughput", "memory")}
    # an H100 part beside them: refused, and the exit status says so
    _write(out, "lenet5", _run("lenet5", [1, 2], card=H100))
    refused = _merge(repo, out)
    assert refused.returncode == 1 and "different kinds" in refused.stderr


def test_a_merge_that_would_lose_a_cited_figure_writes_nothing(tmp_path):
    # README cites the H200's MLP at N = 32; a lease that reran only LeNet-5, merged alone,
    # rewrote BENCHMARKS.md without it, wrote README's other figures, then raised
    # docs_numbers' FigureError as a traceback.
    readme = ("MLP: <!-- hftc:numbers name=cuda-h200/mlp/32/vs-serial -->old"
              "<!-- /hftc:numbers -->; LeNet-5: <!-- hftc:numbers name=cuda-h200/lenet5/2/"
              "vs-serial -->old<!-- /hftc:numbers -->\n")
    repo, out = _repo(tmp_path, readme), tmp_path / "out"
    docs = repo / "docs" / "BENCHMARKS.md"
    _write(out, "lenet5", _run("lenet5", [1, 2]))
    done = _merge(repo, out)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "'cuda-h200/mlp/32/vs-serial'" in done.stderr and "merge OLD_DIR NEW_DIR" in done.stderr
    assert docs.read_text() == DOC and (repo / "README.md").read_text() == readme
    assert not list((repo / "docs").glob("*.png"))
    with pytest.raises(CommandLineError, match="not updated"):
        report.update_docs(docs, "tables\n", "cuda-h200")
    # with the earlier lease's runs the figure is there: every page follows
    _write(tmp_path / "earlier", "mlp", _run("mlp", [32], started="2026-11-27T03:00:00"))
    assert _merge(repo, tmp_path / "earlier", out).returncode == 0
    assert (repo / "README.md").read_text() == readme.replace(">old<", ">2.00x<")
    assert "### lenet5" in docs.read_text() and "### mlp" in docs.read_text()


def test_the_tests_part_runs_without_pytest_xdist(tmp_path):
    # The tests part passed `-n 16` whatever the Python: without pytest-xdist (a CPU
    # try-out, DEVICE=cpu) pytest refused the argument and ran nothing.
    shim = tmp_path / "python"
    shim.write_text("#!/bin/sh\n"
                    'if [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then echo "pytest $*"; exit 0; fi\n'
                    'if [ "$1" = "-c" ] && [ "$2" = "import xdist" ]; then exit 1; fi\n'
                    f'exec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    env = dict(os.environ, PYTHON=str(shim), DEVICE="cpu", BUDGET_S="60")
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), "tests", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    args = (out / "tests.log").read_text().split()
    assert "-n" not in args
    # every test the part names is there (a node id pytest cannot find runs nothing)
    for arg in args:
        if "::" in arg:
            path, name = arg.split("::")
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), arg


def test_hftc_step_contender_fuses_a_model_that_reads_its_input_size():
    # nanoGPT asserts on the sequence length in Python: every hftc contender fuses it from
    # the batch (example_inputs), but hftc+step called hftc.fuse without it (TraceError).
    import torch

    from hftc.bench.contenders import build_step
    from hftc.bench.workloads import WORKLOADS, Workload
    from hftc.bench.zoo import GPT

    def tiny_gpt():
        return GPT(block_size=8, vocab_size=11, n_layer=1, n_head=2, n_embd=8)

    tiny = Workload("tiny_gpt", tiny_gpt, (8,), 2, 11, sizes=(2,), quick_sizes=(2,),
                    criterion=WORKLOADS["gpt"].criterion, batch_fn=WORKLOADS["gpt"].batch_fn,
                    example_inputs=True)
    step = build_step("hftc+step", tiny, 2)
    before = {k: v.clone() for k, v in step.parameters().items()}
    step.fn()
    assert any(not torch.equal(before[k], v) for k, v in step.parameters().items())


def test_a_probe_out_of_time_is_ended_at_once():
    # A largest-N probe still building when the search's budget ends did not read the
    # stop it was sent: its worker was waited for 10 s more, time the GPU part's search
    # does not have (the call's limit killed ResNet-18's search before it saved its end).
    import time

    from hftc.bench import runner

    runner.matmul_worker(1).close()  # the forkserver up, as in a suite
    t0 = time.perf_counter()
    ok, peak, why = runner.fits("resnet18", "hftc", 4, 4096, timeout_s=2)
    elapsed = time.perf_counter() - t0
    assert (ok, peak) == (False, None) and "no answer within 2 s" in why
    assert elapsed < 9, elapsed


def test_autotune_under_bf16_autocast_keeps_the_candidates_that_agree(tmp_path, monkeypatch):
    # The bf16 bench part fuses under torch.autocast(bfloat16), as a user's AMP loop does.
    # Autotune held every candidate's float32 weight gradient (computed through bf16) to
    # float32's 1e-4, so it rejected them all, N separate convs ('loop') included, each
    # with a warning: bf16 runs measured the cost model's guess, not the fastest lowering.
    import warnings

    import torch
    import torch.nn as nn

    import hftc
    from hftc.lowering import timing

    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing, "_MEMORY", {})
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Conv1d(3, 16, 1), nn.BatchNorm1d(16), nn.ReLU(),
                            nn.Conv1d(16, 32, 1), nn.ReLU()) for _ in range(3)]
    x = torch.randn(4, 3, 32)
    fused = hftc.fuse(models, autotune=True)
    with warnings.catch_warnings(record=True) as caught, \
            torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.simplefilter("always")
        out = fused(x)
        want = torch.stack([m(x) for m in models])
    assert not [str(w.message) for w in caught if "gave other outputs" in str(w.message)]
    choices = [c for c in fused.fusion_report.lowerings if c.kernel == "conv"]
    assert choices and all(not c.rejected and len(c.times) > 1 for c in choices), choices
    torch.testing.assert_close(out.float(), want.float(), rtol=5e-2, atol=5e-2)


def test_a_bench_cut_by_its_time_limit_stops_the_mps_daemon_it_started(tmp_path):
    # `timeout` ends a part's bench with SIGTERM: Python's default handler died without
    # the suite's clean-up, and the MPS daemon concurrent-mps had started kept serving the
    # GPU while the next part started its own.
    from test_bench import _fake_mps_control

    bin_dir, log = _fake_mps_control(tmp_path, 0)
    code = ("import time\n"
            "from hftc.bench.cli import exit_on_sigterm\n"
            "from hftc.bench.suite import mps_daemon\n"
            "exit_on_sigterm()\n"
            "with mps_daemon(log=print):\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(120)\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.terminate()
        assert proc.wait(60) == 128 + 15
    finally:
        proc.kill()
    started, stopped = log.read_text().splitlines()
    assert started.startswith("args=-d") and stopped.startswith("args= ") \
        and stopped.endswith("stdin=quit")


def test_a_run_ended_while_it_saves_keeps_its_last_whole_results(tmp_path, monkeypatch):
    # A part's time limit can end the bench while it writes its JSON (the suite saves after
    # every N): the file was left half-written, and the merge could not read it.
    from hftc.bench.suite import write_results

    out, real_write = tmp_path / "mlp.json", Path.write_text
    write_results(out, {"configs": [1]})

    def write_then_cut(self, text, *args, **kwargs):
        real_write(self, text[:len(text) // 2], *args, **kwargs)
        raise SystemExit(143)

    monkeypatch.setattr(Path, "write_text", write_then_cut)
    with pytest.raises(SystemExit):
        write_results(out, {"configs": [1, 2]})
    assert json.loads(out.read_text()) == {"configs": [1]}


def test_an_unreadable_part_is_named(tmp_path, capsys):
    # A JSON cut mid-write (by a limit, before saves were whole) stopped the merge with a
    # bare JSONDecodeError traceback that did not say which of the parts it was.
    good, cut = tmp_path / "mlp.json", tmp_path / "lenet5.json"
    good.write_text(json.dumps(_run("mlp", [1])))
    cut.write_text(json.dumps(_run("lenet5", [1]))[:200])
    assert report.main([str(good), str(cut)]) == 2
    assert f"{cut}: not a results JSON" in capsys.readouterr().err


def test_a_cpu_try_out_of_the_merge_goes_to_the_block_it_names(tmp_path):
    # DEVICE=cpu parts are CPU runs: their own block would be the CPU suite's main one,
    # whose figures README cites (so nothing is written); BLOCK names a block to try into.
    repo, out = _repo(tmp_path), tmp_path / "out"
    _write(out, "mlp", _run("mlp", [1, 2], card=None))
    _write(out, "bf16-mlp", _run("mlp", [1], card=None, precision="bf16"))
    env = dict(os.environ, PYTHON=sys.executable, BLOCK="try")
    done = subprocess.run(["bash", "scripts/gpu_bench.sh", "merge", str(out)], cwd=repo,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    body = (repo / "docs" / "BENCHMARKS.md").read_text()
    for block, precision in (("try", "fp32"), ("try-bf16", "bf16")):
        inside = body.split(f"<!-- bench:{block}:begin -->")[1].split("<!-- bench:")[0]
        assert f"device `cpu`, {precision}" in inside
    assert DOC.strip() in body
