"""The optional integrations (hftc.hf, hftc.lightning) without their packages: importing
one raises MissingExtraError naming the extra to install, not a bare ImportError from
inside hftc. (``import hftc`` never imports them: tests/test_package.py.)"""

from __future__ import annotations

import importlib
import sys

import pytest

import hftc


@pytest.mark.parametrize("module, missing, extra", [
    ("hftc.hf", "transformers", "hf"),
    ("hftc.hf", "accelerate", "hf"),
    ("hftc.lightning", "lightning", "lightning"),
])
def test_a_missing_package_names_the_extra_to_install(monkeypatch, module, missing, extra):
    monkeypatch.setitem(sys.modules, missing, None)  # import of `missing` fails
    monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.delitem(sys.modules, hftc.OLD_NAMES[module], raising=False)  # its real name
    monkeypatch.delitem(sys.modules, f"{missing}.pytorch", raising=False)
    with pytest.raises(hftc.errors.MissingExtraError,
                       match=rf"{module} needs .*\({missing} is not installed\): "
                             rf"pip install 'hftc\[{extra}\]'") as caught:
        importlib.import_module(module)
    assert isinstance(caught.value, ImportError)
