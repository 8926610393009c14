"""JAX's internals are read in `jlms/_compat.py` alone, by feature, with a
clear error for what it does not know."""

import ast
import pathlib

import jax
import jax.numpy as jnp
import pytest

import jlms
from jlms import _compat, _xla_memory

_PACKAGE = pathlib.Path(jlms.__file__).parent


def _modules_but_compat():
  return [p for p in sorted(_PACKAGE.glob("*.py")) if p.name != "_compat.py"]


def test_only_compat_reads_equation_params_or_private_jax():
  offences = []
  for path in _modules_but_compat():
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.Attribute) and node.attr == "params":
        offences.append(f"{path.name}:{node.lineno} reads .params")
      if isinstance(node, ast.ImportFrom) and node.module and (
          node.module.startswith(("jax._src", "jax.extend"))):
        offences.append(f"{path.name}:{node.lineno} imports {node.module}")
      if isinstance(node, ast.Import) and any(
          a.name.startswith(("jax._src", "jax.extend")) for a in node.names):
        offences.append(f"{path.name}:{node.lineno} imports private jax")
  assert len(_modules_but_compat()) >= 10
  assert not offences, offences


def _scan_equation():
  def f(w, c, xs):
    def body(carry, x):
      return carry * w + x, carry - x
    return jax.lax.scan(body, c, xs)
  (eqn,) = jax.make_jaxpr(f)(2.0, 1.0, jnp.ones(5)).jaxpr.eqns
  return eqn


def test_scan_layout_reads_this_jax():
  eqn = _scan_equation()
  layout = _compat.scan_layout(eqn)
  assert (layout.num_consts, layout.num_carry) == (1, 1)
  assert (layout.length, layout.reverse) == (5, False)
  assert len(layout.body.jaxpr.invars) == 3  # const, carry, x
  assert len(eqn.invars) == layout.num_consts + layout.num_carry + 1


def test_unknown_equation_params_name_the_jax_version():
  eqn = _scan_equation().replace(params={"jaxpr": None, "length": 5})
  with pytest.raises(_compat.UnsupportedJaxError, match=jax.__version__):
    _compat.scan_layout(eqn)
  with pytest.raises(_compat.UnsupportedJaxError, match="supports JAX"):
    _compat.call_body(eqn.replace(params={}))


def test_bind_jit_inlines_the_body_into_the_caller():
  closed = jax.make_jaxpr(jax.jit(lambda x: jnp.sin(x) * 2))(1.0)
  params, _ = _compat.call_template(closed)
  body, _ = _compat.call_body(closed.jaxpr.eqns[0])
  outer = jax.make_jaxpr(
      lambda x: _compat.bind_jit(
          params, _compat.call_body_closed(closed.jaxpr.eqns[0]), [x]))(1.0)
  assert [e.primitive for e in outer.jaxpr.eqns] == [
      e.primitive for e in body.eqns]


def test_a_plugin_of_another_jaxlib_is_named_with_the_install(monkeypatch):
  assert _xla_memory._plugin_version_mismatch() is None  # as installed here

  def version(package):
    if package.startswith("jax-cuda13"):
      return "0.0.1"
    raise _xla_memory.importlib.metadata.PackageNotFoundError(package)

  monkeypatch.setattr(_xla_memory.importlib.metadata, "version", version)
  message = _xla_memory._plugin_version_mismatch()
  assert "jax-cuda13-plugin 0.0.1 does not match jaxlib" in message
  assert f"jax[cuda13-local]=={jax.__version__}" in message


def test_call_template_refuses_a_trace_without_a_jit_equation():
  with jax.disable_jit():
    closed = jax.make_jaxpr(jax.jit(lambda x: jnp.sin(x) * 2))(1.0)
    with pytest.raises(RuntimeError, match="disable_jit"):
      _compat.call_template(closed)
  inlined = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
  with pytest.raises(_compat.UnsupportedJaxError, match="2 equations"):
    _compat.call_template(inlined)
