"""The per-primitive rule table: every primitive of the test models' steps
is known, or knowingly opaque (a kernel of its own)."""

import jax

from benchmarks import models
from jlms import _compat, _rules

# Kernels of their own: contractions, gathers and scatters, loops.
_OPAQUE = {"conv_general_dilated", "dot_general", "gather", "scatter-add",
           "scan"}


def _primitives_of(jaxpr, found):
  for eqn in jaxpr.eqns:
    found.add(eqn.primitive)
    for body in _compat.sub_jaxprs(eqn):
      _primitives_of(body, found)
  return found


def test_every_primitive_of_the_model_families_has_a_rule():
  # A primitive a new JAX introduces (0.12's `one_minus_square`, tanh's
  # derivative) and the table misses would be priced as a kernel of its
  # own: a buffer the simulator counts and XLA does not make.
  found = set()
  for case in (models.mlp_case(depth=2, width=32, batch=8),
               models.resnet_case(blocks=2, channels=8, image_size=16,
                                  batch=2),
               models.gpt_case(layers=2, width=32, heads=2, seq=16, batch=2,
                               vocab=64, scan_layers=True)):
    _primitives_of(jax.make_jaxpr(case.step)(*case.abstract_args()).jaxpr,
                   found)
  unknown = {str(p) for p in found if p not in _rules.RULES}
  assert unknown <= _OPAQUE, unknown - _OPAQUE


def test_rules_say_how_xla_treats_each_kind():
  (tanh,) = _compat.primitives_named("tanh")
  (reduce_sum,) = _compat.primitives_named("reduce_sum")
  (transpose,) = _compat.primitives_named("transpose")
  (dot,) = _compat.primitives_named("dot_general")
  assert _rules.rule(tanh).fuses_into_readers and _rules.rule(tanh).computed_once
  assert _rules.rule(reduce_sum).takes_fused_operands
  assert not _rules.rule(reduce_sum).fuses_into_readers
  assert _rules.rule(transpose).relayout_only
  assert _rules.rule(dot) is _rules.OPAQUE


def test_a_call_of_only_elementwise_equations_is_fusible():
  relu = jax.make_jaxpr(jax.nn.relu)(jax.ShapeDtypeStruct((4,), "float32"))
  (call,) = relu.jaxpr.eqns  # a custom_jvp_call of a max
  assert _rules.is_fusible_equation(call)
  matmul = jax.make_jaxpr(jax.jit(lambda a: a @ a))(
      jax.ShapeDtypeStruct((4, 4), "float32"))
  assert not _rules.is_fusible_equation(matmul.jaxpr.eqns[0])
