"""`jlms.offload`: same results as `jax.jit`, the jit surface, bad input."""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jlms
from benchmarks import models
from jlms_tests.conftest import (F32_TOLERANCE, FORCED, backend_compiles,
                                 max_relative_error)

# Small thresholds so that even tiny test models offload plenty.
EAGER = dict(min_bytes=1, swapout_threshold=4)
@functools.cache
def _case(name):
  return models.SMALL_CASES[name]()


def _concrete_args(case) -> tuple:
  """`case.make_args()` compiled as one program. The cases initialise their
  models eagerly, which compiles each new operation of the initialisation
  on its own: on JAX 0.12.0.1 the scanned GPT's arguments take 3.5 s that
  way and 1.6 s so, the ResNet's 2.4 and 1.3. (Eagerly, operations
  compiled before are reused: a case whose operations an earlier test
  compiled is quicker eagerly.) The same keys draw the same values, up to
  XLA's rounding of the fused random-number code."""
  return jax.jit(case.make_args)()


def _cases(slow=()):
  """The case names, those in `slow` in the slow tier: the quick one keeps
  a case of each kind of program (the scanned GPT stands for both)."""
  return [pytest.param(name, marks=[pytest.mark.slow] if name in slow else [])
          for name in sorted(models.SMALL_CASES)]


# The quick tier runs the MLP and the control-flow step; the property tests
# draw attention, scanned and BatchNorm steps there. The hand-written GPTs
# and ResNet (5 to 10 s each on JAX 0.12) are in the slow tier.
@pytest.mark.parametrize("name", _cases(slow={"gpt", "gpt_scan", "resnet_bn_adam"}))
def test_outputs_equal_jax_jit(name):
  case = _case(name)
  args = _concrete_args(case)
  step = jlms.offload(case.step, **FORCED)
  assert step.plan(*args).offloaded, "the test must exercise offloading"
  expected = jax.jit(case.step)(*args)
  assert max_relative_error(step(*args), expected) <= F32_TOLERANCE


# A transformer's H100 compile takes 8 to 11 seconds (XLA compiles each of
# its many small kernels): both are in the slow tier.
# The quick tier compiles the MLP for an H100; the others (5 to 10 s each
# on JAX 0.12) are in the slow tier.
@pytest.mark.parametrize("name", _cases(slow={"gpt", "gpt_scan", "resnet_bn_adam",
                                             "control_flow"}))
def test_h100_compile_puts_bytes_on_host(name):
  case = _case(name)
  memory = jlms.xla_memory(jlms.offload(case.step, **FORCED),
                           *case.abstract_args(), target="h100")
  assert memory.host_bytes > 0
  assert memory.host_offloaded_buffers > 0


@pytest.mark.slow  # a few seconds: the quick tier stays within 2 minutes
def test_gpt_adamw_gradients_equal_jax_jit():
  case = models.gpt_case(layers=2, width=64, heads=2, seq=32, batch=2,
                         vocab=128)
  params, _, tokens = case.make_args()

  def grads(params, tokens):
    # The loss of the case's own step, differentiated.
    (_, _), loss = case.step(params, optax.adamw(0.0).init(params), tokens)
    return loss

  value_and_grad = lambda p, t: jax.value_and_grad(grads)(p, t)
  expected = jax.jit(value_and_grad)(params, tokens)
  actual = jlms.offload(value_and_grad, **EAGER)(params, tokens)
  assert max_relative_error(actual, expected) <= F32_TOLERANCE


def _mlp(params, x):
  for w in params:
    x = jnp.tanh(x @ w)
  return x


def _sgd_step(params, x, lr=0.1):
  loss = lambda p: jnp.mean(_mlp(p, x) ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads), value


def _mlp_args(depth=6, width=64):
  keys = jax.random.split(jax.random.key(1), depth)
  params = [jax.random.normal(k, (width, width)) / np.sqrt(width)
            for k in keys]
  return params, jnp.ones((32, width))


def test_traceable_inside_jit_and_grad_free_transforms():
  params, x = _mlp_args()
  step = jlms.offload(_sgd_step, **EAGER)
  expected = jax.jit(_sgd_step)(params, x)
  assert max_relative_error(jax.jit(step)(params, x), expected) <= F32_TOLERANCE
  assert "device_put" in str(jax.make_jaxpr(step)(params, x))


