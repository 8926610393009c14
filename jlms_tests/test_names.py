"""Value names as the model spells them, and `str(plan)` never cutting a
name or a shape (`jlms._names`, the plan's table, the HTML report)."""

import functools
import html
import re

import jax
import numpy as np
import pytest

import jlms
from benchmarks import models
from jlms import _plan
from jlms._names import ELLIPSIS, elide, profile_scope, readable_name

# Name stacks (their text) and primitives of equations of the zoo's
# networks, traced with JAX 0.10.2 (`jlms._program.flatten`, which does not
# push the jit that stages the step), and the names a user is shown.
ZOO_NAMES = [
    ("jvp(_ResNet)/_ConvBN_0/BatchNorm_0", "mul",
     "_ResNet/_ConvBN_0/BatchNorm_0/mul"),
    ("jvp(_ResNet)/stage3_block0/_ConvBN_1/Conv_0", "conv_general_dilated",
     "_ResNet/stage3_block0/_ConvBN_1/Conv_0/conv_general_dilated"),
    ("transpose(jvp(_ResNet))/Dense_0", "transpose",
     "_ResNet/Dense_0/transpose (backward)"),
    # nn.remat: JAX's remat scopes go, the doubled module scope is one.
    ("transpose(jvp(_ResNet))/jvp(_ResNet)/checkpoint/rematted_computation/"
     "stage3_block0/stage3_block0/_ConvBN_1/BatchNorm_0", "mul",
     "_ResNet/stage3_block0/_ConvBN_1/BatchNorm_0/mul (backward)"),
    ("jvp(_DenseNet)/block0_layer1/block0_layer1/relu", "max",
     "_DenseNet/block0_layer1/relu/max"),
    ("jvp(_Inception)/mixed2/mixed2/_ConvBN_3/Conv_0", "conv_general_dilated",
     "_Inception/mixed2/_ConvBN_3/Conv_0/conv_general_dilated"),
    ("jvp(_MobileNetV2)/stage1_block0/_ConvBN_2/relu6", "min",
     "_MobileNetV2/stage1_block0/_ConvBN_2/relu6/min"),
    ("transpose(jvp(_UNet3D))/jvp(_UNet3D)/checkpoint/rematted_computation/"
     "up1/up1/relu", "max", "_UNet3D/up1/relu/max (backward)"),
    ("jvp(_UNet3D)/ConvTranspose_0", "conv_general_dilated",
     "_UNet3D/ConvTranspose_0/conv_general_dilated"),
    # Flax methods other than __call__, and jax.numpy's jitted helpers.
    ("jvp(_ScannedGPT)/Embed_0.attend", "dot_general",
     "_ScannedGPT/Embed_0.attend/dot_general"),
    ("jvp(_ScannedGPT)/Embed_0/_take/_where", "select_n",
     "_ScannedGPT/Embed_0/_take/_where/select_n"),
    ("transpose(jvp(_take))", "scatter-add", "_take/scatter-add (backward)"),
    # nn.scan's layer stack, outside any module's jvp (a hoisted mask).
    ("blocks/blocks/_CausalSelfAttention_0/tril", "ge",
     "blocks/_CausalSelfAttention_0/tril/ge"),
    # A plain-JAX step: nothing but the transformations.
    ("jvp()", "tanh", "tanh"),
    ("transpose(jvp())", "dot_general", "dot_general (backward)"),
    ("", "add", "add"),
    ("vmap(encoder)/layer_0", "dot_general", "encoder/layer_0/dot_general"),
]

# Internal wrappers no name may start with (jlms's own, JAX's).
INTERNAL_PREFIXES = ("flat_fun", "_rewritten", "jvp(", "transpose(", "vmap(",
                     "pjit", "jit(", "checkpoint", "rematted_computation",
                     "jlms")


@pytest.mark.parametrize("stack, primitive, expected", ZOO_NAMES,
                         ids=[n for _, _, n in ZOO_NAMES])
def test_readable_name_of_a_zoo_name_stack(stack, primitive, expected):
  assert readable_name(stack, primitive) == expected


def _parts_kept(shown: str, name: str) -> bool:
  """Whether `shown` is `name`, or `name` with whole parts in its middle
  (or start) replaced by one "…"."""
  if shown == name:
    return True
  if shown.count(ELLIPSIS) != 1:
    return False
  parts, shown_parts = name.split("/"), shown.split("/")
  cut = shown_parts.index(ELLIPSIS)
  head, tail = shown_parts[:cut], shown_parts[cut + 1:]
  return (bool(tail) and parts[:len(head)] == head
          and parts[len(parts) - len(tail):] == tail
          and len(head) + len(tail) < len(parts))


@pytest.mark.parametrize("width", range(1, 80, 3))
def test_elide_keeps_parts_whole_and_fits_when_it_can(width):
  for _, _, name in ZOO_NAMES:
    shown = elide(name, width)
    assert _parts_kept(shown, name), (shown, name)
    last = name.split("/")[-1]
    if len(name) <= width:
      assert shown == name
    elif len(f"{ELLIPSIS}/{last}") <= width or "/" not in name:
      assert len(shown) <= width or shown == name, shown


def test_elide_keeps_the_outer_block_and_the_layer():
  name = "_ResNet/stage3_block0/_ConvBN_1/Conv_0/conv_general_dilated"
  assert elide(name, 52) == (
      f"_ResNet/stage3_block0/{ELLIPSIS}/Conv_0/conv_general_dilated")


