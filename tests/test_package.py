"""The package as a whole: what `import hftc` costs and pulls in."""

import subprocess
import sys

import pytest


def _modules_after_import_hftc() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, torch, hftc; print('\\n'.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_hftc_leaves_torch_dynamo_and_optional_integrations_unimported():
    modules = _modules_after_import_hftc()
    assert "hftc" in modules and "hftc.module.fused" in modules
    heavy = {"torch._dynamo", "networkx", "optuna", "matplotlib", "ray", "transformers", "lightning"}
    assert not heavy & modules, f"import hftc imported {sorted(heavy & modules)}"


def test_fuse_and_torch_compile_still_work_after_the_lazy_dynamo_import():
    # hftc.lowering.compile_guard.run_eagerly keeps hftc's own Python out of a compiled caller's
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


def test_training_with_torch_optim_leaves_torch_dynamo_unimported_until_compiling():
    """torch's ``@torch._disable_dynamo`` guards (Optimizer.zero_grad / add_param_group /
    state_dict / load_state_dict, the meta kernels hftc's shape propagation runs, hftc's
    dispatch modes) import torch._dynamo on their first call
    in stock torch; with hftc they run as they are until torch._dynamo is imported, then
    they are torch's own again: a compiled caller graph-breaks at them, as in stock torch."""
    code = """
import sys, torch, hftc
models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
          for _ in range(3)]
fused = hftc.fuse(models)
opt = hftc.optim.fuse_optimizers(fused, [torch.optim.SGD(m.parameters(), lr=0.1)
                                         for m in models])
stock = torch.optim.Adam(models[0].parameters())
stock.load_state_dict(stock.state_dict())
x = torch.randn(5, 4, requires_grad=True)
for _ in range(2):
    opt.zero_grad()
    fused(x).sum().backward()
    opt.step()
stock.zero_grad()
assert 'torch._dynamo' not in sys.modules, 'imported torch._dynamo'
import torch._dynamo
fn = torch.optim.Optimizer.zero_grad.__wrapped__
assert getattr(fn, '__dynamo_disable', None) is None, 'still deferred after the import'
def step():
    stock.zero_grad()
    return models[0](x.detach()).sum()
torch.testing.assert_close(torch.compile(step, backend='eager')(), step())
assert fn.__dynamo_disable is not fn   # torch's own disabled function, made by torch
print('ok')
"""
    assert _run(code) == "ok"


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_hftc_without_torch_loads_no_torch():
    # The command line's help answers without torch (hftc/__init__.py's docstring).
    assert _run("import sys, hftc; print('torch' in sys.modules, hftc.__version__)") == \
        "False 0.1.0"


@pytest.mark.parametrize("imports", [
    "import torch, hftc",                    # the core loads at once
    "import hftc\nfrom torch.nn.utils import clip_grad_norm_",   # when torch is imported
    "import hftc\nfrom hftc import fuse",    # on first access, torch not yet imported
    "from hftc.module.fused import fuse\nimport hftc",  # once hftc.module.fused's own import is done
])
def test_torch_patches_are_in_place_whatever_the_import_order(imports):
    """A lazy ``import hftc`` must not let code bind torch's clip_grad_norm_ (one norm over
    all N models) or build a stock LBFGS on a fused module before hftc's patches are in."""
    code = imports + """
import torch
from torch.nn.utils import clip_grad_norm_
import hftc.utils
models = [torch.nn.Linear(3, 2) for _ in range(2)]
fused = hftc.fuse(models)
try:
    torch.optim.LBFGS(fused.parameters())
except hftc.errors.FusionArgumentError:
    refused = True
print(clip_grad_norm_ is hftc.utils._clip_grad_norm_per_model, refused,
      sorted(dir(hftc)) == sorted(hftc.__all__ + ["__version__"]))
"""
    assert _run(code) == "True True True"
