"""The rewritten jaxpr: well typed, and offloads where and when planned."""

import re

import jax
import jax.numpy as jnp
import pytest

import jlms
from benchmarks import models, overhead
from jlms import _compat, _xla_memory
from jlms._names import profile_scope


def _mlp_step(params, x):
  def loss(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)

  value, grads = jax.value_and_grad(loss)(params, x)
  return [p - 0.1 * g for p, g in zip(params, grads)], value


def _args(depth=8, width=64, batch=32):
  params = [jnp.full((width, width), 0.01, jnp.float32)] * depth
  return params, jnp.ones((batch, width), jnp.float32)


def _on_host(var) -> bool:
  return "host" in str(getattr(var.aval, "memory_space", "")).lower()


@pytest.mark.parametrize("sync_mode", [0, 1, 2, 3])
def test_rewritten_jaxpr_is_well_typed_and_matches_the_plan(sync_mode):
  step = jlms.offload(_mlp_step, min_bytes=1, swapout_threshold=4,
                      sync_mode=sync_mode)
  args = _args()
  rewritten = step.jaxpr(*args)
  _compat.check_jaxpr(rewritten)
  eqns = rewritten.jaxpr.eqns
  puts = [e for e in eqns if _compat.is_device_put(e)]
  to_host = [e for e in puts if _on_host(e.outvars[0])]
  to_device = [e for e in puts if not _on_host(e.outvars[0])]
  plan = step.plan(*args)
  assert plan.offloaded
  assert len(to_host) == len(plan.offloaded)
  assert len(to_device) == sum(v.swap_ins for v in plan.offloaded)
  # Every host copy passes through a barrier before it is read back: XLA
  # deletes a bare device-host-device round trip.
  barrier_inputs = {id(v) for e in eqns
                    if e.primitive is jax.lax.optimization_barrier_p
                    for v in e.invars}
  assert all(id(e.outvars[0]) in barrier_inputs for e in to_host)


def test_no_equation_reads_a_device_value_after_its_swap_out():
  step = jlms.offload(_mlp_step, min_bytes=1, swapout_threshold=4)
  eqns = step.jaxpr(*_args()).jaxpr.eqns
  for position, eqn in enumerate(eqns):
    if _compat.is_device_put(eqn) and _on_host(eqn.outvars[0]):
      device_value = eqn.invars[0]
      later_readers = [e for e in eqns[position + 1:]
                       if any(v is device_value for v in e.invars)]
      assert not later_readers, eqn


def test_swap_ins_come_before_their_reads_and_after_the_swap_out():
  step = jlms.offload(_mlp_step, min_bytes=1, swapout_threshold=4,
                      prefetch_ahead=1)
  jaxpr = step.jaxpr(*_args()).jaxpr
  eqns = jaxpr.eqns
  outputs = {id(v) for v in jaxpr.outvars}
  position_of = {}
  for position, eqn in enumerate(eqns):
    for v in eqn.outvars:
      position_of[id(v)] = position
  for position, eqn in enumerate(eqns):
    if _compat.is_device_put(eqn) and not _on_host(eqn.outvars[0]):
      # The host operand was made (swapped out and tied) earlier ...
      assert position_of[id(eqn.invars[0])] < position
      # ... and the device copy is read afterwards (or is an output).
      readers = [p for p, e in enumerate(eqns)
                 if any(v is eqn.outvars[0] for v in e.invars)]
      assert readers or id(eqn.outvars[0]) in outputs
      assert all(p > position for p in readers)


def test_nothing_offloaded_means_no_transfers():
  step = jlms.offload(_mlp_step, min_bytes=1 << 40)
  rewritten = step.jaxpr(*_args())
  assert not any(_compat.is_device_put(e) for e in rewritten.jaxpr.eqns)
  assert step.plan(*_args()).offloaded == ()


@pytest.mark.parametrize("options", [
    dict(min_bytes=4096, swapout_threshold=2), dict(budget="min")],
    ids=["knobs", "fitted"])
