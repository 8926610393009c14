"""The demo says what it is doing: each phase is announced before it
starts and again every `TICK_S` seconds while it lasts (issue 38: "the
demo is never silent for more than 10 s"). The demo itself takes a minute;
its phases are tested here with a short tick."""

import io
import threading
import time

from benchmarks import demo

TICK_S = 0.05


def _lines(stream: io.StringIO) -> list[str]:
  return stream.getvalue().splitlines()


def test_a_phase_is_announced_then_again_every_tick_until_it_ends():
  stream = io.StringIO()
  with demo.phase("XLA compiling", stream=stream, tick_s=TICK_S):
    assert _lines(stream) == ["> XLA compiling"]
    time.sleep(3.5 * TICK_S)
  lines = _lines(stream)
  assert lines[0] == "> XLA compiling"
  assert len(lines) >= 3  # at least two ticks in 3.5 ticks' time
  assert all(line.startswith("> XLA compiling: ") and
             line.endswith(" s so far") for line in lines[1:])
  assert not any(t.name == "demo-phase" for t in threading.enumerate())
  time.sleep(2 * TICK_S)
  assert _lines(stream) == lines  # nothing after the phase ends


def test_a_phase_that_reports_itself_is_announced_once():
  stream = io.StringIO()
  with demo.phase("jlms planning", ticking=False, stream=stream,
                  tick_s=TICK_S):
    time.sleep(3 * TICK_S)
  assert _lines(stream) == ["> jlms planning"]


def test_a_phase_ends_its_ticks_when_what_it_runs_raises():
  stream = io.StringIO()
  try:
    with demo.phase("failing", stream=stream, tick_s=TICK_S):
      raise RuntimeError("XLA")
  except RuntimeError:
    pass
  time.sleep(2 * TICK_S)
  assert _lines(stream) == ["> failing"]


def test_the_demo_ticks_before_jlms_would_speak():
  # A phase left to jlms's own progress is silent for jlms's QUIET_S at
  # most; the demo's ticks are no rarer than that.
  from jlms._progress import QUIET_S
  assert demo.TICK_S <= QUIET_S <= 10
