"""Equations joined into groups by the values they share.

Guarantees: `connected_groups` returns every member exactly once; two
members of a joined pair are in the same group; each group is in
increasing order and the groups are ordered by their first member.
"""

from __future__ import annotations

from typing import Iterable


def connected_groups(members: Iterable[int],
                     pairs: Iterable[tuple[int, int]]) -> list[list[int]]:
  """The connected components of `members` under `pairs` (union-find)."""
  parent = {i: i for i in members}

  def root(i):
    while parent[i] != i:
      parent[i] = parent[parent[i]]
      i = parent[i]
    return i

  for a, b in pairs:
    parent[root(a)] = root(b)
  groups: dict[int, list[int]] = {}
  for index in sorted(parent):
    groups.setdefault(root(index), []).append(index)
  return list(groups.values())
