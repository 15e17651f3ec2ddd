"""Progress bars that log lines print above, not into.

A log record written to the terminal while a tqdm bar is open lands straight after the bar's
text on the same line (``train:  35%|...| 211/600 [...]2026-12-02 ... step 220 | loss ...``).
While a ``progress_bar`` is open, the root logger's console handlers are swapped for tqdm's
own (``tqdm.contrib.logging.logging_redirect_tqdm``), which clears the bar, writes the record
and draws the bar again; closing the bar (also on an error) puts the handlers back."""

from __future__ import annotations

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class progress_bar(tqdm):  # noqa: N801 - used like the tqdm it is
    """``tqdm`` (the auto flavour) with log records routed through it while it is open."""

    def __init__(self, *args, **kwargs):
        self._redirect = None
        super().__init__(*args, **kwargs)
        if not self.disable:
            self._redirect = logging_redirect_tqdm(tqdm_class=tqdm)
            self._redirect.__enter__()

    def close(self) -> None:
        try:
            super().close()
        finally:
            redirect, self._redirect = getattr(self, "_redirect", None), None
            if redirect is not None:
                redirect.__exit__(None, None, None)
