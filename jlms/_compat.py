"""Every use of JAX's unstable surfaces (`jax.extend`, `jax._src`) in one place.

jlms reads and re-emits jaxprs, which needs a few names that JAX does not
promise to keep. Each is imported here, once, with a note on the versions it
was checked against, so that a JAX upgrade touches this file alone.

Checked with jax 0.10.2. Known breaks to watch (see STYLE.md):
- `Primitive.get_bind_params` returns `(subfuns, params)` before 0.9.2 and the
  params alone from 0.9.2 on; `bind_params` below accepts both.
- The nested-jit primitive was `pjit_p` before it became `jit_p`; both are
  matched by object, never by name.
- `ClosedJaxpr` merges into `Jaxpr` in 0.11; `jaxpr_parts` reads either.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
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

#: Call-like primitives whose body is inlined into the flat program: a nested
#: `jax.jit` (named `jit` from 0.8, `pjit` before) and `closed_call`.
_JIT_PRIMITIVES = tuple(
    p for p in (getattr(_prims, "jit_p", None), getattr(_prims, "pjit_p", None))
    if p is not None)
INLINABLE_CALL_PRIMITIVES = frozenset(
    _JIT_PRIMITIVES + (_prims.closed_call_p, _prims.call_p))

device_put_p = _prims.device_put_p


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
  body = params["jaxpr"] if "jaxpr" in params else params["call_jaxpr"]
  return jaxpr_parts(body)


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


def bind_params(eqn) -> tuple[tuple, dict]:
  """(leading sub-functions, keyword params) to re-bind `eqn`'s primitive."""
  got = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(got, tuple):  # jax < 0.9.2
    subfuns, params = got
    return tuple(subfuns), params
  params = dict(got)
  subfuns = params.pop("subfuns", ())
  return tuple(subfuns), params


def bind_equation(eqn, invals, name_stack):
  """Binds `eqn`'s primitive on `invals` in the current trace, keeping its
  source location, name stack and per-equation context (mesh, compute type)."""
  subfuns, params = bind_params(eqn)
  with _source_info.user_context(eqn.source_info.traceback,
                                 name_stack=name_stack), eqn.ctx.manager:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return out if eqn.primitive.multiple_results else [out]


def current_name_stack():
  return _source_info.current_name_stack()


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


@contextlib.contextmanager
def no_context():
  yield
