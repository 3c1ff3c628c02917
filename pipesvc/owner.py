"""The owner of a process that ``LocalCluster`` started: the child stops when its owner dies.

[Note: owned processes] ``LocalCluster`` starts the coordinator and the stages as separate
processes. When the Python process that owns the cluster dies without running ``__exit__``
(SIGKILL, SIGTERM with the default handler, a crash, the OOM killer), nothing in it can stop
them, so each child watches for the death itself:

- ``LocalCluster`` starts every child with ``OWNER_PID_ENV`` set to its own pid
  (``owner_environ``). ``pipesvc`` reads it first thing in ``main`` (``follow_owner``); a
  ``pipesvc stage`` or ``pipesvc coordinator`` started any other way has no such variable and
  is not affected. The variable is removed from the child's environment once read, so nothing
  the child starts believes it is owned.
- On Linux the child asks for SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``). The
  kernel sends it when the *thread* that forked the child ends, not the process, so the owner
  asks for it (``OWNER_DEATHSIG_ENV``) only when it starts the child from its main thread: a
  cluster started from a worker thread that then finishes must keep running.
- Everywhere, a daemon thread in the child compares ``os.getppid()`` with the owner's pid every
  ``POLL_S`` seconds: once the owner is dead the child has been re-parented (to init or to a
  subreaper), and it sends itself SIGTERM.
- The owner may die before the child sets the flag (between ``fork`` and the ``prctl``): the
  kernel would then never send the signal. So right after setting it the child compares
  ``os.getppid()`` with the owner's pid, and if they differ it stops before doing anything.

Either way the child gets SIGTERM, the signal ``LocalCluster.close`` sends, so it stops the way
it does on a proper shutdown (a stage drains, the coordinator stops its server). A child that is
still alive ``GRACE_S`` seconds after that is ended with ``os._exit``: an orphan must not live on
whatever it is waiting for.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

logger = logging.getLogger(__name__)

OWNER_PID_ENV = "PIPESVC_OWNER_PID"
"""The pid of the process that started this one and whose death should stop it."""
OWNER_DEATHSIG_ENV = "PIPESVC_OWNER_DEATHSIG"
"""``1`` when the owner started this process from its main thread (so PDEATHSIG is safe)."""
POLL_S = 0.5
"""How often the watchdog compares the parent pid with the owner's."""
GRACE_S = 10.0
"""How long a child whose owner died may take to stop after its SIGTERM: what
``LocalCluster.close`` gives it before SIGKILL. A stage's drain waits for its coordinator,
which went with the same owner, so an orphan would otherwise wait for nobody."""
_PR_SET_PDEATHSIG = 1


def owner_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start an owned child in: ``environ`` (default ``os.environ``) with this
    process named as its owner (see [Note: owned processes])."""
    env = dict(os.environ if environ is None else environ)
    env[OWNER_PID_ENV] = str(os.getpid())
    on_main = threading.current_thread() is threading.main_thread()
    env[OWNER_DEATHSIG_ENV] = "1" if on_main else "0"
    return env


def _set_parent_death_signal(signum: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, signum)``; False where that is not available (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)) == 0
    except (OSError, AttributeError, TypeError):
        return False


def _watch(owner_pid: int) -> None:
    while os.getppid() == owner_pid:
        time.sleep(POLL_S)
    logger.warning("owner process %d is gone: stopping", owner_pid)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(GRACE_S)
    logger.error("still running %.0f s after owner %d died: exiting", GRACE_S, owner_pid)
    os._exit(1)


def follow_owner(environ: dict[str, str] | None = None) -> bool:
    """Makes this process stop when the owner named in ``environ`` (default ``os.environ``)
    dies, and removes the owner's variables from it; returns False when the owner is already
    gone (the caller should exit). Without an owner it does nothing and returns True.

    Raises:
        ValueError: the owner variable is not a pid.
    """
    env: dict[str, str] | os._Environ[str] = os.environ if environ is None else environ
    text = env.pop(OWNER_PID_ENV, None)
    deathsig = env.pop(OWNER_DEATHSIG_ENV, "0") == "1"
    if text is None:
        return True
    try:
        owner_pid = int(text)
    except ValueError:
        raise ValueError(f"{OWNER_PID_ENV}={text!r} is not a process id") from None
    if deathsig:
        _set_parent_death_signal(signal.SIGTERM)
    # The check after the flag: an owner that died before it was set never sends the signal.
    if os.getppid() != owner_pid:
        return False
    threading.Thread(target=_watch, args=(owner_pid,), name="owner-watch", daemon=True).start()
    return True
