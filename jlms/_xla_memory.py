"""What XLA says a program needs in memory, on a GPU that need not be there.

`xla_memory(fn, *args)` compiles `fn` with XLA's real GPU pipeline for a named
target (an H100, H200 or A100 described by the `targets/*.txtpb` files), or for
the local backend, and returns the compiler's own accounting as an
`XlaMemory`. Guarantees:

- The numbers are `compiled.memory_analysis()` of that one compile, unchanged;
  nothing is estimated here. They are per device: for a program sharded over
  `topology="1x1x8"` they describe one of the eight GPUs.
- For a GPU target every array argument is compiled as an abstract value placed
  on the target's first device, unless its sharding already lives on that
  target's topology (then it is kept), so concrete CPU arrays, numpy arrays and
  `jax.ShapeDtypeStruct`s all measure the same. No data is ever transferred.
  Without a `topology=`, arguments sharded over devices of
  `target_devices(target, topology)` are compiled on that topology.
  Arguments on compile-only devices of another topology (made with
  `jax.experimental.topologies`) whose device kind is a target's are
  compiled on the target's topology of as many hosts and GPUs per host,
  each device taken to the one of the same host and rank there.
- When deviceless compilation cannot work on this machine the error is a
  `DevicelessUnavailableError` whose message says what to install or set.
- A program compiled before in this process for the same GPU target and
  topology (the same StableHLO text, arguments, shardings, memory kinds and
  donation included, but for the names of the module, its arguments and
  results; and the same compiler options) is not compiled again: the last
  `_CACHE_SIZE` results are kept. XLA's deviceless compile measures
  nothing on a device, so the same program gives the same figures; a fit
  that compiles a plan it compiled before (a budget refused, then its
  stated minimum) saves seconds. `target="local"` compiles every time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import os
import re
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from jlms import _compat

# Target name -> GpuTargetConfigProto (text format) shipped in jlms/targets.
_GPU_TARGET_FILES = {
    "h100": "h100.txtpb",
    "h200": "h200.txtpb",
    "a100": "a100.txtpb",
}
LOCAL_TARGET = "local"
KNOWN_TARGETS = (*sorted(_GPU_TARGET_FILES), LOCAL_TARGET)

# The CUDA PJRT plugin packages register themselves under these module names.
_CUDA_PLUGIN_MODULES = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")

_MIB = 1 << 20


class DevicelessUnavailableError(RuntimeError):
    """The GPU target cannot be compiled for in this Python process:
    deviceless compilation is not set up here, `target="local"` names a
    GPU this machine does not have, or the step calls back into Python
    (JAX lowers a callback only for a backend the process has)."""

    __module__ = "jlms"  # tracebacks and reprs show the public name


_INSTALL_AOT_ADVICE = (
    "Install the deviceless-compilation extra: pip install 'jlms[aot]' "
    "(it installs jax-cuda13-plugin and jax-cuda13-pjrt of the installed "
    "jax's version, nvidia-cuda-nvcc for ptxas and nvidia-nvvm for "
    "libdevice)."
)
_SET_PLATFORMS_ADVICE = (
    "Set JAX_PLATFORMS=cpu in the environment before jax is first imported "
    "(e.g. `JAX_PLATFORMS=cpu python ...`, or "
    "`os.environ['JAX_PLATFORMS'] = 'cpu'` at the very top of the script): "
    "without a GPU the CUDA plugin fails its start-up check and its "
    "compile-only topology is never registered. On a machine with a GPU, "
    "target='local' measures the attached device instead."
)


@dataclasses.dataclass(frozen=True)
class XlaMemory:
    """XLA's memory accounting of one compiled program, in bytes per device."""

    #: What the program was compiled for: "h100", "h200", "a100" or "local".
    target: str
    #: Device bytes of the arguments.
    argument_bytes: int
    #: Device bytes of the outputs.
    output_bytes: int
    #: Bytes of donated arguments whose buffers XLA reuses for outputs.
    alias_bytes: int
    #: Device bytes of the temporaries (XLA's scheduled temp allocation).
    temp_bytes: int
    #: Bytes of arguments taken from host memory.
    host_argument_bytes: int
    #: Bytes of outputs given back in host memory.
    host_output_bytes: int
    #: Bytes of temporaries in host memory (values offloaded in the step).
    host_temp_bytes: int
    #: Bytes of the compiled code.
    generated_code_bytes: int
    #: Values the optimized HLO brings into host memory (space S(5)), each
    #: counted where it enters it.
    host_offloaded_buffers: int
    #: The optimized HLO of the compile; kept for inspection, too long to
    #: print.
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)

    @property
    def peak_bytes(self) -> int:
        """Device peak of the step as XLA's buffer assignment sees it.

        Arguments and outputs stay allocated for the whole call, donated
        arguments that XLA reuses for outputs count once, and temporaries
        are the size of the scheduled temp allocation.
        """
        return (
            self.argument_bytes
            + self.output_bytes
            - self.alias_bytes
            + self.temp_bytes
        )

    @property
    def host_bytes(self) -> int:
        """Bytes the program keeps in host memory (offloaded or host args)."""
        return (
            self.host_argument_bytes + self.host_output_bytes + self.host_temp_bytes
        )

    def as_dict(self) -> dict[str, Any]:
        """The quantities as plain JSON-serializable values, without HLO."""
        values = {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "hlo_text"
        }
        values["peak_bytes"] = self.peak_bytes
        values["host_bytes"] = self.host_bytes
        return values

    def __str__(self) -> str:
        byte_rows = (
            ("device arguments", self.argument_bytes),
            ("device outputs", self.output_bytes),
            ("aliased (donated)", self.alias_bytes),
            ("device temporaries", self.temp_bytes),
            ("device peak", self.peak_bytes),
            ("host arguments", self.host_argument_bytes),
            ("host outputs", self.host_output_bytes),
            ("host temporaries", self.host_temp_bytes),
            ("host total", self.host_bytes),
            ("generated code", self.generated_code_bytes),
        )
        lines = [f"XLA memory on {self.target}:"]
        lines += [f"  {name:<20}{value / _MIB:12.2f} MiB" for name, value in byte_rows]
        lines.append(f"  {'host buffers':<20}{self.host_offloaded_buffers:12d}")
        return "\n".join(lines)


