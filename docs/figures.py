"""Draws the figures of docs/how-it-works.md from a real plan.

    python docs/figures.py                       # into a new temporary folder
    python docs/figures.py --out docs/_static    # over the committed ones

The demo's step (`benchmarks.demo`: a 16-block BatchNorm ResNet, 64
channels, 256x256, batch 8, adam) is planned by `jlms.offload` for an H100
without a GPU, at a budget of 65% of jax.jit's XLA peak. `Plan.plot()` and
`Tradeoff.plot()` draw the pictures. The docs show the ones committed in
docs/_static/, so that building the docs runs no model; they are replaced
only when `--out docs/_static` asks for it (when the plan's pictures
change), and otherwise the pictures go to a new temporary folder, whose
path is printed.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ and this checkout's jlms

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import jlms
from benchmarks import models

TARGET = "h100"


def output_folder(argv=None) -> pathlib.Path:
  """The folder `--out` names (made if missing), else a new temporary one:
  the committed pictures are replaced only when asked."""
  parser = argparse.ArgumentParser(
      description="Draw the plan pictures of docs/how-it-works.md.")
  parser.add_argument(
      "--out", type=pathlib.Path, default=None,
      help="folder to write plan_plot.png and tradeoff_plot.png to "
           "(docs/_static replaces the committed ones); default: a new "
           "temporary folder")
  out = parser.parse_args(argv).out
  if out is None:
    return pathlib.Path(tempfile.mkdtemp(prefix="jlms-figures-"))
  out.mkdir(parents=True, exist_ok=True)
  return out


def draw(folder: pathlib.Path) -> None:
  """Plans the demo's step and writes its two pictures into `folder`."""
  case = models.resnet_case(blocks=16, channels=64, image_size=256, batch=8)
  args = case.abstract_args()
  jit_peak = jlms.xla_memory(jax.jit(case.step), *args,
                             target=TARGET).peak_bytes
  step = jlms.offload(case.step, budget=int(0.65 * jit_peak), target=TARGET)
  plan = step.plan(*args)
  print(plan)
  ax = plan.plot()
  ax.set_title(f"{case.name}: budget 65% of jax.jit's XLA peak, {TARGET}")
  ax.figure.savefig(folder / "plan_plot.png", dpi=100, bbox_inches="tight")
  plt.close(ax.figure)
  tradeoff = step.tradeoff(*args)
  print(tradeoff)
  ax = tradeoff.plot()
  ax.set_title(f"{case.name}, {TARGET}")
  ax.figure.savefig(folder / "tradeoff_plot.png", dpi=100,
                    bbox_inches="tight")
  plt.close(ax.figure)


def main(argv=None):
  folder = output_folder(argv)
  draw(folder)
  print(f"figures written to {folder}")


if __name__ == "__main__":
  main()
