"""Small train steps drawn at random, for the property tests.

`step_specs()` is a `hypothesis` strategy of `StepSpec`s: a model family
(MLP, convolution, attention, an NNX MLP), how its layers repeat (a Python
loop, `jax.lax.scan`, linen's `nn.scan`), the precision (float32, bfloat16,
mixed: float32 parameters with bfloat16 compute), what the layers hold
(BatchNorm, dropout, residuals), control flow around them (`cond`,
`while_loop`, a nested `jax.jit`), what users add around a model of
their own (their own remat of each layer with a checkpoint policy,
gradient accumulation over microbatches by `jax.lax.scan` or a Python
loop), the optimizer (SGD, Adam, AdamW after clipping by global norm, or
Adam applied every second step by `optax.MultiSteps`),
and how the step is jitted (a donated state, a static argument by
position or by name).
`build(spec)` turns one into a `DrawnStep`. The layers are composed here
from Flax's; the attention family's attention and every loss's
cross-entropy are the model registry's (`benchmarks.models`).

What holds for every `DrawnStep`:
- `fn(*args, **kwargs)` is a pure, jittable train step; `jit_options` are
  the `jax.jit` options it needs (static and donated arguments);
  `jax.jit(fn, **jit_options)` is the reference every property compares
  with.
- `make_args()` returns fresh concrete arguments, equal on every call (the
  state is donated in some steps, so each run needs its own);
  `abstract_args()` the same as `ShapeDtypeStruct`s, statics unchanged.
- `fn` returns the new state and the loss; `next_args(args, outputs)` are
  the arguments of the next step (the batch stays, the state advances).
- `offload(**options)` wraps the step in jlms with the step's jit options:
  `jlms.offload`, or for the NNX family `jlms.offload_nnx`'s step (which
  takes the graph definition and the split state, as `nnx.jit` does).
- Sizes are tiny (a few KiB per value), so a drawn step traces, compiles and
  runs in about a second; parameters are drawn with numpy, not by running
  the model's initializers, which would compile each of them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import zlib
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from hypothesis import strategies as st

import jlms
from benchmarks import models

FAMILIES = ("mlp", "conv", "attention", "nnx")
LAYOUTS = ("loop", "lax_scan", "nn_scan")
PRECISIONS = ("float32", "bfloat16", "mixed")
STATICS = ("none", "argnum", "argname")
OPTIMIZERS = ("sgd", "adam", "adamw_clipped", "adam_every_2")
#: The user's own remat of each layer: none, or `nn.remat` with one of
#: JAX's checkpoint policies (`jax.checkpoint_policies`).
REMATS = ("none", "nothing_saveable", "dots_saveable")
#: Gradient accumulation: none, or the batch split into `_MICROBATCHES`
#: whose gradients are summed by a `jax.lax.scan` or a Python loop.
ACCUMULATIONS = ("none", "scan", "loop")
_MICROBATCHES = 2

_CLASSES = 4  # labels of the convolution family
_VOCAB = 16  # tokens of the attention family
_HEADS = 2
# A BatchNorm over two or four samples divides by each feature's spread in
# the batch; with the usual epsilon (1e-5) a feature whose samples nearly
# agree multiplies rounding by up to 300 in each step, and jax.jit's program
# differs from itself under other compile options by 1e-4 after three
# steps. With 0.1, by 3 at most.
_BATCHNORM_EPSILON = 0.1


@dataclasses.dataclass(frozen=True)
class StepSpec:
  """One drawn train step: what `build` makes (see the module docstring)."""
  family: str = "mlp"
  layout: str = "loop"
  depth: int = 1
  width: int = 8
  batch: int = 2
  precision: str = "float32"
  batchnorm: bool = False
  dropout: bool = False
  residual: bool = False
  cond: bool = False
  while_loop: bool = False
  nested_jit: bool = False
  optimizer: str = "sgd"
  donate: bool = False
  static: str = "none"
  remat: str = "none"
  accumulate: str = "none"

  def __str__(self) -> str:
    flags = [name for name in ("batchnorm", "dropout", "residual", "cond",
                               "while_loop", "nested_jit", "donate")
             if getattr(self, name)]
    static = [] if self.static == "none" else [f"static={self.static}"]
    remat = [] if self.remat == "none" else [f"remat={self.remat}"]
    accumulate = ([] if self.accumulate == "none"
                  else [f"accumulate={self.accumulate}"])
    return (f"{self.family}/{self.layout} depth {self.depth} width "
            f"{self.width} batch {self.batch} {self.precision} "
            f"{self.optimizer} "
            + " ".join(flags + static + remat + accumulate)).strip()


@st.composite
def step_specs(draw, families=FAMILIES, max_depth=3) -> StepSpec:
  """A `StepSpec` of one of `families`, of 1 to `max_depth` layers; shrinks
  towards a one-layer float32 MLP in a loop."""
  family = draw(st.sampled_from(families))
  # NNX models repeat in a Python loop here; linen's nn.scan needs linen.
  layout = "loop" if family == "nnx" else draw(st.sampled_from(LAYOUTS))
  flags = {name: draw(st.booleans()) for name in (
      "dropout", "residual", "cond", "while_loop", "nested_jit")}
  # BatchNorm normalises over the batch: layers of attention take LayerNorm.
  batchnorm = family != "attention" and draw(st.booleans())
  if family == "nnx":  # offload_nnx decides static and donated arguments
    donate, static = False, "none"
  else:
    donate, static = draw(st.booleans()), draw(st.sampled_from(STATICS))
  # The NNX family's step is nnx's own (`nnx.value_and_grad`, the
  # optimizer's update in place): remat and accumulation are linen's here.
  linen = family != "nnx"
  remat = draw(st.sampled_from(REMATS)) if linen else "none"
  accumulate = draw(st.sampled_from(ACCUMULATIONS)) if linen else "none"
  # A microbatch of one sample has no spread for BatchNorm to divide by.
  batches = (4,) if accumulate != "none" else (2, 4)
  return StepSpec(
      family=family, layout=layout, depth=draw(st.integers(1, max_depth)),
      width=draw(st.sampled_from((8, 16))),
      batch=draw(st.sampled_from(batches)),
      precision=draw(st.sampled_from(PRECISIONS)), batchnorm=batchnorm,
      optimizer=draw(st.sampled_from(OPTIMIZERS)), donate=donate,
      static=static, remat=remat, accumulate=accumulate, **flags)


@dataclasses.dataclass(frozen=True, eq=False)
class DrawnStep:
  """A train step built from a `StepSpec` (see the module docstring)."""
  spec: StepSpec
  fn: Callable
  jit_options: dict
  make_args: Callable[[], tuple[tuple, dict]]
  state_position: int  # of the state among the positional arguments
  state_of: Callable[[Any], Any]  # the new state among the outputs
  offload: Callable[..., Any]

  def abstract_args(self) -> tuple[tuple, dict]:
    # Made once per step (`build` keeps one per spec): a property asks for
    # them several times a draw, and each `make_args` fills every leaf.
    abstract = self.__dict__.get("_abstract_args")
    if abstract is None:
      abstract = jax.tree.map(_abstract, self.make_args())
      object.__setattr__(self, "_abstract_args", abstract)
    args, kwargs = abstract
    return args, dict(kwargs)

  def next_args(self, args: tuple, outputs) -> tuple:
    args = list(args)
    args[self.state_position] = self.state_of(outputs)
    return tuple(args)

  def jitted(self):
    return jax.jit(self.fn, **self.jit_options)


def _seed(spec: StepSpec) -> int:
  # Not hash(): strings hash differently in each Python process.
  return zlib.crc32(repr(spec).encode())


def _abstract(leaf):
  if isinstance(leaf, (jax.Array, np.ndarray)):
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)
  return leaf


# -- layers ------------------------------------------------------------------

def _cond(h, inputs):
  # Which branch runs depends on the data, so neither is specialised away;
  # on the step's inputs, not on activations, whose rounding may differ
  # between two compiles and flip the branch.
  positive = jnp.sum(inputs.astype(jnp.float32)) > 0
  return jax.lax.cond(positive, lambda h: h * 1.5, jnp.sin, h)


def _root_mean_square(h):
  """sqrt(mean(h**2)) by Newton's method: a data-dependent while_loop (a
  constant to differentiation: while_loop has no reverse rule)."""
  mean_square = jnp.mean(jnp.square(h.astype(jnp.float32))) + 1e-3

  def not_converged(state):
    root, previous, iteration = state
    return (jnp.abs(root - previous) > 1e-6 * root) & (iteration < 32)

  def newton(state):
    root, _, iteration = state
    return 0.5 * (root + mean_square / root), root, iteration + 1

  start = jnp.maximum(mean_square, 1.0)
  root, _, _ = jax.lax.while_loop(not_converged, newton,
                                  (start, 2.0 * start + 1.0, jnp.int32(0)))
  return root


@jax.jit
def _nested(h):
  # Jitted on its own, so that the step's jaxpr holds a nested jit.
  return h + 0.5 * jnp.tanh(h)


def _control_flow(spec: StepSpec, h, inputs):
  if spec.cond:
    h = _cond(h, inputs)
  if spec.while_loop:
    h = h / _root_mean_square(jax.lax.stop_gradient(h)).astype(h.dtype)
  if spec.nested_jit:
    h = _nested(h)
  return h


def _dtypes(spec: StepSpec) -> tuple[Any, Any]:
  """(compute dtype, parameter dtype)."""
  return {"float32": (jnp.float32, jnp.float32),
          "bfloat16": (jnp.bfloat16, jnp.bfloat16),
          "mixed": (jnp.bfloat16, jnp.float32)}[spec.precision]


class _Block(nn.Module):
  """One layer of a linen family; `(carry, x) -> (carry, None)`, the shape
  nn.scan and lax.scan need."""
  spec: StepSpec

  @nn.compact
  def __call__(self, h, _=None):
    spec = self.spec
    dtype, param_dtype = _dtypes(spec)
    kinds = dict(dtype=dtype, param_dtype=param_dtype)
    if spec.family == "attention":
      attention = models.CausalSelfAttention(_HEADS, **kinds)
      h = h + attention(nn.LayerNorm(**kinds)(h))
      y = nn.Dense(2 * spec.width, **kinds)(nn.LayerNorm(**kinds)(h))
      y = nn.gelu(y)
      if spec.dropout:
        y = nn.Dropout(0.25, deterministic=False)(y)
      y = nn.Dense(spec.width, **kinds)(y)
      return (h + y if spec.residual else y), None
    if spec.family == "conv":
      # No bias before BatchNorm: its gradient is zero up to rounding.
      y = nn.Conv(spec.width, (3, 3), padding="SAME",
                  use_bias=not spec.batchnorm, **kinds)(h)
    else:
      y = nn.Dense(spec.width, use_bias=not spec.batchnorm, **kinds)(h)
    if spec.batchnorm:
      y = nn.BatchNorm(use_running_average=False, momentum=0.9,
                       epsilon=_BATCHNORM_EPSILON, **kinds)(y)
    y = nn.relu(y) if spec.family == "conv" else jnp.tanh(y)
    if spec.dropout:
      y = nn.Dropout(0.25, deterministic=False)(y)
    return (h + y if spec.residual else y), None


class _Stem(nn.Module):
  spec: StepSpec

  @nn.compact
  def __call__(self, inputs):
    spec = self.spec
    dtype, param_dtype = _dtypes(spec)
    if spec.family == "attention":
      seq = inputs.shape[1]
      positions = self.param("positions", nn.initializers.zeros,
                             (seq, spec.width), param_dtype)
      embedded = nn.Embed(_VOCAB, spec.width, dtype=dtype,
                          param_dtype=param_dtype)(inputs)
      return embedded + positions.astype(dtype)
    # No bias when a BatchNorm follows the first layer: its gradient would
    # be zero up to rounding, and a leaf of rounding noise differs wholly.
    kinds = dict(use_bias=not spec.batchnorm, dtype=dtype,
                 param_dtype=param_dtype)
    if spec.family == "conv":
      return nn.Conv(spec.width, (3, 3), padding="SAME", **kinds)(inputs)
    return nn.Dense(spec.width, **kinds)(inputs)


class _Head(nn.Module):
  spec: StepSpec

  @nn.compact
  def __call__(self, h):
    spec = self.spec
    dtype, param_dtype = _dtypes(spec)
    kinds = dict(dtype=dtype, param_dtype=param_dtype)
    if spec.family == "attention":
      return nn.Dense(_VOCAB, **kinds)(nn.LayerNorm(**kinds)(h))
    if spec.family == "conv":
      return nn.Dense(_CLASSES, **kinds)(jnp.mean(h, axis=(1, 2)))
    return nn.Dense(spec.width, **kinds)(h)


def _block_class(spec: StepSpec) -> type[nn.Module]:
  """`_Block`, or `_Block` under the user's own `nn.remat` with the drawn
  checkpoint policy (the parameters keep their names either way)."""
  if spec.remat == "none":
    return _Block
  policy = getattr(jax.checkpoint_policies, spec.remat)
  return nn.remat(_Block, policy=policy)


def _scanned_blocks(spec: StepSpec) -> nn.Module:
  return nn.scan(_block_class(spec),
                 variable_axes={"params": 0, "batch_stats": 0},
                 split_rngs={"params": True, "dropout": True},
                 length=spec.depth)(spec)


def _optimizer(spec: StepSpec) -> optax.GradientTransformation:
  # A large eps: Adam divides by sqrt(v) + eps, which turns a gradient
  # near zero into an update of about the learning rate whatever its
  # rounding (and bfloat16 rounds a small gradient by tens of percent).
  if spec.optimizer == "adam":
    return optax.adam(1e-2, eps=1e-1)
  if spec.optimizer == "adamw_clipped":
    # Clipping by the global norm reads every gradient before any update:
    # what most language-model recipes do.
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(1e-2, eps=1e-1, weight_decay=1e-2))
  if spec.optimizer == "adam_every_2":
    # Accumulation as optax does it: the gradients summed in the state and
    # Adam applied every second step, chosen by a `lax.cond` on a counter.
    return optax.MultiSteps(optax.adam(1e-2, eps=1e-1), every_k_schedule=2)
  return optax.sgd(1e-2, momentum=0.9)


def _batch(spec: StepSpec, rng: np.random.Generator) -> tuple:
  """The step's batch, concrete: (inputs, targets)."""
  dtype = jnp.float32 if spec.precision == "mixed" else _dtypes(spec)[0]
  if spec.family == "attention":
    tokens = rng.integers(0, _VOCAB, (spec.batch, 5), dtype=np.int32)
    return (jnp.asarray(tokens),)
  if spec.family == "conv":
    images = rng.standard_normal((spec.batch, 4, 4, 3), np.float32)
    labels = rng.integers(0, _CLASSES, (spec.batch,), dtype=np.int32)
    return jnp.asarray(images, dtype), jnp.asarray(labels)
  x = rng.standard_normal((spec.batch, spec.width), np.float32)
  y = rng.standard_normal((spec.batch, spec.width), np.float32)
  return jnp.asarray(x, dtype), jnp.asarray(y, dtype)


