"""Choosing what to offload (pure functions of reads and knobs)."""

import itertools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import models
from jlms._analysed import AnalysedProgram
from jlms._config import OffloadConfig, SyncMode
from jlms._cost import time_target
from jlms._fit import fit
from jlms._liveness import analyse
from jlms._planner import (SwapIn, _plan_value, joins_kernel, kernel_facts,
                           plan_offloads, shared_kernels)
from jlms._program import flatten


def test_value_is_swapped_out_after_its_last_near_read():
  config = OffloadConfig(swapout_threshold=10, prefetch_ahead=2,
                         swapin_groupby=3)
  offload = _plan_value(7, producer=5, reads=(6, 12, 40, 42, 50), config=config)
  assert offload.swap_out_after == 12
  # 40 and 42 share a copy (2 <= groupby); 50 is 8 after 42: a new copy.
  assert offload.swap_ins == (SwapIn(38, (40, 42)), SwapIn(48, (50,)))


def test_no_far_read_no_offload():
  config = OffloadConfig(swapout_threshold=10)
  assert _plan_value(0, producer=0, reads=(3, 13, 23), config=config) is None


def test_prefetch_never_precedes_the_swap_out():
  config = OffloadConfig(swapout_threshold=3, prefetch_ahead=50)
  offload = _plan_value(0, producer=10, reads=(20,), config=config)
  assert offload.swap_out_after == 10
  assert offload.swap_ins[0].issue_before == 11


def test_groupby_defaults_to_the_threshold():
  config = OffloadConfig(swapout_threshold=10, prefetch_ahead=0)
  offload = _plan_value(0, producer=0, reads=(20, 30, 41), config=config)
  assert [s.reads for s in offload.swap_ins] == [(20, 30), (41,)]


def test_only_large_made_values_with_a_layout_are_offloaded():
  def f(x, key, n):
    big = jnp.tanh(x)                    # 4 KiB float
    small = jnp.sum(x, axis=0)           # 32 B float
    mask = big > 0                       # 1 KiB bool: offloadable too
    keys = jax.random.split(key, 4)      # PRNG keys: never offloaded
    for _ in range(12):
      x = jnp.sin(x)
    return (x + big, small * 2.0, mask, keys, n)

  closed = jax.make_jaxpr(f)(jnp.ones((32, 32)), jax.random.key(0), 3)
  program = flatten(closed)
  config = OffloadConfig(min_bytes=1024, swapout_threshold=4)
  offloads = plan_offloads(program, analyse(program), config)
  offloaded_avals = [program.avals[o.value] for o in offloads]
  assert {str(a.dtype) for a in offloaded_avals} == {"float32", "bool"}
  assert all(o.value not in program.invars for o in offloads)
  assert all(a.size * a.dtype.itemsize >= 1024 for a in offloaded_avals)


def test_swap_in_is_not_put_between_a_dot_and_its_transpose():
  def f(x, w):
    a = jnp.tanh(x)                      # 0: offloaded across the gap
    for _ in range(10):
      x = jnp.sin(x)                     # 1..10
    g = jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))   # 11
    return jnp.transpose(g) + 1.0, a * 2.0                    # 12, 13, 14

  program = flatten(jax.make_jaxpr(f)(jnp.ones((64, 64)), jnp.ones((64, 64))))
  names = [e.primitive.name for e in program.equations]
  assert names[11:13] == ["dot_general", "transpose"]
  config = OffloadConfig(min_bytes=1, swapout_threshold=5, prefetch_ahead=2)
  offloads = plan_offloads(program, analyse(program), config)
  (offload,) = [o for o in offloads
                if program.equations[0].outputs[0] == o.value]
  # 14 - 2 would put it right after the dot, before the transpose: one earlier.
  assert offload.swap_ins[0].issue_before == 11


@pytest.mark.parametrize("bad", [
    dict(min_bytes=-1), dict(swapout_threshold=1.5), dict(prefetch_ahead=-2),
    dict(swapin_groupby=-1), dict(sync_mode=4)])
def test_bad_knobs_are_refused(bad):
  with pytest.raises(ValueError, match="jlms"):
    OffloadConfig(**bad)


def test_sync_mode_accepts_ints():
  assert OffloadConfig(sync_mode=3).sync_mode is SyncMode.BOTH


def test_the_fits_pair_test_agrees_with_shared_kernels():
  # The greedy fit asks of the same pairs of recomputations round after
  # round whether they share a kernel: from each chain's facts, found
  # once, it must answer as `shared_kernels` does, joins included (a
  # relu's mask joins its relu).
  case = models.resnet_case(blocks=2, channels=8, image_size=32, batch=2)
  step = AnalysedProgram.of(flatten(jax.make_jaxpr(case.step)(
      *case.abstract_args())))
  chains = [o.recompute for o in fit(
      step.program, step.liveness, None, time_target("h100"), 4096,
      step.fusion).offloads if o.is_recompute]
  joined = 0
  for first, second in itertools.product(chains, chains):
    shared = shared_kernels(step.program, [first, second]) == [[0, 1]]
    assert shared == joins_kernel(kernel_facts(step.program, first),
                                  kernel_facts(step.program, second))
    joined += shared
  assert joined
