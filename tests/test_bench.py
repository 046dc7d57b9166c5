"""The benchmark suite's machinery (hftc/bench/): correctness and output structure, no timings.

* the hand-fused references compute what the N stock models compute;
* every in-process contender trains the same N models: after one step their
  parameters agree with the serial contender's (torch.func: model 0, whose
  learning rate it shares; Adam's first step is nearly lr * sign(grad), so a
  gradient that rounds differently near 0 moves a weight by up to ~lr * 1e-2);
* a tiny suite (MLP, N in {1, 2}, 2 rounds, a largest-N search with a small
  limit) runs end to end in worker processes and writes the documented JSON,
  markdown tables and plots.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import time
from pathlib import Path

import pytest
import torch

from hftc.bench import report, runner, zoo
from hftc.bench.contenders import CONTENDERS, build_step, make_models
from hftc.bench.handfused import HAND_FUSED, hand_fuse
from hftc.bench.suite import SuiteConfig, run_suite
from hftc.bench.workloads import WORKLOADS


def _prediction(out):
    return out[0] if isinstance(out, tuple) else out


# (parameters, buffer elements, parameter tensors) of the models docs/BENCHMARKS.md was
# measured on; the zoo (hftc/bench/zoo.py) is shared with the tests, whose sizes must not leak.
MEASURED_MODELS = {
    "mlp": (26_122, 0, 6),
    "lenet5": (61_706, 0, 10),
    "pointnet": (1_614_129, 7_946, 44),
    "resnet18": (11_173_962, 9_620, 62),
    "mobilenet_v2": (2_236_682, 34_164, 158),
    "transformer": (534_026, 0, 28),
    "transformer_stock": (534_026, 0, 28),
    "convnext": (413_418, 0, 70),
    "efficientnet": (257_290, 6_521, 109),
    "style_transfer": (276_675, 0, 46),
    "lstm_lm": (1_445_200, 0, 11),
    "gpt": (413_312, 0, 28),
}


def test_workload_models_are_the_measured_ones():
    assert set(MEASURED_MODELS) == set(WORKLOADS)
    for name, expected in MEASURED_MODELS.items():
        model = WORKLOADS[name].factory()
        params = list(model.parameters())
        found = (sum(p.numel() for p in params), sum(b.numel() for b in model.buffers()),
                 len(params))
        assert found == expected, name


@pytest.mark.parametrize("name", sorted(HAND_FUSED))
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_hand_fused_equals_stock_models(name, mode):
    w = WORKLOADS[name]
    models = make_models(w, 3)
    for m in models:
        getattr(m, mode)()
        for sub in m.modules():  # dropout masks cannot be compared; everything else can
            if isinstance(sub, torch.nn.Dropout):
                sub.p = 0.0
    x, _ = w.inputs()
    x = x[:4]
    fused = hand_fuse(name, copy.deepcopy(models))
    for sub in [fused, *fused.modules()]:
        if isinstance(getattr(sub, "p", None), float):
            sub.p = 0.0
    got = _prediction(fused(x))
    want = torch.stack([_prediction(m(x)) for m in models])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["mlp", "lenet5"])
def test_contenders_train_the_same_models(name):
    steps = {c: build_step(c, name, 3)
             for c in ("serial", "hand-fused", "hftc", "hftc+step", "torch.func", "hftc+ckpt",
                       "hftc+defaults")}
    for s in steps.values():
        s.fn()
    want = steps["serial"].parameters()
    for c, s in steps.items():
        got = s.parameters()
        assert set(got) == set(want), c
        for k in want:
            rows = slice(0, 1) if c == "torch.func" else slice(None)
            torch.testing.assert_close(got[k][rows], want[k][rows], rtol=1e-3, atol=2e-5,
                                       msg=lambda m, c=c, k=k: f"{c} {k}: {m}")


def test_the_default_options_contender_warms_up_until_its_strategy_is_chosen(tmp_path,
                                                                           monkeypatch):
    # hftc+defaults is hftc.fuse(models) with no options: its first calls alternate the
    # fused program and the models one by one; the runner warms up while choosing() holds,
    # so the timed rounds measure the way chosen, and records which.
    monkeypatch.setenv("HFTC_STRATEGY", "timed")
    monkeypatch.setenv("HFTC_CACHE_DIR", str(tmp_path))  # timed here, not found cached
    step = build_step("hftc+defaults", "mlp", 2)
    step.fn()
    assert step.choosing()
    calls = 1
    while step.choosing() and calls < runner._MAX_CHOOSING_STEPS:
        step.fn()
        calls += 1
    assert not step.choosing() and calls < runner._MAX_CHOOSING_STEPS
    strategy = step.settled_info()["strategy"]
    assert strategy.startswith(("runs the fused program", "runs the models one by one"))
    assert "timing the first calls" not in strategy


# The models users train (issue 29) at toy sizes, with stochastic depth and dropout at
# p = 0: random draws cannot be compared between contenders, everything else can.
REAL_MODEL_WORKLOADS = {
    "convnext": dict(factory=functools.partial(
        zoo.ConvNeXt, ((8, 1), (16, 2)), stochastic_depth_prob=0.0), input_shape=(3, 16, 16),
        batch=4),
    "efficientnet": dict(factory=functools.partial(
        zoo.EfficientNet, ((1, 3, 1, 8, 8, 1), (4, 5, 2, 8, 16, 2)), stochastic_depth_prob=0.0,
        dropout=0.0, last_channel=32), input_shape=(3, 16, 16), batch=4),
    "style_transfer": dict(factory=functools.partial(zoo.TransformerNet, (4, 8, 8), 1),
                           input_shape=(3, 16, 16), batch=2),
    "lstm_lm": dict(factory=functools.partial(zoo.RNNModel, ntoken=23, ninp=8, nhid=8,
                                              dropout=0.0),
                    input_shape=(6,), batch=3, num_classes=23),
    "gpt": dict(factory=functools.partial(zoo.GPT, vocab_size=17, block_size=8, n_layer=2,
                                          n_head=2, n_embd=8),
                input_shape=(8,), batch=2, num_classes=17),
}


def test_real_model_workloads_on_a_gpu_are_the_real_models():
    """The ``gpu`` sizes build the models the issue names, parameter for parameter:
    torchvision's convnext_tiny and efficientnet_b0 (1000 classes), fast_neural_style's
    TransformerNet."""
    expected = {"convnext": 28_589_128, "efficientnet": 5_288_548, "style_transfer": 1_679_235}
    for name, count in expected.items():
        model = WORKLOADS[name].on("cuda").factory()
        assert sum(p.numel() for p in model.parameters()) == count, name


def _two_steps(w, contender: str, dtype: torch.dtype) -> tuple[dict, dict, list[str]]:
    """The N = 3 models' stacked parameters before and after two steps of ``contender``
    in ``dtype``, and its fallbacks."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        step = build_step(contender, w, 3)
        before = step.parameters()
        for _ in range(2):
            step.fn()
    finally:
        torch.set_default_dtype(default)
    return before, step.parameters(), step.info.get("fallbacks", [])


