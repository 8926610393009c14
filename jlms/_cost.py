"""How long each kernel of a flat step takes on a target GPU.

The step is priced the way XLA's GPU backend runs it: the fusion model of
`jlms._simulator.analyse_fusion` says which equations become kernels of
their own and which run fused inside a reader; each kernel costs

    max(FLOPs / (tensor-core peak of its dtype x efficiency of its kind),
        HBM bytes / (HBM bandwidth x memory efficiency))

where the FLOPs are those of its matmuls and convolutions and the HBM bytes
are the buffers it reads and writes (fused producers are read through their
own inputs). Loops cost their trip count times their body (a `while` of
unknown count, once), branches their costliest branch; a scan's iteration
also copies the slices that matmuls read from its stacked operands and
write to its stacked results (`_stacking_seconds`).

Targets carry published hardware facts (NVIDIA's datasheets for peaks and
HBM bandwidth) and the host link as measured: 52 GB/s each way inside a
jitted program on an H100's PCIe Gen5 x16 (../shared/reference/
H100-MEASURED.md). Efficiencies per kind of kernel are the calibration,
fitted first to eight `jax.jit` and per-layer remat steps timed on an H100
there, and checked against the frontier's own nine programs timed on an
H100 by `benchmarks.gpu_steps` (a BatchNorm ResNet at 256x256 and
1024x1024, a scanned GPT in float32 and in bfloat16, a scanned MLP):
memory-bound kernels at 70% of HBM bandwidth, matmuls at 60% of their
tensor-core peak, convolutions at 60% of their roofline. At the roofline
the model is 14-43% below every measured step; calibrated, it is within
11% of seven of the nine and 25% and 12% above the other two (the float32
GPT under remat, the 1024x1024 ResNet under remat), rms log error 0.104;
the best point of the grid, 0.102, is too close to be worth a change
(`python -m benchmarks.time_model_error` reproduces the fit).

Pure functions of a program: nothing here traces or compiles.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np

from jlms import _compat, _rules
from jlms._liveness import analyse
from jlms._planner import chain_inputs, shared_kernels
from jlms._program import Program, flatten
from jlms._sharding import device_share
from jlms._simulator import analyse_fusion


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """What the time model knows of one GPU and its host link."""
  name: str
  hbm_bytes_per_s: float
  #: dense tensor-core peak by operand dtype ("float32" is TF32, the rate
  #: XLA's default precision uses).
  contraction_flops_per_s: types.MappingProxyType
  #: full-precision float32 (precision=HIGHEST) on the CUDA cores.
  fp32_flops_per_s: float
  link_bytes_per_s: float  # host link, each direction, achieved
  link: str
  #: GPU-to-GPU link, each direction, nominal (NVIDIA's datasheets: an
  #: H100 SXM's NVLink 4 moves 900 GB/s both ways together), for the
  #: collectives of a sharded step (`jlms._collectives`).
  interconnect_bytes_per_s: float = 450e9
  interconnect: str = "NVLink 4"
  #: Whether the fit counts on a host copy overlapping the compute between
  #: its issue and its wait. False: each copy costs its whole link time
  #: each way. On an H100 a ResNet plan whose copies came back a few
  #: equations before their reads moved 5.0 GiB each way in 243 ms against
  #: jax.jit's 45.6, that is 198 ms more, and 2 x 5.0 GiB at 52 GB/s is
  #: 206 ms (../shared/reference/H100-MEASURED.md). XLA itself starts a
  #: copy as soon as the barrier before it allows (a copy the fit placed
  #: 1.4 ms of compute ahead of its read started there), but the windows
  #: the fit plans by this model are half as long by the schedule model's
  #: roofline, and copies planned in one window queue on one engine; see
  #: docs/benchmarks.md. True trusts the windows.
  hides_copies: bool = False
  #: Whether XLA's scheduler runs a loop's streamed slices (fetched an
  #: iteration ahead, or copied out from the start of their iteration)
  #: beside the iteration's kernels. It does while what the program holds
  #: stays under its memory limit; past it, it keeps each copy next to its
  #: wait. `jlms._schedule.scheduler_overlaps` says which, per program.
  streams_hide: bool = True
  #: Whether the host slices a loop moves beside its own kernels run
  #: beside them on a real GPU: a scan's residual streamed through host (a
  #: slice copied out in the iteration that makes it, fetched back an
  #: iteration ahead of the one that reads it), and the state a fused
  #: update loop fetches ahead and writes behind. They do not, on an H200
  #: with JAX 0.11.2 (docs/benchmarks.md, "On a real GPU"):
  #: - the 16-layer MLP under `lax.scan` at `budget="min"` ran in 31.3 ms,
  #:   jax.jit's 8.5 plus both directions' 0.5 GiB at the link's full
  #:   speed; priced beside the kernels it was 20.9 ms, priced in line
  #:   29.7. On the GPU the layer's matmul or the kernel after it waits
  #:   for the copy out, and the copy back is a kernel that reads host
  #:   memory;
  #: - the 4-layer GPT of width 4096 at 16 GiB (six moments' slices in its
  #:   backward loop) ran in 538.5 ms: priced beside the kernels 381.1 ms
  #:   (29% under), in line 545.4 (1.3% over); the 6.58B GPT (two
  #:   moments) in 2209.5 ms: beside 1930.4 (13% under), in line 2567.9
  #:   (16% over). In line is the nearer for both, and errs long.
  #: XLA's deviceless schedule puts the slices beside the kernels (the
  #: MLP by the schedule model: 21.0 ms). False: each slice is waited for
  #: whole; a fused update loop's slices at its edges still hide where
  #: `copies_profiled` says so.
  loop_slices_hide: bool = False
  #: Whether XLA's scheduler orders the program by jlms's latency profile
  #: of it (`jlms._latency_profile`): then a fused update loop's fetch for
  #: its first iteration runs under the kernels before the loop, and its
  #: last write-back beside the kernels that may follow it (those it does
  #: not read from, whatever their jaxpr order), where without a profile
  #: each is started a few kernels before its wait (the 6.58B GPT with its
  #: moments on host, schedule model: 16.3 ms of copies exposed without,
  #: 3.7 with). Set per program, as `streams_hide` is.
  copies_profiled: bool = False
  #: Whether a whole copy of state pinned beside the backward pass
  #: (`jlms._state_pins`: issued a margin of link time of the critical
  #: chain's kernels before its read, done as far after its update) runs
  #: beside the kernels between its issue and its wait, one copy at a
  #: time on each direction's engine. It does in XLA's deviceless schedule
  #: (Llama-3-8B at batch 4, schedule model: each 224 MiB moment waited
  #: 1.2 to 2.5 ms of its 4.3 ms of link time, in a step of 2.4 s of
  #: compute); no GPU has run such a plan yet. Unlike `hides_copies`, the
  #: windows here are set by the critical chain, which XLA's order keeps.
  pinned_copies_hide: bool = True
  #: fraction of the roofline each kind of kernel reaches: the least
  #: root-mean-square log error against the H100's measured steps on the
  #: grid of `benchmarks.time_model_error` (see the module's docstring).
  efficiency: types.MappingProxyType = dataclasses.field(
      default_factory=lambda: types.MappingProxyType(
          {"conv": 0.6, "matmul": 0.6, "memory": 0.7}))

  def contraction_peak(self, dtype, full_precision: bool) -> float:
    name = np.dtype(dtype).name
    if name == "float32" and full_precision:
      return self.fp32_flops_per_s
    return self.contraction_flops_per_s.get(
        name, self.contraction_flops_per_s["float32"])

  def transfer_seconds(self, nbytes: float) -> float:
    return nbytes / self.link_bytes_per_s


def _peaks(**by_dtype) -> types.MappingProxyType:
  return types.MappingProxyType(by_dtype)


_HOPPER_PEAKS = _peaks(float32=494.7e12, bfloat16=989.4e12, float16=989.4e12,
                       float8_e4m3fn=1978.9e12, float8_e5m2=1978.9e12,
                       int8=1978.9e12)

#: Time-model targets, by the names `target=` takes.
TARGETS = types.MappingProxyType({
    "h100": GpuTarget("h100", 3.35e12, _HOPPER_PEAKS, 66.9e12, 52e9,
                      "PCIe Gen5 x16"),
    "h200": GpuTarget("h200", 4.8e12, _HOPPER_PEAKS, 66.9e12, 52e9,
                      "PCIe Gen5 x16"),
    # A100 SXM 80GB: TF32 156, BF16 312 TFLOP/s; PCIe Gen4 x16 achieves
    # about half of Gen5.
    "a100": GpuTarget("a100", 2.039e12,
                      _peaks(float32=156e12, bfloat16=312e12, float16=312e12,
                             int8=624e12), 19.5e12, 25e9, "PCIe Gen4 x16",
                      interconnect_bytes_per_s=300e9,
                      interconnect="NVLink 3"),
    # GH200: an H100 with HBM3 at 4.0 TB/s and NVLink-C2C to the Grace CPU
    # (450 GB/s each way nominal).
    "gh200": GpuTarget("gh200", 4.0e12, _HOPPER_PEAKS, 66.9e12, 350e9,
                       "NVLink-C2C"),
})


def time_constants(efficiency: float | None = None,
                   link_bytes_per_s: float | None = None) -> dict:
  """`GpuTarget` fields to replace so that the time model prices every
  kind of kernel at `efficiency` of its roofline and the host link at
  `link_bytes_per_s` each way (either None: the target's own)."""
  constants = {}
  if efficiency is not None:
    if not 0 < efficiency <= 1:
      raise ValueError(f"jlms: efficiency {efficiency!r} is the share of "
                       f"its roofline a kernel reaches: give a number in "
                       f"(0, 1], 1 for the roofline itself")
    constants["efficiency"] = types.MappingProxyType(
        dict.fromkeys(("conv", "matmul", "memory"), float(efficiency)))
  if link_bytes_per_s is not None:
    if not link_bytes_per_s > 0:
      raise ValueError(f"jlms: link_bytes_per_s {link_bytes_per_s!r}: give "
                       f"the bytes the host link moves each way per second, "
                       f"above 0 (an H100's PCIe Gen5 x16 moves about 55e9)")
    constants["link_bytes_per_s"] = float(link_bytes_per_s)
  return constants


def time_target(name: str | None) -> GpuTarget:
  """The time model of `name` ("h100" when None: the GPU jlms is tuned
  for, also for a local GPU whose kind it does not know)."""
  if name is None or name == "local":
    return TARGETS["h100"]
  try:
    return TARGETS[name]
  except KeyError:
    raise ValueError(f"jlms: no time model for target {name!r}; known: "
                     f"{', '.join(TARGETS)}") from None


def kernel_seconds(program: Program, target: GpuTarget, fusion=None,
                   liveness=None) -> np.ndarray:
  """Seconds of the kernel each equation of `program` runs, in jaxpr order;
  0 for an equation fused into a later one (its work is priced there)."""
  if liveness is None:
    liveness = analyse(program)
  if fusion is None:
    fusion = analyse_fusion(program, liveness)
  n = len(program)
  flops = np.zeros(n)
  peak = np.full(n, np.inf)
  kind = ["memory"] * n
  touched: list[set] = [set() for _ in range(n)]
  extra = np.zeros(n)  # loop and branch bodies
  body_cache: dict[int, float] = {}
  materialized = fusion.materialized
  executes_at = fusion.executes_at
  for index, equation in enumerate(program.equations):
    eqn = equation.eqn
    at = int(executes_at[index])
    if at >= n:  # fused into the step's outputs: it runs at the end
      at = n - 1
    work = _device_flops(eqn)
    if work:
      flops[at] += work
      dtype = eqn.invars[0].aval.dtype
      peak[at] = min(peak[at], target.contraction_peak(
          dtype, _compat.contraction_is_full_precision(eqn)))
      kind[at] = "conv" if _compat.is_convolution(eqn) else "matmul"
    if _rules.rule(eqn.primitive).moves_one_slice:
      # The slice it reads (its result) or writes (its update operand).
      sliced = (equation.inputs[1:2] if len(equation.inputs) > 1 and len(
          equation.outputs) == 1 and program.avals[equation.outputs[0]].shape
                == _shape_of(equation.inputs[0], program) else
                equation.outputs)
      touched[at].update(a for a in sliced if isinstance(a, int))
      continue
    for atom in equation.inputs:
      if isinstance(atom, int) and materialized[atom]:
        touched[at].add(atom)
    for out in equation.outputs:
      if materialized[out]:
        touched[at].add(out)
    bodies = _compat.sub_jaxprs(eqn)
    if bodies and not _rules.is_fusible_equation(eqn):
      costs = [_body_seconds(body, target, body_cache) for body in bodies]
      trips = _compat.loop_trip_count(eqn)
      if trips is not None:
        extra[at] += trips * (sum(costs) + _stacking_seconds(
            eqn, bodies[0], target, body_cache))
      else:  # a while of unknown count runs once; a cond its costliest branch
        extra[at] += max(costs)
  nbytes = np.asarray(liveness.nbytes, dtype=np.float64)
  seconds = np.zeros(n)
  memory_rate = target.hbm_bytes_per_s * target.efficiency["memory"]
  for at in range(n):
    moved = sum(nbytes[v] for v in touched[at]) / memory_rate
    compute = 0.0
    if flops[at]:
      compute = flops[at] / (peak[at] * target.efficiency[kind[at]])
    seconds[at] = max(moved, compute) + extra[at]
  # Loop bodies read their operands slice by slice: the loop equation's own
  # operands are counted by its body, not again in full.
  for index, equation in enumerate(program.equations):
    if extra[index] and _compat.loop_trip_count(equation.eqn) is not None:
      seconds[index] = extra[index]
  return seconds


def _device_flops(eqn) -> float:
  """FLOPs one device runs of a contraction: of its result's shard, where
  the result's aval carries an explicit sharding (a batch-split matmul
  runs a device's rows). One split along the contracted axes alone is
  priced whole, an upper bound."""
  work = _rules.flops(eqn)
  return work * device_share(eqn.outvars[0].aval) if work else 0.0


def _shape_of(atom, program: Program):
  if isinstance(atom, int):
    return program.avals[atom].shape
  return getattr(atom.value, "shape", ())


def _body_seconds(body, target: GpuTarget, cache: dict) -> float:
  key = id(body)
  if key not in cache:
    inner = flatten(_compat.closed_jaxpr(
        [], [], list(body.constvars) + list(body.invars), body.outvars,
        body.eqns, body.debug_info))
    cache[key] = float(kernel_seconds(inner, target).sum())
  return cache[key]


def _stacking_seconds(eqn, body, target: GpuTarget, cache: dict) -> float:
  """Seconds of one iteration of a scan spent copying slices into and
  out of its stacked operands and results: XLA writes a result a matmul or
  convolution makes into its stack with a kernel of its own (it fuses an
  elementwise producer into that write), and cuts the slice a matmul reads
  out of its stack with one. Each copy reads and writes the slice. On the
  12-layer GPT under `nn.scan` the schedule model prices these kernels of
  jax.jit's program at 16.4 ms of its 48.9, and remat's stacks none of
  them, which is why an H100 runs remat faster (43.4 against 56.3 ms;
  ../shared/reference/H100-MEASURED.md)."""
  if eqn.primitive is not _compat.scan_p:
    return 0.0
  key = ("stacking", id(body))
  if key not in cache:
    layout = _compat.scan_layout(eqn)
    inner = flatten(_compat.closed_jaxpr(
        [], [], list(body.constvars) + list(body.invars), body.outvars,
        body.eqns, body.debug_info))
    liveness = analyse(inner)
    n_consts = len(body.constvars) + layout.num_consts
    xs = inner.invars[n_consts + layout.num_carry:]
    ys = inner.outvars[layout.num_carry:]

    def by_contraction(index: int) -> bool:
      return (0 <= index < len(inner)
              and _rules.flops(inner.equations[index].eqn) > 0)

    copied = [v for v in xs if any(by_contraction(r) for r in liveness.uses[v])]
    copied += [v for v in ys if isinstance(v, int)
               and by_contraction(liveness.producer[v])]
    nbytes = 2 * sum(liveness.nbytes[v] for v in set(copied))
    cache[key] = nbytes / (target.hbm_bytes_per_s * target.efficiency["memory"])
  return cache[key]


def recompute_seconds(program: Program, liveness, chain: tuple[int, ...],
                      value: int, target: GpuTarget,
                      reads_inputs: bool = True) -> float:
  """Seconds to make `value` again by the equations `chain`: each matmul or
  convolution is a kernel of its own, priced as in `kernel_seconds`; the
  elementwise rest is one fused kernel that reads the chain's inputs made
  outside it and writes `value`. With `reads_inputs=False` that kernel is
  another recomputation's, which reads the inputs anyway: only the writing
  of `value` is this one's."""
  moved = liveness.nbytes[value]
  if reads_inputs:
    moved += sum(liveness.nbytes[v] for v in chain_inputs(program, chain))
  seconds = moved / (target.hbm_bytes_per_s * target.efficiency["memory"])
  for index in chain:
    eqn = program.equations[index].eqn
    work = _device_flops(eqn)
    if work:
      kind = "conv" if _compat.is_convolution(eqn) else "matmul"
      peak = target.contraction_peak(
          eqn.invars[0].aval.dtype, _compat.contraction_is_full_precision(eqn))
      seconds += work / (peak * target.efficiency[kind])
  return seconds


def recompute_seconds_together(program: Program, liveness,
                               together: list[tuple[tuple[int, ...], int]],
                               target: GpuTarget) -> list[float]:
  """Seconds of each recomputation of `together`, (chain, value) pairs
  remade before one equation: as `recompute_seconds`, except that a chain
  that joins another's kernel (`jlms._planner.shared_kernels`) pays only
  for writing its value."""
  seconds = [0.0] * len(together)
  for group in shared_kernels(program, [chain for chain, _ in together]):
    for position, k in enumerate(group):
      chain, value = together[k]
      seconds[k] = recompute_seconds(program, liveness, chain, value, target,
                                     reads_inputs=position == 0)
  return seconds
