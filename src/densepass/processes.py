"""Helper processes that end with the process that started them.

A helper densepass starts (the background ABS scheduler, ``training/planner.py``) calls
:func:`die_with_parent` first thing, so that killing the main process (SIGKILL, SIGTERM, the out-of-memory
killer) leaves nothing running: a helper blocked on a queue its parent will never write to would otherwise
live forever, and with it multiprocessing's resource tracker, which ends only when the last process holding
its pipe has ended.

On Linux the kernel sends the helper SIGKILL when its parent ends (``prctl(PR_SET_PDEATHSIG)``); elsewhere a
daemon thread of the helper polls ``os.getppid()`` and ends the process when the parent has gone. Either way a
parent that ended before the helper asked is caught at once (the helper then has another parent pid).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
EXIT_PARENT_GONE = 1


def _kernel_kills_on_parent_death() -> bool:
    """Ask Linux for SIGKILL when the parent ends; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, poll_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(poll_s)
    os._exit(EXIT_PARENT_GONE)


def die_with_parent(parent_pid: int, poll_s: float = 1.0) -> None:
    """End this process (at once, without clean-up) when process ``parent_pid``, its parent, ends.

    Call it first thing in a helper process, with the pid the parent had when it started the helper (the
    parent passes ``os.getpid()``). On Linux the signal comes when the parent *thread* that started this
    process ends, so start helpers from a thread that lives as long as the process (the main thread). Elsewhere
    the parent's end is noticed within ``poll_s`` seconds.
    """
    if not _kernel_kills_on_parent_death():
        threading.Thread(target=_watch_parent, args=(parent_pid, poll_s), name="die-with-parent", daemon=True).start()
    if os.getppid() != parent_pid:  # the parent ended before the request above: no signal will come
        os._exit(EXIT_PARENT_GONE)