def target_devices(target: str = "h100", topology: str = "1x1x1") -> list:
    """The devices programs for `target` are compiled for.

    For a GPU target these are compile-only devices of a deviceless topology
    (`topology` is `<slices>x<hosts>x<gpus per host>`); the same objects are
    returned on every call, so shardings built from them are recognised by
    `xla_memory`. For "local" they are `jax.devices()` and `topology` is not
    used.
    """
    _check_target(target)
    if target == LOCAL_TARGET:
        return jax.devices()
    _check_topology(topology)
    return list(_gpu_topology(target, topology).devices)


def _check_topology(topology) -> None:
    """ValueError saying what a topology is, where `topology` is not one:
    three positive counts, `<slices>x<hosts>x<gpus per host>`."""
    counts = (topology.split("x") if isinstance(topology, str) else [])
    if len(counts) != 3 or not all(c.isdigit() and int(c) > 0
                                   for c in counts):
        raise ValueError(
            f"jlms: topology {topology!r} is not '<slices>x<hosts>x<gpus "
            "per host>' with each count at least 1, such as '1x1x8' for "
            "one host of eight GPUs")


def xla_memory(
    fn: Callable,
    *args: Any,
    target: str = "h100",
    topology: str | None = None,
    **kwargs: Any,
) -> XlaMemory:
    """Compiles `fn(*args, **kwargs)` for `target` and returns XLA's memory.

    Args:
      fn: a callable; one with a `.lower(*args, **kwargs)` method (a `jax.jit`
        object or a jlms step) is lowered through it, anything else through
        `jax.jit(fn)`.
      *args: pytrees of jax arrays, numpy arrays, Python scalars or
        `jax.ShapeDtypeStruct` values. Python scalars are passed unchanged
        (weakly typed under jit).
      **kwargs: the same, by keyword.
      target: "h100", "h200", "a100" (deviceless GPU compile) or "local" (the
        default local backend, with the arguments exactly as given).
      topology: GPU layout `<slices>x<hosts>x<gpus per host>` of a GPU target.
        None (default): the topology whose devices (from `target_devices`)
        the arguments' shardings use, else "1x1x1".

    Returns:
      An `XlaMemory` with the compiled program's per-device bytes (from the
      cache the module docstring describes where this program was compiled
      before: a jlms step measured after its plan takes the plan's compile).

    Raises:
      ValueError: `target` is not a known target.
      DevicelessUnavailableError: a GPU target cannot be compiled here.
    """
    return xla_memory_of_call(fn, args, kwargs, target, topology)