def _loss(spec: StepSpec, outputs, batch):
  outputs = outputs.astype(jnp.float32)
  if spec.family == "attention":
    return models.cross_entropy(outputs, batch[0][:, 1:])
  if spec.family == "conv":
    return models.cross_entropy(outputs, batch[1])
  return jnp.mean(jnp.square(outputs - batch[1].astype(jnp.float32)))


def _model_inputs(spec: StepSpec, batch):
  return batch[0][:, :-1] if spec.family == "attention" else batch[0]


def _filled(tree, seed: int):
  """Concrete leaves for the abstract `tree` (as `jax.eval_shape` gives):
  weights drawn with numpy (scaled by their fan-in), biases small, scales
  and variances one, means, counts and optimizer moments zero, PRNG keys
  from `seed`."""
  rng = np.random.default_rng(seed)

  def fill(path, leaf):
    name = jax.tree_util.keystr(path)
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
      return jax.random.key(seed)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
      return jnp.zeros(leaf.shape, leaf.dtype)
    if "kernel" in name or "embedding" in name:
      conv = len(leaf.shape) >= 4 and "Conv" in name
      fan_in = math.prod(leaf.shape[-4 if conv else -2:-1])
      values = rng.standard_normal(leaf.shape, np.float32) / math.sqrt(fan_in)
      return jnp.asarray(values, leaf.dtype)
    if "['opt" in name:  # optimizer state: moments start at zero
      return jnp.zeros(leaf.shape, leaf.dtype)
    if "scale" in name or "var" in name:
      return jnp.ones(leaf.shape, leaf.dtype)
    if "mean" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    # Biases and positions: small but not zero, so that Adam's first
    # update, about the learning rate whatever the gradient, is not all of
    # a leaf (bfloat16 rounding of a tiny gradient flips its sign).
    values = 0.1 * rng.standard_normal(leaf.shape, np.float32)
    return jnp.asarray(values, leaf.dtype)

  return jax.tree_util.tree_map_with_path(fill, tree)