def test_profile_scope_keeps_the_path_and_plain_characters():
  assert profile_scope("swap_out", "_ResNet/Dense_0/transpose (backward)") == (
      "jlms/swap_out/_ResNet/Dense_0/transpose_backward")
  assert profile_scope("recompute", "_GPT/Embed_0.attend/dot_general") == (
      "jlms/recompute/_GPT/Embed_0.attend/dot_general")
  assert profile_scope("swap_in", "") == "jlms/swap_in"
  for _, _, name in ZOO_NAMES:
    assert re.fullmatch(r"[A-Za-z0-9_./\-]+", profile_scope("swap_in", name))


def _long_value(name: str) -> _plan.OffloadedValue:
  return _plan.OffloadedValue(
      name=name, source="", shape=(8, 1024, 1024, 64),
      dtype=np.dtype(np.float32), nbytes=1 << 31, produced_at=3,
      swapped_out_after=4, prefetched_before=(1000, 1200, 14000),
      used_at=(1001, 1201, 14001))


def test_a_name_too_long_for_any_elision_takes_a_line_of_its_own():
  one_part = "x" * (_plan.NAME_WIDTH + 10)
  lines = _plan._value_table([_long_value(one_part), _long_value("short")])
  assert lines[1] == f"  {one_part}"
  assert lines[2].split()[0] == "float32[8,"  # the row, its name cell empty
  assert "float32[8, 1024, 1024, 64]" in lines[2]
  assert "1000,1200,14000" in lines[2]
  assert lines[3].split()[0] == "short"


_ZOO_PLANS = pytest.mark.xdist_group("zoo_plans")


@functools.cache
def _zoo_plan(name: str) -> jlms.Plan:
  """The plan of the zoo's tiny `name` (simulator and time model: no
  compile), made once per process: the tests that read these plans
  (`_ZOO_PLANS`) run on one worker, since a plan takes 1.5 to 5 s (mostly
  tracing the Flax model)."""
  case = models.ZOO[name].tiny_case()
  return jlms.offload(case.step, min_bytes=1 << 10).plan(
      *case.abstract_args())


def _table_rows(text: str) -> list[tuple[str, str]]:
  """(name cell, shape cell) of each row of `str(plan)`'s value table."""
  lines = text.splitlines()
  start = next(i for i, line in enumerate(lines)
               if line.split()[:2] == ["value", "shape"])
  shape_at = lines[start].index("shape")
  rows, own_line = [], None
  for line in lines[start + 1:]:
    if line.startswith("  ... and"):
      break
    if len(line) <= shape_at or line[shape_at - 1] != " ":
      own_line = line.strip()  # a name too long for its column
      continue
    name = line[:shape_at].strip() or own_line
    own_line = None
    shape = line[shape_at:line.index("]", shape_at) + 1]
    rows.append((name, shape))
  return rows


#: Zoo models whose plans the quick tier prints; the others (2 to 6 s each
#: on JAX 0.12) are in the slow tier.
_QUICK_ZOO_PLANS = ("gpt", "resnet50", "unet3d")  # planned for other tests too


@_ZOO_PLANS
@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[] if name in _QUICK_ZOO_PLANS else
                 [pytest.mark.slow]) for name in sorted(models.ZOO)])
def test_plan_of_a_zoo_model_prints_names_and_shapes_whole(name):
  plan = _zoo_plan(name)
  text = str(plan)
  listed = plan.largest_offloaded()
  assert listed, "the tiny step offloads nothing"
  rows = _table_rows(text)
  assert len(rows) == len(listed)
  for (shown, shape), value in zip(rows, listed):
    assert shape == value.shape_text
    assert _parts_kept(shown, value.marked_name), (shown, value.marked_name)
  for line in text.splitlines():
    assert line.count("[") == line.count("]"), line
    assert line.count("(") == line.count(")"), line
  names = ([v.name for v in plan.offloaded] + [plan.largest_equation]
           + [n for n, _ in plan.live_at_peak])
  for full in names:
    assert not full.startswith(INTERNAL_PREFIXES), full
    # No transformation wraps a scope: only the backward mark has "(".
    assert "(" not in full.replace(" (backward)", ""), full


@_ZOO_PLANS
@pytest.mark.parametrize("name", ["resnet50", "gpt"])
def test_html_report_lists_the_plans_names_and_shapes(name):
  plan = _zoo_plan(name)
  page = plan._repr_html_()
  for value in plan.largest_offloaded():
    assert f"<td>{html.escape(value.name)}</td>" in page
    assert f"<td>{html.escape(value.shape_text)}</td>" in page


@_ZOO_PLANS
def test_names_are_the_modules_in_the_models_variables_tree():
  # A value made in a layer with parameters is named by that layer's path in
  # the model's parameters, below the model's class.
  plan = _zoo_plan("unet3d")
  params = models.ZOO["unet3d"].tiny_case().abstract_args()[0]
  paths = {"/".join(str(k.key) for k in path[:-1])
           for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  checked = 0
  for value in plan.offloaded:
    scopes = value.name.removesuffix(" (backward)").split("/")[:-1]
    if len(scopes) > 1 and re.fullmatch(r"(Conv|ConvTranspose|BatchNorm)_\d+",
                                        scopes[-1]):
      assert scopes[0] == "_UNet3D", value.name
      assert "/".join(scopes[1:]) in paths, value.name
      checked += 1
  assert checked
