"""The largest-model sweep's search and its resumption from saved probes."""

from benchmarks import largest_gpt


def _fake_probes(monkeypatch, largest_by_way):
  """Probes that fit up to each way's size, without planning; the sizes
  probed, in order."""
  probed = []

  def probe(self, way, size):
    probed.append((way, size))
    return {"way": way, "layers": size, "width": 4096, "parameters": size,
            "xla_peak_bytes": 1, "state_host_bytes": None,
            "predicted_s": None, "error": None, "seconds": 0.0,
            "fits": size <= largest_by_way[way]}

  monkeypatch.setattr(largest_gpt.Prober, "probe", probe)
  monkeypatch.setattr(largest_gpt.Prober, "jit_time", lambda self, size: None)
  return probed


def test_the_search_doubles_then_bisects_to_the_largest_fitting_size():
  fitting = 21
  assert largest_gpt.largest(lambda size: size <= fitting, 4, 1) == (
      21, 22, 32)
  assert largest_gpt.largest(lambda size: size <= 3, 4, 1) == (3, 4, 4)


def test_a_resumed_sweep_probes_only_the_sizes_it_has_not_saved(
    monkeypatch, tmp_path):
  path = str(tmp_path / "largest.json")
  largest = {largest_gpt.JIT: 14, largest_gpt.ACTIVATIONS: 24,
             largest_gpt.STATE_ON_HOST: 40}
  probed = _fake_probes(monkeypatch, largest)
  whole = largest_gpt.run_sweep("llama-depth", path)
  assert {way: row["layers"] for way, row in whole["largest"].items()} == (
      largest)
  # A run stopped after the first way's probes: the resumed sweep takes
  # them from the JSON and probes the rest, reaching the same sizes.
  first_way = [p for p in probed if p[0] == largest_gpt.JIT]
  saved = whole["probes"][:len(first_way)]
  largest_gpt._save(path, "llama-depth", {**whole, "probes": saved,
                                          "complete": False})
  probed.clear()
  resumed = largest_gpt.run_sweep("llama-depth", path, resume=True)
  assert not any(way == largest_gpt.JIT for way, _ in probed)
  assert probed and resumed["largest"] == whole["largest"]