@pytest.mark.parametrize("name", sorted(REAL_MODEL_WORKLOADS))
def test_real_model_workloads_train_like_the_serial_loop(name):
    """The bench's hftc contender (hftc.fuse, hftc.optim.Adam with per-model learning
    rates, per_model of the workload's own loss) takes two steps that leave each model's
    weights where N stock models with N stock Adams leave them: in float64 every weight;
    in float32 the weights whose gradient is not zero.  A bias right before a
    normalisation that removes it (a conv bias before InstanceNorm, an MBConv's last
    BatchNorm bias feeding only 1x1 convs + BatchNorm) has a zero gradient, computed as
    rounding noise that Adam scales to +-lr in float32 (to ~1e-12 in float64): those
    elements are the ones the float64 serial loop moved by less than 1e-8."""
    w = dataclasses.replace(WORKLOADS[name], **REAL_MODEL_WORKLOADS[name])
    before, want, _ = _two_steps(w, "serial", torch.float64)
    _, got, _ = _two_steps(w, "hftc", torch.float64)
    assert set(got) == set(want)
    trained = {}
    for k in want:
        assert got[k].dtype == torch.float64, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-7, atol=1e-9,
                                   msg=lambda m, k=k: f"float64 {k}: {m}")
        trained[k] = (want[k] - before[k]).abs() > 1e-8
    assert sum(int(t.sum()) for t in trained.values()) > 0.5 * sum(
        t.numel() for t in trained.values()), "most weights must train"

    _, want, _ = _two_steps(w, "serial", torch.float32)
    _, got, fallbacks = _two_steps(w, "hftc", torch.float32)
    for k in want:
        assert got[k].dtype == torch.float32, k
        torch.testing.assert_close(got[k][trained[k]], want[k][trained[k]], rtol=1e-3,
                                   atol=2e-5, msg=lambda m, k=k: f"float32 {k}: {m}")
    # hftc has no rule for stochastic depth yet (run model by model); everything else fuses.
    assert all(f.startswith("stochastic_depth") for f in fallbacks), fallbacks