# -- the linen families ------------------------------------------------------

def _linen_forward(spec: StepSpec, params, batch_stats, inputs, key):
  """Logits and the new BatchNorm statistics of the blocks."""
  h = _Stem(spec).apply({"params": params["stem"]}, inputs)
  rngs = {"dropout": key}
  block = _block_class(spec)(spec)

  def apply_block(block_params, block_stats, h, key):
    variables = {"params": block_params}
    if spec.batchnorm:
      variables["batch_stats"] = block_stats
    (h, _), updated = block.apply(variables, h, rngs={"dropout": key},
                                  mutable=["batch_stats"])
    return h, updated.get("batch_stats", {})

  if spec.layout == "loop":
    keys = jax.random.split(key, spec.depth)
    new_stats = []
    for i in range(spec.depth):
      h, stats = apply_block(params["blocks"][i], batch_stats[i], h, keys[i])
      new_stats.append(stats)
  elif spec.layout == "lax_scan":
    def layer(h, scanned):
      block_params, block_stats, key = scanned
      h, stats = apply_block(block_params, block_stats, h, key)
      return h, stats
    h, new_stats = jax.lax.scan(
        layer, h, (params["blocks"], batch_stats,
                   jax.random.split(key, spec.depth)))
  else:  # nn_scan
    variables = {"params": params["blocks"]}
    if spec.batchnorm:
      variables["batch_stats"] = batch_stats
    (h, _), updated = _scanned_blocks(spec).apply(
        variables, h, None, rngs=rngs, mutable=["batch_stats"])
    new_stats = updated.get("batch_stats", {})
  h = _control_flow(spec, h, inputs)
  return _Head(spec).apply({"params": params["head"]}, h), new_stats


