"""Fixtures shared by every test directory. Test support code lives in the workspace's dev-only
package ``lw_dev`` (engine runners, PD oracle and flows, proxy mocks, test hosts, ports), imported
as a module: no test touches ``sys.path``. A directory's own helpers are modules next to its tests
(pytest puts the directory on ``sys.path``); their names are unique across directories."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from lw_dev.harness import pool_dir
from lw_dev.requirements import REQUIRED, missing_dependencies


def pytest_configure(config: pytest.Config) -> None:
    missing = missing_dependencies()
    if missing:
        lines = "\n".join(f"  {m}: {REQUIRED[m]}" for m in missing)
        raise pytest.UsageError(
            f"the test suite needs these, and they are not installed:\n{lines}\n"
            "Run scripts/setup.sh (the README's test command does), or set "
            f"LW_TESTS_ALLOW_MISSING={','.join(missing)} to run without them (their tests are skipped)."
        )


@pytest.fixture
def pool_path() -> Iterator[str]:
    """A fresh embedded pool directory (not created) on tmpfs when there is one; removed after."""
    p = pool_dir("lw-test-pool")
    yield p
    shutil.rmtree(p, ignore_errors=True)
