"""Shared test set-up: CPU jax (deviceless GPU compiles need it) and helpers."""

import importlib
import importlib.metadata
import os
import sys

# Must precede the first import of jax: the CUDA plugin's start-up check fails
# on a machine without a GPU otherwise, and no H100 topology can be made.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _older_cpu_emitters_flag() -> str:
  """`--xla_cpu_use_fusion_emitters=false` where this jaxlib's XLA still has
  XLA's older CPU loop emitters (JAX 0.10), else "": an XLA_FLAGS entry
  that XLA does not know aborts the process, and whether it knows this one
  cannot be asked before jax is imported, so it goes by jaxlib's version
  (JAX 0.12's XLA has no such flag)."""
  try:
    major, minor = (int(part) for part in
                    importlib.metadata.version("jaxlib").split(".")[:2])
  except (importlib.metadata.PackageNotFoundError, ValueError):
    return ""
  if (major, minor) >= (0, 11):
    return ""
  return " --xla_cpu_use_fusion_emitters=false"


if (os.environ["JAX_PLATFORMS"] == "cpu"
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")):
  # LLVM optimisation off: CPU compiles take about a third less time. The HLO
  # passes, where host copies and barriers could be lost or reordered, run
  # as always, and the deviceless GPU compiles' memory figures are the same
  # (measured on the MLP, scanned GPT and ResNet cases). Not on a GPU run.
  # Where XLA still has its older CPU loop emitters, those too, for every
  # CPU compile (jlms's own when a step is called, jax.jit's references),
  # as `fast_compile_options` gives the property tests: on JAX 0.10.2 the
  # 3-layer scanned GPT's step compiles in 0.5 s instead of 1.7, its H100
  # memory the same (the flag is the CPU backend's).
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0"
                             + _older_cpu_emitters_flag()).strip()

import functools
import types

import pytest

# jax, numpy, hypothesis and the benchmarks are imported where they are
# used (in the processes that run tests), not here: xdist's controller
# imports this module too, before it starts its workers, and runs no test
# (importing them took it about 2 s, with hypothesis's modules rewritten
# for pytest's asserts).


def __getattr__(name: str):
  """`PLATFORM`, `F32_TOLERANCE` and `TFLMS_KNOBS`, worked out when a test
  module first imports them: asking jax for its platform starts a backend,
  which a worker process that imports the helpers here must not do before
  `jax.distributed.initialize`."""
  if name == "TFLMS_KNOBS":
    from benchmarks.models import TFLMS_KNOBS
    return TFLMS_KNOBS
  if name == "PLATFORM":
    # The platform the tests run on: "cpu" unless JAX_PLATFORMS names a GPU.
    import jax
    return jax.default_backend()
  if name == "F32_TOLERANCE":
    import jax
    # Normwise relative error allowed between jlms's and jax.jit's float32
    # outputs. The two programs are compiled separately and XLA may order a
    # reduction differently around jlms's barriers: on JAX 0.12's CPU
    # backend a BatchNorm bias gradient of 1e-4 differs by 1e-6 relative,
    # which Adam's second moment doubles. On a GPU, float32 matmuls and
    # convolutions run in TF32 (10 mantissa bits), which differ by about
    # 2e-4 relative (measured on an H100) wherever fusion or order differ,
    # and up to 1.1e-3 through the tiny Inception's 20 convolutions and Adam
    # (an H200). A wrong copy or a lost dependency gives errors of order one
    # either way.
    return 1e-5 if jax.default_backend() == "cpu" else 4e-3
  raise AttributeError(name)

#: The same for steps that compute in bfloat16 (every leaf of their
#: outputs, float32 parameters of mixed precision too), compiled without
#: excess precision (`xla_allow_excess_precision=False`, so that both
#: programs round to bfloat16 where the jaxpr says): what is left is the
#: order of a reduction XLA may change around jlms's barriers, a few
#: bfloat16 ulps (3.9e-3 each). A wrong value differs by 1e-1 and up.
BF16_TOLERANCE = 2e-2

#: The forced offloading every model family (`benchmarks.models.SMALL_CASES`)
#: is held to, on each JAX of the supported range.
FORCED = dict(min_bytes=4096, swapout_threshold=2)

