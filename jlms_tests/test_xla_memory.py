"""Tests of jlms._xla_memory: XLA's GPU memory accounting without a GPU."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

import jlms
from jlms import _xla_memory
from jlms._xla_memory import (
    DevicelessUnavailableError,
    XlaMemory,
    count_host_buffers,
    target_devices,
    xla_memory,
)

MIB = 1 << 20
SQUARE_F32 = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)  # 64 MiB


def matmul(a, b):
    return a @ b


def round_trip_with_barrier(x):
    host = jax.device_put(x, jax.memory.Space.Host)
    host = jax.lax.optimization_barrier(host)
    return jax.device_put(host, jax.memory.Space.Device) * 2


def round_trip_without_barrier(x):
    host = jax.device_put(x, jax.memory.Space.Host)
    return jax.device_put(host, jax.memory.Space.Device) * 2


def test_matmul_on_h100_counts_arguments_and_output():
    memory = xla_memory(matmul, SQUARE_F32, SQUARE_F32)

    assert memory.target == "h100"
    assert memory.argument_bytes == 2 * 64 * MIB
    assert memory.output_bytes == 64 * MIB
    assert memory.alias_bytes == 0
    assert memory.host_bytes == 0
    assert memory.host_offloaded_buffers == 0
    assert memory.peak_bytes == 3 * 64 * MIB + memory.temp_bytes


def test_host_round_trip_behind_a_barrier_lives_in_host_memory():
    memory = xla_memory(round_trip_with_barrier, SQUARE_F32)

    assert memory.host_temp_bytes == 64 * MIB
    assert memory.host_bytes == 64 * MIB
    assert memory.host_offloaded_buffers == 1
    # The host copy is not also kept on the device: only a few bytes of temp.
    assert memory.temp_bytes < MIB
    assert "S(5)" in memory.hlo_text


def test_host_round_trip_without_a_barrier_is_deleted_by_xla():
    memory = xla_memory(round_trip_without_barrier, SQUARE_F32)

    assert memory.host_bytes == 0
    assert memory.host_offloaded_buffers == 0
    assert "S(5)" not in memory.hlo_text


def test_concrete_arguments_are_measured_on_the_target():
    abstract = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
    from_numpy = xla_memory(
        round_trip_with_barrier, np.ones((1024, 1024), np.float32)
    )
    from_jax = xla_memory(round_trip_with_barrier, jnp.ones((1024, 1024)))
    from_abstract = xla_memory(round_trip_with_barrier, abstract)

    assert from_numpy.argument_bytes == 4 * MIB
    assert from_numpy.as_dict() == from_abstract.as_dict()
    assert from_jax.as_dict() == from_abstract.as_dict()
    # Only the GPU pipeline offloads to host; a CPU compile would not.
    assert from_numpy.host_offloaded_buffers == 1


def test_python_scalars_stay_weakly_typed():
    x = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16)

    memory = xla_memory(lambda x, scale: x * scale, x, 3.0)

    assert memory.output_bytes == 2 * MIB  # bf16: 3.0 did not promote to f32


def test_objects_with_lower_are_lowered_through_it():
    donating = jax.jit(lambda x: x + 1, donate_argnums=0)

    class Step:
        def lower(self, *args, **kwargs):
            return donating.lower(*args, **kwargs)

    for fn in (donating, Step()):
        memory = xla_memory(fn, SQUARE_F32)
        # Wrapping in a fresh jax.jit would have lost the donation.
        assert memory.alias_bytes == 64 * MIB
        assert memory.peak_bytes == 64 * MIB + memory.temp_bytes


def test_programs_differing_only_in_names_are_compiled_once(monkeypatch):
    compiles = []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, *a, **k: compiles.append(1)
                        or compile_(self, *a, **k))
    monkeypatch.setattr(_xla_memory, "_COMPILED_MEMORY",
                        type(_xla_memory._COMPILED_MEMORY)())

    def first(a, b):
        return {"product": a @ b}

    def second(x, y):  # another name, and other names for its result
        return [x @ y]

    one = xla_memory(first, SQUARE_F32, SQUARE_F32)
    two = xla_memory(second, SQUARE_F32, SQUARE_F32)
    assert len(compiles) == 1 and two is one
    # Anything XLA compiles from tells them apart: a donation, compiler
    # options (which the lowered text does not show).
    xla_memory(jax.jit(second, donate_argnums=0), SQUARE_F32, SQUARE_F32)
    assert len(compiles) == 2
    xla_memory(jax.jit(second, compiler_options={
        "xla_disable_hlo_passes": "rematerialization"}),
        SQUARE_F32, SQUARE_F32)
    assert len(compiles) == 3


def test_an_offloaded_step_is_measured_with_the_compile_its_plan_made(
        monkeypatch):
    import jlms
    monkeypatch.setattr(_xla_memory, "_COMPILED_MEMORY",
                        type(_xla_memory._COMPILED_MEMORY)())

    def step(x):
        h = jnp.tanh(x @ x)
        return jnp.sum(jnp.tanh(h @ h) * h)

    offloaded = jlms.offload(jax.grad(step), budget="352MiB", target="h100")
    plan = offloaded.plan(SQUARE_F32)
    assert plan.xla_peak_bytes is not None
    compiles = []
    compile_ = jax.stages.Lowered.compile
    monkeypatch.setattr(jax.stages.Lowered, "compile",
                        lambda self, *a, **k: compiles.append(1)
                        or compile_(self, *a, **k))
    memory = xla_memory(offloaded, SQUARE_F32)
    assert compiles == []
    assert memory.peak_bytes == plan.xla_peak_bytes


def test_keyword_arguments_are_placed_too():
    memory = xla_memory(
        lambda a, *, b: a + b, SQUARE_F32, b=np.ones((4096, 4096), np.float32)
    )

    assert memory.argument_bytes == 2 * 64 * MIB


def test_shardings_on_the_target_topology_are_kept():
    devices = target_devices("h100", "1x1x8")
    mesh = Mesh(np.array(devices), ("gpus",))
    row_sharded = jax.ShapeDtypeStruct(
        (4096, 4096),
        jnp.float32,
        sharding=NamedSharding(mesh, PartitionSpec("gpus")),
    )

    memory = xla_memory(lambda x: x * 2, row_sharded, topology="1x1x8")

    # Bytes are per device: one eighth of the array on each GPU.
    assert memory.argument_bytes == 8 * MIB
    assert memory.output_bytes == 8 * MIB


def _other_topology(target_file, topology):
    """Compile-only devices made with jax.experimental.topologies, as a user
    would, not by jlms."""
    config = (_xla_memory.importlib.resources.files("jlms")
              .joinpath("targets").joinpath(target_file).read_text())
    return topologies.get_topology_desc(
        platform="cuda", target_config=config, topology=topology).devices


def test_arguments_on_another_topologys_h100_are_an_h100():
    [device] = _other_topology("h100.txtpb", "1x1x1")
    assert device.device_kind == "NVIDIA H100 80GB HBM3"
    assert device not in target_devices("h100")
    square = jax.ShapeDtypeStruct(
        (4096, 4096), jnp.float32, sharding=SingleDeviceSharding(device))

    assert _xla_memory.target_of_arguments([square]) == "h100"
    memory = xla_memory(matmul, square, square)
    assert memory.target == "h100"
    assert memory.argument_bytes == 2 * 64 * MIB


def test_shardings_on_another_topologys_h100s_are_kept_per_device():
    devices = _other_topology("h100.txtpb", "1x2x4")
    mesh = Mesh(np.array(devices).reshape(2, 4), ("hosts", "gpus"))
    tiles = jax.ShapeDtypeStruct(
        (4096, 4096), jnp.float32,
        sharding=NamedSharding(mesh, PartitionSpec("hosts", "gpus")))

    assert _xla_memory.target_of_arguments([tiles]) == "h100"
    memory = xla_memory(lambda x: x * 2, tiles)
    assert memory.argument_bytes == 8 * MIB  # one eighth on each GPU


def test_a_step_on_another_topologys_h100_is_fitted_for_an_h100():
    import jlms

    [device] = _other_topology("h100.txtpb", "1x1x1")
    placed = SingleDeviceSharding(device)
    w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=placed)
    x = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=placed)

    def step(w, x):
        return jax.grad(lambda w: (jnp.tanh(x @ w) ** 2).sum())(w)

    plan = jlms.offload(step).plan(w, x)
    assert plan.xla_target == "h100"
    assert plan.budget_bytes == _xla_memory.target_memory_bytes("h100")


class _FakeGpu:
    """A device object as jax gives one: only what target_of_arguments reads."""

    platform = "gpu"
    device_kind = "NVIDIA H100 80GB HBM3"
    process_index = 0
    id = 0


def test_a_device_kind_names_its_target_only_on_compile_only_devices(
        monkeypatch):
    gpu = _FakeGpu()
    monkeypatch.setattr(jax, "devices", lambda platform=None: [])
    assert _xla_memory._foreign_target({gpu}) == "h100"
    # A GPU of this process is the "local" target, whatever its kind.
    monkeypatch.setattr(jax, "devices", lambda platform=None: [gpu])
    assert _xla_memory._foreign_target({gpu}) is None


def test_an_unknown_device_kind_is_no_target(monkeypatch):
    gpu = _FakeGpu()
    gpu.device_kind = "NVIDIA GeForce RTX 4090"
    monkeypatch.setattr(jax, "devices", lambda platform=None: [])
    assert _xla_memory._foreign_target({gpu}) is None


def test_target_devices_are_created_once_per_topology():
    eight = target_devices("h100", "1x1x8")

    assert len(eight) == 8
    assert eight == target_devices("h100", "1x1x8")
    assert all(a is b for a, b in zip(eight, target_devices("h100", "1x1x8")))
    assert target_devices("h100")[0].device_kind == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("topology", ["0x0x0", "1x8", "1x1x-8", "eight"])
def test_a_topology_that_is_not_three_counts_says_what_one_is(topology):
    with pytest.raises(ValueError, match="<slices>x<hosts>x<gpus"):
        target_devices("h100", topology)
    with pytest.raises(ValueError, match="<slices>x<hosts>x<gpus"):
        xla_memory(round_trip_with_barrier, SQUARE_F32, topology=topology)


@pytest.mark.parametrize(
    "target, device_kind",
    [("h200", "NVIDIA H200"), ("a100", "NVIDIA A100-SXM4-80GB")],
)
def test_other_gpu_targets_compile(target, device_kind):
    assert target_devices(target)[0].device_kind == device_kind

    memory = xla_memory(round_trip_with_barrier, SQUARE_F32, target=target)

    assert memory.target == target
    assert memory.argument_bytes == 64 * MIB
    assert memory.output_bytes == 64 * MIB
    assert memory.host_temp_bytes == 64 * MIB
    assert memory.host_offloaded_buffers == 1


def test_local_target_compiles_the_arguments_as_given():
    a = jnp.ones((256, 256), jnp.float32)

    memory = xla_memory(matmul, a, np.ones((256, 256), np.float32), target="local")

    assert memory.target == "local"
    assert memory.argument_bytes == 2 * 256 * 256 * 4
    assert memory.output_bytes == 256 * 256 * 4
    assert target_devices("local") == jax.devices()


def test_scan_offload_is_one_host_buffer():
    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=["pre_activation"],
        offload_src="device",
        offload_dst="pinned_host",
    )

    def layer(h, w):
        z = checkpoint_name(h @ w, "pre_activation")
        return jnp.sin(z), None

    def loss(weights, x):
        remat_layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        h, _ = jax.lax.scan(remat_layer, x, weights)
        return h.sum()

    weights = jax.ShapeDtypeStruct((16, 256, 256), jnp.float32)
    x = jax.ShapeDtypeStruct((128, 256), jnp.float32)

    memory = xla_memory(jax.grad(loss), weights, x)

    # All 16 pre-activations go to one stacked host buffer, filled in place
    # by the loop; it is threaded through two while loops but counted once.
    assert memory.host_temp_bytes == 16 * 128 * 256 * 4
    assert memory.host_offloaded_buffers == 1


def test_count_host_buffers_counts_where_values_enter_host_memory():
    hlo = """
ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %copy-start = (f32[8]{0:S(5)}, f32[8]{0}, u32[]) copy-start(%x)
  %copy-done = f32[8]{0:S(5)} copy-done(%copy-start)
  %copy-start.1 = (f32[8]{0}, f32[8]{0:S(5)}, u32[]) copy-start(%copy-done)
  ROOT %copy-done.1 = f32[8]{0} copy-done(%copy-start.1)
}
"""
    assert count_host_buffers(hlo) == 1
    assert count_host_buffers(hlo.replace(":S(5)", "")) == 0


def test_memory_prints_in_mib_and_serializes_without_hlo():
    memory = xla_memory(round_trip_with_barrier, SQUARE_F32)

    text = str(memory)
    assert "host temporaries" in text and "64.00 MiB" in text
    assert "hlo_text" not in repr(memory)
    as_dict = json.loads(json.dumps(memory.as_dict()))
    assert as_dict["host_bytes"] == 64 * MIB
    assert as_dict["peak_bytes"] == memory.peak_bytes
    assert "hlo_text" not in as_dict
    # The dict keeps every field but the HLO: it makes an equal XlaMemory.
    fields = {f.name: as_dict[f.name] for f in dataclasses.fields(XlaMemory)
              if f.name != "hlo_text"}
    assert XlaMemory(**fields) == memory
    assert "S(5)" in memory.hlo_text  # kept on the object, for inspection


def test_unknown_target_lists_the_known_ones():
    with pytest.raises(ValueError, match="h100, h200, local"):
        xla_memory(matmul, SQUARE_F32, SQUARE_F32, target="v100")
    with pytest.raises(ValueError, match="a100"):
        target_devices("tpu")


def _no_cuda_topology(*args, **kwargs):
    raise NotImplementedError("topology not implemented for cuda")


# Topologies not used elsewhere, so the cached ones stay valid.
def test_missing_plugin_says_to_install_the_aot_extra(monkeypatch):
    monkeypatch.setattr(topologies, "get_topology_desc", _no_cuda_topology)
    monkeypatch.setattr(_xla_memory, "_cuda_plugin_installed", lambda: False)

    with pytest.raises(DevicelessUnavailableError, match=r"pip install 'jlms\[aot\]'"):
        xla_memory(matmul, SQUARE_F32, SQUARE_F32, topology="1x1x3")


def test_missing_ptxas_or_libdevice_says_to_install_the_aot_extra():
    class LoweredWithoutLibdevice:
        def compile(self):
            raise RuntimeError("INTERNAL: libdevice not found at ./libdevice.10.bc")

    class Step:
        def lower(self, *args, **kwargs):
            return LoweredWithoutLibdevice()

    with pytest.raises(DevicelessUnavailableError, match=r"pip install 'jlms\[aot\]'"):
        xla_memory(Step(), SQUARE_F32)


def test_other_compile_errors_pass_through():
    class BrokenLowered:
        def compile(self):
            raise RuntimeError("RESOURCE_EXHAUSTED: something else")

    class Step:
        def lower(self, *args, **kwargs):
            return BrokenLowered()

    with pytest.raises(RuntimeError, match="something else") as raised:
        xla_memory(Step(), SQUARE_F32)
    assert not isinstance(raised.value, DevicelessUnavailableError)


@pytest.mark.parametrize("platforms", [None, "cuda,cpu"])
def test_gpu_platforms_say_to_set_jax_platforms_cpu(monkeypatch, platforms):
    monkeypatch.setattr(topologies, "get_topology_desc", _no_cuda_topology)
    monkeypatch.setattr(_xla_memory, "_cuda_plugin_installed", lambda: True)
    if platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)

    with pytest.raises(DevicelessUnavailableError, match="JAX_PLATFORMS=cpu") as raised:
        xla_memory(matmul, SQUARE_F32, SQUARE_F32, topology="1x1x5")
    assert "target='local'" in str(raised.value)


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="a GPU machine has the topology"
)
def test_jax_imported_without_jax_platforms_cpu_really_fails_this_way():
    script = (
        "import jax, jlms._xla_memory as m\n"
        "try:\n"
        "    m.target_devices('h100')\n"
        "except m.DevicelessUnavailableError as e:\n"
        "    print(e)\n"
    )
    environment = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}

    result = subprocess.run(
        [sys.executable, "-c", script],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert "JAX_PLATFORMS unset" in result.stdout
    assert "Set JAX_PLATFORMS=cpu" in result.stdout


def _shard_map_step():
    """A step whose shard_map runs over a mesh of this machine's CPU."""
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("x",))

    def mlp(w, x):
        return jax.lax.psum(jnp.tanh(x @ w), "x")

    sharded = jax.shard_map(mlp, mesh=mesh, in_specs=(P("x", None), P(None, "x")),
                            out_specs=P())

    def step(w, x):
        loss, grad = jax.value_and_grad(lambda w: jnp.mean(sharded(w, x) ** 2))(w)
        return w - 0.1 * grad, loss

    w = jax.device_put(jnp.full((256, 256), 0.01), NamedSharding(mesh, P("x", None)))
    x = jax.device_put(jnp.ones((512, 256)), NamedSharding(mesh, P(None, "x")))
    return step, w, x


