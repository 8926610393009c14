"""What a long planning is doing, said while it runs.

Planning a large step (tracing, fitting every way its loops can run, XLA's
deviceless compiles) can take minutes. A `Progress` stays silent for its
first `QUIET_S` seconds, so that a step planned in a few seconds prints
nothing; after that, each stage the planner reports is shown: on a
terminal as one status line on stderr, rewritten in place, elsewhere (a
log file, CI, a notebook's captured stderr) as one line per stage, at most
one every `QUIET_S` seconds. A stage that lasts longer (one XLA compile of
a large step, one fit) is shown again every `QUIET_S` seconds by a
background ticker, with the time so far. Every stage also goes to the
"jlms" logger at INFO. `done()` stops the ticker and ends the status line
with the total time.

Guarantees: nothing is written before `QUIET_S` seconds have passed;
once they have, never `QUIET_S` seconds without a line until `done()`;
nothing is written to stdout.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("jlms")

#: Seconds of planning before anything is shown, and at most between two
#: lines after that: under 10, so that a user never waits 10 s unanswered.
QUIET_S = 8.0


class Progress:
  """Progress of planning one signature of the step `name`."""

  def __init__(self, name: str, stream=None, clock=time.perf_counter,
               ticking: bool = False):
    self.name = name
    self._stream = stream
    self._clock = clock
    self._start = clock()
    self._last_shown = None  # when a line was last written
    self._stage = ""
    self._lock = threading.Lock()
    self._finished = threading.Event()
    # Started by the first stage, stopped by `done`; a daemon thread never
    # holds up the interpreter's exit.
    self._ticker = (threading.Thread(target=self._tick, daemon=True,
                                     name="jlms-progress")
                    if ticking else None)

  def _tick(self) -> None:
    while not self._finished.wait(QUIET_S):
      with self._lock:
        if self._finished.is_set():  # `done` came first
          return
        now = self._clock()
        if (now - self._start >= QUIET_S and (
            self._last_shown is None or now - self._last_shown >= QUIET_S)):
          self._show(now)

  @property
  def elapsed_s(self) -> float:
    return self._clock() - self._start

  def _out(self):
    return self._stream if self._stream is not None else sys.stderr

  def _on_terminal(self) -> bool:
    isatty = getattr(self._out(), "isatty", None)
    try:
      return bool(isatty and isatty())
    except ValueError:  # a closed stream
      return False

  def stage(self, text: str) -> None:
    """The planner is now doing `text`."""
    log.info("jlms: planning %s: %s", self.name, text)
    if self._ticker is not None and not self._ticker.is_alive() and (
        not self._finished.is_set()):
      self._ticker.start()
    with self._lock:
      self._stage = text
      now = self._clock()
      if now - self._start < QUIET_S:
        return
      if (not self._on_terminal() and self._last_shown is not None
          and now - self._last_shown < QUIET_S):
        return
      self._show(now)

  def _show(self, now: float) -> None:
    terminal = self._on_terminal()
    line = (f"jlms: planning {self.name} ({now - self._start:.0f} s): "
            f"{self._stage}")
    out = self._out()
    if terminal:
      out.write("\r\x1b[2K" + line)
    else:
      out.write(line + "\n")
    out.flush()
    self._last_shown = now

  def done(self) -> None:
    """Planning ended: the ticker stops, and the status line, if one was
    shown, says in how long."""
    self._finished.set()
    with self._lock:
      self._finish()

  def _finish(self) -> None:
    if self._last_shown is None:
      return
    line = f"jlms: planned {self.name} in {self.elapsed_s:.0f} s"
    out = self._out()
    out.write(("\r\x1b[2K" if self._on_terminal() else "") + line + "\n")
    out.flush()
