"""A long planning says what it is doing; a short one says nothing."""

import io
import threading
import time

import jax
import jax.numpy as jnp

import jlms
from jlms import _progress
from jlms._progress import QUIET_S, Progress


class _Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def test_nothing_is_shown_in_the_first_seconds_then_each_stage_at_most_every_few():
  clock, out = _Clock(), io.StringIO()
  progress = Progress("step", stream=out, clock=clock)
  progress.stage("tracing")
  clock.now = QUIET_S - 1
  progress.stage("fitting")
  progress.done()
  assert out.getvalue() == ""  # a step planned in seconds prints nothing

  progress = Progress("step", stream=out, clock=clock)
  clock.now += QUIET_S + 2
  progress.stage("fitting loops as they are (1 of 3)")
  clock.now += 1
  progress.stage("fitting the next way (2 of 3)")  # too soon after: silent
  clock.now += QUIET_S
  progress.stage("XLA compiling a program for h100")
  progress.done()
  lines = out.getvalue().splitlines()
  assert lines == [
      f"jlms: planning step ({QUIET_S + 2:.0f} s): fitting loops as they "
      "are (1 of 3)",
      f"jlms: planning step ({2 * QUIET_S + 3:.0f} s): XLA compiling a "
      "program for h100",
      f"jlms: planned step in {2 * QUIET_S + 3:.0f} s"]


def test_on_a_terminal_one_status_line_is_rewritten_in_place():
  clock, out = _Clock(), _Terminal()
  progress = Progress("step", stream=out, clock=clock)
  clock.now = QUIET_S + 1
  progress.stage("one")
  clock.now += 1
  progress.stage("two")
  progress.done()
  text = out.getvalue()
  assert text.count("\n") == 1 and text.endswith(
      f"planned step in {QUIET_S + 2:.0f} s\n")
  assert "one" in text and "two" in text and text.count("\r") == 3


def test_a_step_planned_quickly_prints_nothing(capsys):
  step = jlms.offload(lambda x: jnp.sin(x) * 2, budget="min")
  step.plan(jnp.ones((8, 8)))
  captured = capsys.readouterr()
  assert captured.out == "" and "jlms: plann" not in captured.err


def test_a_long_stage_is_shown_again_until_it_ends(monkeypatch):
  # One XLA compile of a large step can take minutes: the ticker shows the
  # stage again every QUIET_S seconds, and stops with `done`.
  monkeypatch.setattr(_progress, "QUIET_S", 0.05)
  out = io.StringIO()
  progress = Progress("step", stream=out, ticking=True)
  progress.stage("XLA compiling a program for h100")
  time.sleep(0.5)
  progress.done()
  lines = out.getvalue().splitlines()
  assert len(lines) >= 4 and lines[-1].startswith("jlms: planned step in")
  assert all("XLA compiling" in line for line in lines[:-1])
  time.sleep(0.2)
  assert out.getvalue().splitlines() == lines  # nothing after done


def test_a_step_that_does_not_trace_leaves_no_progress_ticking():
  def not_traceable(x):
    if x.sum() > 0:  # Python control flow on a traced value
      return x
    return -x

  before = {t.ident for t in threading.enumerate()}
  try:
    jlms.offload(not_traceable, budget="min")(jnp.ones(3))
  except jax.errors.TracerBoolConversionError:
    pass
  ticking = [t for t in threading.enumerate()
             if t.name == "jlms-progress" and t.ident not in before]
  for thread in ticking:
    thread.join(timeout=1)
  assert not any(t.is_alive() for t in ticking)