def _linen_state(spec: StepSpec, batch) -> dict:
  """The abstract state: parameters, BatchNorm statistics, optimizer state
  and the dropout key."""
  inputs = _model_inputs(spec, batch)

  def init():
    key = jax.random.key(0)
    stem = _Stem(spec).init(key, inputs)["params"]
    h = _Stem(spec).apply({"params": stem}, inputs)
    block = _Block(spec).init(key, h)
    if spec.layout == "loop":
      blocks = [block["params"]] * spec.depth
      stats = [block.get("batch_stats", {})] * spec.depth
    elif spec.layout == "lax_scan":
      stack = lambda tree: jax.tree.map(
          lambda x: jnp.stack([x] * spec.depth), tree)
      blocks, stats = stack(block["params"]), stack(block.get("batch_stats",
                                                             {}))
    else:
      scanned = _scanned_blocks(spec).init(key, h, None)
      blocks, stats = scanned["params"], scanned.get("batch_stats", {})
    head = _Head(spec).init(key, h)["params"]
    params = {"stem": stem, "blocks": blocks, "head": head}
    return {"params": params, "batch_stats": stats,
            "opt": _optimizer(spec).init(params), "key": key}

  return jax.eval_shape(init)


def _gradients(spec: StepSpec, params, batch_stats, batch, key):
  """(loss, new BatchNorm statistics, gradients) of `batch`: at once, or as
  users accumulate them when a batch does not fit, microbatch by
  microbatch, the statistics carried from one to the next and the sums
  divided by the number of microbatches."""

  def of_one(batch_stats, batch, key):
    def loss_fn(params):
      logits, stats = _linen_forward(spec, params, batch_stats,
                                     _model_inputs(spec, batch), key)
      return _loss(spec, logits, batch), stats
    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return loss, stats, grads

  if spec.accumulate == "none":
    return of_one(batch_stats, batch, key)
  microbatches = jax.tree.map(
      lambda x: x.reshape(_MICROBATCHES, x.shape[0] // _MICROBATCHES,
                          *x.shape[1:]), batch)
  keys = jax.random.split(key, _MICROBATCHES)

  def accumulate(carry, microbatch_and_key):
    loss_sum, stats, grad_sum = carry
    loss, stats, grads = of_one(stats, *microbatch_and_key)
    return (loss_sum + loss, stats,
            jax.tree.map(jnp.add, grad_sum, grads)), None

  carry = (jnp.float32(0), batch_stats, jax.tree.map(jnp.zeros_like, params))
  if spec.accumulate == "scan":
    carry, _ = jax.lax.scan(accumulate, carry, (microbatches, keys))
  else:
    for i in range(_MICROBATCHES):
      carry, _ = accumulate(
          carry, (jax.tree.map(lambda x: x[i], microbatches), keys[i]))
  loss_sum, stats, grad_sum = carry
  return (loss_sum / _MICROBATCHES, stats,
          jax.tree.map(lambda g: g / _MICROBATCHES, grad_sum))


