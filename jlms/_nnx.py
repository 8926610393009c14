"""`jlms.offload_nnx`: `jlms.offload` for Flax NNX steps that take modules.

An NNX train step reads and mutates Python objects (`nnx.Module`,
`nnx.Optimizer`, `nnx.Rngs`), which a jaxpr cannot hold. As `nnx.jit` does,
the step's graph-node arguments are split into a static graph definition and
a pytree of arrays; the offloaded step runs the user's function on objects
merged from that pytree and returns the state they end in, which is then
written back into the caller's objects.

Guarantees: after a call, the caller's modules, optimizers and RNG streams
hold exactly the state `nnx.jit(step)` would leave in them, and the return
value is the same; objects shared between arguments (an optimizer's model)
stay shared; one offload analysis is made and cached per graph structure and
argument shapes, like any `jlms.offload` step.
"""

from __future__ import annotations

import functools
from typing import Callable

from jlms._offload import OffloadedStep, offload


class OffloadedNnxStep:
  """A step over NNX objects whose program runs under `jlms.offload`."""

  def __init__(self, fun: Callable, **offload_options):
    for name in ("static_argnums", "static_argnames", "donate_argnums",
                 "donate_argnames"):
      if offload_options.get(name):
        raise ValueError(f"jlms.offload_nnx does not take {name}: the "
                         "graph structure is its static argument, and the "
                         "state it splits off is donated")
    functools.update_wrapper(self, fun)
    self._fun = fun

    def pure_step(graphdef, state, *args):
      from flax import nnx
      nodes = nnx.merge(graphdef, state)
      out = fun(*nodes, *args)
      return out, nnx.state(nodes)

    # Warnings, logs and XLA's module name the user's step.
    name = getattr(fun, "__name__", None)
    if isinstance(name, str) and name.isidentifier():
      pure_step.__name__ = pure_step.__qualname__ = name

    # The split state is the caller's only copy once written back, so it
    # is donated, as `nnx.jit` does with its state.
    self.offloaded: OffloadedStep = offload(
        pure_step, static_argnums=0, donate_argnums=1, **offload_options)

  def _split(self, args):
    from flax import nnx
    positions = [i for i, a in enumerate(args) if nnx.graph.is_graph_node(a)]
    if not positions:
      raise TypeError("jlms.offload_nnx: no NNX module, optimizer or Rngs "
                      "among the arguments; use jlms.offload")
    if positions != list(range(len(positions))):
      raise TypeError("jlms.offload_nnx: pass the NNX objects first, then "
                      "the arrays (as in step(model, optimizer, batch))")
    nodes = tuple(args[: len(positions)])
    graphdef, state = nnx.split(nodes)
    return nodes, graphdef, state, args[len(positions):]

  def __call__(self, *args):
    from flax import nnx
    nodes, graphdef, state, rest = self._split(args)
    out, new_state = self.offloaded(graphdef, state, *rest)
    nnx.update(nodes, new_state)
    return out

  def plan(self, *args):
    """The `jlms.Plan` of the step for these objects and arrays."""
    _, graphdef, state, rest = self._split(args)
    return self.offloaded.plan(graphdef, state, *rest)

  def place(self, *args) -> None:
    """Puts the objects' state where the step takes it, in the objects
    themselves (as `OffloadedStep.place` does for arrays): the state that
    the plan keeps on host copied to pinned host memory. Call it once
    before the first step; each step leaves it there."""
    from flax import nnx
    nodes, graphdef, state, rest = self._split(args)
    placed = self.offloaded.place(graphdef, state, *rest)
    nnx.update(nodes, placed[1])

  def tradeoff(self, *args, budgets=None, points: int = 6):
    """Predicted step time against device budget, as
    `OffloadedStep.tradeoff`."""
    _, graphdef, state, rest = self._split(args)
    return self.offloaded.tradeoff(graphdef, state, *rest, budgets=budgets,
                                   points=points)

  def lower(self, *args) -> "jax.stages.Lowered":
    """The `jax.stages.Lowered` of the program that runs for these objects
    and arrays (what `jlms.xla_memory` compiles; `jax.jit` of this object
    would trace the objects as a pytree instead)."""
    _, graphdef, state, rest = self._split(args)
    return self.offloaded.lower(graphdef, state, *rest)

  def memory(self, *args, target: str = "h100"):
    """XLA's memory with and without jlms, as `OffloadedStep.memory`."""
    _, graphdef, state, rest = self._split(args)
    return self.offloaded.memory(graphdef, state, *rest, target=target)


def offload_nnx(fun: Callable | None = None, **offload_options):
  """`jlms.offload` for a Flax NNX step `fun(model, optimizer, ..., *batch)`.

  The NNX objects (modules, optimizers, `nnx.Rngs`) come first, the arrays
  after them; the step may mutate the objects (`optimizer.update`,
  BatchNorm statistics, dropout RNG counters) and the mutations are written
  back after each call, as with `nnx.jit`. `offload_options` are
  `jlms.offload`'s (`min_bytes`, `budget`, `target`, ...), except the
  static/donated argument options, which the split decides.

  Use as `step = jlms.offload_nnx(train_step)` or as a decorator.
  """
  if fun is None:
    return lambda f: OffloadedNnxStep(f, **offload_options)
  return OffloadedNnxStep(fun, **offload_options)
