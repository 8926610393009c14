"""A latency profile of a compiled program for XLA's GPU scheduler
(`jlms._latency_profile`): what each kernel and host copy costs, by the
names the scheduler knows them by, and plans that compile with it."""

import pathlib
import re

import pytest

import jlms
from benchmarks import models
from jlms import _compat
from jlms._cost import time_target
from jlms._latency_profile import (PROFILE_OPTION, latency_profile,
                                   parse_computations, profile_of,
                                   schedule_of)

H100 = time_target("h100")
MIB = 1 << 20

# A module as XLA prints a compiled one: a matmul fused with its library
# call, a 4 MiB copy of a pinned host buffer beside it, and a loop of six
# iterations of an elementwise kernel.
_MODULE = """HloModule jit_step, is_scheduled=true

%fused_dot (param_0: f32[4096,4096], param_1: f32[4096,4096]) -> f32[4096,4096] {
  %param_0 = f32[4096,4096]{1,0} parameter(0), metadata={scheduling_name="param_0"}
  %param_1 = f32[4096,4096]{1,0} parameter(1), metadata={scheduling_name="param_1"}
  ROOT %dot.1 = f32[4096,4096]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={scheduling_name="dot.1"}
}

%fused_add (param_0.1: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.1 = f32[1024,1024]{1,0} parameter(0)
  ROOT %add.2 = f32[1024,1024]{1,0} add(%param_0.1, %param_0.1)
}

%body (carry: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %carry = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%carry), index=0
  %v = f32[1024,1024]{1,0} get-tuple-element(%carry), index=1
  %loop_add_fusion = f32[1024,1024]{1,0} fusion(%v), kind=kLoop, calls=%fused_add, metadata={op_name="jit(step)/add" scheduling_name="loop_add_fusion"}
  ROOT %tuple.3 = (s32[], f32[1024,1024]{1,0}) tuple(%i, %loop_add_fusion)
}

%cond (carry.1: (s32[], f32[1024,1024])) -> pred[] {
  %carry.1 = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%carry.1), index=0
  %six = s32[] constant(6)
  ROOT %lt = pred[] compare(%i.1, %six), direction=LT
}

ENTRY %main.9 (x: f32[4096,4096], w: f32[4096,4096], h: f32[1024,1024]) -> (f32[4096,4096], f32[1024,1024]) {
  %x = f32[4096,4096]{1,0} parameter(0), metadata={scheduling_name="x"}
  %w = f32[4096,4096]{1,0} parameter(1), metadata={scheduling_name="w"}
  %h = f32[1024,1024]{1,0:S(5)} parameter(2), metadata={scheduling_name="h"}
  %copy-start.4 = (f32[1024,1024]{1,0}, f32[1024,1024]{1,0:S(5)}, u32[]) copy-start(%h), metadata={scheduling_name="copy-start"}
  %gemm_fusion = f32[4096,4096]{1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, metadata={op_name="jit(step)/dot_general" scheduling_name="gemm_fusion.3"}
  %copy-done.4 = f32[1024,1024]{1,0} copy-done(%copy-start.4), metadata={scheduling_name="copy-done"}
  %zero = s32[] constant(0)
  %tuple.5 = (s32[], f32[1024,1024]{1,0}) tuple(%zero, %copy-done.4)
  %while.6 = (s32[], f32[1024,1024]{1,0}) while(%tuple.5), condition=%cond, body=%body, metadata={scheduling_name="while.6"}, backend_config={"known_trip_count":{"n":"6"}}
  %out = f32[1024,1024]{1,0} get-tuple-element(%while.6), index=1
  ROOT %tuple.7 = (f32[4096,4096]{1,0}, f32[1024,1024]{1,0}) tuple(%gemm_fusion, %out)
}
"""


def test_kernels_are_priced_at_their_roofline_and_host_copies_at_the_link():
  profile = profile_of(_MODULE, H100)
  # The matmul: 2 * 4096^3 FLOPs at the TF32 peak, above its bytes' time.
  assert profile.costs["gemm_fusion.3"] == pytest.approx(
      2 * 4096**3 / H100.contraction_peak("float32", False))
  # The loop's kernel reads and writes 4 MiB; the loop runs it six times.
  add = profile.costs["loop_add_fusion"]
  assert add == pytest.approx(8 * MIB / H100.hbm_bytes_per_s)
  assert profile.costs["while.6"] == pytest.approx(6 * add)
  # 4 MiB over the link, from its start to its done, under each name
  # either may have had at scheduling; the pair's own instructions are
  # left to XLA's estimate.
  link = pytest.approx(4 * MIB / 52e9)
  assert profile.latencies == {
      (start, done): link for start in ("copy-start", "copy-start.4")
      for done in ("copy-done", "copy-done.4")}
  assert not {"copy-start", "copy-start.4", "copy-done", "copy-done.4"} & set(
      profile.costs)
  # Nothing inside a fusion, nothing that runs no kernel.
  assert not {"dot.1", "add.2", "x", "h", "tuple.5"} & set(
      profile.costs)


