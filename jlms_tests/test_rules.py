"""The per-primitive rule table: every primitive of the test models' steps
is known, or knowingly opaque (a kernel of its own)."""

import dataclasses

import jax
import jax.numpy as jnp

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
  # A contraction: a kernel of its own, priced by its FLOPs, that reads a
  # transposed matrix without a buffer.
  assert _rules.rule(dot).folds_transposed_matrices
  assert dataclasses.replace(_rules.rule(dot), flops=None, splits=None,
                             folds_transposed_matrices=False,
                             fuses_when=None) == _rules.OPAQUE
  matmul = jax.make_jaxpr(lambda a, b: a @ b)(
      jax.ShapeDtypeStruct((4, 8), "float32"),
      jax.ShapeDtypeStruct((8, 16), "float32")).jaxpr.eqns[0]
  assert _rules.flops(matmul) == 2 * 4 * 8 * 16
  assert not _rules.is_fusible_equation(matmul)
  # An outer product (a contraction over one element) is a multiply to
  # XLA, fused into its readers.
  outer = jax.make_jaxpr(lambda a, b: a @ b)(
      jax.ShapeDtypeStruct((4, 1), "float32"),
      jax.ShapeDtypeStruct((1, 16), "float32")).jaxpr.eqns[0]
  assert _rules.is_fusible_equation(outer)
  assert _rules.flops(jax.make_jaxpr(jnp.tanh)(1.0).jaxpr.eqns[0]) == 0


def test_calls_loops_barriers_and_copies_have_their_rules():
  (scan,) = _compat.primitives_named("scan")
  assert _rules.rule(scan).loop and not _rules.rule(scan).inlined_call
  nested = jax.make_jaxpr(jax.jit(jnp.sin))(1.0).jaxpr.eqns[0]
  assert _rules.rule(nested.primitive).inlined_call
  barrier = _rules.rule(_compat.barrier_p)
  assert barrier.aliases_operands and not barrier.recomputable
  put = jax.make_jaxpr(lambda x: jax.device_put(x, jax.memory.Space.Host))(
      jnp.ones(2)).jaxpr.eqns[0]
  assert not _rules.is_recomputable(put)
  assert _rules.is_recomputable(jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0])


def test_a_call_of_only_elementwise_equations_is_fusible():
  relu = jax.make_jaxpr(jax.nn.relu)(jax.ShapeDtypeStruct((4,), "float32"))
  (call,) = relu.jaxpr.eqns  # a custom_jvp_call of a max
  assert _rules.is_fusible_equation(call)
  matmul = jax.make_jaxpr(jax.jit(lambda a: a @ a))(
      jax.ShapeDtypeStruct((4, 4), "float32"))
  assert not _rules.is_fusible_equation(matmul.jaxpr.eqns[0])
