"""What jlms's time model knows, told to XLA's GPU scheduler: a latency
profile of a compiled program.

XLA's latency-hiding scheduler decides how far ahead of its wait a host
copy starts from two estimates: what each kernel costs, and how long each
asynchronous pair (a copy's start and done) takes. Without a profile its
GPU estimator gives every loop fusion or library call the same cost and
every asynchronous pair the same latency, about five such kernels,
whatever the bytes: a 256 MiB slice of a moment fetched over PCIe (4.9 ms)
is started five kernels (a few tenths of a millisecond) ahead of its read.
Its profile-guided estimator takes both from a profile instead
(`ProfiledInstructionsProto`: `costs {name, cost_us}` and `latencies
{source, target, latency_us}`, by the names the scheduler sees), given in
the compiler option `PROFILE_OPTION`. A profile of latencies alone changes
nothing (the 4-layer GPT of width 4096 at 16 GiB, JAX 0.10.2: the same
schedule with every copy's latency ten or a hundred times its link time):
the costs of the kernels are what a latency is weighed against.

`latency_profile` writes that profile for a program XLA compiled once
already, from the program's own instructions: each kernel priced as
`jlms._cost` prices one (its matmul or convolution FLOPs at the target's
tensor-core peak, or the bytes it reads and writes at HBM bandwidth), each
host copy at its bytes over the host link, each loop at its trip count
times its body. Kernels are priced at their roofline, the link as
measured: the scheduler hides a copy under the kernels it thinks long
enough, so kernels priced slower than they run start copies too late (the
6.58B GPT with its moments on host, H100, schedule model: 16.3 ms of
copies exposed without a profile; 47.2 ms with kernels at jlms's
calibrated 60-70% of their roofline; 3.7 at their roofline).

Guarantees: a pure function of the compiled program's text and a
`GpuTarget`; it names only instructions of the computations the scheduler
orders (not those inside fusions), each by its name and by the name XLA
recorded for it at scheduling, where the two differ; no profile (None)
for a program that copies nothing to or from host memory. A profile's
file that is gone by a later compile (a temporary directory cleaned)
costs only the profile: XLA logs "PGLE profile file does not exist" and
schedules without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pathlib
import re
import tempfile
import types

from jlms._cost import GpuTarget
from jlms._xla_memory import hlo_computations, hlo_itemsize, split_operands

#: XLA's compiler option naming the profile's file.
PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"
#: XLA's check of a profile against the program, off: it logs to stderr,
#: on every compile, each instruction that the profile gives no cost, and
#: the profile leaves the asynchronous copies' starts and dones, which
#: run no kernel, to XLA's own estimate on purpose (given a cost of 0 or
#: 1 us, the scanned MLP's least-memory plan, JAX 0.12, came out at 31.3
#: and 30.5 ms by the schedule model instead of 26.0).
PROFILE_CHECK_OFF = {"xla_gpu_pgle_accuracy_checker":
                     "PGLE_STRICTNESS_LEVEL_OFF"}

#: XLA's element types as `GpuTarget.contraction_peak` names them.
_PEAK_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16",
                "f8e4m3fn": "float8_e4m3fn", "f8e5m2": "float8_e5m2",
                "s8": "int8"}
#: The memory space of pinned host buffers in XLA's GPU programs.
_HOST_SPACE = "S(5)"
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")
_CALLED = re.compile(r"\b(?:body|condition|to_apply|calls|true_computation|"
                     r"false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
#: Instructions that run no kernel of their own.
_FREE = frozenset({
    "parameter", "get-tuple-element", "tuple", "bitcast", "constant",
    "after-all", "partition-id", "replica-id", "opt-barrier",
    "add-dependency", "domain", "call", "conditional"})
_LIBRARY_CONTRACTIONS = ("gemm", "matmul", "conv")


@dataclasses.dataclass(frozen=True)
class _Array:
  dtype: str
  dims: tuple
  host: bool

  @property
  def nbytes(self) -> float:
    return math.prod(self.dims) * hlo_itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class _Instruction:
  name: str
  scheduling_name: str
  arrays: tuple  # its shape's arrays (a tuple shape's, flattened)
  opcode: str
  operands: tuple  # names
  #: Its text after the shape: opcode, operands and attributes.
  attributes: str

  @property
  def parameter_number(self) -> int:
    found = re.match(r"parameter\((\d+)\)", self.attributes)
    return int(found.group(1)) if found else 0

  def attribute(self, key: str) -> str | None:
    found = re.search(rf"\b{key}=\"?([^\",\s]+)", self.attributes)
    return found.group(1) if found else None

  @property
  def called(self) -> list[str]:
    return _CALLED.findall(self.attributes)

  @property
  def nbytes(self) -> float:
    return sum(a.nbytes for a in self.arrays)


def _arrays(shape_text: str) -> tuple:
  return tuple(
      _Array(dtype, tuple(int(d) for d in dims.split(",") if d),
             _HOST_SPACE in (layout or ""))
      for dtype, dims, layout in _ARRAY.findall(shape_text)
      if hlo_itemsize(dtype) is not None)


def parse_computations(hlo_text: str) -> tuple[dict, str | None]:
  """({computation name: its instructions in order}, the entry's name) of
  an HLO module's text (read by `jlms._xla_memory.hlo_computations`)."""
  computations, entry = {}, None
  for computation in hlo_computations(hlo_text):
    instructions = []
    for name, shape, rest in computation.instructions:
      opcode, operands = split_operands(rest)
      scheduled = re.search(r'scheduling_name="([^"]+)"', rest)
      instructions.append(_Instruction(
          name, scheduled.group(1) if scheduled else name, _arrays(shape),
          opcode, tuple(operands), rest))
    computations[computation.name] = instructions
    if computation.is_entry:
      entry = computation.name
  return computations, entry


def _scheduled(computations: dict, entry: str) -> list[str]:
  """The computations the scheduler orders: the entry and what its
  loops, calls and branches run, not what fusions and reductions apply."""
  order, seen, stack = [], set(), [entry]
  while stack:
    name = stack.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    order.append(name)
    for instruction in computations[name]:
      if instruction.opcode in ("while", "call", "conditional"):
        stack += instruction.called
        for branches in _BRANCHES.findall(instruction.attributes):
          stack += re.findall(r"%?([\w.\-]+)", branches)
  return order


def _contraction_flops(instruction: _Instruction, operands: list) -> float:
  """FLOPs of a dot or convolution (or a library call of one), given its
  operands' arrays."""
  if not instruction.arrays or len(operands) < 2:
    return 0.0
  result, lhs, rhs = instruction.arrays[0], operands[0], operands[1]
  out = math.prod(result.dims)
  labels = instruction.attribute("dim_labels")
  if labels and "_" in labels and "->" in labels:  # a convolution
    kernel = labels.split("_", 1)[1].split("->")[0]
    features = (rhs.dims[kernel.index("o")]
                if "o" in kernel and len(kernel) == len(rhs.dims) else 1)
    return 2.0 * out * math.prod(rhs.dims) / max(features, 1)
  contracting = re.search(
      r"lhs_contracting_dim(?:ension)?s[^\d\]}]*([\d,\s\"]*)",
      instruction.attributes)
  size = 1
  for index in re.findall(r"\d+", contracting.group(1) if contracting
                          else ""):
    if int(index) < len(lhs.dims):
      size *= lhs.dims[int(index)]
  return 2.0 * out * size


class _Pricer:
  """Seconds of the kernels of one compiled module on `target`."""

  def __init__(self, computations: dict, target: GpuTarget):
    self.computations = computations
    self.target = target
    self._fused: dict[str, tuple] = {}

  def _fused_work(self, name: str) -> tuple:
    """(FLOPs, contraction's dtype, {parameter number: bytes it reads or
    None for all of it}, the numbers of the parameters it updates in
    place) of the fused computation `name`."""
    if name in self._fused:
      return self._fused[name]
    body = self.computations.get(name, ())
    by_name = {i.name: i for i in body}
    flops, dtype = 0.0, None
    users: dict[str, list] = {}
    for instruction in body:
      for position, operand in enumerate(instruction.operands):
        users.setdefault(operand, []).append((instruction, position))
      if instruction.opcode in ("dot", "convolution"):
        operands = [by_name[o].arrays[0] for o in instruction.operands[:2]
                    if o in by_name and by_name[o].arrays]
        flops += _contraction_flops(instruction, operands)
        dtype = dtype or (operands[0].dtype if operands else None)
      elif instruction.opcode == "fusion" and instruction.called:
        inner_flops, inner_dtype, _, _ = self._fused_work(
            instruction.called[0])
        flops += inner_flops
        dtype = dtype or inner_dtype
    reads: dict[int, float | None] = {}
    in_place: set[int] = set()
    for instruction in body:
      if instruction.opcode != "parameter":
        continue
      index = instruction.parameter_number
      readers = users.get(instruction.name, [])
      # A dynamic slice reads its slice, an update in place writes its
      # update: the rest of a stacked operand is not touched.
      if readers and all(r.opcode == "dynamic-slice" for r, _ in readers):
        reads[index] = sum(r.nbytes for r, _ in readers)
      elif readers and all(r.opcode == "dynamic-update-slice" and p == 0
                           for r, p in readers):
        updates = [by_name.get(r.operands[1]) for r, _ in readers
                   if len(r.operands) > 1]
        reads[index] = sum(u.nbytes for u in updates if u is not None)
        in_place.add(index)
      else:
        reads[index] = None
    self._fused[name] = (flops, dtype, reads, in_place)
    return self._fused[name]

  def seconds(self, instruction: _Instruction, arrays: dict) -> float | None:
    """What the kernel of `instruction` costs (`arrays`: the first array
    of each instruction of its computation, by name); None where it runs
    none, or where the scheduler prices it from its parts (a loop, an
    asynchronous pair)."""
    opcode = instruction.opcode
    if (opcode in _FREE or opcode == "while" or opcode.endswith("-start")
        or opcode.endswith("-done")):
      return None
    operands = [arrays.get(o) for o in instruction.operands]
    read = [a.nbytes if a is not None else 0.0 for a in operands]
    written = instruction.nbytes
    flops, dtype = 0.0, None
    if opcode == "fusion" and instruction.called:
      flops, dtype, reads, in_place = self._fused_work(instruction.called[0])
      read = [reads.get(i) if reads.get(i) is not None else full
              for i, full in enumerate(read)]
      # An output updated in place writes only its update, counted as
      # read: the buffer it aliases is not written whole.
      written = max(0.0, written - sum(
          operands[i].nbytes for i in in_place
          if i < len(operands) and operands[i] is not None))
    elif opcode == "custom-call" and not instruction.operands:
      return 0.0  # an allocation (XLA's AllocateBuffer): nothing moves
    elif opcode == "custom-call" and any(
        kind in (instruction.attribute("custom_call_target") or "")
        for kind in _LIBRARY_CONTRACTIONS):
      present = [a for a in operands if a is not None]
      flops = _contraction_flops(instruction, present)
      dtype = present[0].dtype if present else None
      written = instruction.arrays[0].nbytes if instruction.arrays else 0.0
    target = self.target
    seconds = (sum(read) + written) / (target.hbm_bytes_per_s
                                       * target.efficiency["memory"])
    if any(a is not None and a.host for a in operands) or any(
        a.host for a in instruction.arrays):
      # A kernel that reads or writes pinned host memory runs at the
      # link's speed: what crosses it is its slice, one way.
      seconds = max(seconds, target.transfer_seconds(max(sum(read),
                                                         written)))
    if flops:
      kind = "conv" if instruction.attribute("dim_labels") else "matmul"
      peak = target.contraction_peak(_PEAK_DTYPES.get(dtype, "float32"),
                                     False)
      seconds = max(seconds, flops / (peak * target.efficiency[kind]))
    return seconds

  def host_copy_seconds(self, start: _Instruction, arrays: dict
                        ) -> float | None:
    """The link time of the asynchronous copy `start` begins, where it
    moves bytes to or from host memory; None otherwise."""
    operands = [arrays.get(o) for o in start.operands]
    if start.opcode == "copy-start":
      source = operands[0] if operands else None
      if source is None:
        return None
      moves_host = source.host or any(a.host for a in start.arrays)
      return (self.target.transfer_seconds(source.nbytes) if moves_host
              else None)
    if not start.called:
      return None
    # An asynchronous slice of a host buffer (a scan's residual, a
    # moment's layer): what it moves is its result, or its update.
    body = self.computations.get(start.called[0], ())
    touches_host = any(a is not None and a.host for a in operands) or any(
        a.host for a in start.arrays)
    if not touches_host or not body:
      return None
    # The slicing is in the wrapped computation, or in a fusion it calls.
    while body and body[-1].opcode == "fusion" and body[-1].called and (
        body[-1].called[0] in self.computations):
      body = self.computations[body[-1].called[0]]
    by_name = {i.name: i for i in body}
    updates = [by_name.get(i.operands[1]) for i in body
               if i.opcode == "dynamic-update-slice" and len(i.operands) > 1]
    slices = [i for i in body if i.opcode == "dynamic-slice"]
    if updates:
      moved = sum(u.nbytes for u in updates if u is not None)
    elif slices:
      moved = sum(i.nbytes for i in slices)
    else:
      moved = body[-1].nbytes
    return self.target.transfer_seconds(moved)


def _names(instruction: _Instruction) -> tuple:
  """The names XLA's scheduler may know `instruction` by: its name in the
  program, and the one XLA recorded at scheduling (`scheduling_name`).
  The two differ where a pass after scheduling gave an instruction
  another's metadata (XLA of JAX 0.12: a copy-done recorded under the name
  of the optimization barrier it replaced, "optimization_barrier.86.0" for
  "copy-done.29", which the scheduler knew as "copy-done.29")."""
  if instruction.scheduling_name == instruction.name:
    return (instruction.name,)
  return (instruction.name, instruction.scheduling_name)


def _trip_count(instruction: _Instruction) -> int | None:
  found = re.search(r'known_trip_count[^\d]*"?n"?\s*:\s*"?(\d+)',
                    instruction.attributes)
  return int(found.group(1)) if found else None


@dataclasses.dataclass(frozen=True)
class Profile:
  """The seconds of each kernel and the link seconds of each host copy
  (start's name, done's name) of a compiled program, by the names its
  scheduler knows them by."""
  costs: dict
  latencies: dict

  def text(self) -> str:
    """As XLA reads it: `ProfiledInstructionsProto` in text format."""
    lines = [f'costs {{ name: "{name}" cost_us: {seconds * 1e6:.3f} }}'
             for name, seconds in self.costs.items()]
    lines += [f'latencies {{ source: "{start}" target: "{done}" '
              f'latency_us: {seconds * 1e6:.3f} }}'
              for (start, done), seconds in self.latencies.items()]
    return "\n".join(lines) + "\n"


def profile_of(hlo_text: str, target: GpuTarget) -> Profile:
  """The `Profile` of the compiled program `hlo_text` on `target`: every
  kernel of the computations its scheduler orders at its roofline (a loop
  at its trip count times its body, where XLA knows the count), and every
  asynchronous copy to or from host memory at its link time."""
  computations, entry = parse_computations(hlo_text)
  fastest = dataclasses.replace(target, efficiency=types.MappingProxyType(
      dict.fromkeys(target.efficiency, 1.0)))
  pricer = _Pricer(computations, fastest)
  costs, latencies = {}, {}
  totals: dict[str, float] = {}
  # Callees first: a loop is priced from its body.
  for name in reversed(_scheduled(computations, entry) if entry else []):
    instructions = computations[name]
    arrays = {i.name: i.arrays[0] for i in instructions if i.arrays}
    starts = {}
    total = 0.0
    for instruction in instructions:
      seconds = pricer.seconds(instruction, arrays)
      if instruction.opcode == "while":
        trips = _trip_count(instruction)
        body = re.search(r"\bbody=%?([\w.\-]+)", instruction.attributes)
        if trips is not None and body is not None and body.group(1) in totals:
          seconds = trips * totals[body.group(1)]
      elif instruction.opcode.endswith("-start"):
        link = pricer.host_copy_seconds(instruction, arrays)
        if link is not None:
          starts[instruction.name] = (instruction, link)
      elif (instruction.opcode.endswith("-done") and instruction.operands
            and instruction.operands[0] in starts):
        start, link = starts[instruction.operands[0]]
        for start_name in _names(start):
          for done_name in _names(instruction):
            latencies[(start_name, done_name)] = link
      if seconds is not None:
        # An instruction's own name first: a name recorded at scheduling
        # may be another instruction's now.
        own, *recorded = _names(instruction)
        costs[own] = seconds
        for known_as in recorded:
          costs.setdefault(known_as, seconds)
        total += seconds
    totals[name] = total
  return Profile(costs, latencies)


def schedule_of(hlo_text: str) -> tuple:
  """The order XLA's scheduler gave a compiled program: the scheduling
  names of each scheduled computation's instructions, in order."""
  computations, entry = parse_computations(hlo_text)
  if entry is None:
    return ()
  return tuple(tuple(i.scheduling_name for i in computations[name])
               for name in _scheduled(computations, entry))


def latency_profile(hlo_text: str, target: GpuTarget) -> str | None:
  """The profile of `profile_of` as XLA reads it, or None where the
  program copies nothing over the host link (there is nothing to hide)."""
  profile = profile_of(hlo_text, target)
  return profile.text() if profile.latencies else None


def write_profile(text: str) -> str:
  """The path of a file holding `text`, named by its content in a folder
  of the machine's temporary directory (the compile that reads it, and
  any later one of the same plan in this process, find it there)."""
  # One folder per user, that only they can write: another user's file
  # of the same name is never read.
  user = getattr(os, "getuid", lambda: "")()
  folder = pathlib.Path(tempfile.gettempdir()) / f"jlms-latency-profiles-{user}"
  folder.mkdir(mode=0o700, parents=True, exist_ok=True)
  path = folder / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.pbtxt"
  if not path.is_file():
    # Written under a name of its own, then renamed: a process writing
    # the same profile beside this one never reads half of it.
    with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".partial",
                                     delete=False) as staging:
      staging.write(text)
    os.replace(staging.name, path)
  return str(path)