def test_a_step_with_its_own_mesh_is_refused_with_what_to_build():
    """A shard_map over a mesh of this machine's devices cannot compile for a
    deviceless target: JAX said the shard_map's specs did not match (the
    arguments went onto the target's device) and jlms fell back from its plan
    without saying why; the error names `target_devices` (found by fuzzing)."""
    step, w, x = _shard_map_step()
    jax.jit(step)(w, x)  # runs here, as written
    with pytest.raises(DevicelessUnavailableError, match=r"jlms.target_devices\('h100'"):
        xla_memory(jax.jit(step), w, x, target="h100")
    offloaded = jlms.offload(step, donate_argnums=0, budget="min", target="h100")
    with pytest.raises(DevicelessUnavailableError, match="names devices of its own"):
        offloaded.plan(w, x)


def test_two_lowerings_that_differ_in_names_alone_key_one_compile():
    """A step and jlms's program for it differ only in the module's name and
    the names of main's arguments and results, which `_without_names` takes
    out of the first lines alone (searching the whole text of an 8B Llama
    took 4 s a compile): the same as searching all of it."""
    from jlms._xla_memory import _NAMES, _without_names

    def step(params, x):
        inner = jax.jit(lambda h: jnp.tanh(h) * 2)
        return {"loss": jnp.sum(inner(x @ params["w"]))}

    def program_fn(params, x):
        return step(params, x)

    args = ({"w": jnp.ones((4, 4))}, jnp.ones((2, 4)))
    texts = [jax.jit(f).lower(*args).as_text() for f in (step, program_fn)]
    assert texts[0] != texts[1] and "jax.result_info" in texts[0]
    stripped = [_without_names(t) for t in texts]
    assert stripped[0] == stripped[1]
    assert stripped == [_NAMES.sub("", t) for t in texts]