HYPOTHESIS_PROFILE = os.environ.get("JLMS_HYPOTHESIS_PROFILE", "quick")


def _import_without_assert_rewriting(module: str) -> None:
  """Imports `module` past pytest's assertion rewriting, which pytest
  applies to every module of a plugin's distribution: Hypothesis's 73
  modules, rewritten again in every process wherever Python writes no
  bytecode (PYTHONDONTWRITEBYTECODE=1, as on this machine), took 6 s
  instead of 0.6 in a pytest process (this machine, loaded; about a tenth
  of that unloaded). Hypothesis's own asserts are not this project's."""
  rewriters = [finder for finder in sys.meta_path
               if type(finder).__name__ == "AssertionRewritingHook"]
  for finder in rewriters:
    sys.meta_path.remove(finder)
  try:
    importlib.import_module(module)
  finally:
    sys.meta_path[:0] = rewriters


def _load_hypothesis_profiles() -> None:
  """Hypothesis profiles of the property tests (test_properties.py):
  "quick" (the default, CI's) draws the same steps on every run; "long"
  draws fresh ones, 500 in all: JLMS_HYPOTHESIS_PROFILE=long python -m
  pytest jlms_tests/test_properties.py. Compiles take seconds: no
  deadline. Hypothesis's explain phase reruns a shrunk failure many times
  (minutes)."""
  if "hypothesis" not in sys.modules:
    _import_without_assert_rewriting("hypothesis.strategies")
  from hypothesis import HealthCheck, Phase, settings
  common = dict(deadline=None, database=None, print_blob=True,
                phases=[Phase.explicit, Phase.reuse, Phase.generate,
                        Phase.shrink],
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.data_too_large])
  settings.register_profile("quick", derandomize=True, **common)
  settings.register_profile("long", derandomize=False, **common)
  settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_configure(config):
  """The Hypothesis profile, loaded before any test module is imported (a
  test's `@settings` takes the profile's defaults when it is applied), in
  every process that runs tests: not in xdist's controller, whose
  workers do (they have `workerinput`; `-n 0` runs tests here)."""
  if (getattr(config.option, "numprocesses", None)
      and not hasattr(config, "workerinput")):
    return
  _load_hypothesis_profiles()


def pytest_xdist_auto_num_workers(config) -> int:
  """Workers for `-n auto` (pyproject's default): one per core on CPU, where
  each test compiles alone and two cores halve the wall time; none where
  JAX_PLATFORMS names a GPU, which one process must own (each would
  preallocate most of its memory, and the `gpu` tests measure its peak)."""
  del config
  platforms = os.environ.get("JAX_PLATFORMS", "cpu")
  if any(name in platforms for name in ("cuda", "gpu", "rocm")):
    return 0
  return os.cpu_count() or 1


@functools.cache
def fast_compile_options() -> dict:
  """On CPU, compile options that cut compile time by about two thirds
  (LLVM optimisation off, XLA's older loop emitters where this XLA still
  has them); the HLO passes, where host copies and barriers could be lost
  or reordered, run as always. On any other platform none: these options
  are the CPU backend's, and a GPU compile refuses them."""
  import jax
  if jax.default_backend() != "cpu":
    return {}
  options = {"xla_backend_optimization_level": 0}
  older_emitters = {**options, "xla_cpu_use_fusion_emitters": False}
  try:
    jax.jit(lambda x: x + 1).lower(1.0).compile(compiler_options=older_emitters)
  except jax.errors.JaxRuntimeError:  # "No such compile option" on newer XLA
    return options
  return older_emitters


_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_backend_compiles: list[float] = []


@functools.cache
def backend_compiles() -> list[float]:
  """The seconds of each XLA backend compile in this process from the first
  call on (appended as they happen; one listener, registered once, since
  jax.monitoring has no public way to remove one)."""
  import jax

  def listener(event, seconds, **kwargs):
    if event == _BACKEND_COMPILE:
      _backend_compiles.append(seconds)
  jax.monitoring.register_event_duration_secs_listener(listener)
  return _backend_compiles