def test_tiny_suite_end_to_end(tmp_path):
    contenders = [c for c in CONTENDERS if c != "hftc+compile"]
    cfg = SuiteConfig(workloads=["mlp"], sizes={"mlp": [1, 2]}, contenders=contenders,
                      rounds={"mlp": 2}, min_sample_s=0.0, name="smoke")
    out = tmp_path / "smoke.json"
    lines = []
    result = run_suite(cfg, out=out, log=lines.append)
    assert json.loads(out.read_text())["config"]["name"] == "smoke"
    assert result["commands"] and "Activation checkpointing" in report.markdown(result)

    assert result["threads"] == 1 and result["peak_gflops"]
    assert all(g > 0 for g in result["peak_gflops"])
    entry = result["workloads"]["mlp"]
    assert entry["batch"] == 64 and entry["flops_per_model_step"] > 0
    assert [c["n"] for c in entry["configs"]] == [1, 2]
    # concurrent-mps is a GPU's contender: asked for on the CPU, it is left out.
    ran = [c for c in contenders if c != "concurrent-mps"]
    assert result["contenders"] == ran
    for cfg_result in entry["configs"]:
        assert list(cfg_result["contenders"]) == ran
        for name, run in cfg_result["contenders"].items():
            assert run["error"] is None, (name, run["error"])
            assert len(run["step_s"]) == 2 and all(t > 0 for t in run["step_s"])
            assert run["steps_per_sample"] >= 1
            assert run["peak_mib"] is not None and run["peak_mib"] >= 0
    info = result["workloads"]["mlp"]["configs"][1]["contenders"]["hftc"]["info"]
    assert info["fallbacks"] == []
    # autotune picked one of each linear's lowerings (MLP: a shared first layer, then two
    # batched ones) ...
    assert info["lowerings"]["linear"] in ("baddbmm", "gemm", "loop")
    assert {info["lowerings"][k] for k in ("linear_1", "linear_2")} <= {
        "baddbmm", "baddbmm_t", "baddbmm_autograd", "einsum", "loop"}
    # ... and the step's phases were timed and its self time split three ways.
    phases = info["phases"]
    assert all(phases[k] > 0 for k in ("forward_loss_s", "backward_s", "optimizer_s"))
    fractions = [phases[k] for k in ("gemm_fraction", "optimizer_fraction", "other_fraction")]
    assert all(0 <= f <= 1 for f in fractions) and sum(fractions) == pytest.approx(1.0)

    text = report.markdown(result)
    for heading in ("### Targets", "### mlp", "Peak memory", "Efficiency",
                    "Where hftc's step goes", "Lowerings autotune chose"):
        assert heading in text
    assert report.ratio(result, "mlp", 2, "hftc", "serial") > 0
    paths = report.plot(result, tmp_path)
    assert [p.name for p in paths] == ["bench_throughput.png", "bench_memory.png"]
    assert all(p.stat().st_size > 1000 for p in paths)

    doc = tmp_path / "BENCHMARKS.md"
    doc.write_text(f"# prose\n\n{report.BEGIN}\nstale tables\n{report.END}\n\nmore prose\n")
    report.update_docs(doc, text)
    body = doc.read_text()
    assert "stale tables" not in body and "### mlp" in body and body.endswith("more prose\n")


def test_paired_ratios_pair_each_round():
    # serial / hftc round by round: 2/1, 3/2, 1/2 -> median 1.5, range 0.5-2.
    runs = {"serial": {"step_s": [2.0, 3.0, 1.0]}, "hftc": {"step_s": [1.0, 2.0, 2.0]}}
    result = {"workloads": {"mlp": {"configs": [{"n": 4, "contenders": runs}]}}}
    assert report.paired_ratios(result, "mlp", 4, "hftc", "serial") == (1.5, 0.5, 2.0)
    assert report.ratio(result, "mlp", 4, "hftc", "serial") == 1.0  # medians 2 and 2
    assert report.paired_ratios(result, "mlp", 8, "hftc", "serial") is None
    assert "1.50x [0.50-2.00]" in "\n".join(report._speedup_table(
        {**result, "contenders": ["serial", "hftc"]}))