def _build_linen(spec: StepSpec) -> DrawnStep:
  tx = _optimizer(spec)

  def step(state, *batch_and_scale, **kwargs):
    if spec.static == "argname":
      batch, scale = batch_and_scale, kwargs["scale"]
    elif spec.static == "argnum":
      batch, scale = batch_and_scale[:-1], batch_and_scale[-1]
    else:
      batch, scale = batch_and_scale, 1.0
    key, dropout_key = jax.random.split(state["key"])
    loss, stats, grads = _gradients(spec, state["params"],
                                    state["batch_stats"], batch, dropout_key)
    updates, opt = tx.update(grads, state["opt"], state["params"])
    updates = jax.tree.map(lambda u: u * scale, updates)
    params = optax.apply_updates(state["params"], updates)
    new_state = {"params": params, "batch_stats": stats, "opt": opt,
                 "key": key}
    return new_state, loss

  batch_size = len(_batch(spec, np.random.default_rng(0)))
  jit_options: dict = {}
  if spec.static == "argnum":
    jit_options["static_argnums"] = 1 + batch_size
  elif spec.static == "argname":
    jit_options["static_argnames"] = "scale"
  if spec.donate:
    jit_options["donate_argnums"] = 0
  seed = _seed(spec)

  @functools.cache
  def abstract_state():
    return _linen_state(spec, _batch(spec, np.random.default_rng(seed)))

  def make_args():
    batch = _batch(spec, np.random.default_rng(seed))
    state = _filled(abstract_state(), seed)
    args = (state, *batch) + ((0.5,) if spec.static == "argnum" else ())
    kwargs = {"scale": 0.5} if spec.static == "argname" else {}
    return args, kwargs

  return DrawnStep(
      spec, step, jit_options, make_args, 0, lambda outputs: outputs[0],
      lambda **options: jlms.offload(step, **jit_options, **options))


