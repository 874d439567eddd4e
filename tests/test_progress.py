"""utils.progress_bar: a live bar on a terminal, a few lines in a log file; utils.check_positive."""

from __future__ import annotations

import argparse
import io

import pytest

from icefall_lite.utils import LOG_REFRESH_SECONDS, check_positive, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_to_a_file_refreshes_rarely():
    log = io.StringIO()
    items = list(progress_bar(range(5000), desc="work", file=log))
    assert items == list(range(5000))
    # The first and the closing draw only: no carriage-return update per item.
    assert log.getvalue().count("\r") <= 3
    assert "5000/5000" in log.getvalue()


def test_progress_bar_on_a_terminal_is_tqdms_live_bar():
    bar = progress_bar(range(3), desc="work", file=_Terminal())
    assert bar.mininterval < LOG_REFRESH_SECONDS
    bar.close()
    logged = progress_bar(range(3), desc="work", file=io.StringIO())
    assert logged.mininterval == LOG_REFRESH_SECONDS and logged.maxinterval == LOG_REFRESH_SECONDS
    logged.close()


def test_progress_bar_keeps_explicit_settings_and_postfix_waits():
    log = io.StringIO()
    bar = progress_bar(range(100), file=log, mininterval=0.5)
    assert bar.mininterval == 0.5
    bar.close()
    log = io.StringIO()
    bar = progress_bar(range(1000), file=log)
    for i in bar:
        bar.set_postfix(loss=f"{i:.3f}", refresh=False)
    assert log.getvalue().count("\r") <= 3


def test_check_positive_names_the_flag():
    parser = argparse.ArgumentParser(prog="x")
    check_positive(parser, argparse.Namespace(a=1, b_c=0.5), ["a", "b_c"])
    with pytest.raises(SystemExit):
        check_positive(parser, argparse.Namespace(a=1, b_c=0), ["a", "b_c"])