def xla_memory_of_call(
    fn: Callable,
    args: tuple,
    kwargs: dict,
    target: str = "h100",
    topology: str | None = None,
) -> XlaMemory:
    """`xla_memory` of `fn(*args, **kwargs)`, whose keyword arguments may
    include ones named `target` or `topology` (the step's own)."""
    _check_target(target)
    if target != LOCAL_TARGET:
        if topology is None:
            topology = _topology_of_arguments(target, (args, kwargs))
        _check_topology(topology)
        devices = _gpu_topology(target, topology).devices
        moved = bool(_devices_of((args, kwargs)) - set(devices))
        args, kwargs = _place_on_target((args, kwargs), devices)
    else:
        moved = False
    lower = fn.lower if hasattr(fn, "lower") else jax.jit(fn).lower
    try:
        lowered = lower(*args, **kwargs)
    except RuntimeError as error:
        if target != LOCAL_TARGET and "Unknown backend" in str(error):
            raise _calls_back(target, "JAX lowers a callback only for a "
                              "backend this process has") from error
        raise
    except ValueError as error:
        # JAX's words where the step's own mesh is this machine's: its
        # devices against the target's, or (where the arguments were
        # moved from its devices onto the target's) a shard_map's specs
        # against the arguments' shardings.
        if target != LOCAL_TARGET and (
                "incompatible devices" in str(error)
                or (moved and "shard_map" in str(error))):
            raise _own_devices(target, error) from error
        raise
    key = None
    if target != LOCAL_TARGET and hasattr(lowered, "as_text"):
        options = _compat.compiler_options(lowered)
        text = lowered.as_text()
        if options is not None:
            # Names aside only where the options are known: two functions
            # of one body could otherwise take each other's compile.
            text = _without_names(text)
        key = (target, topology, options,
               hashlib.sha256(text.encode()).digest())
        cached = _COMPILED_MEMORY.get(key)
        if cached is not None:
            _COMPILED_MEMORY.move_to_end(key)
            return cached
    try:
        compiled = lowered.compile()
    except Exception as error:
        if (target != LOCAL_TARGET and isinstance(error, TypeError)
                and "host_callbacks" in str(error)):
            # On a machine with a GPU the callback lowers, and JAX hands
            # it to the compile-only client, which takes none (0.11.2).
            raise _calls_back(target, "JAX compiles a callback only for a "
                              "device this process has") from error
        if target != LOCAL_TARGET and _names_missing_cuda_tool(str(error)):
            raise DevicelessUnavailableError(
                f"Compiling for {target!r} needs ptxas and libdevice, which "
                f"were not found. {_INSTALL_AOT_ADVICE}"
            ) from error
        raise
    memory = _memory_of(compiled, target)
    if key is not None:
        _COMPILED_MEMORY[key] = memory
        if len(_COMPILED_MEMORY) > _CACHE_SIZE:
            _COMPILED_MEMORY.popitem(last=False)
    return memory


def _own_devices(target: str, error: ValueError
                 ) -> DevicelessUnavailableError:
    """The error of a step that names devices of its own (a `shard_map`'s
    or a sharding constraint's mesh, built from this machine's devices):
    its arguments go onto `target`'s devices, and JAX refuses to compile
    one program over both (`error`, JAX's words)."""
    first = str(error).splitlines()[0] if str(error) else repr(error)
    return DevicelessUnavailableError(
        f"The step names devices of its own (a shard_map's or a sharding "
        f"constraint's mesh), this machine's rather than the target's, so "
        f"XLA cannot compile it for {target!r} here ({first[:300]}). "
        f"Build that mesh from "
        f"jlms.target_devices({target!r}, '1x1xN') (N devices) to plan for "
        f"{target!r}, or leave target= out where no GPU is local, and jlms "
        f"plans by its simulator alone.")


def _calls_back(target: str, why: str) -> DevicelessUnavailableError:
    """The error of a step with a host callback, which JAX cannot compile
    for `target`'s compile-only devices, for the reason `why`."""
    return DevicelessUnavailableError(
        f"jlms: the step calls back into Python (jax.debug.print, "
        f"jax.debug.callback, jax.pure_callback or io_callback), and {why}: "
        f"the step cannot be compiled for {target!r} without that GPU. "
        f"Leave the callback out while planning (behind a flag of your "
        f"own), or plan on the GPU itself")