def _one_config(serial: list[float], hftc: list[float]) -> dict:
    runs = {"serial": {"step_s": serial}, "hftc": {"step_s": hftc}}
    return {"workloads": {"mlp": {"configs": [{"n": 2, "contenders": runs}]}}}


def test_the_issue_29_targets_read_the_default_options_where_the_run_has_them():
    # convnext N=4 with both: its row is hftc+defaults'; the every-N row comes for both.
    runs = {"serial": {"step_s": [2.0, 2.0, 2.0]}, "hftc": {"step_s": [1.0, 1.0, 1.0]},
            "hftc+defaults": {"step_s": [4.0, 4.0, 4.0]}}
    result = {"config": {}, "workloads": {"convnext": {"configs": [{"n": 4, "contenders": runs}]}}}
    rows = report._targets_table(result)
    assert "| convnext N=4: hftc+defaults >= 1.2x serial | 0.50x |" in "\n".join(rows)
    assert any(r.startswith("| every workload, every N >= 2: hftc >= 1.0x serial | lowest "
                            "2.00x") for r in rows)
    assert any(r.startswith("| every workload, every N >= 2: hftc+defaults >= 1.0x serial | "
                            "lowest 0.50x") for r in rows)


def test_the_ratio_interval_separates_noise_from_a_clear_result():
    # Every round 2x faster: every resample's ratio is 2, the interval is [2, 2].
    clear = _one_config([2.0, 4.0, 3.0, 5.0], [1.0, 2.0, 1.5, 2.5])
    assert report.ratio_interval(clear, "mlp", 2, "hftc", "serial") == (2.0, 2.0)
    assert report._verdict(2.0, (2.0, 2.0), 1.0) == "yes"
    # Rounds on both sides of 1.0: the interval holds the ratio of medians and spans 1.0.
    noisy = _one_config([1.0, 1.2, 0.9, 1.1, 1.0, 0.95], [1.1, 1.0, 1.0, 1.2, 0.9, 1.05])
    got = report.ratio(noisy, "mlp", 2, "hftc", "serial")
    low, high = report.ratio_interval(noisy, "mlp", 2, "hftc", "serial")
    assert low < 1.0 < high and low <= got <= high
    assert report._verdict(got, (low, high), 1.0) == "**no** (within noise)"
    # Fixed seed: the same rounds give the same interval.
    assert report.ratio_interval(noisy, "mlp", 2, "hftc", "serial") == (low, high)
    # Clearly below: no "within noise".
    assert report._verdict(0.9, (0.85, 0.95), 1.0) == "**no**"
    # One round has no spread to resample.
    assert report.ratio_interval(_one_config([1.0], [1.0]), "mlp", 2, "hftc", "serial") is None
    table = "\n".join(report._targets_table({**noisy, "config": {"device": "cpu"}}))
    assert f"lowest {got:.2f}x (mlp N=2) | {low:.2f}-{high:.2f}x | **no** (within noise)" in table


def test_largest_n_search_and_memory_cap():
    found = runner.largest_n("mlp", "hftc", cap_mib=4096, limit=4, log=lambda *_: None)
    assert found["largest_n"] == 4
    assert [p["n"] for p in found["probes"]] == [1, 2, 4]
    # A cap no process can meet: the search says so instead of failing.
    found = runner.largest_n("mlp", "hftc", cap_mib=0.001, limit=4, log=lambda *_: None)
    assert found["largest_n"] == 0 and found["probes"][0]["fits"] is False


def test_largest_n_search_is_bounded_in_time(monkeypatch):
    """With ``budget_s`` the search stops probing once it is spent, keeps the largest N
    seen to fit and says it is not exact; every probe is reported as it ends (the suite
    saves the JSON then), and each probe's worker gets only the time left."""
    timeouts = []

    def fake_fits(workload, contender, n, cap_mib, threads, adam, setting, timeout_s):
        timeouts.append(timeout_s)
        time.sleep(0.2)
        return n <= 5, float(n), ""

    monkeypatch.setattr(runner, "fits", fake_fits)
    seen = []
    found = runner.largest_n("pointnet", "hftc+ckpt", 1.0, budget_s=0.5, on_probe=seen.append,
                             log=lambda *_: None)
    assert 2 <= len(found["probes"]) <= 3 and found["exact"] is False
    assert found["largest_n"] == max(p["n"] for p in found["probes"])
    assert [s["largest_n"] for s in seen] == [p["n"] for p in found["probes"]]
    assert all(t <= 0.5 for t in timeouts)
    found = runner.largest_n("pointnet", "hftc", 1.0, budget_s=60, log=lambda *_: None)
    assert found["largest_n"] == 5 and found["exact"] and found["smallest_failing"] == 6
    assert [p["n"] for p in found["probes"]] == [1, 2, 4, 8, 6, 5]


