"""Value names as the user's model spells them, and how they are shown.

A jaxpr equation's name stack is JAX's record of where it was made: the
`jax.named_scope`s and Flax module calls around it, wrapped in the
transformations that made it (`jvp(...)` for the forward pass of a
gradient, `transpose(jvp(...))` for its backward pass, `vmap(...)`), with
scopes that JAX's own rematerialisation adds (`checkpoint`,
`rematted_computation`). `readable_name` turns one into the name a user
recognises:

    transpose(jvp(_ResNet))/jvp(_ResNet)/checkpoint/rematted_computation/
        stage3_block0/stage3_block0/_ConvBN_1/BatchNorm_0   + "mul"
    ->  _ResNet/stage3_block0/_ConvBN_1/BatchNorm_0/mul (backward)

- Transformations are unwrapped to the scope inside them; a value made
  under `transpose` (in the backward pass) is marked " (backward)", since
  the same module path then names both an activation and a gradient.
- The model's own name (the root Flax module's class, or a plain-JAX
  step's outermost `named_scope`) stays: it is the one part a user chose,
  and it tells apart two models in one step (a GAN's generator and
  discriminator). Below it come the Flax module path, as in the model's
  variables tree, and the primitive.
- Scopes that only rematerialisation adds are dropped, and a scope repeated
  right after itself (Flax's lifted transformations, `nn.remat` and
  `nn.scan`, enter a module's scope twice) is written once.
- The step's own outermost `jax.jit` (jlms's wrapper, or the user's jitted
  step) never appears: `jlms._program.flatten` does not push it.

`elide` fits a name into a column without cutting a part of it, and
`profile_scope` is the `jax.named_scope`-style name under which jlms emits
its copies and recomputations.

Pure string functions: they read no JAX internals, so a name stack's text
is all they need (`str(name_stack)`).
"""

from __future__ import annotations

import re

#: Transformations whose names wrap the scope they were applied under.
_TRANSFORMS = frozenset({"jvp", "transpose", "vmap", "pmap"})
#: Scopes added by `jax.checkpoint` (and by `flatten` for its bodies), not
#: by the user.
_REMAT_SCOPES = frozenset({"checkpoint", "rematted_computation"})
BACKWARD = " (backward)"
ELLIPSIS = "\u2026"  # one character: "a/…/z"
_WRAPPED = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)\((.*)\)$")


def _split_stack(stack: str) -> list[str]:
  """`stack`'s parts at the '/'s outside parentheses."""
  parts, depth, start = [], 0, 0
  for i, char in enumerate(stack):
    if char == "(":
      depth += 1
    elif char == ")":
      depth = max(depth - 1, 0)
    elif char == "/" and depth == 0:
      parts.append(stack[start:i])
      start = i + 1
  parts.append(stack[start:])
  return parts


def _unwrap(part: str) -> tuple[str, set[str]]:
  """The scope inside `part`'s transformation wrappers, and their names."""
  transforms = set()
  while (match := _WRAPPED.match(part)) and match.group(1) in _TRANSFORMS:
    transforms.add(match.group(1))
    part = match.group(2)
  return part, transforms


def readable_name(stack: str, primitive: str) -> str:
  """The name of the value that an equation with name stack `stack` (its
  text) and primitive `primitive` makes (see the module docstring)."""
  scopes: list[str] = []
  backward = False
  for part in _split_stack(stack):
    scope, transforms = _unwrap(part)
    backward |= "transpose" in transforms
    # A scope may hold '/'s of its own (`jax.named_scope("a/b")`).
    for piece in scope.split("/"):
      if piece and piece not in _REMAT_SCOPES and (
          not scopes or scopes[-1] != piece):
        scopes.append(piece)
  name = "/".join(scopes + [primitive])
  return name + BACKWARD if backward else name


def made_in_backward(stack: str) -> bool:
  """Whether an equation with name stack `stack` (its text) was made by
  autodiff's transpose: in a gradient's backward pass."""
  return any("transpose" in _unwrap(part)[1] for part in _split_stack(stack))


def common_scope(stacks: list[str]) -> str:
  """The leading '/'-separated scopes that all of `stacks` (name stacks'
  texts) share; "" for none."""
  if not stacks:
    return ""
  split = [_split_stack(s) for s in stacks]
  shared = []
  for parts in zip(*split):
    if any(p != parts[0] for p in parts):
      break
    shared.append(parts[0])
  return "/".join(shared)


def elide(name: str, width: int) -> str:
  """`name` in at most `width` characters, its parts ('/'-separated) whole:
  as it is if it fits, else with "…" for parts in its middle. The first
  and last parts stay, then parts are put back from both ends in turn
  (a module path's outer block and its innermost layer say most):
  "_ResNet/stage3_block0/…/Conv_0/conv_general_dilated". When even the
  first and last parts are too wide, "…/" and the last part, which may be
  wider than `width` (the caller then wraps the line): a part is never
  cut."""
  parts = name.split("/")
  if len(name) <= width or len(parts) < 2:
    return name
  first, *middle, last = parts
  head, tail = [first], [last]
  if len(_joined(head, tail)) > width:
    return f"{ELLIPSIS}/{last}"
  lo, hi = 0, len(middle)  # middle[lo:hi] is elided: one part at least
  from_head = True
  while hi - lo > 1:
    for side in (from_head, not from_head):
      trial = ((head + [middle[lo]], tail) if side
               else (head, [middle[hi - 1]] + tail))
      if len(_joined(*trial)) <= width:
        head, tail = trial
        lo, hi = (lo + 1, hi) if side else (lo, hi - 1)
        from_head = not side
        break
    else:
      break
  return _joined(head, tail)


def _joined(head: list[str], tail: list[str]) -> str:
  return "/".join([*head, ELLIPSIS, *tail])


def profile_scope(kind: str, value_name: str) -> str:
  """'jlms/<kind>/<value name>': the scope under which jlms emits a copy or
  recomputation of the value named `value_name`, as an XProf or Nsight
  Systems trace shows it. The name keeps its '/'s (profilers nest scopes
  at them); any run of other characters outside [A-Za-z0-9_.-] becomes one
  '_' (" (backward)" -> "_backward"), the characters TensorFlow-style op
  names allow, so every profiler view shows it as written here."""
  cleaned = "_".join(re.sub(r"[^A-Za-z0-9_./\-]+", " ", value_name).split())
  return f"jlms/{kind}/{cleaned}" if cleaned else f"jlms/{kind}"