# The module's name and the names JAX gives its arguments and results, which
# XLA compiles nothing from: a jlms step and the plan jlms confirmed for it
# differ only there (`jit_step` against `jit_program_fn`), so measuring the
# step after planning it reuses the plan's compile.
_NAMES = re.compile(r'^module @[\w.\-]+|jax\.(?:arg|result)_info = "(?:[^"\\]|\\.)*"',
                    re.MULTILINE)


def _without_names(text: str) -> str:
    # The names are in the module's first line and in the signature of
    # `main`, the first function: the rest is not searched (an 8B Llama's
    # step took 4 s a compile to search whole).
    main = text.find("func.func public @main")
    if main < 0:
        return _NAMES.sub("", text)
    end = text.find("\n", main)
    end = len(text) if end < 0 else end
    return _NAMES.sub("", text[:end]) + text[end:]


# Deviceless compiles' memory by (target, topology, compiler options, SHA-256
# of the lowered StableHLO text less its names), least recently used first.
# Bounded: each keeps its optimized HLO text (megabytes for a large model).
_CACHE_SIZE = 32
_COMPILED_MEMORY: collections.OrderedDict[tuple, XlaMemory] = (
    collections.OrderedDict())


def _check_target(target: str) -> None:
    if target not in KNOWN_TARGETS:
        raise ValueError(
            f"unknown target {target!r}; known targets: {', '.join(KNOWN_TARGETS)}"
        )


def check_local_gpu() -> None:
    """Raises `DevicelessUnavailableError` unless jax here runs on a GPU:
    the "local" target, which a plan is fitted for and confirmed on, is
    this machine's GPU."""
    backend = jax.default_backend()
    if backend != "gpu":
        raise DevicelessUnavailableError(
            f"jlms: there is no local GPU to fit the step for: jax here runs "
            f"on {backend} (target 'local' is this machine's GPU). To plan "
            f"for a GPU you do not have, name it: target='h100' (or 'h200', "
            f"'a100'), which XLA compiles for deviceless with "
            f"JAX_PLATFORMS=cpu and the aot extra (pip install 'jlms[aot]'; "
            f"see docs/deviceless.md). To run the step here as jax.jit's "
            f"program, name neither a target nor a budget."
        )


def target_memory_bytes(target: str) -> int:
    """Device memory of one GPU of `target`: its description's
    `device_memory_size` for a named target, the allocator's limit for
    "local" (`DevicelessUnavailableError` without a local GPU, ValueError
    where its backend reports no limit)."""
    _check_target(target)
    if target == LOCAL_TARGET:
        check_local_gpu()
        stats = jax.local_devices()[0].memory_stats() or {}
        if stats.get("bytes_limit", -1) > 0:
            return int(stats["bytes_limit"])
        raise ValueError(
            f"jlms: the {jax.default_backend()} backend reports no memory "
            "limit; give the budget in bytes or name a target such as 'h100'")
    text = (importlib.resources.files("jlms").joinpath("targets")
            .joinpath(_GPU_TARGET_FILES[target]).read_text())
    match = re.search(r"device_memory_size:\s*(\d+)", text)
    if match is None:
        raise ValueError(f"jlms: target {target!r} has no device_memory_size")
    return int(match.group(1))


@functools.cache
def _gpu_topology(target: str, topology: str) -> topologies.TopologyDescription:
    # Cached because creating it is slow and because devices of two creations
    # never compare equal: shardings must be built from the ones we compile on.
    target_config = (
        importlib.resources.files("jlms")
        .joinpath("targets")
        .joinpath(_GPU_TARGET_FILES[target])
        .read_text()
    )
    mismatch = _plugin_version_mismatch()
    if mismatch:
        raise DevicelessUnavailableError(mismatch)
    try:
        description = topologies.get_topology_desc(
            platform="cuda", target_config=target_config, topology=topology
        )
    except NotImplementedError as error:
        raise DevicelessUnavailableError(
            f"No deviceless CUDA topology for target {target!r}: "
            f"{_why_no_cuda_topology()}"
        ) from error
    _TOPOLOGIES_MADE.setdefault(target, []).append(topology)
    return description


