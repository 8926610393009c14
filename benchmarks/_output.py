"""Writing a benchmark's figures: every benchmark prints its table and,
given `--json PATH`, writes the same figures there."""

from __future__ import annotations

import json

import numpy as np


def write_json(path: str | None, result) -> None:
  """Writes `result` to `path` as indented JSON (arrays as lists); does
  nothing when `path` is None."""
  if path:
    with open(path, "w") as f:
      json.dump(result, f, indent=2,
                default=lambda x: np.asarray(x).tolist())


def print_table(rows, columns) -> None:
  """Prints `rows` (dicts) as a " | "-separated table of `columns`, "-"
  where a row has no figure."""
  print(" | ".join(columns))
  for row in rows:
    print(" | ".join("-" if row.get(c) is None else str(row[c])
                     for c in columns))
