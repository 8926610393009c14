"""Every size threshold jlms's passes decide by, named in one place.

A pass starts only where a value is large enough to be worth it: a loop
input worth making inside the loop, a state leaf worth a copy of its own,
a value worth a choice of the fit. Each pass reads its threshold from
`THRESHOLDS` when it runs, so that a test can lower them all at once
(`overridden`) and make every pass start on a small step, where the real
sizes would need a large one.

Guarantees: the defaults are the sizes each pass documents; lowering a
threshold never changes what a pass computes, only where it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses


@dataclasses.dataclass(frozen=True)
class Thresholds:
  #: A value made by fusible equations from inputs at least this many
  #: times smaller is an expansion (a broadcast, an iota, a mask): XLA
  #: makes it inside the kernels that read it.
  expansion_factor: int = 4
  #: A loop-invariant input of a scan is made inside the loop from this
  #: size on (`jlms._loop_sink`).
  loop_sink_min_bytes: int = 1 << 20
  #: The longest chain of equations the loop sink re-runs per iteration.
  loop_sink_max_chain: int = 16
  #: A state leaf is updated by a loop over its rows from this size on;
  #: a smaller one is copied whole (`jlms._update_loops`).
  streamed_leaf_min_bytes: int = 1 << 20
  #: An update loop takes enough rows per iteration that each slice it
  #: moves is at least this (`jlms._update_loops`): every iteration pays
  #: fixed costs beside its bytes (a GPU `lax.scan` iteration, about 8 us,
  #: QuantEcon's Nsight measurement in QuantEcon/lecture-python-programming
  #: pull request 437; a copy's latency, about 10 us), and 4 MiB crosses
  #: the link in about 80 us.
  update_slice_min_bytes: int = 4 << 20
  #: A state leaf is worth a copy to host of its own from this size on
  #: (each copy costs a transfer's latency, about 10 us; `jlms._search`).
  state_leaf_min_bytes: int = 64 << 10
  #: The fit weighs values from this size on, or a 65536th of the budget
  #: if larger (`jlms._options.SearchOptions.min_bytes_for`).
  fit_min_bytes: int = 4096
  #: Equations re-emitted for one recomputation, at most (`jlms._fit`).
  recompute_max_chain: int = 64
  #: A run of equations is split over the batch when the largest value it
  #: would cut takes at least this (`jlms._batch_split`): below it, a loop
  #: over chunks costs more than the memory it saves is worth.
  batch_split_min_bytes: int = 256 << 20
  #: The most equations one batch-split region takes in.
  batch_split_max_equations: int = 512
  #: Segments of a forward pass are remade (`jlms._segment_remat`) where
  #: the activations they remake take at least this in all: each such way
  #: costs the search an analysis of the whole step (a 450-layer MLP of
  #: 128-byte activations planned in 4.5x its tracing with three of them,
  #: 1.3x without).
  segment_remat_min_bytes: int = 1 << 20


#: The thresholds in force; read by each pass when it runs.
THRESHOLDS = Thresholds()


@contextlib.contextmanager
def overridden(**fields):
  """`THRESHOLDS` with `fields` replaced while the block runs."""
  global THRESHOLDS
  saved = THRESHOLDS
  THRESHOLDS = dataclasses.replace(saved, **fields)
  try:
    yield THRESHOLDS
  finally:
    THRESHOLDS = saved


#: Thresholds that every small step crosses: each pass starts wherever
#: its value exists at all.
EVERY_SIZE = dict(loop_sink_min_bytes=1, streamed_leaf_min_bytes=1,
                  state_leaf_min_bytes=1, fit_min_bytes=1,
                  batch_split_min_bytes=1, segment_remat_min_bytes=1)
