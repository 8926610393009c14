"""What a user sees when something is wrong: public exception names, and
messages that name the setting at fault and say what to do."""

import inspect
import pickle
import traceback
import warnings

import jax
import jax.numpy as jnp
import pytest

import jlms

PUBLIC_EXCEPTIONS = sorted(
    name for name, value in vars(jlms).items()
    if inspect.isclass(value) and issubclass(value, BaseException))


def test_the_public_exceptions_are_found():
  assert {"BudgetError", "OffloadError", "FallbackWarning",
          "DevicelessUnavailableError"} <= set(PUBLIC_EXCEPTIONS)


@pytest.mark.parametrize("name", PUBLIC_EXCEPTIONS)
def test_an_exception_prints_with_its_public_name(name):
  cls = getattr(jlms, name)
  error = cls("what went wrong")
  shown = traceback.format_exception_only(type(error), error)[-1]
  assert shown.startswith(f"jlms.{name}: what went wrong")
  assert cls.__module__ == "jlms"
  assert repr(cls) == f"<class 'jlms.{name}'>"
  # Pickled by its public path, as a worker process sends it back.
  assert type(pickle.loads(pickle.dumps(error))) is cls


def test_a_malformed_host_pool_is_refused_when_the_step_is_made(monkeypatch):
  monkeypatch.setenv("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "abc")
  with pytest.raises(ValueError, match="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='abc'"):
    jlms.offload(lambda x: x * 2, budget="min")


def _doubled(x):
  return x * 2


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="a GPU is the local target")
@pytest.mark.parametrize("budget", ["device", "50%", "1MiB"])
def test_the_local_target_without_a_gpu_says_what_to_do_instead(budget):
  step = jlms.offload(_doubled, target="local", budget=budget)
  with pytest.raises(jlms.DevicelessUnavailableError,
                     match="no local GPU") as raised:
    step.plan(jnp.ones(4))
  assert "target='h100'" in str(raised.value)
  assert "report" not in str(raised.value)


def test_a_step_that_calls_back_says_why_it_cannot_be_compiled_deviceless():
  # JAX lowers a host callback only for a backend the process has; it said
  # "Unknown backend: 'gpu' requested" from inside JAX's lowering.
  def step(w, x):
    loss = jnp.mean(jnp.tanh(x @ w) ** 2)
    jax.debug.print("loss {}", loss)
    return w, loss

  args = (jnp.ones((64, 64)), jnp.ones((8, 64)))
  with pytest.raises(jlms.DevicelessUnavailableError,
                     match="calls back into Python.*'h100'.*plan on the GPU"):
    jlms.offload(step, target="h100").plan(*args)


def test_a_callback_refused_by_the_compile_only_client_says_why(monkeypatch):
  # On a machine with a GPU the callback lowers, and JAX 0.11.2 hands it
  # to the H100's compile-only client, which takes no host callbacks: a
  # TypeError from inside JAX, taken for a failure of jlms's own (a
  # FallbackWarning asking for a report). Its compile is stood in for
  # here, where the lowering itself refuses the callback.
  def refuse_callbacks(lowered, *args, **kwargs):
    raise TypeError("compile(): incompatible function arguments. Invoked "
                    "with kwargs = { executable_devices: DeviceList, "
                    "compile_options: CompileOptions, host_callbacks: tuple }")

  monkeypatch.setattr(jax.stages.Lowered, "compile", refuse_callbacks)
  with pytest.raises(jlms.DevicelessUnavailableError,
                     match="calls back into Python.*'h100'.*plan on the GPU"):
    jlms.xla_memory(lambda x: jnp.tanh(x), jnp.ones(8), target="h100")


def test_a_nan_of_the_step_under_debug_nans_is_the_steps_error():
  # jax_debug_nans re-runs a program that made a NaN op by op; jlms took
  # JAX's internal error of that re-run for a failure of its own (a
  # FallbackWarning asking for a report, or an OffloadError).
  def step(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)
    return w - 0.1 * grad, jnp.log(loss - 1e6)

  args = (jnp.ones((16, 16)), jnp.ones((4, 16)))
  with jax.debug_nans(True), warnings.catch_warnings():
    warnings.simplefilter("error", jlms.FallbackWarning)
    for options in ({}, {"budget": "min", "strict": True}):
      with pytest.raises(FloatingPointError, match="nan.*log"):
        jlms.offload(step, **options)(*args)
