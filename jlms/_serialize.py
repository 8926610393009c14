"""Choosing the equations to serialize: layers whose ops must run one by one.

TFLMSv2's `serialization` made the ops of chosen graph levels run one after
another, so that large independent ops (the branches of an Inception block)
could not be resident together. In JAX the jaxpr is already a sequence, but
XLA reorders it freely; jlms pins the order of the chosen equations down by
chaining them with optimization barriers (the rewrite does that, see
`jlms._rewrite`). This module only decides which equations are chained.

An equation is chosen when it does work of its own (XLA does not fuse it
into a later kernel: chaining a fused-away equation would give its result
a buffer) and it matches one of `serialize`'s items:
- a string: a glob over the equation's name (the Flax/`jax.named_scope`
  name stack then the primitive, e.g. "*Inception_2/*" or "*branch_*conv*"),
  matched anywhere in the name;
- a `range` or a `(start, stop)` pair: equation indices of the flattened
  step, stop excluded (as `Plan` and the reports number them);
or when its outputs take at least `serialize_by_size` bytes.

Pure function of a program, its liveness and its fusion analysis.
"""

from __future__ import annotations

import fnmatch
import warnings

from jlms._liveness import Liveness
from jlms._program import Program


def parse_serialize(items) -> tuple:
  """`serialize` as a tuple of glob strings and `range`s; raises on items
  of any other kind."""
  if items is None:
    return ()
  if isinstance(items, (str, range)):
    items = (items,)
  parsed = []
  for item in items:
    if isinstance(item, (str, range)):
      parsed.append(item)
    elif (isinstance(item, tuple) and len(item) == 2
          and all(isinstance(i, int) for i in item)):
      parsed.append(range(*item))
    else:
      raise ValueError(
          "jlms: serialize takes name patterns (str), equation ranges "
          f"(range or (start, stop)), got {item!r}")
    if isinstance(parsed[-1], range) and (
        len(parsed[-1]) == 0 or parsed[-1].start < 0
        or parsed[-1].step != 1):
      raise ValueError(
          f"jlms: serialize range {item!r} chooses no equation: give "
          "(start, stop) with 0 <= start < stop, equation indices as "
          "print(plan) numbers them")
    if isinstance(parsed[-1], str) and not parsed[-1].strip("* "):
      raise ValueError(f"jlms: serialize pattern {item!r} matches every "
                       "equation: give a part of a name, such as "
                       "'*block_3/*'")
  return tuple(parsed)


def serialized_equations(program: Program, liveness: Liveness,
                         runs_in_place, serialize=(),
                         serialize_by_size: int | None = None) -> frozenset:
  """Indices of the equations to chain (see the module docstring).
  `runs_in_place[i]` says whether equation `i`'s work happens where it
  stands (`Fusion.executes_at[i] == i`)."""
  # A pattern matches anywhere in the name ("**" matches as "*" does).
  patterns = [f"*{p}*" for p in serialize if isinstance(p, str)]
  ranges = [r for r in serialize if isinstance(r, range)]
  chosen, matched = set(), set()
  for index, equation in enumerate(program.equations):
    if not runs_in_place[index]:
      continue
    if any(index in r for r in ranges):
      chosen.add(index)
      continue
    if serialize_by_size is not None and sum(
        liveness.nbytes[o] for o in equation.outputs) >= serialize_by_size:
      chosen.add(index)
      continue
    if patterns:
      name = equation.readable_name()
      found = {p for p in patterns if fnmatch.fnmatchcase(name, p)}
      if found:
        matched.update(found)
        chosen.add(index)
  for item in serialize:
    if (f"*{item}*" not in matched if isinstance(item, str)
        else not any(i in chosen for i in item)):
      example = next((e.readable_name() for e in program.equations
                      if str(e.name_stack)), "")
      warnings.warn(
          f"jlms: serialize item {item!r} chooses no equation of the step "
          "that runs as a kernel of its own; nothing is chained for it "
          f"(names look like {example!r}; print(plan) lists them)",
          stacklevel=2)
  return frozenset(chosen)
