"""The make_run fixture: a synthetic run directory (run_records.py) in the test's tmp_path."""

from __future__ import annotations

import pytest
from run_records import write_run


@pytest.fixture
def make_run(tmp_path):
    return lambda name="run", **kwargs: write_run(tmp_path / name, **kwargs)
