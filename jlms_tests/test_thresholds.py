"""Size thresholds, named in one place and lowered together for tests."""

import jax
import optax

from benchmarks import models
from jlms import _thresholds
from jlms._liveness import analyse
from jlms._loop_sink import loop_sinks
from jlms._program import flatten


def _small_scanned_gpt_program():
  case = models.gpt_case(layers=2, width=32, heads=2, seq=32, batch=2,
                         vocab=64, scan_layers=True,
                         optimizer=optax.sgd(1e-2))
  program = flatten(jax.make_jaxpr(case.step)(*case.abstract_args()))
  return program, analyse(program)


def test_lowered_thresholds_start_a_pass_on_a_small_step_and_are_restored():
  program, liveness = _small_scanned_gpt_program()
  # Its hoisted causal mask takes 8 KiB, under the loop sink's 1 MiB.
  assert loop_sinks(program, liveness) == ()
  with _thresholds.overridden(**_thresholds.EVERY_SIZE) as lowered:
    assert lowered.loop_sink_min_bytes == 1
    assert loop_sinks(program, liveness)
  assert _thresholds.THRESHOLDS == _thresholds.Thresholds()
  assert loop_sinks(program, liveness) == ()


def test_segments_of_tiny_activations_are_no_way_of_their_own():
  """An unrolled MLP of 128-byte activations has segments to remake, but
  not enough bytes in them to be worth analysing a way for; under the
  lowered thresholds it has that way."""
  from jlms._analysed import AnalysedProgram
  from jlms._config import OffloadConfig
  from jlms._variants import loop_ways

  case = models.many_equations_case(layers=8)
  program = flatten(jax.make_jaxpr(case.step)(*case.abstract_args()))

  def segment_ways():
    return [w.description for w in loop_ways(AnalysedProgram.of(program),
                                             OffloadConfig(), None)
            if "segments" in w.description]

  assert segment_ways() == []
  with _thresholds.overridden(**_thresholds.EVERY_SIZE):
    assert segment_ways()