def test_the_overhead_benchmark_times_the_barriers_that_run(options):
  # The barriers anchor where XLA runs each fused equation: a program
  # without the copies must be made from the same plan and fusion.
  case = models.mlp_case(depth=6, width=128, batch=64)
  args = case.make_args()
  step = jlms.offload(case.step, **options)

  def counts(fn):
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    inner = _compat.call_body(eqns[0])[0].eqns if len(eqns) == 1 else eqns
    return (sum(e.primitive is jax.lax.optimization_barrier_p for e in inner),
            sum(_compat.is_device_put(e) for e in inner))

  barriers, _ = counts(step)
  assert barriers > 0
  assert counts(overhead.barriers_only(step, args)) == (barriers, 0)


def _op_names(lowered_text: str) -> list[tuple[str, str]]:
  """(op line, name) of each op of a StableHLO module printed with its
  debug locations: the name is XLA's op_name, the step's jit then the
  name stack and the primitive."""
  names = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', lowered_text,
                          re.MULTILINE))
  return [(line, names.get(ref, ""))
          for line in lowered_text.splitlines()
          for ref in re.findall(r"loc\((#loc\d+)\)\s*$", line)]


def test_copies_and_recomputations_carry_jlms_scopes_in_the_lowered_hlo():
  # Copies to host survive lowering only for a target with pinned host
  # memory: lowered for the deviceless H100, not compiled.
  # A GPT whose least memory both copies and remakes values.
  case = models.gpt_case(layers=4, width=256, heads=4, seq=256, batch=8,
                         vocab=512)
  args = _xla_memory._place_on_target(
      case.abstract_args(), _xla_memory.target_devices("h100"))
  step = jlms.offload(case.step, budget="min")
  plan = step.plan(*args)
  copied = [v for v in plan.offloaded if not v.recomputed]
  assert copied and plan.recomputed
  ops = _op_names(step.lower(*args).as_text(debug_info=True))
  placements = [(re.search(r'_xla_buffer_placement = "(\w+)"', line).group(1),
                 name) for line, name in ops
                if "@annotate_device_placement" in line]
  to_host = {name for space, name in placements if space == "pinned_host"}
  to_device = {name for space, name in placements if space == "device"}
  # The step's jit is named after the step, as jax.jit names it.
  prefix = f"jit({case.step.__name__})/"
  for value in copied:
    assert (f"{prefix}{profile_scope('swap_out', value.name)}/device_put"
            in to_host), value.name
    assert (f"{prefix}{profile_scope('swap_in', value.name)}/device_put"
            in to_device), value.name
  assert all(name.startswith(f"{prefix}jlms/swap_")
             for name in to_host | to_device)
  remade = {name for _, name in ops if "/jlms/recompute/" in name}
  for value in plan.recomputed:
    scope = f"{prefix}{profile_scope('recompute', value.name)}/"
    assert any(name.startswith(scope) for name in remade), value.name


def test_copies_inside_loops_carry_jlms_scopes_in_the_lowered_hlo():
  # The GPT's layer stack streams its residuals a slice per iteration:
  # the copies inside the scans are named after the stack.
  case = models.ZOO["gpt"].tiny_case()
  args = _xla_memory._place_on_target(
      case.abstract_args(), _xla_memory.target_devices("h100"))
  step = jlms.offload(case.step, min_bytes=1 << 10)
  streamed = [v for v in step.plan(*args).offloaded if v.streamed]
  assert streamed
  ops = _op_names(step.lower(*args).as_text(debug_info=True))
  placed = {name for line, name in ops
            if "@annotate_device_placement" in line}
  for value in streamed:
    for kind in ("swap_out", "swap_in"):
      scope = f"{profile_scope(kind, value.name)}/device_put"
      assert any(name.endswith(scope) for name in placed), (kind, value.name)