# Target -> the topologies made for it so far, in order: arguments sharded
# over devices of one of them are compiled on that one.
_TOPOLOGIES_MADE: dict[str, list[str]] = {}


def _devices_of(tree: Any) -> set:
    """The devices that the sharded leaves of `tree` are placed on."""
    used: set = set()
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.Sharding):
            used |= set(sharding.device_set)
    return used


def _topology_of_arguments(target: str, tree: Any) -> str:
    """The topology of `target`, among those made, whose devices hold every
    sharded argument of `tree`; for arguments on another topology's
    compile-only devices of `target`'s kind, the layout of those devices;
    "1x1x1" when there is none."""
    used = _devices_of(tree)
    if used:
        for topology in _TOPOLOGIES_MADE.get(target, ()):
            if used <= set(_gpu_topology(target, topology).devices):
                return topology
        if _foreign_target(used) == target:
            return _layout(used)
    return "1x1x1"


def target_of_arguments(tree: Any) -> str | None:
    """The GPU target whose compile-only devices hold every sharded array
    of `tree`: devices from `target_devices`, or from another topology of
    `jax.experimental.topologies` whose device kind is the target's (an
    H100's "NVIDIA H100 80GB HBM3"). None when they are not all on one
    target's (arrays of this machine, or no sharding at all)."""
    used = _devices_of(tree)
    if not used:
        return None
    for target, made in _TOPOLOGIES_MADE.items():
        for topology in made:
            if used <= set(_gpu_topology(target, topology).devices):
                return target
    return _foreign_target(used)


@functools.cache
def _targets_by_device_kind() -> dict[str, str]:
    """Device kind (the `name` in a target's description) -> target."""
    targets = {}
    for target, file in _GPU_TARGET_FILES.items():
        text = importlib.resources.files("jlms").joinpath("targets").joinpath(
            file).read_text()
        match = re.search(r'^\s*name:\s*"([^"]+)"', text, re.MULTILINE)
        if match is not None:
            targets[match.group(1)] = target
    return targets


def _is_compile_only(device: Any) -> bool:
    """Whether `device` is none of this process's backends' devices: a
    compile-only device of a deviceless topology."""
    try:
        return device not in jax.devices(device.platform)
    except RuntimeError:  # no backend of its platform here (JAX_PLATFORMS=cpu)
        return True


def _foreign_target(devices: set) -> str | None:
    """The GPU target whose device kind all `devices` have, when they are
    compile-only devices that jlms did not make; else None (a local GPU of
    that kind is the "local" target)."""
    kinds = {getattr(device, "device_kind", None) for device in devices}
    if len(kinds) != 1:
        return None
    target = _targets_by_device_kind().get(kinds.pop())
    if target is None or not all(_is_compile_only(d) for d in devices):
        return None
    return target


def _by_host(devices) -> list[list]:
    """`devices` grouped by host (process index), each group by device id."""
    hosts: dict[int, list] = {}
    for device in sorted(devices, key=lambda d: (d.process_index, d.id)):
        hosts.setdefault(device.process_index, []).append(device)
    return list(hosts.values())


def _layout(devices: set) -> str:
    """The topology `1x<hosts>x<gpus per host>` that holds `devices`: as
    many hosts as they are on, as many GPUs per host as the most on one."""
    hosts = _by_host(devices)
    return f"1x{len(hosts)}x{max(len(host) for host in hosts)}"


def _onto(devices: set, target_devices_: list) -> dict:
    """Each of `devices` (another topology's) -> the device of the same
    host and rank among `target_devices_`, where there is one."""
    mapping = {}
    for ours, theirs in zip(_by_host(target_devices_), _by_host(devices)):
        mapping.update(zip(theirs, ours))
    return mapping


def _why_no_cuda_topology() -> str:
    # jax reports both causes with the same "topology not implemented for
    # cuda", so tell them apart by what is installed and configured.
    if not _cuda_plugin_installed():
        return f"the CUDA PJRT plugin is not installed. {_INSTALL_AOT_ADVICE}"
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms.strip().lower() != "cpu":
        shown = f"JAX_PLATFORMS={platforms!r}" if platforms else "JAX_PLATFORMS unset"
        return f"jax was imported with {shown}. {_SET_PLATFORMS_ADVICE}"
    return (
        "the CUDA plugin is installed and JAX_PLATFORMS=cpu now, yet jax "
        "registered no CUDA topology. If JAX_PLATFORMS was set after jax was "
        f"imported: {_SET_PLATFORMS_ADVICE} Otherwise the plugin may be broken; "
        f"reinstall it. {_INSTALL_AOT_ADVICE}"
    )


