"""Every use of JAX's unstable surfaces (`jax.extend`, `jax._src`) in one place.

jlms reads and re-emits jaxprs, which needs a few names that JAX does not
promise to keep. Each is imported here, once, with a note on the versions it
was checked against, so that a JAX upgrade touches this file alone.

Supported: JAX 0.10.2 through 0.12.x, told apart by feature (which params
an equation carries, which names exist), never by comparing version
strings. Known breaks handled here:
- The nested-jit primitive was `pjit_p` before it became `jit_p`; both are
  matched by object, never by name.
- A jit equation's `inline` param is a bool up to 0.10 and a `jax.Inline`
  enum from 0.11 on (`bind_jit`).
- A scan equation says how its inputs split into consts, carry and scanned
  `xs` with `num_consts`/`num_carry` up to 0.10, and with the flat trees
  `ft_in`/`ft_out` from 0.11 on (`scan_layout`).
- `ClosedJaxpr` merges into `Jaxpr` in 0.12 (a `Jaxpr` carries its consts,
  and `ClosedJaxpr` is an alias); `jaxpr_parts` reads either.

Anything else unknown raises `UnsupportedJaxError`, which names the JAX
version, rather than an `AttributeError` or `KeyError` from deep inside.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as _jex_core
from jax.extend import source_info_util as _source_info

Var = _jex_core.Var
Literal = _jex_core.Literal
DropVar = _jex_core.DropVar
Jaxpr = _jex_core.Jaxpr
ClosedJaxpr = _jex_core.ClosedJaxpr
JaxprEqn = _jex_core.JaxprEqn
Primitive = _jex_core.Primitive

_prims = _jex_core.primitives


class UnsupportedJaxError(NotImplementedError):
  """This JAX has changed an internal that jlms reads in a way jlms does not
  know yet."""

  __module__ = "jlms"  # tracebacks and reprs show the public name


def _unsupported(what: str) -> UnsupportedJaxError:
  return UnsupportedJaxError(
      f"jlms does not know how to read {what} in JAX {jax.__version__} "
      "(jlms supports JAX 0.10.2 through 0.12.x). Install a supported JAX, "
      "e.g. pip install 'jax[cpu]==0.12.0.1', or report this to jlms.")


def _param(eqn, name: str):
  """`eqn.params[name]`, or a clear error naming the JAX version."""
  try:
    return eqn.params[name]
  except KeyError:
    raise _unsupported(
        f"the {name!r} parameter of a {eqn.primitive} equation (it has "
        f"{sorted(eqn.params)})") from None

#: Call-like primitives whose body is inlined into the flat program: a nested
#: `jax.jit` (named `jit` from 0.8, `pjit` before), `closed_call`, and the
#: primal calls of `custom_jvp`/`custom_vjp` functions (XLA lowers them as
#: their `call_jaxpr`; the step is not differentiated again, so their rules
#: are not needed). `jax.checkpoint` (`remat_p`) is inlined by
#: `jlms._program` with the barrier its lowering puts on its inputs.
_JIT_PRIMITIVES = tuple(
    p for p in (getattr(_prims, "jit_p", None), getattr(_prims, "pjit_p", None))
    if p is not None)
INLINABLE_CALL_PRIMITIVES = frozenset(
    _JIT_PRIMITIVES + (_prims.closed_call_p, _prims.call_p,
                       _prims.custom_jvp_call_p, _prims.custom_vjp_call_p))
remat_p = _prims.remat_p

device_put_p = _prims.device_put_p
# Not in `jax.extend` (0.10.2): the one private primitive jlms matches.
from jax._src.lax.lax import optimization_barrier_p  # noqa: E402
barrier_p = optimization_barrier_p
scan_p = _prims.scan_p

# Not in `jax.extend` (0.10.2 to 0.12): which effects JAX orders (threads
# a token through). Read by feature: a JAX without the set orders none that
# jlms can tell.
from jax._src import effects as _effects  # noqa: E402
_ORDERED_EFFECTS = getattr(_effects, "ordered_effects", None)


def has_ordered_effect(eqn) -> bool:
  """Whether `eqn` (a nested call or loop: anything in its bodies) has an
  ordered effect: an `io_callback` or a `jax.debug.print` with
  `ordered=True`. JAX (0.10.2 to 0.12) fails to lower a program with one
  where any of its values has a memory kind ("safe_zip() argument 1 has
  length ...": the effect's token is not zipped with the kinds)."""
  if _ORDERED_EFFECTS is None:
    return False
  return bool(_ORDERED_EFFECTS.filter_in(eqn.effects))


def primitives_named(*names: str) -> tuple:
  """The primitive objects of `names` (without the `_p` suffix) that this
  JAX has; a name it lacks is skipped rather than matched by string."""
  found = (getattr(_prims, f"{name}_p", None) for name in names)
  return tuple(p for p in found if p is not None)


def reduced_axes(eqn) -> tuple[int, ...]:
  """The axes a reduction equation reduces."""
  return tuple(int(a) for a in _param(eqn, "axes"))


#: The loop primitives (a scan, a while loop).
LOOP_PRIMITIVES = frozenset(primitives_named("scan", "while"))


def sub_jaxprs(eqn) -> list:
  """The open jaxprs among an equation's params (bodies, branches)."""
  found = []
  for value in eqn.params.values():
    for item in (value if isinstance(value, (tuple, list)) else (value,)):
      if isinstance(item, ClosedJaxpr):
        found.append(item.jaxpr)
      elif isinstance(item, Jaxpr):
        found.append(item)
  return found


@dataclasses.dataclass(frozen=True)
class ScanLayout:
  """How a scan equation's inputs and outputs split, and its body.

  Inputs are `num_consts` consts, `num_carry` carries, then the scanned
  `xs`; outputs are `num_carry` final carries, then the stacked `ys`.
  """
  num_consts: int
  num_carry: int
  length: int
  reverse: bool
  body: Any  # ClosedJaxpr (up to 0.11) or Jaxpr with consts (0.12)


def scan_layout(eqn) -> ScanLayout:
  """The `ScanLayout` of a scan equation, however this JAX spells it."""
  params = eqn.params
  if "num_carry" in params:  # up to 0.10
    num_consts, num_carry = params["num_consts"], params["num_carry"]
  elif "ft_in" in params:  # 0.11 on: flat trees of (consts, carry, xs)
    try:
      consts, carry, _ = params["ft_in"].unpack()
    except (AttributeError, TypeError, ValueError) as error:
      raise _unsupported(f"the scan's ft_in {params['ft_in']!r}") from error
    num_consts, num_carry = len(consts), len(carry)
  else:
    raise _unsupported(f"a scan equation with params {sorted(params)}")
  return ScanLayout(num_consts, num_carry, _param(eqn, "length"),
                    _param(eqn, "reverse"), _param(eqn, "jaxpr"))


def with_scan_body(eqn, body, **fields):
  """Scan `eqn` with its body replaced (same input and output layout), and
  the equation's `fields` (invars, outvars) replaced too."""
  _param(eqn, "jaxpr")
  return eqn.replace(params={**eqn.params, "jaxpr": body}, **fields)


def with_call_body(eqn, body, name: str, **fields):
  """Nested-jit `eqn` with its body and name replaced, and the equation's
  `fields` replaced too."""
  _param(eqn, "jaxpr")
  return eqn.replace(params={**eqn.params, "jaxpr": body, "name": name},
                     **fields)


def call_body_closed(eqn):
  """The body of a nested-jit equation as it is stored (closed)."""
  return _param(eqn, "jaxpr")


def is_jit_primitive(primitive) -> bool:
  return primitive in _JIT_PRIMITIVES


def jaxpr_parts(closed_or_open) -> tuple[Any, list]:
  """(open jaxpr, consts) of a ClosedJaxpr, or of a Jaxpr with no consts."""
  if isinstance(closed_or_open, ClosedJaxpr):
    return closed_or_open.jaxpr, list(closed_or_open.consts)
  return closed_or_open, []


def call_body(eqn) -> tuple[Any, list]:
  """The inlinable body (open jaxpr, consts) of a call-like equation."""
  params = eqn.params
  body = params["call_jaxpr"] if "call_jaxpr" in params else _param(eqn, "jaxpr")
  return jaxpr_parts(body)


def call_name(eqn) -> str | None:
  """The name a call-like equation gives its body (a nested jit's function
  name), if it has one."""
  name = eqn.params.get("name")
  return name if isinstance(name, str) else None


def remat_body(eqn) -> tuple[Any, list]:
  """The body (open jaxpr, consts) of a `jax.checkpoint` equation."""
  return jaxpr_parts(_param(eqn, "jaxpr"))


def remat_barrier_positions(eqn) -> list[int]:
  """Inputs of a `jax.checkpoint` equation that its lowering passes through
  an optimization barrier (so that XLA cannot CSE the recomputation with
  the forward pass): those with `prevent_cse`, once differentiated."""
  if not eqn.params.get("differentiated", False):
    return []
  prevent_cse = _param(eqn, "prevent_cse")
  if isinstance(prevent_cse, bool):
    prevent_cse = (prevent_cse,) * len(eqn.invars)
  return [i for i, flag in enumerate(prevent_cse) if flag]


def _is_unspecified(sharding) -> bool:
  # `UNSPECIFIED` is a private sentinel; compare by type name so that a moved
  # module does not break inlining (it only makes inlining more conservative).
  return type(sharding).__name__ == "UnspecifiedValue"


def jit_is_plain(eqn) -> bool:
  """True when a nested jit carries no placement of its own, so inlining it
  changes nothing but the program's nesting."""
  params = eqn.params
  shardings = tuple(params.get("in_shardings", ())) + tuple(
      params.get("out_shardings", ()))
  layouts = tuple(params.get("in_layouts", ())) + tuple(
      params.get("out_layouts", ()))
  return (all(_is_unspecified(s) for s in shardings)
          and all(l is None for l in layouts)
          and not params.get("compiler_options_kvs"))


def new_var(aval):
  return Var(aval)


def new_dropvar(aval):
  return DropVar(aval)


def eval_jaxpr(jaxpr, consts, *args) -> list:
  """Evaluates (or, under a trace, stages) an open jaxpr on `args`."""
  return jax.core.eval_jaxpr(jaxpr, consts, *args)


def has_plain_layout(aval) -> bool:
  """An array with a memory layout of its own (not a token or PRNG key)."""
  dtype = getattr(aval, "dtype", None)
  return dtype is not None and not is_extended_dtype(dtype)


def passes_a_barrier(aval) -> bool:
  """An array that `optimization_barrier` takes: one with a layout of its
  own, or a PRNG key (every JAX this supports ties typed keys, as its own
  checkpoint does); not a token."""
  return getattr(aval, "dtype", None) is not None and getattr(
      aval, "shape", None) is not None


def under_a_trace() -> bool:
  """Whether any JAX trace (jit, scan, vmap, grad, ...) is active: a
  constant-time check before looking for tracers among many leaves."""
  from jax._src import core
  return not core.trace_state_clean()


def is_transformed(value) -> bool:
  """Whether `value` is a tracer of a transformation that computes on it
  (`jax.vmap`, `jax.grad`, `jax.jvp`, ...), not of staging into a jaxpr
  (`jax.jit`, `lax.scan`, `jax.make_jaxpr`)."""
  from jax._src.interpreters import partial_eval
  return (isinstance(value, jax.core.Tracer)
          and not isinstance(value, partial_eval.DynamicJaxprTracer))


def nan_check_errors() -> tuple:
  """The errors of `jax_debug_nans` / `jax_debug_infs` finding a NaN or an
  infinity in what the step computes: the step's own, never jlms's."""
  from jax._src import api_util
  internal = getattr(api_util, "InternalFloatingPointError", None)
  return (FloatingPointError,) + ((internal,) if internal else ())


def is_host_aval(aval) -> bool:
  """Whether `aval` is placed in host memory (pinned or unpinned)."""
  return getattr(aval, "memory_space", None) == jax.memory.Space.Host


def on_device(aval):
  """`aval` in device memory (itself when it is there already)."""
  if not is_host_aval(aval):
    return aval
  return aval.update(memory_space=jax.memory.Space.Device)


def memory_space_aval(aval, space):
  """`aval` placed in memory space `space` (a `jax.memory.Space`)."""
  return aval.update(memory_space=space)


@functools.cache
def _template_equation(kind: str):
  # Equations are copied from a tiny traced template so that jlms never spells
  # out a primitive's params (they change between JAX versions).
  x = jax.ShapeDtypeStruct((), jnp.float32)
  if kind == "barrier":
    fn = jax.lax.optimization_barrier
  else:
    space = jax.memory.Space.Host if kind == "to_host" else jax.memory.Space.Device
    fn = lambda v: jax.device_put(v, space)
  return jax.make_jaxpr(fn)(x).jaxpr.eqns[0]


def device_put_equation(invar, outvar, to_host: bool, anchor_eqn,
                        scope: str):
  """A `device_put` of `invar` to pinned host (or back to device), under
  the name stack `scope` alone (see `scope_name_stack`)."""
  template = _template_equation("to_host" if to_host else "to_device")
  return _copy_equation(template, [invar], [outvar], anchor_eqn, scope)


def sharding_constraint_equation(invar, outvar, sharding, anchor_eqn,
                                 scope: str):
  """A `with_sharding_constraint` of `invar` to `sharding` (its aval's
  shape must divide by it), under the name stack `scope` alone."""
  template = _constraint_template(tuple(invar.aval.shape), invar.aval.dtype,
                                  sharding)
  return _copy_equation(template, [invar], [outvar], anchor_eqn, scope)


@functools.lru_cache(maxsize=256)
def _constraint_template(shape, dtype, sharding):
  # Traced at the value's own shape: the constraint's params are the
  # sharding's, which JAX checks against the shape.
  x = jax.ShapeDtypeStruct(shape, dtype)
  return jax.make_jaxpr(
      lambda v: jax.lax.with_sharding_constraint(v, sharding))(x).jaxpr.eqns[0]


def barrier_equation(invars, outvars, anchor_eqn, scope: str):
  """An `optimization_barrier` whose outputs are its inputs, under the name
  stack `scope` alone."""
  return _copy_equation(_template_equation("barrier"), invars, outvars,
                        anchor_eqn, scope)


def _copy_equation(template, invars, outvars, anchor_eqn, scope):
  # The anchor's traceback and context (the user's line, its mesh), but a
  # name of jlms's own: under the anchor's name stack, a transformation
  # around it would wrap the scope ("jvp(jlms)/...").
  source_info = anchor_eqn.source_info.replace(
      name_stack=scope_name_stack(scope))
  return template.replace(invars=list(invars), outvars=list(outvars),
                          source_info=source_info, ctx=anchor_eqn.ctx)


def scope_name_stack(scope: str):
  """A name stack of `scope` alone ("jlms/swap_out/<value>"): the op names
  XLA gives the equations under it start with it, after the jit's own."""
  return _source_info.new_name_stack(scope)


def rebuilt_equation(eqn, invars, outvars, name_stack):
  """`eqn` reading `invars` and writing `outvars`, under `name_stack` (its
  full name stack, or `scope_name_stack`'s)."""
  return eqn.replace(invars=list(invars), outvars=list(outvars),
                     source_info=eqn.source_info.replace(name_stack=name_stack))


def closed_jaxpr(constvars, consts, invars, outvars, eqns, debug_info):
  effects = frozenset().union(*(e.effects for e in eqns))
  jaxpr = Jaxpr(constvars, invars, outvars, eqns, effects,
                debug_info=debug_info)
  return ClosedJaxpr(jaxpr, list(consts))


def call_template(closed) -> tuple[dict, Any]:
  """(params, debug info) of the single jit equation that
  `jax.make_jaxpr(jax.jit(f))` produces. Raises if it produced another
  shape of jaxpr: under `jax.disable_jit()` (the step's equations come
  inlined), or in a JAX that jlms does not know."""
  jaxpr, _ = jaxpr_parts(closed)
  if len(jaxpr.eqns) != 1 or not is_jit_primitive(jaxpr.eqns[0].primitive):
    if jax.config.jax_disable_jit:
      raise RuntimeError(
          "jlms: a step cannot be planned under jax.disable_jit(): "
          "jax.jit(step) traces to the step's equations inlined, with no "
          "jit equation to stage the rewritten program as")
    raise _unsupported(f"a jax.jit(step) trace of {len(jaxpr.eqns)} "
                       "equations, not one jit equation")
  params = jaxpr.eqns[0].params
  return dict(params), jaxpr_parts(_param(jaxpr.eqns[0], "jaxpr"))[0].debug_info


# The `inline` value that makes jit's staging rule copy a body's equations
# into the caller rather than nest a call (which XLA's CPU pipeline does not
# always see through): `True` up to 0.10, `jax.Inline.JAX_EARLY` from 0.11.
_INLINE_INTO_CALLER = (jax.Inline.JAX_EARLY if hasattr(jax, "Inline")
                       else True)


def bind_jit(params: dict, closed, args) -> list:
  """Stages `closed` into the current trace on `args` with one bind, however
  many equations it has, its equations copied into the caller."""
  if "inline" not in params:
    raise _unsupported("a jit equation without an 'inline' parameter")
  return _JIT_PRIMITIVES[0].bind(
      *args, **{**params, "jaxpr": closed, "inline": _INLINE_INTO_CALLER})


def mark_host_arguments(lowered, positions) -> None:
  """Marks, in place, the arguments of `lowered` at `positions` (among the
  call's dynamic leaves) as taken from pinned host memory: the attribute
  `mhlo.memory_kind = "pinned_host"` that JAX puts on an argument in
  pinned host memory on a GPU, which compile-only devices drop from
  shardings (XLA then lays it out in host memory, S(5)). The arguments jit
  prunes as unused are skipped."""
  from jax._src.lib.mlir import ir  # the module that holds the attributes
  kept = lowered._lowering.compile_args.get("kept_var_idx")
  order = sorted(kept) if kept is not None else None
  module = lowered.compiler_ir()  # the module `compile()` compiles
  with module.context:
    main = next(op for op in module.body.operations
                if "sym_name" in op.attributes
                and ir.StringAttr(op.attributes["sym_name"]).value == "main")
    attributes = list(main.arg_attrs)
    for position in positions:
      if order is not None and position not in kept:
        continue
      index = order.index(position) if order is not None else position
      entries = {a.name: a.attr for a in ir.DictAttr(attributes[index])}
      entries["mhlo.memory_kind"] = ir.StringAttr.get("pinned_host")
      attributes[index] = ir.DictAttr.get(entries)
    main.arg_attrs = ir.ArrayAttr.get(attributes)


def compiler_options(lowered) -> tuple | None:
  """The XLA options `jax.jit(..., compiler_options=...)` gave `lowered`'s
  compile, as (name, value) pairs, () for none: they change what XLA
  compiles but are not in `lowered.as_text()`. None where this JAX keeps
  them elsewhere (not known)."""
  options = getattr(getattr(lowered, "_lowering", None),
                    "_compiler_options_kvs", None)
  return None if options is None else tuple(options)


def is_scalar_broadcast(eqn) -> bool:
  """Whether `eqn` broadcasts a rank-0 operand to an array."""
  return (eqn.primitive is _prims.broadcast_in_dim_p
          and not getattr(eqn.invars[0].aval, "shape", (0,)))


def broadcast_scalar(eqn, operand, shape) -> Any:
  """The broadcast of rank-0 `eqn` staged for `operand` at `shape`, its
  other params as they are (a sharding of the whole array is dropped: a
  slice of it is not that)."""
  params = dict(eqn.params, shape=tuple(shape), broadcast_dimensions=())
  if "sharding" in params:
    params["sharding"] = None
  return eqn.primitive.bind(operand, **params)


def bind_equation(eqn, args) -> list:
  """Stages (or evaluates) `eqn`, an equation with no sub-jaxprs, on `args`
  with its own params; its results as a list."""
  if sub_jaxprs(eqn):
    raise _unsupported(f"binding a {eqn.primitive} equation with a body")
  out = eqn.primitive.bind(*args, **eqn.params)
  return list(out) if eqn.primitive.multiple_results else [out]


def stage_equation(eqn, args) -> list:
  """Stages (or evaluates) any equation, bodies included, on `args` under
  its own name stack, as `jax.core.eval_jaxpr` does for each of its
  equations; its results as a list."""
  params = eqn.primitive.get_bind_params(eqn.params)
  stack = _source_info.current_name_stack() + eqn.source_info.name_stack
  with _source_info.user_context(eqn.source_info.traceback,
                                 name_stack=stack), eqn.ctx.manager:
    out = eqn.primitive.bind(*args, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def name_stack(eqn):
  """The name stack of `eqn` (relative to the jaxpr that holds it)."""
  return eqn.source_info.name_stack


def body_equations(eqn) -> list:
  """The equations of `eqn`'s bodies (a loop's, a call's), in order."""
  return [inner for body in sub_jaxprs(eqn) for inner in body.eqns]


def extend_name_stack(stack, name: str):
  return stack.extend(name)


def empty_name_stack():
  return _source_info.new_name_stack()


def user_frame_summary(source_info) -> str:
  """'file.py:LINE (function)' of the user code that made an equation."""
  try:
    return _source_info.summarize(source_info)
  except Exception:  # best effort: a missing traceback is not an error
    return ""


def abstractify(leaf):
  """The abstract value jit would trace `leaf` as (arrays, tracers, scalars,
  ShapeDtypeStructs alike)."""
  from jax._src import core as _core  # the one public-less function we need
  return _core.shaped_abstractify(leaf)


def is_extended_dtype(dtype) -> bool:
  """PRNG key arrays and other dtypes that have no plain memory layout."""
  return jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


@functools.lru_cache(maxsize=None)
def extended_itemsize(dtype) -> int:
  """Bytes one element of an extended dtype takes on the device: a typed
  PRNG key's data (two uint32 for threefry); 0 for any other extended
  dtype, which jlms does not size."""
  if not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    return 0
  data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
  return math.prod(data.shape) * np.dtype(data.dtype).itemsize


def check_jaxpr(closed) -> None:
  """Raises if `closed` is not a well-typed jaxpr (used by the tests)."""
  _jex_core.check_jaxpr(jaxpr_parts(closed)[0])


def is_device_put(eqn) -> bool:
  return eqn.primitive is device_put_p


def _shape_size(shape) -> int:
  size = 1
  for dim in shape:
    size *= int(dim)
  return size


def contraction_flops(eqn) -> float:
  """Multiply-add FLOPs (2 per multiply-accumulate) of a `dot_general` or
  `conv_general_dilated` equation; 0 for any other primitive."""
  if eqn.primitive is _prims.dot_general_p:
    (lhs_contracting, _), _ = _param(eqn, "dimension_numbers")
    lhs_shape = eqn.invars[0].aval.shape
    contracted = _shape_size(lhs_shape[d] for d in lhs_contracting)
    return 2.0 * _shape_size(eqn.outvars[0].aval.shape) * contracted
  if eqn.primitive is _prims.conv_general_dilated_p:
    numbers = _param(eqn, "dimension_numbers")
    rhs_shape = eqn.invars[1].aval.shape
    out_features_dim = numbers.rhs_spec[0]
    # Each output element accumulates over one kernel window of the input
    # features of its group: the kernel's size per output feature.
    per_output = _shape_size(rhs_shape) // max(int(rhs_shape[out_features_dim]), 1)
    return 2.0 * _shape_size(eqn.outvars[0].aval.shape) * per_output
  return 0.0


def contracts_nothing(eqn) -> bool:
  """Whether a `dot_general` contracts no dimension longer than one (an
  outer product: `vmap(grad)`'s per-example weight gradients)."""
  if eqn.primitive is not _prims.dot_general_p:
    return False
  (lhs_contracting, _), _ = _param(eqn, "dimension_numbers")
  lhs_shape = eqn.invars[0].aval.shape
  return all(lhs_shape[d] == 1 for d in lhs_contracting)


def contraction_is_full_precision(eqn) -> bool:
  """Whether a float32 contraction asked for HIGHEST precision (no TF32)."""
  precision = eqn.params.get("precision")
  return "HIGHEST" in str(precision)


def is_convolution(eqn) -> bool:
  return eqn.primitive is _prims.conv_general_dilated_p


def loop_trip_count(eqn) -> int | None:
  """Iterations of a loop equation: a scan's length; None for a `while`
  (unknown) and for anything else."""
  if eqn.primitive is scan_p:
    return int(scan_layout(eqn).length)
  return None


def loop_carries(eqn) -> tuple[tuple[int, int], ...]:
  """(input position, output position) of each carry of a loop equation:
  a scan's carries, a `while`'s (after its condition's and body's
  consts); () for anything else."""
  if eqn.primitive is scan_p:
    layout = scan_layout(eqn)
    return tuple((layout.num_consts + i, i) for i in range(layout.num_carry))
  if eqn.primitive is _prims.while_p:
    skipped = _param(eqn, "cond_nconsts") + _param(eqn, "body_nconsts")
    return tuple((skipped + i, i) for i in range(len(eqn.outvars)))
  return ()


def pruned_jaxpr(closed, outputs: list[int]):
  """`closed` (same inputs) computing only its outputs at `outputs`: the
  equations nothing kept reads are dropped (effectful ones are kept)."""
  jaxpr, consts = jaxpr_parts(closed)
  outvars = [jaxpr.outvars[i] for i in outputs]
  needed = {v for v in outvars if isinstance(v, Var)}
  kept = []
  for eqn in reversed(jaxpr.eqns):
    if eqn.effects or any(v in needed for v in eqn.outvars):
      kept.append(eqn)
      needed.update(v for v in eqn.invars if isinstance(v, Var))
  return closed_jaxpr(jaxpr.constvars, consts, jaxpr.invars, outvars,
                      kept[::-1], jaxpr.debug_info)


#: Where each shape parameter of a primitive lives, read by `shape_layout`:
#: (name in `jlms._split_rules`, param name).
_SHAPE_PARAMS = (
    ("axes", "axes"), ("broadcast_dimensions", "broadcast_dimensions"),
    ("dimension_numbers", "dimension_numbers"),
    ("start_indices", "start_indices"), ("limit_indices", "limit_indices"),
    ("strides", "strides"), ("padding_config", "padding_config"),
    ("permutation", "permutation"), ("dimensions", "dimensions"),
    ("dimension", "dimension"), ("axis", "axis"), ("new_sizes", "new_sizes"),
    ("slice_sizes", "slice_sizes"))
_INDEXING = frozenset(primitives_named("gather", "scatter_add"))


def _index_dimension_numbers(numbers) -> dict:
  """A gather's or scatter's dimension numbers as plain tuples (batching
  dims are empty in a JAX without them)."""
  fields = ("offset_dims", "collapsed_slice_dims", "start_index_map",
            "operand_batching_dims", "start_indices_batching_dims",
            "update_window_dims", "inserted_window_dims",
            "scatter_dims_to_operand_dims", "scatter_indices_batching_dims")
  return {name: tuple(int(d) for d in getattr(numbers, name))
          for name in fields if hasattr(numbers, name)}


def shape_layout(eqn) -> dict:
  """The shape parameters `eqn` carries (axes, dimension maps, slice
  bounds, padding), as plain ints and tuples under the names of
  `_SHAPE_PARAMS`; a `dot_general`'s dimension numbers as
  `((lhs contracting, rhs contracting), (lhs batch, rhs batch))`."""
  layout = {}
  for name, param in _SHAPE_PARAMS:
    if param not in eqn.params:
      continue
    value = eqn.params[param]
    if name == "dimension_numbers" and eqn.primitive is _prims.dot_general_p:
      (lc, rc), (lb, rb) = value
      value = ((tuple(map(int, lc)), tuple(map(int, rc))),
               (tuple(map(int, lb)), tuple(map(int, rb))))
    elif name == "dimension_numbers" and eqn.primitive in _INDEXING:
      value = _index_dimension_numbers(value)
    elif name == "padding_config":
      value = tuple(tuple(int(x) for x in p) for p in value)
    elif name in ("dimension", "axis"):
      value = None if value is None else int(value)
    elif value is not None and name != "dimension_numbers":
      value = tuple(int(x) for x in value)
    layout[name] = value
  return layout


def bind_resized(eqn, args, out_shapes) -> list:
  """Stages `eqn` (no sub-jaxprs) on `args`, operands cut along one axis,
  with the shape parameters that make its results `out_shapes`: the
  target shape of a `broadcast_in_dim`, `iota` or `reshape`, a `slice`'s
  limits. A sharding of the whole array (`sharding`, `out_sharding`) is
  dropped (a slice of it is not that). Its results as a list."""
  params = dict(eqn.params)
  out_shape = tuple(int(d) for d in out_shapes[0])
  primitive = eqn.primitive
  if primitive in (_prims.broadcast_in_dim_p, _prims.iota_p):
    params["shape"] = out_shape
  elif primitive is _prims.reshape_p:
    params["new_sizes"] = out_shape
  elif primitive is _prims.gather_p:
    # A window taken whole along the cut axis is cut with it.
    operand = args[0].shape
    params["slice_sizes"] = tuple(min(int(size), int(operand[d])) for d, size
                                  in enumerate(params["slice_sizes"]))
  elif primitive is _prims.slice_p:
    strides = params.get("strides") or (1,) * len(out_shape)
    params["limit_indices"] = tuple(
        int(start) + (size - 1) * int(stride) + 1 if size else int(start)
        for start, size, stride in zip(params["start_indices"], out_shape,
                                       strides))
  for name in ("sharding", "out_sharding"):
    if params.get(name) is not None:
      params[name] = None
  out = primitive.bind(*args, **params)
  return list(out) if primitive.multiple_results else [out]
