"""Models from the libraries users train with (DeepMind's Gemma, Hugging Face
Llama, GPT-2, BART and ResNet, a Flax NNX and an Equinox decoder), unmodified,
under `jlms.offload`: over three steps on a CPU their outputs are jax.jit's
(`nnx.jit`'s) at the least memory, with the state on host and, for the
scanned ones, on the device with the update inside the backward loop; at a
budget halfway to jax.jit's peak, serialized by size; and under TFLMS's
knobs. Each of jlms's passes starts on them: the tiny sizes of
`benchmarks.real_models` cross each pass's size threshold (values over 4
KiB for the fit, state leaves over 64 KiB for the host and over 1 MiB for
the update loops, scan inputs and residual stacks over 1 MiB for the loop
passes; the least-memory plans split runs over the batch from 1 MiB, where
the real threshold is 256 MiB), and no pass may drop its way for a
failure.

A model whose library is not installed is skipped (`pip install -e
".[models]"`).
"""

import logging
import warnings

import jax
import numpy as np
import pytest
import flax.linen as nn
from flax import nnx

import jlms
from jlms import _thresholds
from benchmarks.models import TFLMS_KNOBS
from benchmarks.real_models import LIBRARY, REAL_MODELS
from jlms_tests.conftest import (BF16_TOLERANCE, F32_TOLERANCE,
                                 fast_compile_options, max_relative_error)

# One worker runs the module, so each model's jax.jit outputs and least-
# memory plan are made once for its tests.
pytestmark = pytest.mark.xdist_group("real_models")

STEPS = 3
#: Models whose layers run under a scan (`nnx.scan`, `jax.lax.scan`): the
#: loop passes have something to do only there.
SCANNED = ("nnx_transformer", "equinox_transformer")
#: The ways of running a step's loops that `jlms._variants` builds, as the
#: search logs each one it fits: masks made inside the loops
#: (`jlms._loop_sink`), residuals remade in the backward loop
#: (`jlms._loop_remat`), residuals streamed through host (`jlms._loops`).
LOOP_WAYS = ("loop-invariant inputs inside", "of their residuals",
             "scan residuals streamed through host")
#: Models whose loss over the vocabulary runs in chunks of the batch
#: (`jlms._batch_split`): the transformers that are not scanned (the
#: scanned ones' tiny vocabularies are too small beside their hidden
#: states for a split to be worth it; the ResNet's batch norm reduces
#: over the batch).
SPLIT = ("gemma2", "llama", "gpt2", "bart")
#: The least-memory plans split a run whose largest value takes this.
SPLIT_BYTES = 1 << 20
#: Heavier models (most of their time is the library's import and eager
#: initialization, and XLA compiling their convolutions on a CPU; BART's
#: four tests, an encoder and a decoder planned, took 81 s of the quick
#: tier's 481 on a 2-core machine).
SLOW = ("gemma2", "resnet50", "bart")
#: Every equation making at least this much is serialized in the budget
#: test (`serialize_by_size`): each tiny model has values above it.
SERIALIZE_BYTES = 1 << 20

#: Float32 tolerances wider than `F32_TOLERANCE`, each explained. The tiny
#: ResNet-50: AdamW divides each gradient element by its running
#: magnitude, and some of this model's are at rounding level (about 1e-8,
#: Adam's eps): such an element moves its parameter by up to the learning
#: rate (1e-4) whatever its rounding. Two float32 programs that sum in
#: another order (jlms's, jax.jit's) agree to 6e-7 after the first step,
#: and then part by 3.5e-5 of the largest parameter at the second and
#: 3.2e-4 of the largest Adam moment at the third (JAX 0.10.2, measured
#: 2026-11-29; an earlier environment stayed under 1e-5).
F32_TOLERANCE_OF = {"resnet50": 1e-3}

#: CPU compiles of the bfloat16 steps round to bfloat16 wherever the
#: program says (see test_properties): with excess precision XLA keeps
#: float32 between a producer and a reader fused together, and jlms's
#: barriers change which are.
_COMPILE_OPTIONS = {**fast_compile_options(),
                    "xla_allow_excess_precision": False}


def _params(names):
  return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW
          else name for name in names]


class _Model:
  """One model's tiny step, with what its tests share: jax.jit's outputs
  and the least-memory step, its plan and jlms's log of planning it, each
  made when first asked for."""

  def __init__(self, name, case=None):
    self.name = name
    self.case = REAL_MODELS[name]("tiny") if case is None else case
    self._expected = None
    self._least = None

  def expected(self):
    if self._expected is None:
      self._expected = _run(self.case, self.case.jitted())
    return self._expected

  def least_memory(self):
    if self._least is None:
      step = self.case.offload(budget="min", strict=True)
      handler = _ListHandler()
      logger = logging.getLogger("jlms")
      level = logger.level
      logger.addHandler(handler)
      logger.setLevel(logging.DEBUG)
      try:
        with _thresholds.overridden(batch_split_min_bytes=SPLIT_BYTES):
          plan = _plan(step, self.case)
      finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
      self._least = step, plan, "\n".join(handler.lines)
    return self._least


