"""Running and measuring the train steps `_step_strategies` draws: what the
property tests (`test_properties.py`) check each draw with, and the
regression tests (`test_regressions.py`) of the failures they found.

- `run_on_cpu` runs a few steps of a jitted or offloaded step, each fed
  the last one's state, and returns host copies of the outputs;
  `jit_outputs` is that for `jax.jit`'s program, once per spec.
- `h100_peak`, `jit_peak`: XLA's deviceless H100 peak of a program, and
  of `jax.jit`'s (once per spec); `fitted_peak` that of the plan for a
  budget, or the `jlms.BudgetError` it raises.
- `assert_outputs_agree`: jlms's outputs against `jax.jit`'s, within the
  tolerance of the step's dtype.
"""

import collections

import jax
import numpy as np

import jlms
from jlms_tests.conftest import (BF16_TOLERANCE, F32_TOLERANCE,
                                 fast_compile_options, max_relative_error)

TARGET = "h100"


def jlms_outcome(call):
  """`call()`, or the `jlms.BudgetError` it raises: anything else fails the
  property (d), as does an error that does not say it is jlms's."""
  try:
    return call()
  except jlms.BudgetError as error:
    assert str(error).startswith("jlms: "), str(error)
    assert "budget" in str(error), str(error)
    return error