def test_lower_with_shape_dtype_structs_of_an_h100():
  params, x = _mlp_args()
  device = jlms.target_devices("h100")[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  abstract = jax.tree.map(
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
      (params, x))
  step = jlms.offload(_sgd_step, **EAGER)
  for lowered in (step.lower(*abstract), jax.jit(step).lower(*abstract)):
    compiled = lowered.compile()
    assert "S(5)" in compiled.as_text()
    assert compiled.memory_analysis().host_temp_size_in_bytes > 0


def test_static_and_donated_arguments():
  params, x = _mlp_args()
  step = jlms.offload(_sgd_step, static_argnums=2, donate_argnums=0, **EAGER)
  expected = jax.jit(_sgd_step, static_argnums=2)(params, x, 0.5)
  assert max_relative_error(step(params, x, 0.5), expected) <= F32_TOLERANCE
  lowered = step.lower(params, x, 0.5)
  assert "tf.aliasing_output" in lowered.as_text() or (
      "jax.buffer_donor" in lowered.as_text())
  assert all(p.is_deleted() for p in params)  # donated

  params, x = _mlp_args()
  by_name = jlms.offload(_sgd_step, static_argnames="lr", **EAGER)
  assert max_relative_error(by_name(params, x, lr=0.5), expected) <= F32_TOLERANCE


def _sgd_step_branching_on_lr(params, x, lr=0.1):
  if lr > 0.25:  # Python control flow on lr: it must be static
    return _sgd_step(params, x, lr / 2)
  return _sgd_step(params, x, lr)


@pytest.mark.parametrize("static, call", [
    (dict(static_argnames="lr"), lambda step, p, x: step(p, x, 0.5)),
    (dict(static_argnums=2), lambda step, p, x: step(p, x, lr=0.5)),
], ids=["name-passed-by-position", "number-passed-by-name"])
def test_static_arguments_named_either_way(static, call):
  # jax.jit completes static_argnums and static_argnames from each other
  # through the step's signature; so does jlms.
  params, x = _mlp_args()
  expected = jax.jit(_sgd_step_branching_on_lr, **static)(params, x, 0.5)
  step = jlms.offload(_sgd_step_branching_on_lr, **static, **EAGER)
  assert max_relative_error(call(step, params, x), expected) <= F32_TOLERANCE
  assert call(step.plan, params, x).offloaded  # planned on a concrete lr


def test_donated_argument_named_and_passed_by_position():
  params, x = _mlp_args()
  step = jlms.offload(_sgd_step, donate_argnames="params", **EAGER)
  step(params, x)
  assert all(p.is_deleted() for p in params)


def test_one_analysis_per_signature():
  traces = []

  def counted(params, x):
    traces.append(1)
    return _sgd_step(params, x)

  step = jlms.offload(counted, **EAGER)
  params, x = _mlp_args()
  step(params, x)
  step(params, x + 1.0)
  step.plan(params, x)
  assert len(traces) == 1
  step(params, jnp.ones((16, 64)))  # a new batch shape: a new analysis
  assert len(traces) == 2


def test_the_first_call_check_traces_the_step_once():
  # On a GPU `verify` is on by default: it compared jlms's program with a
  # jax.jit of the step made anew, which traced the step a second time
  # (seen on an H100 as two traces of one signature).
  traces = []

  def counted(params, x):
    traces.append(1)
    return _sgd_step(params, x)

  step = jlms.offload(counted, verify=True, **EAGER)
  params, x = _mlp_args()
  with warnings.catch_warnings():
    # On a CPU nothing is in host memory, and the check says so.
    warnings.simplefilter("ignore", jlms.OffloadIneffectiveWarning)
    step(params, x)
    step(params, x + 1.0)
  assert len(traces) == 1


def test_under_disable_jit_the_step_runs_op_by_op_as_jax_jit_does():
  params, x = _mlp_args()
  step = jlms.offload(_sgd_step, **EAGER)
  with jax.disable_jit():
    actual = step(params, x)
    expected = jax.jit(_sgd_step)(params, x)
  assert max_relative_error(actual, expected) <= F32_TOLERANCE


def test_steps_on_their_own_outputs_compile_once():
  # jlms's outputs are committed (JAX commits the outputs of a program with
  # host copies) and jax.jit compiles again for committed arguments: the
  # first call's fresh arguments are committed where they are.
  compiles = backend_compiles()
  traces = []

  def counted(params, x):
    traces.append(1)
    return _sgd_step(params, x)

  step = jlms.offload(counted, donate_argnums=0, **EAGER)
  params, x = _mlp_args()
  params, _ = step(params, x)
  first = (len(traces), len(compiles))
  for _ in range(4):
    params, _ = step(params, jnp.ones((32, 64)))  # a fresh batch each step
  assert (len(traces), len(compiles)) == first


def test_a_step_planned_at_every_call_warns_once_with_the_cost():
  step = jlms.offload(_sgd_step, **EAGER)
  params, _ = _mlp_args()
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for batch in (8, 16, 24, 32, 40):
      step(params, jnp.ones((batch, 64)))
      replans = [w for w in caught
                 if issubclass(w.category, jlms.ReplanWarning)]
      assert len(replans) == (0 if batch < 24 else 1)
  assert re.search(r"planned for 3 argument signatures, \d+\.\d\d s of "
                   r"planning", str(replans[0].message))


def test_plan_reports_values_like_tfmls():
  params, x = _mlp_args()
  plan = jlms.offload(_sgd_step, **EAGER).plan(params, x)
  assert plan.offloaded_bytes == sum(v.nbytes for v in plan.offloaded) > 0
  value = plan.offloaded[0]
  assert value.nbytes == int(np.prod(value.shape)) * value.dtype.itemsize
  assert value.produced_at <= value.swapped_out_after
  assert all(value.swapped_out_after < p for p in value.prefetched_before)
  assert all(p <= u for p, u in zip(value.prefetched_before, value.used_at))
  assert "_sgd_step" in value.name or "tanh" in value.name
  text = str(plan)
  assert f"{plan.num_equations} equations" in text
  assert f"offloaded {len(plan.offloaded)} values" in text
  assert "largest equation" in text
  assert plan.argument_bytes == 6 * 64 * 64 * 4 + 32 * 64 * 4


def test_decorator_forms():
  @jlms.offload
  def plain(x):
    return jnp.sin(x)

  @jlms.offload(min_bytes=1)
  def configured(x):
    return jnp.sin(x)

  assert isinstance(plain, jlms.OffloadedStep)
  assert configured.config.min_bytes == 1
  np.testing.assert_allclose(plain(jnp.ones(3)), np.sin(1.0), rtol=1e-6)


# -- bad input -------------------------------------------------------------

def test_keys_ints_bools_none_and_python_scalars_pass_through():
  def step(key, counts, flags, nothing, scale, x):
    noise = jax.random.normal(key, x.shape)
    y = x
    for _ in range(8):
      y = jnp.sin(y) * scale
    new_key, _ = jax.random.split(key)
    return new_key, counts + 1, ~flags, nothing, (y + noise).sum()

  args = (jax.random.key(0), jnp.arange(4096, dtype=jnp.int32),
          jnp.zeros(4096, bool), None, 0.5, jnp.ones((64, 64)))
  offloaded = jlms.offload(step, **EAGER)
  actual, expected = offloaded(*args), jax.jit(step)(*args)
  assert jax.random.key_data(actual[0]).tolist() == (
      jax.random.key_data(expected[0]).tolist())
  assert max_relative_error(actual[1:], expected[1:]) <= F32_TOLERANCE


def test_not_jittable_is_a_clear_error():
  def step(x):
    if x.sum() > 0:  # Python control flow on a traced value
      return x
    return -x

  with pytest.raises(jax.errors.TracerBoolConversionError) as info:
    jlms.offload(step)(jnp.ones(3))
  assert any("jittable" in note for note in info.value.__notes__)


def test_not_callable_is_refused():
  with pytest.raises(TypeError, match="callable"):
    jlms.offload(3)


def test_a_leaf_that_is_not_an_array_is_named_by_its_path():
  def step(x, hyper):
    return x * float(hyper["lr"])

  offloaded = jlms.offload(step, **EAGER)
  for entry in (offloaded, offloaded.plan):
    with pytest.raises(TypeError, match=r"(?s)args\[1\]\['lr'\].*static"):
      entry(jnp.ones(3), {"lr": "0.1"})
  with pytest.raises(TypeError, match=r"(?s)kwargs\['hyper'\]\['lr'\].*static"):
    offloaded.plan(jnp.ones(3), hyper={"lr": "0.1"})