def compiled_as(peak_of):
  """A stand-in for `jlms._search.xla_compiled` (XLA's compile of a
  program for the search) from a stand-in for its peak, `peak_of`, called
  with the same arguments: XLA's memory with that peak and no program
  text, so that no latency profile is written of it."""
  def stand_in(*args, **kwargs):
    return types.SimpleNamespace(peak_bytes=peak_of(*args, **kwargs),
                                 hlo_text="")
  return stand_in


def plan_as_without_a_gpu(monkeypatch) -> None:
  """Has jlms plan as on a machine without a GPU, through `monkeypatch` (a
  fixture or one of its contexts): XLA confirms a plan only for a target
  the step names or its arguments are placed on, never the local GPU's.
  For tests whose budgets are the simulator's peaks (on a GPU its XLA
  confirmed every plan, and refused some of those budgets)."""
  from jlms import _search
  confirm = _search.confirm_target
  monkeypatch.setattr(
      _search, "confirm_target",
      lambda options, leaves=(), on_gpu=False: confirm(options, leaves))


@pytest.fixture
def as_without_a_gpu(monkeypatch):
  """`plan_as_without_a_gpu` for the whole test."""
  plan_as_without_a_gpu(monkeypatch)


def max_relative_error(actual, expected) -> float:
  """Worst, over the leaves of two pytrees, of max|a - e| / max|e| (the
  normwise error of each leaf, so that exact zeros do not divide)."""
  import jax
  import numpy as np
  actual_leaves = jax.tree.leaves(actual)
  expected_leaves = jax.tree.leaves(expected)
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  worst = 0.0
  for a, e in zip(actual_leaves, expected_leaves):
    if jax.dtypes.issubdtype(getattr(e, "dtype", np.float32),
                             jax.dtypes.prng_key):
      a, e = jax.random.key_data(a), jax.random.key_data(e)
    a = np.asarray(a, np.float64)
    e = np.asarray(e, np.float64)
    assert a.shape == e.shape
    if e.size == 0:
      continue
    scale = max(float(np.max(np.abs(e))), np.finfo(np.float32).tiny)
    worst = max(worst, float(np.max(np.abs(a - e))) / scale)
  return worst


#: Modules whose tests run first: the property tests take 15 to 40 s each,
#: and xdist hands tests out in collection order (multi-test groups first),
#: so that, collected late, two of them ran last on one worker while the
#: other had finished (14 s of a 155 s quick tier on JAX 0.12.0.1).
_LONGEST_FIRST = ("test_properties.py",)


def _leave_out_the_long_profile(config, items) -> None:
  """Deselects the tests marked `long` (claims at realistic sizes, a minute
  or more each, which the benchmarks measure too) unless the `-m`
  expression names them: `python -m pytest` and CI's tiers leave them out
  and say how many; `python -m pytest -m long` runs them alone."""
  if "long" in (config.getoption("markexpr", "") or ""):
    return
  kept, left_out = [], []
  for item in items:
    (left_out if item.get_closest_marker("long") else kept).append(item)
  if left_out:
    config.hook.pytest_deselected(items=left_out)
    items[:] = kept


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
  """The longest tests first (`_LONGEST_FIRST`), and xdist groups that
  work. `--dist loadgroup` (pyproject's addopts) sends the tests of one
  `xdist_group` to one worker by a suffix `@<group>` on their node ids,
  which pytest-xdist (3.8) sets as `item._nodeid`; pytest 9.2 reads a
  node's id from `item._id` instead, so the suffix was lost and a group's
  tests went to any worker, each building the group's module-scoped
  fixture (a large compile) again. Where the suffix is missing, it is set
  here, after xdist's own hook."""
  _leave_out_the_long_profile(config, items)
  items.sort(key=lambda item: item.path.name not in _LONGEST_FIRST)
  if not getattr(config.option, "loadgroup", False):
    return
  for item in items:
    groups = sorted({str(mark.args[0] if mark.args
                         else mark.kwargs.get("name", "default"))
                     for mark in item.iter_markers("xdist_group")})
    if not groups:
      continue
    suffix = "@" + "_".join(groups)
    node_id = getattr(item, "_id", None)
    if item.nodeid.endswith(suffix) or not hasattr(node_id, "parse"):
      continue
    # NodeId.parse keeps the string it is given as the id's text.
    item._id = type(node_id).parse(item.nodeid + suffix)