# -- the NNX family ----------------------------------------------------------

class _NnxNet(nnx.Module):
  def __init__(self, spec: StepSpec, rngs: nnx.Rngs):
    dtype, param_dtype = _dtypes(spec)
    kinds = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.spec = spec
    self.stem = nnx.Linear(spec.width, spec.width,
                           use_bias=not spec.batchnorm, **kinds)
    self.layers = nnx.List([
        nnx.Linear(spec.width, spec.width, use_bias=not spec.batchnorm,
                   **kinds) for _ in range(spec.depth)])
    self.norms = nnx.List([nnx.BatchNorm(spec.width, momentum=0.9,
                                         epsilon=_BATCHNORM_EPSILON, **kinds)
                           for _ in range(spec.depth if spec.batchnorm
                                          else 0)])
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.head = nnx.Linear(spec.width, spec.width, **kinds)

  def __call__(self, x):
    spec = self.spec
    h = self.stem(x)
    for i, layer in enumerate(self.layers):
      y = layer(h)
      if spec.batchnorm:
        y = self.norms[i](y)
      y = jnp.tanh(y)
      if spec.dropout:
        y = self.dropout(y)
      h = h + y if spec.residual else y
    return self.head(_control_flow(spec, h, x))


def _build_nnx(spec: StepSpec) -> DrawnStep:
  def nnx_step(model, optimizer, x, y):
    def loss_fn(model):
      return _loss(spec, model(x), (x, y))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  def pure(graphdef, state, *batch):
    # What jlms.offload_nnx runs, as nnx.jit does: objects merged from the
    # state, the state they end in returned.
    nodes = nnx.merge(graphdef, state)
    return nnx_step(*nodes, *batch), nnx.state(nodes)

  def create():
    model = _NnxNet(spec, nnx.Rngs(0, dropout=1))
    return model, nnx.Optimizer(model, _optimizer(spec), wrt=nnx.Param)

  seed = _seed(spec)

  @functools.cache
  def split():
    return nnx.split(nnx.eval_shape(create))

  def make_args():
    graphdef, abstract = split()
    batch = _batch(spec, np.random.default_rng(seed))
    return (graphdef, _filled(abstract, seed), *batch), {}

  def offload(**options):
    return jlms.offload_nnx(nnx_step, **options).offloaded

  return DrawnStep(spec, pure, dict(static_argnums=0, donate_argnums=1),
                   make_args, 1, lambda outputs: outputs[1], offload)


@functools.lru_cache(maxsize=64)
def build(spec: StepSpec) -> DrawnStep:
  """The `DrawnStep` of `spec` (one per spec, so that what is computed
  from it can be shared)."""
  return _build_nnx(spec) if spec.family == "nnx" else _build_linen(spec)