def test_a_copy_is_known_by_its_name_where_a_later_pass_renamed_its_record():
  """XLA of JAX 0.12 records some copy-dones under the name of the
  barrier they replaced after scheduling; the scheduler knew them by their
  own name, and a profile naming only the record misses them."""
  renamed = _MODULE.replace('copy-done(%copy-start.4), metadata={'
                            'scheduling_name="copy-done"}',
                            'copy-done(%copy-start.4), metadata={'
                            'scheduling_name="optimization_barrier.8.0"}')
  assert renamed != _MODULE
  latencies = profile_of(renamed, H100).latencies
  assert ("copy-start.4", "copy-done.4") in latencies
  assert ("copy-start", "copy-done.4") in latencies

def test_an_instruction_is_priced_by_its_own_name_before_anothers_record():
  # The matmul recorded under the name of the loop's add kernel, which is
  # priced first (a loop's body before the computation that runs it): the
  # add keeps its own price, and the matmul has its own under its name.
  recorded = _MODULE.replace('scheduling_name="gemm_fusion.3"',
                             'scheduling_name="loop_add_fusion"')
  assert recorded != _MODULE
  costs = profile_of(recorded, H100).costs
  assert costs["gemm_fusion"] == pytest.approx(
      2 * 4096**3 / H100.contraction_peak("float32", False))
  assert costs["loop_add_fusion"] == pytest.approx(
      8 * MIB / H100.hbm_bytes_per_s)


# An update in place of a stacked buffer on host, as an asynchronous slice
# (the write-back of a layer's moment), the same update of a stack on the
# device as a kernel, and an allocation of a host buffer.
_SLICES = """HloModule jit_step, is_scheduled=true

%wrapped_dynamic-update-slice_computation (param_0: f32[32,1024,1024], param_1: f32[1,1024,1024], param_2: s32[]) -> f32[32,1024,1024] {
  %param_0 = f32[32,1024,1024]{2,1,0:S(5)} parameter(0), metadata={scheduling_name="param_0"}
  %param_1 = f32[1,1024,1024]{2,1,0} parameter(1), metadata={scheduling_name="param_1"}
  %copy.1 = f32[1,1024,1024]{2,1,0} copy(%param_1)
  %param_2 = s32[] parameter(2), metadata={scheduling_name="param_2"}
  %zero = s32[] constant(0)
  ROOT %dynamic-update-slice.1 = f32[32,1024,1024]{2,1,0:S(5)} dynamic-update-slice(%param_0, %copy.1, %param_2, %zero, %zero)
}

%fused_update (p0: f32[32,1024,1024], p1: f32[1,1024,1024], p2: s32[]) -> f32[32,1024,1024] {
  %p0 = f32[32,1024,1024]{2,1,0} parameter(0)
  %p1 = f32[1,1024,1024]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus.2 = f32[32,1024,1024]{2,1,0} dynamic-update-slice(%p0, %p1, %p2, %z, %z)
}

ENTRY %main.3 (h: f32[32,1024,1024], u: f32[1,1024,1024], i: s32[], d: f32[32,1024,1024]) -> (f32[32,1024,1024], f32[32,1024,1024], f32[32,1024,1024]) {
  %h = f32[32,1024,1024]{2,1,0:S(5)} parameter(0)
  %u = f32[1,1024,1024]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %d = f32[32,1024,1024]{2,1,0} parameter(3)
  %custom-call.7 = f32[32,1024,1024]{2,1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer", metadata={scheduling_name="custom-call.7"}
  %dynamic-update-slice-start.1 = ((f32[32,1024,1024]{2,1,0:S(5)}, f32[1,1024,1024]{2,1,0}, s32[]), f32[32,1024,1024]{2,1,0:S(5)}, u32[]) fusion-start(%h, %u, %i), kind=kLoop, calls=%wrapped_dynamic-update-slice_computation, metadata={scheduling_name="dynamic-update-slice-start.1"}
  %loop_dynamic_update_slice_fusion = f32[32,1024,1024]{2,1,0} fusion(%d, %u, %i), kind=kLoop, calls=%fused_update, metadata={scheduling_name="loop_dynamic_update_slice_fusion"}
  %dynamic-update-slice-done.1 = f32[32,1024,1024]{2,1,0:S(5)} fusion-done(%dynamic-update-slice-start.1), metadata={scheduling_name="dynamic-update-slice-done.1"}
  ROOT %t = (f32[32,1024,1024]{2,1,0:S(5)}, f32[32,1024,1024]{2,1,0}, f32[32,1024,1024]{2,1,0:S(5)}) tuple(%dynamic-update-slice-done.1, %loop_dynamic_update_slice_fusion, %custom-call.7)
}
"""


def test_a_slice_moves_its_slice_not_the_stack_it_updates():
  profile = profile_of(_SLICES, H100)
  # The write-back of one 4 MiB layer of a 128 MiB stack on host.
  assert profile.latencies == {
      ("dynamic-update-slice-start.1", "dynamic-update-slice-done.1"):
      pytest.approx(4 * MIB / 52e9)}
  # On the device: the update read, and written in place (not 128 MiB).
  assert profile.costs["loop_dynamic_update_slice_fusion"] == pytest.approx(
      8 * MIB / H100.hbm_bytes_per_s)
  # An allocation runs no kernel: it costs nothing.
  assert profile.costs["custom-call.7"] == 0.0