def test_a_failing_contender_is_reported_not_raised():
    runs = runner.run_config("transformer_stock", 1, ["hand-fused", "serial"], rounds=1,
                             min_sample_s=0.0, log=lambda *_: None)
    assert "no hand-fused version" in runs["hand-fused"].error
    assert runs["serial"].error is None and len(runs["serial"].step_s) == 1


# --------------------------------------------------------------------------- device, precision


class _MatmulDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype of every matrix product / convolution the step runs."""

    OPS = ("mm", "bmm", "addmm", "baddbmm", "convolution")

    def __init__(self):
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            self.dtypes.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("contender", ["serial", "torch.func", "hand-fused", "hftc"])
def test_precision_runs_the_products_in_that_dtype(contender, precision, dtype):
    """bf16: AMP (matrix products in bfloat16, parameters and optimizer in fp32)."""
    from hftc.bench.contenders import Setting

    step = build_step(contender, "mlp", 2, setting=Setting("cpu", precision))
    with _MatmulDtypes() as seen:
        step.fn()
    assert seen.dtypes == {dtype}, (contender, seen.dtypes)
    params = step.parameters()
    assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params.values())


def test_bf16_contenders_train_like_serial():
    """Under bf16 autocast the fused contenders take serial's step up to bf16 rounding:
    Adam's first step is about lr * sign(grad), so a gradient whose sign bf16 rounding
    flips moves a weight by 2 * lr; all but a few weights agree to fp32 precision."""
    from hftc.bench.contenders import Setting

    setting = Setting("cpu", "bf16")
    steps = {c: build_step(c, "mlp", 3, setting=setting) for c in ("serial", "hftc",
                                                                    "hand-fused")}
    before = steps["serial"].parameters()
    for s in steps.values():
        s.fn()
    want = steps["serial"].parameters()
    for c, s in steps.items():
        got = s.parameters()
        for k in want:
            moved = (want[k] - before[k]).abs() > 0
            assert moved.float().mean() > 0.5, (c, k)  # the step did happen
            close = torch.isclose(got[k], want[k], rtol=1e-4, atol=1e-6)
            assert close.float().mean() > 0.97, (c, k, close.float().mean())


def test_workloads_on_a_gpu_take_their_full_sizes():
    pointnet = WORKLOADS["pointnet"]
    assert pointnet.on("cpu") is pointnet
    full = pointnet.on("cuda")
    assert full.input_shape == (3, 1024) and full.batch == 32 and full.gpu == {}
    assert WORKLOADS["mlp"].on("cuda") is WORKLOADS["mlp"]  # no overrides: the same


def test_bf16_suite_end_to_end(tmp_path):
    cfg = SuiteConfig(workloads=["mlp"], sizes={"mlp": [2]}, contenders=["serial", "hftc"],
                      rounds={"mlp": 1}, min_sample_s=0.0, precision="bf16", name="smoke-bf16")
    result = run_suite(cfg, log=lambda *_: None)
    runs = result["workloads"]["mlp"]["configs"][0]["contenders"]
    assert all(r["error"] is None and r["step_s"] for r in runs.values())
    text = report.markdown(result)
    assert "device `cpu`, bf16 (forward and loss under `torch.autocast(bfloat16)`)" in text
    assert "Peak bf16 matmul (512^3" in text


def test_bench_cli_names_each_kind_of_run_and_refuses_a_missing_gpu():
    from hftc.__main__ import build_parser
    from hftc.bench.cli import config_from_args, docs_block

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["bench", *argv]))

    assert (cfg().name, docs_block(cfg())) == ("full", "")
    both = cfg("--quick", "--precision", "bf16", "--adam", "fused")
    assert (both.name, docs_block(both)) == ("quick-bf16-adam-fused", "bf16-adam-fused")
    assert both.cores == 1 and both.threads == 1  # the CPU: one pinned core each
    # The whole 2-core machine is its own block, beside the one-core default.
    assert docs_block(cfg("--cores", "2")) == "cores-2"
    assert docs_block(cfg("--cores", "0", "--threads", "2")) == "cores-all-threads-2"
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no such device"):
            cfg("--device", "cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_suite_end_to_end(tmp_path):
    from hftc.bench.suite import default_contenders

    contenders = [c for c in default_contenders("cuda") if c != "hftc+compile"] + ["hftc+ckpt"]
    cfg = SuiteConfig(workloads=["mlp"], sizes={"mlp": [1, 2]}, contenders=contenders,
                      rounds={"mlp": 2}, min_sample_s=0.0, device="cuda", cores=0,
                      name="smoke-cuda")
    result = run_suite(cfg, log=lambda *_: None)
    assert result["machine"]["gpu"]["name"]
    for cfg_result in result["workloads"]["mlp"]["configs"]:
        for name, run in cfg_result["contenders"].items():
            assert run["error"] is None and run["step_s"], (name, run["error"])
            assert run["peak_mib"] > 0  # device memory
    text = report.markdown(result)
    assert "device `cuda`" in text and "Peak device memory" in text
    assert "Activation checkpointing" in text and f"CUDA {torch.version.cuda}" in text


def _fake_mps_control(tmp_path, exit_code: int):
    """An ``nvidia-cuda-mps-control`` stand-in that logs how it was called."""
    log = tmp_path / "mps.log"
    script = tmp_path / "bin" / "nvidia-cuda-mps-control"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\n"
                      f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {log}\n'
                      f"exit {exit_code}\n")
    script.chmod(0o755)
    return script.parent, log


def test_mps_daemon_is_started_in_a_private_pipe_directory_and_stopped(tmp_path, monkeypatch):
    from hftc.bench.suite import mps_daemon

    bin_dir, log = _fake_mps_control(tmp_path, 0)
    monkeypatch.setenv("PATH", f"{bin_dir}:{runner.os.environ['PATH']}")
    with mps_daemon(log=lambda *_: None) as root:
        assert root is not None
        pipe = runner.MPS_ENV["CUDA_MPS_PIPE_DIRECTORY"]
        assert pipe.startswith(root) and Path(pipe).is_dir()
        # concurrent-mps's N processes get the daemon's directories; concurrent's do not
        specs = []

        class Recorder:
            def __init__(self, spec):
                specs.append(spec)

            def wait_ready(self):
                return {"build_s": 0.0, "first_step_s": 0.0, "warm_s": [], "info": {}}

        monkeypatch.setattr(runner, "Worker", Recorder)
        for name in ("concurrent-mps", "concurrent"):
            runner.Contender(name, "mlp", 2, threads=1, warmup=0)
        assert [s["env"] for s in specs] == [dict(runner.MPS_ENV)] * 2 + [{}] * 2
        assert all(s["contender"] == "serial" for s in specs)
    started, stopped = log.read_text().splitlines()
    assert started.startswith(f"args=-d pipe={pipe}")
    assert stopped == f"args= pipe={pipe} stdin=quit"
    assert runner.MPS_ENV == {} and not Path(root).exists()


def test_mps_daemon_that_does_not_start_leaves_concurrent_mps_out(tmp_path, monkeypatch):
    from hftc.bench.suite import mps_daemon

    bin_dir, _ = _fake_mps_control(tmp_path, 1)
    monkeypatch.setenv("PATH", f"{bin_dir}:{runner.os.environ['PATH']}")
    lines = []
    with mps_daemon(log=lines.append) as root:
        assert root is None and runner.MPS_ENV == {}
    assert "did not start" in lines[0]
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with mps_daemon(log=lines.append) as root:
        assert root is None
    assert "not found" in lines[1]


def _fake_result(device: str, workload: str, n: int, step_s: list[float]) -> dict:
    runs = {c: {"step_s": step_s, "peak_mib": 1.0, "runtime_mib": 0.0, "error": None,
                "build_s": 0.1, "first_step_s": 0.1, "info": {}} for c in ("serial", "hftc")}
    return {"config": {"name": "part", "device": device, "precision": "fp32", "adam": "default"},
            "machine": {"cpu": "x", "cores": 1, "memory_gib": 1, "python": "3", "torch": "t",
                        "git_commit": "c", "gpu": None},
            "threads": 1, "cpus": [], "started": "s", "load_start": [0.0], "load_end": [0.0],
            "peak_gflops": [10.0], "max_n": [], "wall_s": 60.0,
            "workloads": {workload: {"batch": 8, "note": "", "flops_per_model_step": 1e9,
                                     "peak_gflops": [10.0],
                                     "configs": [{"n": n, "contenders": runs}]}}}


def test_runs_of_one_kind_merge_into_one_report(tmp_path):
    """A GPU suite run workload by workload (each call within a time limit) is reported as
    one run, with the card, its driver, torch's version and every part's command; runs of
    different kinds are not mixed."""
    parts = [_fake_result("cuda", "mlp", 4, [1.0]), _fake_result("cuda", "lenet5", 2, [2.0])]
    for k, part in enumerate(parts):
        part["machine"]["gpu"] = {"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2,
                                  "cuda": "13.0", "driver": "580.159.04", "cudnn": 91300}
        part["commands"] = [f"python -m hftc bench --device cuda --out part{k}.json"]
        part["max_n"] = [{"workload": "pointnet", "contender": "hftc+ckpt", "cap_mib": 81000.0,
                          "largest_n": 96 + k, "probes": [{"n": 64, "fits": True,
                                                           "peak_mib": 40000.0}],
                          "budget_s": 150.0, "exact": False, "smallest_failing": 128}]
    paths = []
    for k, part in enumerate(parts):
        paths.append(tmp_path / f"part{k}.json")
        paths[-1].write_text(json.dumps(part))
    merged = report.merge(parts)
    assert list(merged["workloads"]) == ["mlp", "lenet5"]
    assert merged["wall_s"] == 120.0 and merged["peak_gflops"] == [10.0, 10.0]
    doc = tmp_path / "B.md"
    assert report.main([str(p) for p in paths] + ["--docs", str(doc), "--block", "cuda"]) == 0
    body = doc.read_text()
    assert "<!-- bench:cuda:begin -->" in body and "### mlp" in body and "### lenet5" in body
    assert ("**NVIDIA H100 80GB HBM3** (79 GiB, CUDA 13.0, driver 580.159.04, cuDNN 91300)"
            in body and "torch t" in body)
    assert ("python -m hftc bench --device cuda --out part0.json\n"
            "python -m hftc bench --device cuda --out part1.json\n```") in body
    assert ("| pointnet | hftc+ckpt | 81000 | **96** (at least; the 150 s budget ran out, "
            "below 128) | 64: ok 40000 |") in body
    with pytest.raises(ValueError, match="different kinds"):
        report.merge([parts[0], _fake_result("cpu", "lenet5", 2, [2.0])])


def test_a_round_warms_every_worker_before_the_clock_starts(monkeypatch):
    # On a GPU a worker re-warms its allocator with an untimed step before each sample;
    # the coordinator's clock must start only once every worker has done so.
    events = []

    class Recorder:
        def __init__(self, spec):
            self.name = spec.get("model_index")

        def wait_ready(self):
            return {"build_s": 0.0, "first_step_s": 0.0, "warm_s": [], "info": {}}

        def send(self, msg):
            events.append(("send", msg[0]))

        def _recv(self, timeout):
            return None

        def close(self):
            pass

    clock = iter(range(100))
    monkeypatch.setattr(runner, "Worker", Recorder)
    monkeypatch.setattr(runner.time, "perf_counter",
                        lambda: events.append(("clock", None)) or float(next(clock)))
    c = runner.Contender("concurrent", "mlp", 3, threads=1, warmup=0)
    c.time_round()
    assert events == [("send", "warm")] * 3 + [("clock", None)] + [("send", "run")] * 3 \
        + [("clock", None)]
    assert c.run.step_s == [1.0]


def test_workers_wait_passively_only_where_threads_outnumber_their_cores(monkeypatch):
    """Passive OpenMP waiting is for oversubscribed workers; a user's default otherwise."""
    from hftc.bench import runner

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    cores = len(os.sched_getaffinity(0))
    try:
        runner.set_cpus(1, 1)
        assert "OMP_WAIT_POLICY" not in os.environ
        runner.set_cpus(cores, cores)
        assert "OMP_WAIT_POLICY" not in os.environ
        runner.set_cpus(1, 2)
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    finally:
        runner.set_cpus(0)