class _ListHandler(logging.Handler):
  def __init__(self):
    super().__init__(logging.DEBUG)
    self.lines = []

  def emit(self, record):
    self.lines.append(record.getMessage())


_MODELS: dict = {}


def _model(name):
  pytest.importorskip(LIBRARY[name])
  if name not in _MODELS:
    _MODELS[name] = _Model(name)
  return _MODELS[name]


# Module-scoped and parametrized: pytest runs each model's tests together,
# in this order. Gemma comes last: importing `gemma` replaces
# `flax.linen.Module.param` for the whole process with a wrapper that
# passes `dtype=None` on to every init function, and the init functions
# of transformers' FlaxLlamaRMSNorm take no dtype (TypeError).
@pytest.fixture(scope="module", params=_params(
    [name for name in REAL_MODELS if name != "gemma2"] + ["gemma2"]))
def model(request):
  if request.param == "gemma2":
    # Put Flax's own `param` back once the gemma tests are done: the
    # worker goes on to other modules' Flax models.
    original = nn.Module.param
    request.addfinalizer(lambda: setattr(nn.Module, "param", original))
  return _model(request.param)


@pytest.fixture(scope="module", params=_params(SCANNED))
def scanned_model(request):
  return _model(request.param)


def _host(tree):
  """Host copies of `tree`'s leaves in float64 (PRNG keys as key data)."""
  def copy(leaf):
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      leaf = jax.random.key_data(leaf)
    return np.asarray(leaf, np.float64)
  return jax.tree.map(copy, tree)


def _run(case, stepper, place=False):
  """Host copies of the outputs of `STEPS` steps of `stepper` (jax.jit's
  or jlms's), from fresh arguments, each step fed the last one's state:
  per step the state's parts and the loss (NNX: the model's and the
  optimizer's state after the step, and the loss). The bfloat16 steps run
  compiled with `_COMPILE_OPTIONS`."""
  args = case.make_args()
  if place:  # the state jlms keeps on host goes there once, as documented
    args = stepper.place(*args)
  call = stepper
  if case.compute_dtype != "float32":
    call = stepper.lower(*args).compile(_COMPILE_OPTIONS)
  outputs = []
  for _ in range(STEPS):
    with warnings.catch_warnings():
      # `jlms.offload_nnx`'s step has no `place`: the state that a plan
      # keeps on host arrives on the device at the first step, and jlms
      # copies it there, warning once.
      warnings.simplefilter("ignore", jlms.StateOnDeviceWarning)
      out = call(*args)
    if case.nnx:
      model, optimizer = args[:2]
      outputs.append(_host((nnx.state(model), nnx.state(optimizer), out)))
    else:
      state, loss = out
      outputs.append(_host((*state, loss)))
    args = case.next_args(args, out)
  return outputs


def _step_error(actual, expected) -> float:
  """The largest normwise error of one output of a step (each part of the
  state, the loss) taken as one vector, as test_zoo measures it. Leaf by
  leaf it would compare rounding noise with itself: some leaves are zero
  in exact arithmetic (the gradient of a BatchNorm bias whose only readers
  undo any shift)."""
  def flat(tree):
    return np.concatenate([np.ravel(leaf) for leaf in jax.tree.leaves(tree)])
  return max(max_relative_error(flat(a), flat(e))
             for a, e in zip(actual, expected))


def _assert_outputs_agree(model, stepper, plan):
  case = model.case
  actual = _run(case, stepper, place=not case.nnx)
  tolerance = (F32_TOLERANCE_OF.get(model.name, F32_TOLERANCE)
               if case.compute_dtype == "float32" else BF16_TOLERANCE)
  for step, (a, e) in enumerate(zip(actual, model.expected())):
    error = _step_error(a, e)
    assert error <= tolerance, (
        f"{model.name} step {step + 1}: relative error {error:.2e} "
        f"(tolerance {tolerance:.0e})\n{plan}")


def _plan(stepper, case):
  # The concrete arguments the steps then take (one signature planned).
  return stepper.plan(*case.make_args())


def test_the_least_memory_plan_gives_jax_jits_outputs(model):
  step, plan, log = model.least_memory()
  assert plan.predicted_peak_bytes < 0.7 * plan.baseline_peak_bytes, plan
  # Activations remade or copied, and the state (parameters, AdamW's
  # moments: leaves over 64 KiB) kept on host between steps.
  assert plan.offloaded, plan
  assert plan.state_leaves > 0, plan
  # A pass that fails on the step only drops its way (a debug line): none
  # may.
  assert " left out (" not in log and "way for this step (" not in log, log
  if model.name in SCANNED:
    for way in LOOP_WAYS:
      assert way in log, f"no way with {way!r} was fitted:\n{log}"
  # The loss runs in chunks of the batch, and says so.
  assert bool(plan.split_over_batch) == (model.name in SPLIT), plan
  if model.name in SPLIT:
    assert "split over the batch" in str(plan), plan
  _assert_outputs_agree(model, step, plan)