def _plugin_version_mismatch() -> str | None:
    """What to install, when the CUDA plugin's version is not jaxlib's (a
    plugin of another jaxlib fails to load, or compiles with another XLA)."""
    import jaxlib

    installed = jaxlib.__version__
    for package in ("jax-cuda13-plugin", "jax-cuda13-pjrt",
                    "jax-cuda12-plugin", "jax-cuda12-pjrt"):
        try:
            version = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
        if version != installed:
            cuda = package.split("-")[1]
            return (
                f"{package} {version} does not match jaxlib {installed}: "
                f"deviceless compilation needs the plugin of the same version. "
                f"Install it with pip install 'jax[{cuda}-local]=="
                f"{jax.__version__}' (or pip install -e '.[aot]' in jlms's "
                "folder, which matches it to the installed jax)."
            )
    return None


def _cuda_plugin_installed() -> bool:
    for name in _CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ImportError:  # no `jax_plugins` package at all
            pass
    return False


def _names_missing_cuda_tool(message: str) -> bool:
    lowered = message.lower()
    return ("libdevice" in lowered or "ptxas" in lowered) and (
        "not found" in lowered or "no such file" in lowered
        or "couldn't find" in lowered or "could not find" in lowered
    )


def _place_on_target(tree: Any, devices: list) -> Any:
    """Abstract array leaves onto `devices[0]`, keeping target shardings
    and taking those on another topology's devices of the same kind onto
    `devices` (`_onto`)."""
    target_devices_set = frozenset(devices)
    first_device = SingleDeviceSharding(devices[0])
    foreign = {device for device in _devices_of(tree) - target_devices_set
               if device.device_kind == devices[0].device_kind}
    mapping = (_onto(foreign, devices)
               if foreign and _foreign_target(foreign) is not None else {})

    def place(leaf: Any) -> Any:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            return leaf
        sharding = getattr(leaf, "sharding", None)
        placed_devices = getattr(sharding, "device_set", None)
        if placed_devices is not None and mapping and placed_devices <= set(mapping):
            sharding = _remapped(sharding, mapping)
        elif placed_devices is None or not placed_devices <= target_devices_set:
            sharding = first_device
        return jax.ShapeDtypeStruct(
            leaf.shape,
            leaf.dtype,
            sharding=sharding,
            weak_type=getattr(leaf, "weak_type", False),
        )

    return jax.tree.map(place, tree)


def _remapped(sharding: Any, mapping: dict) -> Any:
    """`sharding` with each device `d` replaced by `mapping[d]`; a sharding
    of a kind not known here onto the first device it maps to."""
    memory_kind = getattr(sharding, "memory_kind", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = sharding.mesh
        devices = np.array([mapping[d] for d in mesh.devices.flat],
                           dtype=object).reshape(mesh.devices.shape)
        return jax.sharding.NamedSharding(
            jax.sharding.Mesh(devices, mesh.axis_names,
                              axis_types=mesh.axis_types),
            sharding.spec, memory_kind=memory_kind)
    first = mapping[min(sharding.device_set, key=lambda d: d.id)]
    return SingleDeviceSharding(first, memory_kind=memory_kind)


def _memory_of(compiled: jax.stages.Compiled, target: str) -> XlaMemory:
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            f"the {target!r} backend gives no memory analysis for compiled code"
        )
    hlo_text = compiled.as_text() or ""
    return XlaMemory(
        target=target,
        argument_bytes=stats.argument_size_in_bytes,
        output_bytes=stats.output_size_in_bytes,
        alias_bytes=stats.alias_size_in_bytes,
        temp_bytes=stats.temp_size_in_bytes,
        host_argument_bytes=stats.host_argument_size_in_bytes,
        host_output_bytes=stats.host_output_size_in_bytes,
        host_temp_bytes=stats.host_temp_size_in_bytes,
        generated_code_bytes=stats.generated_code_size_in_bytes,
        host_offloaded_buffers=count_host_buffers(hlo_text),
        hlo_text=hlo_text,
    )