def _snapshot(tree):
  """Host copies of `tree`'s leaves (a donated output is gone once the next
  step has run); PRNG keys as their key data."""
  def copy(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    return np.array(leaf, copy=True)  # np.asarray may view the buffer
  return jax.tree.map(copy, tree)


def _dynamic(drawn, args, kwargs):
  """The arguments a compiled step takes: all but the static ones."""
  static = drawn.jit_options.get("static_argnums", ())
  static = {static} if isinstance(static, int) else set(static)
  names = drawn.jit_options.get("static_argnames", ())
  names = {names} if isinstance(names, str) else set(names)
  return ([a for i, a in enumerate(args) if i not in static],
          {k: v for k, v in kwargs.items() if k not in names})


#: Compiled CPU programs by their StableHLO text, argument and output trees
#: and compile options: where jlms's program is jax.jit's (nothing moved,
#: as often in (d)) or two draws' options give the same program, it is
#: compiled once (half a second to three seconds each on JAX 0.12's CPU).
#: The last `_COMPILED_KEPT` only: each CPU executable holds about 250
#: memory mappings, and unbounded, the long profile's 200 draws of (a) ran
#: into the kernel's limit of 65530 after about 130 (LLVM "Cannot allocate
#: memory", then a segmentation fault, on JAX 0.12.0.1).
_COMPILED: collections.OrderedDict = collections.OrderedDict()
_COMPILED_KEPT = 32


def _compiled(lowered, options: dict):
  key = (lowered.as_text(), str(lowered.in_tree), str(lowered.out_tree),
         tuple(sorted(options.items())))
  if key in _COMPILED:
    _COMPILED.move_to_end(key)
  else:
    _COMPILED[key] = lowered.compile(options)
    while len(_COMPILED) > _COMPILED_KEPT:
      _COMPILED.popitem(last=False)
  return _COMPILED[key]


def run_on_cpu(drawn, stepper, steps_run=3, options=None):
  """The outputs of `steps_run` steps of `stepper` (a jitted or offloaded
  `drawn.fn`), each fed the last one's state, as host copies, compiled
  with `options` (`_CPU_COMPILE_OPTIONS` when None)."""
  args, kwargs = drawn.make_args()
  place = getattr(stepper, "place", None)  # jax.jit's steps have none
  if place is not None:
    # As a user of the compiled program must: JAX 0.10 to 0.12 abort the
    # process when a compiled program that donates a pinned-host argument
    # is called again with that argument in device memory.
    args, kwargs = (place(*args, **kwargs) if kwargs
                    else (place(*args), kwargs))
  compiled = _compiled(stepper.lower(*args, **kwargs),
                       _CPU_COMPILE_OPTIONS if options is None else options)
  outputs = []
  for _ in range(steps_run):
    dynamic_args, dynamic_kwargs = _dynamic(drawn, args, kwargs)
    out = compiled(*dynamic_args, **dynamic_kwargs)
    outputs.append(_snapshot(out))
    args = drawn.next_args(args, out)
  return outputs


#: Fast CPU compiles, which round to bfloat16 wherever the program says:
#: with excess precision allowed (XLA's default), XLA drops a value's
#: rounding to bfloat16 where its producer and reader meet in one fusion,
#: and jlms's copies and barriers decide where they meet; without it, jlms's
#: program computes jax.jit's values exactly in any precision.
_CPU_COMPILE_OPTIONS = {**fast_compile_options(),
                        "xla_allow_excess_precision": False}

_JIT_OUTPUTS: dict = {}
_JIT_PEAKS: dict = {}


def jit_outputs(drawn):
  if drawn.spec not in _JIT_OUTPUTS:
    _JIT_OUTPUTS[drawn.spec] = run_on_cpu(drawn, drawn.jitted())
  return _JIT_OUTPUTS[drawn.spec]


def h100_peak(stepper, drawn) -> int:
  args, kwargs = drawn.abstract_args()
  return jlms.xla_memory(stepper, *args, target=TARGET, **kwargs).peak_bytes


def jit_peak(drawn) -> int:
  """XLA's H100 peak of `jax.jit`'s program, with the step's donation."""
  if drawn.spec not in _JIT_PEAKS:
    _JIT_PEAKS[drawn.spec] = h100_peak(drawn.jitted(), drawn)
  return _JIT_PEAKS[drawn.spec]


def _tolerance(drawn) -> float:
  return F32_TOLERANCE if drawn.spec.precision == "float32" else BF16_TOLERANCE


#: The most a bfloat16 step may differ, however sensitive it is: a wrong
#: copy or a lost dependency differs by 1e-1 and up.
_BF16_CEILING = 8e-2
#: The most a float32 step may differ from float64's outputs, however
#: sensitive: three steps of float32 rounding stay far below it.
_F32_CEILING = 1e-4
_JIT_NOISE: dict = {}


def _jit_noise(drawn, steps_run: int) -> float:
  """How far `jax.jit`'s own outputs move under a rounding XLA may choose:
  the same program compiled with excess precision allowed (XLA's default),
  worst over `steps_run` steps. A step whose attention, LayerNorm and
  dropout amplify a one-ulp bfloat16 difference moves by 3.7e-2 that way
  after one step (the attention step of `test_regressions`)."""
  key = (drawn.spec, steps_run)
  if key not in _JIT_NOISE:
    options = {**_CPU_COMPILE_OPTIONS, "xla_allow_excess_precision": True}
    moved = run_on_cpu(drawn, drawn.jitted(), steps_run, options)
    _JIT_NOISE[key] = max(max_relative_error(a, e) for a, e in zip(
        moved, jit_outputs(drawn)[:steps_run]))
  return _JIT_NOISE[key]


def _float64_outputs(drawn, steps_run: int) -> list:
  """`jax.jit`'s outputs of `steps_run` steps computed in float64 from the
  same float32 arguments (where the step does not cast to float32
  itself): the exact values both float32 programs round."""
  def widened(tree):
    return jax.tree.map(
        lambda leaf: leaf.astype(np.float64) if getattr(
            leaf, "dtype", None) == np.float32 else leaf, tree)
  outputs = []
  made = drawn.make_args()  # outside: `build`'s caches fill in float32
  with jax.enable_x64(True):
    args, kwargs = widened(made)
    jitted = jax.jit(drawn.fn, **drawn.jit_options)
    for _ in range(steps_run):
      out = jitted(*args, **kwargs)
      outputs.append(_snapshot(out))
      args = drawn.next_args(args, out)
  return outputs


def assert_outputs_agree(drawn, actual, expected, plan=None) -> None:
  """jlms's outputs (a list, one per step) against `jax.jit`'s, within the
  tolerance of their dtype. A step may be sensitive enough that a
  rounding of jlms's (a recomputation, a sum in another order) grows past
  that tolerance over its steps:
  - in float32 it passes if every step is at most as far (times 1.5) from
    the float64 outputs of the same step as `jax.jit`'s are, or within
    the tolerance of them: jlms is then no less exact than jax.jit. (An
    attention step under `nn.scan`: 1.22e-5 from jax.jit after three
    steps, where jax.jit is 1.10e-5 from float64 and jlms 1.7e-6.)
  - in bfloat16 it passes if it stays within 1.5 times what jax.jit's own
    outputs move under another legal rounding, and below `_BF16_CEILING`;
    else if each of its steps is within the tolerance of jax.jit's step
    run from the same state (`_jit_steps_from`).
  A wrong value (a lost dependency, a stale copy) is 1e-2 and more from
  both; a float32 step passes past its tolerance only below
  `_F32_CEILING`, and only where jax.jit's outputs are that near float64's
  (with dropout they are not: JAX draws another mask in float64)."""
  errors = [max_relative_error(a, e) for a, e in zip(actual, expected)]
  tolerance = _tolerance(drawn)
  if max(errors) > tolerance and drawn.spec.precision == "float32":
    exact = _float64_outputs(drawn, len(actual))
    for step, (a, e, x) in enumerate(zip(actual, expected, exact)):
      jit_error = max_relative_error(e, x)
      error = max_relative_error(a, x)
      # Comparable only where jax.jit's float32 outputs are near float64's:
      # in float64 JAX draws another dropout mask from the same key.
      assert jit_error <= _F32_CEILING, (
          f"step {step + 1}: relative error {errors[step]:.2e} from "
          f"jax.jit's outputs, and float64's are no reference ({jit_error:.2e}"
          f" from jax.jit's)\n{plan}")
      assert error <= min(_F32_CEILING, max(tolerance, 1.5 * jit_error)), (
          f"step {step + 1}: relative error {errors[step]:.2e} from "
          f"jax.jit's outputs; {error:.2e} from float64's, where jax.jit's "
          f"are {jit_error:.2e} from them (tolerance {tolerance:.1e})\n"
          f"{plan}")
    return
  bound = tolerance
  if max(errors) > tolerance:
    noise = _jit_noise(drawn, len(actual))
    bound = min(_BF16_CEILING, max(tolerance, 1.5 * noise))
  if max(errors) > bound:
    # Step by step: each of jlms's steps against jax.jit's one step from
    # the same state (jlms's previous outputs). A wrong value shows there
    # at the step that makes it; a one-ulp difference that three steps
    # grow in one element does not (a bfloat16 conv step with its state
    # on host, JAX 0.12.0.1: 4.4e-3, 4.3e-3 and 7.5e-2 from jax.jit's
    # run, 4.4e-3, 4.3e-3 and 6.4e-3 step by step).
    errors = [max_relative_error(a, e) for a, e in zip(
        actual, _jit_steps_from(drawn, actual))]
    bound = tolerance
  for step, error in enumerate(errors):
    assert error <= bound, (
        f"step {step + 1}: relative error {error:.2e} (tolerance "
        f"{bound:.1e})\n{plan}")


def _jit_steps_from(drawn, outputs) -> list:
  """`jax.jit`'s outputs of each step run from the state before it in
  `outputs` (one run's outputs, as `run_on_cpu` returns them): the first
  from the drawn arguments, each next from the last of `outputs`."""
  args, kwargs = drawn.make_args()
  compiled = _compiled(drawn.jitted().lower(*args, **kwargs),
                       _CPU_COMPILE_OPTIONS)
  stepped = []
  for step, _ in enumerate(outputs):
    if step:
      before = args[drawn.state_position]
      args = drawn.next_args(args, outputs[step - 1])
      # The snapshots hold PRNG keys as their data: keys again.
      state = jax.tree.map(_as_key_like, args[drawn.state_position], before)
      args = tuple(state if i == drawn.state_position else a
                   for i, a in enumerate(args))
    dynamic_args, dynamic_kwargs = _dynamic(drawn, args, kwargs)
    stepped.append(_snapshot(compiled(*dynamic_args, **dynamic_kwargs)))
  return stepped


def _as_key_like(leaf, like):
  if jax.dtypes.issubdtype(like.dtype, jax.dtypes.prng_key):
    return jax.random.wrap_key_data(leaf, impl=jax.random.key_impl(like))
  return leaf


def fitted_peak(drawn, budget, **options):
  """(XLA's H100 peak of the plan for `budget`, the plan), or the
  `BudgetError`."""
  args, kwargs = drawn.abstract_args()
  stepper = drawn.offload(budget=budget, target=TARGET, **options)
  plan = jlms_outcome(lambda: stepper.plan(*args, **kwargs))
  if isinstance(plan, jlms.BudgetError):
    return plan
  return plan.xla_peak_bytes, plan