def test_a_llama_accumulating_microbatches_by_scan_trains_as_jax_jit():
  # The tiny Llama's step over 2 microbatches of 2 rows, their gradients
  # added up by `jax.lax.scan`: its least memory keeps the state on host
  # and remakes or copies activations, among ways that unroll the loop
  # (`jlms._unroll`); three steps equal jax.jit's.
  pytest.importorskip(LIBRARY["llama"])
  model = _Model("llama", REAL_MODELS["llama"]("tiny", batch=4,
                                                microbatches=2))
  step, plan, log = model.least_memory()
  assert plan.predicted_peak_bytes < 0.7 * plan.baseline_peak_bytes, plan
  assert plan.offloaded and plan.state_leaves > 0, plan
  assert "1 accumulation loops unrolled" in log, log
  assert " left out (" not in log and "way for this step (" not in log, log
  _assert_outputs_agree(model, step, plan)


def test_the_update_runs_in_the_backward_loop(scanned_model):
  # The state on the device: AdamW's update of each stacked leaf over
  # 1 MiB runs inside the backward scan (`jlms._update_fusion`).
  model = scanned_model
  step = model.case.offload(budget="min", state_on_host=False, strict=True)
  plan = _plan(step, model.case)
  assert plan.state_updated_in_loops > 0, plan
  assert plan.state_leaves == 0, plan
  _assert_outputs_agree(model, step, plan)


def test_a_budget_halfway_to_jax_jits_peak_fits(model):
  # The fit proper: a budget between the least memory and jax.jit's peak
  # (predicted; a CPU has no XLA GPU compiler to confirm it), with the
  # largest equations chained one after another (`serialize_by_size`).
  _, least, _ = model.least_memory()
  budget = (least.predicted_peak_bytes + least.baseline_peak_bytes) // 2
  step = model.case.offload(budget=budget, serialize_by_size=SERIALIZE_BYTES,
                            strict=True)
  plan = _plan(step, model.case)
  assert plan.predicted_peak_bytes <= budget, plan
  assert not plan.fits_as_is, plan
  _assert_outputs_agree(model, step, plan)
  assert plan.serialized > 0, plan


def test_tflms_knobs_copy_to_host_and_stream_scan_residuals(model):
  # TFLMS's rules as given: each value over 1 MiB not read for 20
  # equations goes to host and back, and a scan's residual stacks go one
  # slice per iteration (`jlms._loops`).
  step = model.case.offload(**TFLMS_KNOBS, strict=True)
  plan = _plan(step, model.case)
  copied = [v for v in plan.offloaded if not v.recomputed]
  assert copied, plan
  if model.name in SCANNED:
    assert any(v.streamed for v in copied), plan
  _assert_outputs_agree(model, step, plan)


#: Flax's own `Module.param`, before any gemma import replaces it.
_FLAX_PARAM = nn.Module.param


@pytest.mark.parametrize("name", _params(list(REAL_MODELS)))
def test_the_remat_variant_remakes_each_block_and_trains_the_same(
    name, monkeypatch):
  # The peer of the benchmarks (`REAL_MODELS[name](size, remat=True)`):
  # the same model, each block under the library's remat (a checkpoint
  # in the step), the same loss.
  pytest.importorskip(LIBRARY[name])
  if name != "gemma2":  # run after the gemma tests in the same worker
    monkeypatch.setattr(nn.Module, "param", _FLAX_PARAM)
  plain = REAL_MODELS[name]("tiny")
  remat = REAL_MODELS[name]("tiny", remat=True)
  assert remat.name == plain.name + "-remat"
  if not remat.nnx:
    text = str(jax.make_jaxpr(remat.step)(*remat.abstract_args()))
    assert "checkpoint" in text or "remat" in text
    assert not ("checkpoint" in str(jax.make_jaxpr(plain.step)(
        *plain.abstract_args())))
  losses = [np.asarray(jax.tree.leaves(case.jitted()(*case.make_args()))[-1])
            for case in (plain, remat)]
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)


def test_xla_memory_of_an_nnx_step_compiles_the_whole_step():
  # `jlms.xla_memory` lowers a step through its own `lower`: for
  # `offload_nnx`, the program that runs on the split state, not a jit of
  # the objects (which once measured a program of a fifth of the matmuls).
  pytest.importorskip(LIBRARY["nnx_transformer"])
  case = REAL_MODELS["nnx_transformer"]("tiny")
  args = case.abstract_args()
  texts = [case.jitted().lower(*args).as_text(),
           case.offload().lower(*args).as_text()]
  dots = [text.count("dot_general") for text in texts]
  assert dots[0] > 0 and dots[1] == dots[0], dots