def test_the_profile_is_text_that_xla_reads_and_none_without_host_copies():
  text = latency_profile(_MODULE, H100)
  assert re.search(r'^costs \{ name: "gemm_fusion.3" cost_us: [\d.]+ \}$',
                   text, re.M)
  assert re.search(r'^latencies \{ source: "copy-start" target: '
                   r'"copy-done" latency_us: 80\.\d+ \}$', text, re.M)
  on_device = _MODULE.replace("{1,0:S(5)}", "{1,0}")
  assert latency_profile(on_device, H100) is None


def test_computations_are_read_with_their_entry():
  computations, entry = parse_computations(_MODULE)
  assert entry == "main.9"
  assert set(computations) == {"fused_dot", "fused_add", "body", "cond",
                               "main.9"}
  assert [i.opcode for i in computations["body"]] == [
      "parameter", "get-tuple-element", "get-tuple-element", "fusion",
      "tuple"]


def test_a_schedule_is_the_order_of_the_scheduled_computations():
  schedule = schedule_of(_MODULE)
  assert len(schedule) == 3  # the entry, the loop's body and condition
  assert schedule[0][3:6] == ("copy-start", "gemm_fusion.3", "copy-done")
  # The copy's wait moved before the matmul: another order.
  moved = _MODULE.replace(
      "  %copy-done.4 = f32[1024,1024]{1,0} copy-done(%copy-start.4), "
      'metadata={scheduling_name="copy-done"}\n', "")
  moved = moved.replace(
      "  %gemm_fusion =", "  %copy-done.4 = f32[1024,1024]{1,0} copy-done("
      '%copy-start.4), metadata={scheduling_name="copy-done"}\n'
      "  %gemm_fusion =")
  assert moved != _MODULE
  assert schedule_of(moved) != schedule
  assert schedule_of(moved)[1:] == schedule[1:]


def _options(step, args) -> dict:
  return dict(_compat.compiler_options(step.lower(*args)) or ())


def test_a_plan_that_streams_through_host_compiles_with_a_profile_of_its_copies():
  """The least memory of a scanned MLP streams its layers' inputs through
  host: the program runs with a latency profile of XLA's first compile of
  it, whose copies are the compiled program's own, and XLA's peak with it
  is no higher than without."""
  case = models.scan_mlp_case(layers=4, width=256, batch=1024)
  args = case.abstract_args()
  step = jlms.offload(case.step, budget="min", target="h100")
  plan = step.plan(*args)
  assert plan.offloaded_bytes > 0
  options = _options(step, args)
  path = pathlib.Path(options[PROFILE_OPTION])
  text = path.read_text()
  copies = re.findall(r'latencies \{ source: "([^"]+)" target: "([^"]+)"',
                      text)
  assert copies
  compiled = jlms.xla_memory(step, *args, target="h100")
  names = set(re.findall(r'scheduling_name="([^"]+)"', compiled.hlo_text))
  names |= set(re.findall(r"^\s*(?:ROOT )?%([\w.\-]+) = ",
                          compiled.hlo_text, re.M))
  assert all(start in names and done in names for start, done in copies)
  assert compiled.peak_bytes == plan.xla_peak_bytes


def test_xla_compiles_the_plan_with_a_profile_of_each_host_copy_quietly(
    capfd):
  """Every host copy of the program XLA compiled with the profile is in
  it, by the names the program gives the copy's start and done (XLA of
  JAX 0.12 records some dones under another instruction's name), and XLA
  logs nothing of its check of the profile (it logged each copy's start
  and done, on every compile)."""
  case = models.scan_mlp_case(layers=4, width=256, batch=1024)
  args = case.abstract_args()
  step = jlms.offload(case.step, budget="min", target="h100")
  capfd.readouterr()
  compiled = jlms.xla_memory(step, *args, target="h100")
  assert "profile_guided_latency_estimator" not in capfd.readouterr().err
  options = _options(step, args)
  assert PROFILE_OPTION in options
  profiled = set(re.findall(
      r'latencies \{ source: "([^"]+)" target: "([^"]+)"',
      pathlib.Path(options[PROFILE_OPTION]).read_text()))
  host_starts = set(re.findall(
      r"^\s*%([\w.\-]+) = \(.*S\(5\).*\) (?:copy|fusion|async)-start\(",
      compiled.hlo_text, re.M))
  pairs = set(re.findall(r"^\s*%([\w.\-]+) = \S+ (?:copy|fusion|async)-done"
                         r"\(%([\w.\-]+)\)", compiled.hlo_text, re.M))
  host_pairs = {(start, done) for done, start in pairs if start in host_starts}
  assert host_pairs
  assert host_pairs <= profiled


def test_a_plan_that_copies_nothing_compiles_without_a_profile():
  case = models.scan_mlp_case(layers=4, width=256, batch=1024)
  args = case.abstract_args()
  step = jlms.offload(case.step, budget="90%", target="h100")
  step.plan(*args)
  assert PROFILE_OPTION not in _options(step, args)
