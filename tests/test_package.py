"""The package as a whole: what `import hftc` costs and pulls in."""

import subprocess
import sys


def _modules_after_import_hftc() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, hftc; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_hftc_leaves_torch_dynamo_and_optional_integrations_unimported():
    modules = _modules_after_import_hftc()
    assert "hftc" in modules and "hftc.fused" in modules
    heavy = {"torch._dynamo", "networkx", "optuna", "matplotlib", "ray", "transformers", "lightning"}
    assert not heavy & modules, f"import hftc imported {sorted(heavy & modules)}"


def test_fuse_and_torch_compile_still_work_after_the_lazy_dynamo_import():
    # hftc.compile_guard.run_eagerly keeps hftc's own Python out of a compiled caller's
    # graph once torch._dynamo is in use, as @torch.compiler.disable did.
    code = """
import sys, torch, hftc
models = [torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()) for _ in range(2)]
fused = hftc.fuse(models)
x = torch.randn(5, 4)
eager = fused(x)
compiled = torch.compile(fused, backend='eager')
torch.testing.assert_close(compiled(x), eager)
assert hftc.fuse([torch.compile(m) for m in models]).num_models == 2
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
