"""docs/COVERAGE.md is generated from the rule registry and the tests: it must be current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_coverage_page_is_up_to_date():
    spec = importlib.util.spec_from_file_location("hftc_coverage", ROOT / "scripts" / "coverage.py")
    coverage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(coverage)
    assert coverage.DOC.read_text() == coverage.render(), (
        "docs/COVERAGE.md is stale: run `python scripts/coverage.py` and commit it")
