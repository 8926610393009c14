"""What jlms knows about each primitive, in one table keyed by primitive.

Every analysis that asks how XLA's GPU compiler treats an equation reads it
here: whether the equation's result is computed inside the kernels that
read it (and so is no buffer of its own), whether its kernel computes its
fusible operands inline, whether a costly elementwise result is computed
once rather than again in each reader, whether it only re-lays out its
operand, and whether it is a contraction priced by its FLOPs. JAX's own
passes keep per-primitive knowledge the same way (`pe.dce_rules`,
`ad.primitive_jvps`).

Guarantees: `rule(p)` answers for every primitive; one this table does not
name is opaque (a kernel of its own reading buffers), which can only make
the simulator's peaks larger, never smaller. Primitives are matched by
object, looked up by name through `jlms._compat`; a name this JAX lacks is
left out.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Callable

from jlms import _compat, _split_rules


@dataclasses.dataclass(frozen=True)
class PrimitiveRule:
  #: XLA computes the result inside each kernel that reads it (elementwise
  #: and re-layout primitives), when every reader can take it fused.
  fuses_into_readers: bool = False
  #: Its kernel computes fusible operands inline, though its own result is a
  #: buffer (reductions, cotangent sums).
  takes_fused_operands: bool = False
  #: Its kernel computes a broadcast operand inline, even one that is not
  #: otherwise fusible into it (a broadcast cotangent is never a buffer of
  #: its own).
  takes_fused_expansions: bool = False
  #: Elementwise and costly: read by several kernels it is computed once,
  #: into a buffer.
  computed_once: bool = False
  #: Only re-lays out or re-types its operand: XLA folds it into its
  #: producer or consumer, so a barrier must not separate the two.
  relayout_only: bool = False
  #: A call whose body XLA inlines: as fusible as that body.
  transparent_call: bool = False
  #: Each element of its result is computed from the elements at the same
  #: index of its operands (rank-0 operands broadcast), whatever the shape:
  #: it computes the same on one slice of its operands as on all of them,
  #: so a loop can run it slice by slice (an optimizer's update streamed
  #: through state on host, `jlms._state`).
  pointwise: bool = False
  #: Reads or writes one slice of its first operand, in place (a loop's
  #: `dynamic_slice` of a stack, its `dynamic_update_slice` into a carried
  #: buffer): its kernel moves the slice's bytes, not the operand's.
  moves_one_slice: bool = False
  #: A reduction that XLA's GPU backend can compute inside the kernel that
  #: reads its result, when it reduces each row (the last axis) and only
  #: elementwise work reads it: a softmax or a LayerNorm, whose row
  #: statistics and the normalisation that reads them XLA fuses into one
  #: Triton kernel on a Hopper GPU (seen in the H100's own programs of the
  #: scanned GPT: the attention softmax, the loss's softmax over the
  #: vocabulary).
  fuses_as_row: bool = False
  #: A contraction that reads or writes a matrix transposed without a
  #: buffer for it: XLA folds a transposed operand into its dimension
  #: numbers (its TransposeFolding pass) and lays out a result that is only
  #: transposed as its readers want it. So a `transpose` of a rank-2 value
  #: read only by such equations makes no buffer, nor does such an
  #: equation's rank-2 result read only by transposes (GPT-2's tied
  #: embedding, transposed for the logits and read again by their
  #: gradient: 196 MiB that XLA never allocates, which put the simulator's
  #: peak of per-block remat 2% over XLA's).
  folds_transposed_matrices: bool = False
  #: The multiply-add FLOPs of its equation, for a contraction priced by
  #: its FLOPs (`dot_general`, `conv_general_dilated`; the parameters are
  #: read in `jlms._compat`); None for every other primitive.
  flops: Callable | None = None
  #: Emitting it a second time gives the same result (a pure primitive):
  #: not a copy between memories, nor a barrier that orders others.
  recomputable: bool = True
  #: Its outputs are its operands, not new buffers (an optimization
  #: barrier).
  aliases_operands: bool = False
  #: Whether XLA computes an equation of this primitive elementwise, in
  #: the kernels that read it, though the primitive otherwise has a kernel
  #: of its own (`is_fusible_equation`); None: never.
  fuses_when: Callable | None = None
  #: A call `jlms._program.flatten` inlines: a nested `jax.jit`,
  #: `closed_call`, the primal calls of `custom_jvp`/`custom_vjp`.
  inlined_call: bool = False
  #: A loop that runs a body of its own many times (scan, while).
  loop: bool = False
  #: Reduces its operand over some axes (a sum, a max). XLA's scheduler
  #: runs one that only the step's outputs need (the loss returned beside
  #: its gradients) at the end of the step, and holds what it reads until
  #: then (`jlms._rewrite._postponable_contractions`).
  reduces: bool = False
  #: How its equation runs chunk by chunk along one axis of its values
  #: (`jlms._split_rules`); None where it cannot (`jlms._batch_split`).
  splits: Callable | None = None


OPAQUE = PrimitiveRule()

_ELEMENTWISE = (
    "abs", "add", "and", "atan2", "cbrt", "ceil", "clamp", "concatenate",
    "copy", "cos", "div", "eq", "erf_inv", "erf", "erfc", "exp2", "exp",
    "expm1", "floor", "ge", "gt", "imag", "integer_pow", "iota", "is_finite",
    "le", "log1p", "log", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "not", "or", "pad", "pow", "real", "reduce_precision", "rem", "rev",
    "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "slice", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "xor",
    # inverse and hyperbolic trigonometry, bit tricks, special functions
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cosh", "sinh", "clz",
    "population_count", "nextafter", "conj", "complex", "lgamma", "digamma",
    # new in JAX 0.12: tanh's derivative is `one_minus_square(tanh(x))`
    "log2", "one_minus_square", "polynomial")
# Of those, the ones that act element by element, with no shape parameter.
_POINTWISE = tuple(name for name in _ELEMENTWISE if name not in (
    "concatenate", "iota", "pad", "rev", "slice")) + (
        "convert_element_type", "add_jaxvals")
_RELAYOUT = ("transpose", "reshape", "broadcast_in_dim", "squeeze",
             "convert_element_type")
_COSTLY = (
    "atan2", "cos", "erf_inv", "erf", "erfc", "exp2", "exp", "expm1",
    "log1p", "log", "logistic", "pow", "rsqrt", "sin", "sqrt", "tan", "tanh",
    "div", "rem", "acos", "acosh", "asin", "asinh", "atan", "atanh", "cosh",
    "sinh", "lgamma", "digamma", "log2")
_REDUCTIONS = ("argmax", "argmin", "reduce_and", "reduce_max", "reduce_min",
               "reduce_or", "reduce_prod", "reduce_sum", "reduce_xor")
_ROW_REDUCTIONS = ("reduce_max", "reduce_min", "reduce_sum")
_ACCUMULATIONS = ("add_jaxvals",)  # `add_any`
_TRANSPARENT_CALLS = ("custom_jvp_call", "custom_vjp_call", "remat",
                      "closed_call", "call", "jit", "pjit")


def _table() -> types.MappingProxyType:
  rules: dict = {}

  def add(names, **fields):
    for primitive in _compat.primitives_named(*names):
      rules[primitive] = dataclasses.replace(
          rules.get(primitive, OPAQUE), **fields)

  add(_ELEMENTWISE, fuses_into_readers=True, takes_fused_operands=True)
  add(_RELAYOUT, fuses_into_readers=True, takes_fused_operands=True,
      relayout_only=True)
  add(_COSTLY, computed_once=True)
  add(_REDUCTIONS, takes_fused_operands=True, reduces=True)
  add(_ROW_REDUCTIONS, fuses_as_row=True)
  # A cotangent sum is an add to XLA: it computes its elementwise operands
  # inline (in the scanned bf16 GPT's backward loop, the softmax gradient's
  # division and cast: 2 x 128 MiB that XLA never allocates; the
  # simulator's peak there went from +12% of XLA's to +6%). Its own result
  # stays a buffer: fused into its readers too, the ResNet's plans came out
  # 0.8 GiB above the simulator's peak, so XLA keeps it there.
  add(_ACCUMULATIONS, takes_fused_expansions=True, takes_fused_operands=True)
  add(_TRANSPARENT_CALLS, transparent_call=True)
  add(_POINTWISE, pointwise=True)
  add(("dynamic_slice", "dynamic_update_slice"), moves_one_slice=True)
  add(("dot_general", "conv_general_dilated"),
      flops=_compat.contraction_flops)
  add(("dot_general",), folds_transposed_matrices=True)
  # XLA's algebraic simplifier turns a contraction over nothing longer
  # than one into a broadcast multiply, fused into its readers: the
  # per-example gradients of a DP-SGD step (`vmap(grad)`, batch 256, a
  # 2048 x 2048 weight: 4 GiB) are made by the kernel that transposes
  # them for the contraction that sums them, not also as the products'
  # own buffers (the simulator's peak for that step went from 8.06 to
  # 6.06 GiB; XLA's is 4.03).
  add(("dot_general",), fuses_when=_compat.contracts_nothing)
  add(("device_put",), recomputable=False)
  _add_split_rules(add)
  for primitive in _compat.INLINABLE_CALL_PRIMITIVES:
    rules[primitive] = dataclasses.replace(rules.get(primitive, OPAQUE),
                                           inlined_call=True)
  rules[_compat.barrier_p] = dataclasses.replace(
      rules.get(_compat.barrier_p, OPAQUE), recomputable=False,
      aliases_operands=True)
  for primitive in _compat.LOOP_PRIMITIVES:
    rules[primitive] = dataclasses.replace(rules.get(primitive, OPAQUE),
                                           loop=True)
  return types.MappingProxyType(rules)


def _add_split_rules(add) -> None:
  split = _split_rules
  add(_POINTWISE, splits=split.pointwise)
  for names, how in (
      (("transpose",), split.transpose), (("squeeze",), split.squeeze),
      (("reshape",), split.reshape),
      (("broadcast_in_dim",), split.broadcast_in_dim),
      (("iota",), split.iota), (("reduce_sum",), split.reduce_sum),
      (tuple(r for r in _REDUCTIONS if r != "reduce_sum"),
       split.reduce_other),
      (("slice",), split.slice_), (("pad",), split.pad),
      (("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "split"),
       split.along_axis("axis")),
      (("rev",), split.rev), (("concatenate",), split.concatenate),
      (("dot_general",), split.dot_general), (("gather",), split.gather),
      (("scatter_add",), split.scatter_add)):
    add(names, splits=how)


RULES = _table()
_TRANSPOSES = frozenset(_compat.primitives_named("transpose"))


def rule(primitive) -> PrimitiveRule:
  """The rule of `primitive`; `OPAQUE` for one the table does not name."""
  return RULES.get(primitive, OPAQUE)


def flops(eqn) -> float:
  """Multiply-add FLOPs of a contraction equation; 0 for any other."""
  count = rule(eqn.primitive).flops
  return 0.0 if count is None else count(eqn)


def is_recomputable(eqn) -> bool:
  """Whether `eqn` can be emitted a second time with the same result: a
  pure equation of one primitive (no effects, no body, not a copy between
  memories or a barrier)."""
  return (rule(eqn.primitive).recomputable and not eqn.effects
          and not _compat.sub_jaxprs(eqn))


def reduces_rows(eqn) -> bool:
  """Whether `eqn` is a reduction XLA can fuse as a row into its reader:
  one of `fuses_as_row` over its operand's last axis alone."""
  if not rule(eqn.primitive).fuses_as_row:
    return False
  rank = len(eqn.invars[0].aval.shape)
  return rank > 0 and tuple(_compat.reduced_axes(eqn)) == (rank - 1,)


def is_matrix_transpose(eqn) -> bool:
  """Whether `eqn` transposes a rank-2 value (what a contraction whose
  rule `folds_transposed_matrices` reads without a buffer)."""
  return (eqn.primitive in _TRANSPOSES and len(eqn.invars) == 1
          and len(getattr(eqn.invars[0].aval, "shape", ())) == 2)


def is_fusible_equation(eqn) -> bool:
  """Whether XLA computes `eqn` inside the kernels that read its results:
  an elementwise or re-layout primitive, an equation its rule's
  `fuses_when` says XLA makes elementwise, or a call of only such."""
  found = rule(eqn.primitive)
  if found.fuses_into_readers or (found.fuses_when is not None
                                  and found.fuses_when(eqn)):
    return True
  if not found.transparent_call:
    return False
  bodies = _compat.sub_jaxprs(eqn)
  return bool(bodies) and all(is_fusible_equation(e)
                              for body in bodies for e in body.eqns)
