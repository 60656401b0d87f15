"""The suite's hooks: with -q (``make test``), a failure is named the moment
it happens, on a line of its own, so that a run of many minutes shows it
long before the end, where pytest gives its traceback (-v names each test
as it ends already)."""

from __future__ import annotations

import pytest

_configs = []  # pytest's config, once pytest is configured


def pytest_configure(config: pytest.Config) -> None:
    _configs.append(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or not _configs or _configs[-1].option.verbose > 0:
        return
    terminal = _configs[-1].pluginmanager.get_plugin("terminalreporter")
    if terminal is None:
        return
    crash = getattr(report.longrepr, "reprcrash", None)
    why = crash.message if crash is not None else str(report.longrepr).strip()
    lines = why.splitlines() or [""]
    stage = "" if report.when == "call" else f" (in its {report.when})"
    # After -q's dots, on a line of its own (pytest's writer knows its column).
    if getattr(getattr(terminal, "_tw", None), "width_of_current_line", 1):
        terminal.write("\n")
    terminal.write_line(f"FAILED {report.nodeid}{stage}: {lines[0]}"
                        + (" ..." if len(lines) > 1 else ""), red=True)