def test_only_postponable_contractions_and_the_loss_are_pinned_to_the_next_barrier():
  # Forward and input-gradient matmuls make activations that the next
  # equations read: tying them to a backward barrier would route every later
  # read through it, and XLA could no longer fuse or share those reads (on
  # the 16-block ResNet at the halfway budget this made relu masks twice and
  # split cotangent sums: 25.3 ms by the schedule model, 24.9 ms without).
  # Weight gradients, first read by the update, are pinned, and so is the
  # loss's sum, which only the step's outputs read: XLA's scheduler runs
  # such a reduction last and holds what it reads till then (a Llama's
  # logits, 1 GiB a device over eight H100s: XLA's peak of a 16-layer
  # plan at 70B's widths went from 32.69 to 32.14 GiB with it pinned).
  from jlms._cost import TARGETS
  from jlms._fit import fit
  from jlms._liveness import analyse
  from jlms._program import flatten
  from jlms._rewrite import _postponable_contractions, rewrite
  from jlms._simulator import analyse_fusion
  width, batch = 256, 512
  program = flatten(jax.make_jaxpr(_mlp_step)(*_args(width=width,
                                                      batch=batch)))
  liveness = analyse(program)
  fusion = analyse_fusion(program, liveness)
  offloads = fit(program, liveness, None, TARGETS["h100"], min_bytes=1,
                 fusion=fusion).offloads
  assert offloads
  rewritten = rewrite(program, offloads, jlms.OffloadConfig(), fusion=fusion,
                      pin_contractions=True)
  _compat.check_jaxpr(rewritten)
  made_by = {id(v): e for e in rewritten.jaxpr.eqns for v in e.outvars}
  contracted = (jax.lax.dot_general_p, jax.lax.transpose_p)
  tied = {tuple(v.aval.shape) for e in rewritten.jaxpr.eqns
          if e.primitive is jax.lax.optimization_barrier_p
          for v in e.invars if id(v) in made_by
          and made_by[id(v)].primitive in contracted}
  assert (batch, width) not in tied  # no activation
  # The pinned ones are the weight gradients made before the last barrier.
  barriers = sorted({s.issue_before for o in offloads for s in o.swap_ins})
  weight_gradients = {
      index for index, equation in enumerate(program.equations)
      if equation.primitive is jax.lax.dot_general_p
      and program.avals[equation.outputs[0]].shape == (width, width)
      and index < barriers[-1]}
  assert weight_gradients
  loss_sum, = [index for index, equation in enumerate(program.equations)
               if equation.primitive is jax.lax.reduce_sum_p]
  assert loss_sum < barriers[-1]
  assert _postponable_contractions(program, barriers) == (
      weight_gradients | {loss_sum})


def test_a_gradients_reduction_is_not_pinned_as_the_loss_is():
  # A bias's gradient is a sum over the batch that only the update reads,
  # and so only the step's outputs: pinned like the loss, it held the
  # 16-block ResNet at remat's peak (its BatchNorm scales and shifts) to
  # 26.885 ms by the schedule model instead of 26.565, at the same peak.
  from jlms._names import made_in_backward
  from jlms._program import flatten
  from jlms._rewrite import _postponable_contractions

  def step(params, x):
    def loss(params):
      h = x
      for w, b in params:
        h = jnp.tanh(h @ w + b)
      return jnp.mean(h ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), value

  params = [(jnp.full((64, 64), 0.01), jnp.zeros(64))] * 3
  program = flatten(jax.make_jaxpr(step)(params, jnp.ones((32, 64))))
  sums = [index for index, equation in enumerate(program.equations)
          if equation.primitive is jax.lax.reduce_sum_p]
  backward = {i for i in sums
              if made_in_backward(str(program.equations[i].name_stack))}
  loss_sum, = set(sums) - backward
  biases = {i for i in backward
            if program.avals[program.equations[i].outputs[0]].shape == (64,)}
  assert len(biases) >= 3  # the biases' gradients, at least
  pinned = _postponable_contractions(program, [len(program) - 1])
  assert loss_sum in pinned
  assert not backward & pinned


