"""On CI a test whose requirement CI installs must run: under `MOE_ENGINE_CI=1` (`.ci/run` sets
it) its skip becomes a failure that carries the skip's reason, instead of a line in a count
nobody reads (`pytest -q` prints no skip reasons).

Must run on CI: tests marked `ci_must_run` (the disaggregation tests, which need Mooncake's
transfer engine, and the TLS tests, which need `cryptography` and `openssl`), and any test whose
skip reason is a missing install (`pytest.importorskip`'s "could not import", "not installed",
"does not import", "No module named"): `.ci/run` installs `.[dev]` and the system libraries.
Tests marked `gpu` stay skippable (CI has no GPU), whatever their reason.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import pytest

#: The environment variable that turns CI mode on ("1").
CI_ENV = "MOE_ENGINE_CI"

#: Skip reasons that name a missing install (a package or library CI installs).
INSTALL_PROBLEM = re.compile(r"could not import|not installed|does not import|No module named")


def ci_mode() -> bool:
    """True when the tests run as CI (`MOE_ENGINE_CI=1`)."""
    return os.environ.get(CI_ENV) == "1"


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test's report carries ("Skipped: " dropped)."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, lineno, reason)
        reason = str(longrepr[2])
    else:
        reason = str(longrepr)
    return reason.removeprefix("Skipped: ")


def must_run_on_ci(item: pytest.Item, reason: str) -> bool:
    """Whether a skip of `item` with `reason` is a CI failure (see the module's docstring)."""
    if item.get_closest_marker("gpu") is not None:
        return False
    return (item.get_closest_marker("ci_must_run") is not None
            or INSTALL_PROBLEM.search(reason) is not None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Iterator[None]:
    """Under CI mode, turn the skip of a test that must run on CI into a failure (an error
    when it skipped in set-up) whose message is the skip's reason; xfails are left alone."""
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if not (ci_mode() and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = skip_reason(report)
    if must_run_on_ci(item, reason):
        report.outcome = "failed"
        report.longrepr = (f"{CI_ENV}=1: this test must run on CI, where what it needs is "
                           f"installed, but it skipped: {reason}")
