"""Log lines written while a progress bar is open print on a line of their own."""

from __future__ import annotations

import logging
import re
import sys

from easy_context.utils.progress import progress_bar


def _segments(text: str) -> list[str]:
    """What the terminal shows, piece by piece: a carriage return or a newline starts one."""
    return [s for s in re.split(r"[\r\n]", text) if s.strip()]


def test_a_log_record_does_not_run_into_an_open_bar(capsys):
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)  # a console handler, as basicConfig makes
    root.addHandler(handler)
    old_level, root.level = root.level, logging.INFO
    try:
        with progress_bar(total=4, desc="train", mininterval=0) as bar:
            for step in range(4):
                bar.update(1)
                logging.getLogger("easy_context.train").info("step %d | loss 1.0", step)
        assert root.handlers[-1] is handler  # the console handler is back once the bar closed
        logging.getLogger("easy_context.train").info("after the bar")
    finally:
        root.removeHandler(handler)
        root.level = old_level
    err = capsys.readouterr().err
    logged = [s for s in _segments(err) if "loss 1.0" in s]
    assert len(logged) == 4, err
    assert all(s.startswith("step ") for s in logged), logged  # not after the bar's text
    assert any(s.startswith("train:") for s in _segments(err)), err  # the bar was drawn
    assert "after the bar" in err


def test_a_disabled_bar_leaves_the_handlers_alone():
    before = list(logging.getLogger().handlers)
    with progress_bar(total=1, disable=True):
        assert logging.getLogger().handlers == before
