"""SIGTERM and SIGINT end a run in one line, never half-way through a write.

A cluster scheduler sends SIGTERM at a time limit, a user presses Ctrl-C (SIGINT). Either becomes StopSignal, raised
in the main thread where it is: a run resumes from its last checkpoint whatever it was doing, as after a crash.
Only the writes a resume reads are kept whole: inside `deferred()` (a checkpoint being written, a metrics record
being appended) the signal waits, and is raised as the write ends. The entry point catches StopSignal, names the
last intact checkpoint and exits 128 + the signal's number (143 for SIGTERM, 130 for SIGINT), the status a shell
and a scheduler already read as "ended by that signal".

StopSignal is a BaseException, so that no `except Exception` on its way (a reward's retry loop, a hook's guard)
takes it for a failure of its own.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal(BaseException):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_state = {"depth": 0, "pending": None, "armed": False}


def _handler(signum, frame) -> None:
    for sig in SIGNALS:  # a second signal while the first is being handled would break its one line
        signal.signal(sig, signal.SIG_IGN)
    if not _state["armed"]:  # still importing: nothing is written yet, and no one would catch StopSignal
        print(f"[recam] stopped by {signal.Signals(signum).name} before the run started; nothing was written",
              file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)
    if _state["depth"]:
        _state["pending"] = signum
        return
    raise StopSignal(signum)


def install() -> None:
    """Catch SIGTERM and SIGINT from now on (main thread only, where Python delivers signals)."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handler)


def arm() -> None:
    """From now on a signal raises StopSignal: the caller catches it."""
    _state["armed"] = True


@contextlib.contextmanager
def deferred():
    """A write that must not be cut: a signal that arrives inside waits until it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach only the main thread: another thread's write cannot be cut by one
        return
    _state["depth"] += 1
    try:
        yield
    finally:
        _state["depth"] -= 1
        signum = _state["pending"]
        if not _state["depth"] and signum is not None:
            _state["pending"] = None
            raise StopSignal(signum)