_ITEMSIZE = {"pred": 1, "bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s8": 1,
             "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
             "u64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5,
             "s2": 0.25, "u2": 0.25, "s1": 0.125, "u1": 0.125,
             "f4e2m1fn": 0.5}


def hlo_itemsize(dtype: str) -> float | None:
    """Bytes of one element of an HLO element type (`f32`, `bf16`, any
    float8 variant, ...); None for types that hold no array data (`token`,
    opaque types)."""
    if dtype in _ITEMSIZE:
        return _ITEMSIZE[dtype]
    return 1 if dtype.startswith("f8") else None


# Memory space 5 is host memory in XLA's layouts: `f32[8]{0:S(5)}`.
_HOST_SPACE = "S(5)"
_COMPUTATION_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_CALLEE = re.compile(r"\bcalls=%([\w.\-]+)")
_OPERAND = re.compile(r"%([\w.\-]+)")


def count_host_buffers(hlo_text: str) -> int:
    """How many values the HLO module brings into host memory (space S(5)).

    A host buffer is counted where it enters host memory: at an instruction
    whose shape carries S(5) while none of its operands' shapes do (a
    `copy-start` from device, an `AllocateBuffer` custom call, a host entry
    parameter). Instructions that only pass a host value on (tuples, while
    loops, get-tuple-element, the `copy-done` of the same copy, in-place
    dynamic-update-slice) are not new buffers, nor are parameters of while
    bodies and conditions. Instructions inside computations reached through
    `calls=` (fusion and async bodies) are counted once, at the call site.
    """
    shapes: dict[str, str] = {}
    # (shape, computation, in entry computation, opcode and operands)
    rows: list[tuple[str, str, bool, str]] = []
    called_bodies: set[str] = set()
    for computation in hlo_computations(hlo_text):
        for name, shape, opcode_and_operands in computation.instructions:
            shapes[name] = shape
            rows.append((shape, computation.name, computation.is_entry,
                         opcode_and_operands))
            called_bodies.update(_CALLEE.findall(opcode_and_operands))

    count = 0
    for shape, computation, in_entry, opcode_and_operands in rows:
        if _HOST_SPACE not in shape or computation in called_bodies:
            continue
        opcode, operands = split_operands(opcode_and_operands)
        if opcode == "parameter" and not in_entry:
            continue
        if any(_HOST_SPACE in shapes.get(operand, "") for operand in operands):
            continue
        count += 1
    return count


@dataclasses.dataclass(frozen=True)
class HloComputation:
    """One computation of an HLO module's text, its instructions in the
    module's order (the schedule, in a compiled module): (name, shape,
    opcode with operands and attributes)."""
    name: str
    is_entry: bool
    instructions: tuple[tuple[str, str, str], ...]


def hlo_computations(hlo_text: str) -> list[HloComputation]:
    """The computations of an HLO module's text, in order."""
    found: list[HloComputation] = []
    name, is_entry, instructions = None, False, []
    for line in hlo_text.splitlines():
        header = _COMPUTATION_HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            if name is not None:
                found.append(HloComputation(name, is_entry,
                                            tuple(instructions)))
            is_entry, name, instructions = (bool(header.group(1)),
                                            header.group(2), [])
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        instruction_name, rest = instruction.groups()
        instructions.append((instruction_name, *_split_shape(rest)))
    if name is not None:
        found.append(HloComputation(name, is_entry, tuple(instructions)))
    return found


def _split_shape(text: str) -> tuple[str, str]:
    """`(f32[2]{0:S(5)}, u32[]) copy-start(%x)` -> shape, `copy-start(%x)`."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    end = _closing_paren(text, 0)
    return text[: end + 1], text[end + 1 :].lstrip()


def split_operands(text: str) -> tuple[str, list[str]]:
    """`copy-start(%x, %y), metadata=...` -> "copy-start", ["x", "y"]."""
    opcode, paren, _ = text.partition("(")
    if not paren:
        return opcode.strip(), []
    start = len(opcode)
    operand_list = text[start + 1 : _closing_paren(text, start)]
    return opcode.strip(), _OPERAND.findall(operand_list)


def _closing_paren(text: str, start: int) -> int:
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index
    return len(text)
