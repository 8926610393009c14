"""When jlms itself fails: the step runs as `jax.jit`'s program, or it stops.

Guarantees: a failure inside jlms (planning, rewriting, staging, or XLA
compiling or checking the rewritten program) never stops a step, except
where the user asked it to (`strict=True`) or where `jax.jit`'s program
would break a promise (a budget it does not meet); then `OffloadError` is
raised from the failure. Otherwise the step runs as `jax.jit`'s program and
one `FallbackWarning` per argument signature names the failure. What is the
user's to act on is never jlms's failure and propagates unchanged: a step
that `jax.jit` cannot trace or run either, a budget that cannot be met
(`BudgetError`), a GPU target this machine cannot compile for
(`DevicelessUnavailableError`).
"""

from __future__ import annotations

import warnings


class FallbackWarning(UserWarning):
  """jlms could not plan, rewrite or compile the step for these arguments:
  it runs as `jax.jit`'s program (`strict=True` raises instead)."""

  __module__ = "jlms"  # tracebacks and reprs show the public name


class OffloadError(RuntimeError):
  """jlms could not plan, rewrite or compile the step, and the step may not
  run as `jax.jit`'s program instead: `strict=True` was asked, or a budget
  needs the plan. The failure is the exception's `__cause__`."""

  __module__ = "jlms"  # tracebacks and reprs show the public name


def describe(error: BaseException) -> str:
  """The failure in one line: its type and the first line of its message."""
  lines = str(error).strip().splitlines()
  return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def raise_unless_fallback_allowed(error: BaseException, step_name: str, *,
                                  strict: bool, budget: str | None) -> None:
  """Raises `OffloadError` from `error` where the step may not fall back
  to `jax.jit`'s program: with `strict`, or with a `budget` (its text) that
  `jax.jit`'s program is not known to meet; returns otherwise."""
  if strict:
    raise OffloadError(
        f"jlms.offload({step_name}, strict=True): {describe(error)}. "
        "Without strict=True the step would run as jax.jit's program, "
        "with a FallbackWarning.") from error
  if budget is not None:
    raise OffloadError(
        f"jlms.offload({step_name}): {describe(error)}. The budget of "
        f"{budget} needs jlms's plan (jax.jit's program is not known to "
        "meet it), so the step does not fall back to jax.jit's program; "
        "lift the budget to run it so.") from error


def warn_fallback(error: BaseException, step_name: str, stacklevel: int):
  warnings.warn(
      f"jlms.offload({step_name}) runs as jax.jit's program for these "
      f"arguments: jlms failed with {describe(error)}. Please report it; "
      "strict=True raises instead.", FallbackWarning, stacklevel=stacklevel)