def test_recomputations_that_share_a_kernel_are_emitted_once_behind_one_barrier():
  # Two values remade from the same inputs before the same equation: the
  # equations their chains share are emitted once, behind one barrier, so
  # that XLA can make both in one kernel. A third, remade there from other
  # inputs, keeps a barrier of its own (behind one, XLA could make all at
  # once and hold all they make).
  from jlms._liveness import analyse
  from jlms._planner import Offload, SwapIn
  from jlms._program import flatten
  from jlms._rewrite import rewrite
  def fn(x, w):
    y = x * 3.0 + 1.0
    r = jnp.maximum(y, 0.0)
    m = (y > 0).astype(jnp.float32)
    s = jnp.sin(w)
    h = x
    for _ in range(4):
      h = jnp.tanh(h @ w)
    return h + r + m + s
  shape = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  program = flatten(jax.make_jaxpr(fn)(shape, shape))
  liveness = analyse(program)
  names = [e.primitive.name for e in program.equations]
  scaled, shifted = names.index("mul"), names.index("add")
  relu, mask = names.index("max"), names.index("gt")
  cast, sine = names.index("convert_element_type"), names.index("sin")
  last = len(program) - 3  # the first of the three final adds
  near = max(relu, cast, sine) + 1

  def remade(chain):
    value = program.equations[chain[-1]].outputs[0]
    reads = tuple(u for u in liveness.uses[value] if u > near)
    return Offload(value, near, (SwapIn(last, reads),), recompute=chain)

  offloads = (remade((scaled, shifted, relu)),
              remade((scaled, shifted, mask, cast)), remade((sine,)))
  rewritten = rewrite(program, offloads, jlms.OffloadConfig())
  _compat.check_jaxpr(rewritten)
  emitted = [e.primitive.name for e in rewritten.jaxpr.eqns]
  # Forward: mul, add, max, gt, sin once each; remade: the same again.
  assert emitted.count("mul") == 2 and emitted.count("add") == 2 + 3
  assert emitted.count("gt") == 2 and emitted.count("max") == 2
  assert emitted.count("sin") == 2
  assert emitted.count("optimization_barrier") == 2
  x = jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256) / 65536 - 0.5
  w = jnp.eye(256, dtype=jnp.float32) * 0.5
  want = jax.jit(fn)(x, w)
  got = jax.jit(lambda *a: _compat.eval_jaxpr(
      rewritten.jaxpr, rewritten.consts, *a))(x, w)[0]
  assert jnp.allclose(got, want)


def test_a_recomputation_reads_a_fused_away_fill_as_it_is():
  # A remade `where(keep, x, 0)` reads a broadcast zero that XLA makes
  # inside the select's kernel. Through the remaking's barrier it would be
  # a buffer of its own, written once and read by every kernel that reads
  # the barrier's outputs (GPT-2 medium's dropout gradients: one
  # f32[8,1024,1024] of zeros read by 94 remade kernels).
  from jlms._liveness import analyse
  from jlms._planner import Offload, SwapIn
  from jlms._program import flatten
  from jlms._rewrite import rewrite
  from jlms._simulator import analyse_fusion

  def fn(x, w):
    kept = jnp.where(x > 0, x, 0.0)
    h = x
    for _ in range(4):
      h = jnp.tanh(h @ w)
    return h + kept

  shape = jax.ShapeDtypeStruct((256, 256), jnp.float32)
  program = flatten(jax.make_jaxpr(fn)(shape, shape))
  liveness = analyse(program)
  fusion = analyse_fusion(program, liveness)
  names = [e.primitive.name for e in program.equations]
  fill = program.equations[names.index("broadcast_in_dim")].outputs[0]
  assert not fusion.materialized[fill]
  chain = (names.index("gt"), names.index("select_n"))
  value = program.equations[chain[-1]].outputs[0]
  last = len(program) - 1
  near = names.index("dot_general") + 1
  reads = tuple(u for u in liveness.uses[value] if u > near)
  offloads = (Offload(value, near, (SwapIn(last, reads),), recompute=chain),)
  rewritten = rewrite(program, offloads, jlms.OffloadConfig(), fusion=fusion)
  _compat.check_jaxpr(rewritten)
  made_by = {id(v): e for e in rewritten.jaxpr.eqns for v in e.outvars}
  barrier_reads = [made_by[id(v)].primitive.name
                   for e in rewritten.jaxpr.eqns
                   if e.primitive is jax.lax.optimization_barrier_p
                   for v in e.invars if id(v) in made_by]
  assert barrier_reads and "broadcast_in_dim" not in barrier_reads
  x = jnp.arange(256 * 256, dtype=jnp.float32).reshape(256, 256) / 65536 - 0.5
  w = jnp.eye(256, dtype=jnp.float32) * 0.5
  got = jax.jit(lambda *a: _compat.eval_jaxpr(
      rewritten.jaxpr, rewritten.consts, *a))(x, w)[0]
  assert jnp.allclose(got, jax.jit(fn)(x, w))
