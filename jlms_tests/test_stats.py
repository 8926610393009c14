"""`memory_stats`: real numbers where a backend reports them, None elsewhere."""

import dataclasses

import jax
import numpy as np
import pytest

from jlms._stats import MemoryStats, memory_stats

GIB = 1 << 30

# Keys and magnitudes as a CUDA device's `memory_stats()` returns them.
GPU_LIKE = {
    "num_allocs": 17,
    "bytes_in_use": 3 * GIB,
    "peak_bytes_in_use": 5 * GIB,
    "largest_alloc_size": GIB // 2,
    "bytes_limit": 60 * GIB,
    "bytes_reserved": 0,
    "peak_bytes_reserved": 0,
    "largest_free_block_bytes": 0,
    "pool_bytes": 60 * GIB,
    "peak_pool_bytes": 60 * GIB,
}


class FakeDevice:
  platform = "gpu"
  id = 3

  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats

  def __str__(self):
    return "cuda:3"


def test_cpu_reports_nothing_and_invents_nothing():
  # The CPU device by name: with JAX_PLATFORMS=cuda,cpu the default device
  # is the GPU, and the CPU backend is there too.
  device = jax.devices("cpu")[0]
  stats = memory_stats(device)
  assert device.platform == "cpu"
  assert stats.device == str(device)
  assert stats.platform == "cpu"
  assert stats.reported is False
  assert stats.raw == {}
  for field in ("bytes_in_use", "peak_bytes_in_use", "num_allocs",
                "largest_alloc_size", "bytes_limit", "host_bytes_in_use",
                "host_peak_bytes_in_use"):
    assert getattr(stats, field) is None, field
  assert stats.bytes_free is None
  assert stats.peak_fraction is None
  assert str(stats) == (f"jlms: the cpu backend reports no memory statistics "
                        f"for {device}")


def test_device_given_by_index_or_object_is_the_same():
  device = jax.local_devices()[0]
  assert memory_stats(0) == memory_stats(device) == memory_stats(None)
  assert memory_stats(np.int64(0)).device == str(device)


def test_gpu_like_dict_fills_every_device_field():
  stats = memory_stats(FakeDevice(dict(GPU_LIKE)))
  assert stats.device == "cuda:3"
  assert stats.platform == "gpu"
  assert stats.reported is True
  assert stats.bytes_in_use == 3 * GIB
  assert stats.peak_bytes_in_use == 5 * GIB
  assert stats.num_allocs == 17
  assert stats.largest_alloc_size == GIB // 2
  assert stats.bytes_limit == 60 * GIB
  assert stats.bytes_free == 57 * GIB
  assert stats.peak_fraction == pytest.approx(5 / 60)
  # The CUDA dict has no pinned-host keys; pool_bytes is not host memory.
  assert stats.host_bytes_in_use is None
  assert stats.host_peak_bytes_in_use is None
  assert stats.raw == GPU_LIKE


def test_raw_is_a_copy():
  backend_dict = dict(GPU_LIKE)
  stats = memory_stats(FakeDevice(backend_dict))
  backend_dict["bytes_in_use"] = 0
  assert stats.raw["bytes_in_use"] == 3 * GIB
  assert stats.raw is not backend_dict


def test_partial_dict_leaves_the_rest_none():
  stats = memory_stats(FakeDevice({"bytes_in_use": 4096}))
  assert stats.reported is True
  assert stats.bytes_in_use == 4096
  assert stats.peak_bytes_in_use is None
  assert stats.num_allocs is None
  assert stats.largest_alloc_size is None
  assert stats.bytes_limit is None
  assert stats.bytes_free is None
  assert stats.peak_fraction is None
  text = str(stats)
  assert "4.00 KiB" in text
  assert text.count("not reported") == 8  # every row but bytes in use


def test_unavailable_values_are_none_not_numbers():
  # JAX documents -1 as "unavailable"; a non-integer is not a count either.
  stats = memory_stats(FakeDevice(
      {"bytes_in_use": 10, "bytes_limit": -1, "num_allocs": True,
       "peak_bytes_in_use": 2.5, "largest_alloc_size": np.int64(8)}))
  assert stats.bytes_in_use == 10
  assert stats.bytes_limit is None
  assert stats.num_allocs is None
  assert stats.peak_bytes_in_use is None
  assert stats.largest_alloc_size == 8
  assert type(stats.largest_alloc_size) is int


def test_dict_with_no_known_key_is_not_reported():
  stats = memory_stats(FakeDevice({"pool_bytes": 123}))
  assert stats.reported is False
  assert stats.raw == {"pool_bytes": 123}
  assert str(stats) == ("jlms: the gpu backend reports no memory statistics "
                        "for cuda:3")


def test_str_is_an_aligned_table_of_formatted_bytes():
  lines = str(memory_stats(FakeDevice(dict(GPU_LIKE)))).splitlines()
  assert lines[0] == "jlms: memory statistics of cuda:3 (gpu)"
  rows = dict((line[:22].strip(), line[22:].strip()) for line in lines[1:])
  assert rows == {
      "bytes in use": "3.00 GiB",
      "peak bytes in use": "5.00 GiB",
      "allocations": "17",
      "largest allocation": "512.00 MiB",
      "bytes limit": "60.00 GiB",
      "bytes free": "57.00 GiB",
      "peak / limit": "8.3%",
      "pinned host in use": "not reported",
      "pinned host peak": "not reported",
  }
  assert len({len(line) for line in lines[1:]}) == 1  # right-aligned values


def test_as_dict_round_trips():
  stats = memory_stats(FakeDevice(dict(GPU_LIKE)))
  as_dict = stats.as_dict()
  assert as_dict["bytes_limit"] == 60 * GIB
  assert as_dict["host_bytes_in_use"] is None
  assert as_dict["raw"] == GPU_LIKE
  assert MemoryStats(**as_dict) == stats


def test_stats_are_frozen_and_hashable():
  stats = memory_stats(FakeDevice(dict(GPU_LIKE)))
  with pytest.raises(dataclasses.FrozenInstanceError):
    stats.bytes_in_use = 0
  assert isinstance(hash(stats), int)


@pytest.mark.parametrize("device", [len(jax.local_devices()), -1, 10**6])
def test_index_out_of_range_raises_value_error(device):
  with pytest.raises(ValueError, match=r"local devices .*pass an index from 0"):
    memory_stats(device)


@pytest.mark.parametrize("device", ["cpu:0", 0.0, True, object(), [0]])
def test_other_arguments_raise_type_error(device):
  with pytest.raises(TypeError, match=r"memory_stats\(device=\.\.\.\)"):
    memory_stats(device)


def test_a_backend_returning_a_non_dict_raises():
  with pytest.raises(TypeError, match="returned a list, not a dict or None"):
    memory_stats(FakeDevice([1, 2]))
