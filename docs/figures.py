"""Draws the figures of docs/how-it-works.md from a real plan.

    python docs/figures.py

The demo's step (`benchmarks.demo`: a 16-block BatchNorm ResNet, 64
channels, 256x256, batch 8, adam) is planned by `jlms.offload` for an H100
without a GPU, at a budget of 65% of jax.jit's XLA peak. `Plan.plot()` and
`Tradeoff.plot()` draw the pictures; they are written to docs/_static/ and
committed, so that building the docs runs no model. Run this again when the
plan's pictures change.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ and this checkout's jlms

import jax
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

import jlms
from benchmarks import models

STATIC = ROOT / "docs" / "_static"
TARGET = "h100"


def main():
  case = models.resnet_case(blocks=16, channels=64, image_size=256, batch=8)
  args = case.abstract_args()
  jit_peak = jlms.xla_memory(jax.jit(case.step), *args,
                             target=TARGET).peak_bytes
  step = jlms.offload(case.step, budget=int(0.65 * jit_peak), target=TARGET)
  plan = step.plan(*args)
  print(plan)
  ax = plan.plot()
  ax.set_title(f"{case.name}: budget 65% of jax.jit's XLA peak, {TARGET}")
  ax.figure.savefig(STATIC / "plan_plot.png", dpi=100, bbox_inches="tight")
  plt.close(ax.figure)
  tradeoff = step.tradeoff(*args)
  print(tradeoff)
  ax = tradeoff.plot()
  ax.set_title(f"{case.name}, {TARGET}")
  ax.figure.savefig(STATIC / "tradeoff_plot.png", dpi=100,
                    bbox_inches="tight")
  plt.close(ax.figure)


if __name__ == "__main__":
  main()
