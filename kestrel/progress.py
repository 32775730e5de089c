"""Progress bars (tqdm) for a person at a terminal: weight loading and offline `Engine.generate()`.

A bar is drawn only when stderr is a terminal, so logs, pipes, CI and the server's clients never see
one; `enabled=False` (`generate(use_tqdm=False)`) turns it off at a terminal too.
"""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int | None, desc: str, unit: str, enabled: bool = True) -> tqdm:
    """A tqdm bar on stderr; a silent one (tqdm's `disable`) when stderr is no terminal or not `enabled`."""
    terminal = sys.stderr is not None and sys.stderr.isatty()  # None: a process started without one
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=not (enabled and terminal))
