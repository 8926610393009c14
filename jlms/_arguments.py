"""A step's arguments as `jax.jit` splits them: static values, traced leaves,
and the abstract signature a plan is cached under.

Guarantees: `static_argnums` and `static_argnames` (and the donated pair)
name the same parameters whichever way a caller passes them, each completed
from the other through the step's signature as `jax.jit` does; a leaf that
is neither an array nor static is refused with its path and what to do; a
call's fresh arrays can be committed where they are, without a copy, so
that a train loop compiles its step once; arrays in pinned host memory are
traced as device arrays, and `on_device` (public as `jlms.on_device`)
copies them back to the device on the same devices and sharding.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import jax

from jlms import _compat


def _as_tuple(x) -> tuple:
  if x is None:
    return ()
  if isinstance(x, (int, str)):
    return (x,)
  return tuple(x)


def complete_argnums(fun: Callable, argnums, argnames
                     ) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """(argnums, argnames) naming the same parameters of `fun`: `jax.jit`'s
  rule, where a side left empty is filled from the other through the
  signature (positional-or-keyword parameters only) and two given sides are
  taken as they are."""
  argnums, argnames = _as_tuple(argnums), _as_tuple(argnames)
  if bool(argnums) == bool(argnames):
    return argnums, argnames
  try:
    parameters = list(inspect.signature(fun).parameters.values())
  except (TypeError, ValueError):  # no signature (a builtin): as given
    return argnums, argnames
  by_position = [(i, p.name) for i, p in enumerate(parameters)
                 if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  if argnames:
    return tuple(i for i, name in by_position if name in argnames), argnames
  return argnums, tuple(name for i, name in by_position if i in argnums)


@dataclasses.dataclass(frozen=True)
class SplitArguments:
  """One call's arguments: the dynamic leaves (what is traced) and the
  static values (what keys the plan, and is passed back unchanged)."""
  leaves: list
  treedef: Any  # of (positional args with None at static places, kwargs)
  static_args: tuple  # (position, value) pairs
  static_kwargs: tuple  # (name, value) pairs, sorted by name

  def key(self) -> tuple:
    """The signature a plan is cached under: tree structure, static values
    and each leaf's abstract value, wherever it is (a state that the plan
    keeps on host arrives there or on the device, and is the same step)."""
    return (self.treedef, self.static_args, self.static_kwargs,
            tuple(_abstract_leaves(self.leaves, self.treedef)))

  def rebuilt(self, leaves) -> tuple[tuple, dict]:
    """The call's `(args, kwargs)` with `leaves` in place of the dynamic
    ones and the static values where they were."""
    dyn_args, dyn_kwargs = jax.tree.unflatten(self.treedef, leaves)
    full_args = list(dyn_args)
    for i, value in self.static_args:
      full_args[i] = value
    return tuple(full_args), {**dyn_kwargs, **dict(self.static_kwargs)}

  def call(self, fun: Callable, leaves) -> Any:
    """`fun` on these static values and `leaves` in place of the dynamic
    ones."""
    dyn_args, dyn_kwargs = jax.tree.unflatten(self.treedef, leaves)
    full_args = list(dyn_args)
    for i, value in self.static_args:
      full_args[i] = value
    return fun(*full_args, **dyn_kwargs, **dict(self.static_kwargs))


def split_arguments(args, kwargs, static_argnums, static_argnames
                    ) -> SplitArguments:
  """`args` and `kwargs` split as `jax.jit` with these (completed) static
  argument numbers and names splits them."""
  nargs = len(args)
  static_positions = {i % nargs for i in static_argnums if -nargs <= i < nargs}
  dyn_args = tuple(None if i in static_positions else a
                   for i, a in enumerate(args))
  static_args = tuple((i, args[i]) for i in sorted(static_positions))
  dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
  static_kwargs = tuple(sorted((k, v) for k, v in kwargs.items()
                               if k in static_argnames))
  leaves, treedef = jax.tree.flatten((dyn_args, dyn_kwargs))
  return SplitArguments(leaves, treedef, static_args, static_kwargs)


def committed_where_they_are(args, kwargs) -> tuple[tuple, dict]:
  """`args` and `kwargs` with each uncommitted array committed to the
  device it is on (no copy: the same buffer, so donating it donates the
  caller's), where no committed argument lives on other devices (there
  jax.jit moves it; it is left as it is).

  Why: JAX commits the outputs of a program that moves values between
  memory spaces, as jlms's do, and jax.jit compiles again when an argument's
  commitment changes. A train loop's first call has fresh (uncommitted)
  arguments and the next ones its outputs: committed from the first call
  on, the program compiled for it is the one every later call uses.
  """
  leaves, treedef = jax.tree.flatten((args, kwargs))
  arrays = [x for x in leaves if isinstance(x, jax.Array)
            and not isinstance(x, jax.core.Tracer)]
  if all(x.committed for x in arrays) or any(x.is_deleted() for x in arrays):
    return args, kwargs  # a deleted (donated) one gets jax.jit's own error
  devices = {frozenset(x.sharding.device_set) for x in arrays if x.committed}

  def commit(x):
    if (not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer)
        or x.committed):
      return x
    if devices and devices != {frozenset(x.sharding.device_set)}:
      return x
    return jax.device_put(x, x.sharding)

  return jax.tree.unflatten(treedef, [commit(x) for x in leaves])


def _abstract_leaves(leaves, treedef):
  try:
    return [_compat.on_device(_compat.abstractify(x)) for x in leaves]
  except TypeError as error:
    # The slow path, only to say which leaf, by its path in (args, kwargs).
    for (which, *path), leaf in jax.tree_util.tree_leaves_with_path(
        jax.tree.unflatten(treedef, leaves)):
      if not _is_abstractable(leaf):
        where = "args" if which.idx == 0 else "kwargs"
        raise TypeError(
            f"jlms.offload: the step's argument "
            f"{where}{jax.tree_util.keystr(tuple(path))} is a "
            f"{type(leaf).__name__} ({leaf!r:.60}), not an array: jax.jit "
            "traces every argument that is not static. Mark it static with "
            "static_argnums/static_argnames (its value then keys the plan, "
            "and each new value plans the step again), or pass it as an "
            "array.") from error
    raise


def _is_abstractable(leaf) -> bool:
  try:
    _compat.abstractify(leaf)
  except TypeError:
    return False
  return True


def with_state_on_device(tree, abstract: bool = True):
  """`tree` as jax.jit's program takes it: its arrays in pinned host memory
  (state that a plan keeps on host) in device memory instead, as abstract
  arrays (`abstract`, for a compile) or copied there. A step compiled by
  XLA for a GPU without jlms cannot return what it computes on host
  arguments (XLA's error E1200)."""
  leaves, treedef = jax.tree.flatten(tree)
  if abstract:
    return jax.tree.unflatten(treedef, traceable(leaves))
  return jax.tree.unflatten(treedef, [
      jax.device_put(x, x.sharding.with_memory_kind("device"))
      if in_pinned_host(x) else x for x in leaves])


def on_device(tree):
  """`tree` with each array in pinned host memory (state that a jlms plan
  keeps on host, as its step returns it) copied to device memory, on the
  same devices with the same sharding; other leaves as they are. For
  evaluating, checkpointing or training that state with code other than
  the `jlms.offload` step that returned it: `jax.jit` programs compute on
  device memory ("memory_space of all inputs ... must be the same")."""
  return with_state_on_device(tree, abstract=False)


def in_pinned_host(leaf) -> bool:
  """Whether `leaf` is a concrete array in pinned host memory."""
  return (isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer)
          and leaf.sharding.memory_kind == "pinned_host")


def traceable(leaves) -> list:
  """`leaves` as the step is traced on them: arrays in pinned host memory
  as abstract arrays on the device (a step computes on its arguments; jlms
  places its state itself, `jlms._state`)."""
  def as_traced(leaf):
    if isinstance(leaf, jax.core.Tracer):
      # An outer trace's value in host memory (state that an earlier call
      # of the step returned there, inside the user's own jit) is traced
      # on the device, as a concrete one is.
      if not _compat.is_host_aval(_compat.abstractify(leaf)):
        return leaf
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                  weak_type=leaf.aval.weak_type)
    if not in_pinned_host(leaf):
      return leaf
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                sharding=leaf.sharding.with_memory_kind(
                                    "device"),
                                weak_type=leaf.weak_type)
  return [as_traced(x) for x in leaves]


def host_positions(leaves) -> tuple[int, ...]:
  """Positions of the leaves that are arrays in pinned host memory."""
  return tuple(i for i, x in enumerate(leaves)
               if isinstance(x, jax.Array)
               and _compat.is_host_aval(_compat.abstractify(x)))
