"""What a long planning is doing, said while it runs.

Planning a large step (tracing, fitting every way its loops can run, XLA's
deviceless compiles) can take minutes. A `Progress` stays silent for its
first `QUIET_S` seconds, so that a step planned in a few seconds prints
nothing; after that, each stage the planner reports is shown: on a
terminal as one status line on stderr, rewritten in place, elsewhere (a
log file, CI, a notebook's captured stderr) as one line per stage, at most
one every `QUIET_S` seconds. Every stage also goes to the "jlms" logger at
INFO. `done()` ends the status line with the total time.

Guarantees: nothing is written before `QUIET_S` seconds have passed;
nothing is written to stdout.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("jlms")

#: Seconds of planning before anything is shown.
QUIET_S = 10.0


class Progress:
  """Progress of planning one signature of the step `name`."""

  def __init__(self, name: str, stream=None, clock=time.perf_counter):
    self.name = name
    self._stream = stream
    self._clock = clock
    self._start = clock()
    self._last_shown = None  # when a line was last written
    self._stage = ""

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
    self._stage = text
    log.info("jlms: planning %s: %s", self.name, text)
    now = self._clock()
    elapsed = now - self._start
    if elapsed < QUIET_S:
      return
    terminal = self._on_terminal()
    if (not terminal and self._last_shown is not None
        and now - self._last_shown < QUIET_S):
      return
    line = f"jlms: planning {self.name} ({elapsed:.0f} s): {text}"
    out = self._out()
    if terminal:
      out.write("\r\x1b[2K" + line)
    else:
      out.write(line + "\n")
    out.flush()
    self._last_shown = now

  def done(self) -> None:
    """Planning ended: the status line, if one was shown, says in how
    long."""
    if self._last_shown is None:
      return
    line = f"jlms: planned {self.name} in {self.elapsed_s:.0f} s"
    out = self._out()
    out.write(("\r\x1b[2K" if self._on_terminal() else "") + line + "\n")
    out.flush()
