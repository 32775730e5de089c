"""Ending a server process without unloading its modules.

Once a process has stopped everything it owns (children joined, pipes closed, logs written), what
the interpreter still does at exit is unload its modules one by one: with torch and transformers
imported that takes seconds on a busy machine (measured on 2 loaded CPU cores: 1-3 s for the HTTP
process, 2.5 s for the engine process, 1 s for the tokenizer workers), frees nothing the kernel
frees anyway, and is what made a stopped server outlive `--shutdown-timeout`.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys


def skip_teardown_on_exit(code: int) -> None:
    """When the interpreter exits, end the process with `code` before it unloads its modules.

    What runs before still runs: the joins of non-daemon threads and, in a multiprocessing child,
    multiprocessing's own cleanup (children, semaphores). What this skips: the atexit handlers
    registered before this call (logs are flushed here instead) and the unloading of modules.
    """
    atexit.register(_exit_now, code)


def _exit_now(code: int) -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to save
            pass
    os._exit(code)
