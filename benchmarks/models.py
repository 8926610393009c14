"""The model registry: every train step that jlms's tests, benchmarks and
demo build, each family of network defined once.

Why one module: the same GPT decoder and residual CNN used to be written in
three places (here, `frontier_cases.py`, `zoo.py`), each with its own sizes
and host-link figure, and tests imported the benchmarks' private pieces.
This module is the one the others import: `benchmarks/frontier_cases.py`
and `benchmarks/zoo.py` only pick sizes and names from it (the `jlms plan
benchmarks.zoo:gpt_case` command line keeps working), and `jlms_tests`
import it, not a benchmark's private names. It stays `benchmarks.models`
because that is the name the tests, the documentation and
`jlms plan benchmarks.models:mlp_case` already use.

Families: a tanh MLP (unrolled, `mlp_case`, or under `jax.lax.scan`,
`scan_mlp_case`); a residual CNN at full resolution (`resnet_case`); a GPT
decoder, unrolled or under `nn.scan`, in any compute dtype (`gpt_case`; the
zoo's GPT-2-sized builder `zoo_gpt_case`; `CausalSelfAttention` for steps
built elsewhere); control flow (`control_flow_case`); a very long jaxpr
(`many_equations_case`); attention written head by head
(`per_head_attention_case`); and the well-known networks of the zoo
(`ZOO`: ResNet-50, DenseNet-121, MobileNetV2, Inception-v3, a 3D U-Net and
the GPT).

Every factory returns a `StepCase`. What holds for each case:

- `step` is a pure train step: it closes over no mutable state, so
  `jax.jit(step)` and `jax.make_jaxpr(step)` work on it; it returns
  `(new_state, loss)` where both are pytrees of arrays.
- `make_args()` builds concrete inputs (state and a synthetic batch) from a
  fixed PRNG seed, so two calls return equal arrays.
- `abstract_args()` is `jax.eval_shape(make_args)`: the same pytree structure,
  shapes and dtypes, as `jax.ShapeDtypeStruct`s, with nothing allocated. That
  is what lets a case with many GiB of activations be described, traced and
  compiled on a laptop.

All sizes are factory arguments; the defaults are the sizes the benchmarks
use. Byte counts are in `GIB` and `MIB`; a GPU's host link is
`host_link(target)`, jlms's own time-model figure, so that a benchmark's
transfer times use the number the planner plans with.

Parameter names: `named=True` gives each repeated unit and layer an explicit
name ("block3", "ln_attention"), so that a `remat` twin takes the same
parameters; without it Flax numbers them ("_ResidualBlock_3",
"LayerNorm_0"). The names order the flattened parameters, and with them the
step's arguments and the planner's ties, so each benchmark keeps the scheme
its committed results were planned with.

`remat` (one of `REMAT_MODES`) chooses how the repeated unit (a residual or
bottleneck block, a dense layer, an inverted residual, an Inception block, a
U-Net double convolution, a decoder layer) is differentiated:

- None: plainly; every activation the backward pass reads stays on device.
- "nothing_saveable": each unit is `nn.remat` with
  `jax.checkpoint_policies.nothing_saveable`, so only its inputs are kept
  and everything inside is recomputed in the backward pass.
- "offload": each unit is `nn.remat` with
  `save_and_offload_only_these_names` (nothing saved, the name
  `BOUNDARY_NAME` offloaded from "device" to "pinned_host"), as MaxText
  does. The tagged value is each unit's input, i.e. the previous unit's
  output as this unit reads it: what a rematerialised unit keeps for its
  backward pass is what its recomputation reads, and that is its input. A
  tag on a unit's own output would name a value that no recomputation reads
  and would move nothing. (Measured with jax 0.10.2 for an H100: in the
  unrolled CNNs XLA schedules each copy to host right before the copy back,
  so the inputs stay on the device; inside the GPT's scan they do move.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jlms import _cost

_SEED = 0
_SGD_LEARNING_RATE = 1e-2

GIB = 1 << 30
MIB = 1 << 20

#: TFLMS's rules with the knobs jlms used by default before budgets became
#: the default: the benchmarks and tests of those rules pass them.
TFLMS_KNOBS = dict(min_bytes=1 << 20, swapout_threshold=20)

REMAT_MODES = (None, "nothing_saveable", "offload")
BOUNDARY_NAME = "block_input"


def host_link(target: str) -> tuple[str, float]:
    """(name, achieved bytes per second each way) of the host link of the GPU
    `target` ("h100", "h200", "a100"): the figure jlms's time model plans
    with, not a second one."""
    gpu = _cost.TARGETS[target]
    return gpu.link, gpu.link_bytes_per_s


def cross_entropy(logits, labels):
    """Mean softmax cross-entropy against integer labels, through a one-hot
    product: optax's integer-label form gathers (and its gradient scatters)
    along the class axis, which JAX 0.11+ refuses under explicit sharding
    ("ShardingTypeError ... scatter")."""
    one_hot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return optax.softmax_cross_entropy(logits, one_hot).mean()


@dataclasses.dataclass(frozen=True)
class StepCase:
    """A train step together with builders of its concrete and abstract inputs."""

    name: str
    step: Callable
    make_args: Callable[[], tuple]
    abstract_args: Callable[[], tuple]


def step_case(name: str, step: Callable, make_args: Callable[[], tuple]) -> StepCase:
    """A `StepCase` whose abstract inputs are `jax.eval_shape(make_args)`."""
    # Deriving the abstract inputs from make_args itself keeps the two in
    # agreement by construction rather than by a second hand-written spec.
    return StepCase(name, step, make_args, functools.partial(jax.eval_shape, make_args))


def count_equations(case: StepCase) -> int:
    """Number of top-level equations in the jaxpr of `case.step`, traced abstractly."""
    return len(jax.make_jaxpr(case.step)(*case.abstract_args()).jaxpr.eqns)


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - _SGD_LEARNING_RATE * g, params, grads)


def _remat_suffix(remat: str | None) -> str:
    return "" if remat is None else f"-{remat}"


def _named(module: nn.Module, explicit: str, numbered: str | None = None) -> str | None:
    """The name of a submodule or parameter of `module`: `explicit` where the
    module names its parts, else `numbered` (None: Flax numbers it)."""
    return explicit if module.named else numbered


# --- rematerialisation of the repeated unit ----------------------------------


def _with_tagged_input(unit: type[nn.Module]) -> type[nn.Module]:
    """A subclass of `unit` whose first call argument (any pytree) carries the
    checkpoint name `BOUNDARY_NAME`."""

    class Tagged(unit):
        def __call__(self, inputs, *rest):
            tagged = jax.tree.map(lambda x: checkpoint_name(x, BOUNDARY_NAME), inputs)
            return super().__call__(tagged, *rest)

    Tagged.__name__ = Tagged.__qualname__ = unit.__name__
    return Tagged


def rematerialised(unit: type[nn.Module], remat: str | None, *, scanned: bool = False):
    """`unit` as differentiated under `remat` (one of `REMAT_MODES`).

    `scanned` units sit inside `nn.scan`, whose loop already keeps XLA from
    merging a recomputation with the forward pass, so the extra barriers of
    `prevent_cse` are dropped there (as MaxText does).
    """
    if remat is None:
        return unit
    if remat == "nothing_saveable":
        policy = jax.checkpoint_policies.nothing_saveable
    elif remat == "offload":
        policy = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[BOUNDARY_NAME],
            offload_src="device",
            offload_dst="pinned_host",
        )
        unit = _with_tagged_input(unit)
    else:
        raise ValueError(f"remat must be one of {REMAT_MODES}, got {remat!r}")
    return nn.remat(unit, policy=policy, prevent_cse=not scanned)


# --- 1. Deep tanh MLP, plain jax, SGD -------------------------------------------


def _init_mlp(key, depth, width, dtype):
    keys = jax.random.split(key, depth)
    # 1/sqrt(width) keeps tanh activations out of saturation at any depth.
    scale = 1.0 / math.sqrt(width)
    return [
        (
            (scale * jax.random.normal(k, (width, width))).astype(dtype),
            jnp.zeros((width,), dtype),
        )
        for k in keys
    ]


def _mlp_loss(params, x, y):
    h = x
    for w, b in params[:-1]:
        h = jnp.tanh(h @ w + b)
    w, b = params[-1]
    prediction = h @ w + b
    # Accumulate in float32 so a bfloat16 case still reports a meaningful loss.
    return jnp.mean(jnp.square(prediction - y).astype(jnp.float32))


def mlp_case(depth=32, width=2048, batch=4096, dtype=jnp.float32) -> StepCase:
    """A `depth`-layer tanh MLP of constant `width`, MSE loss, plain SGD.

    Step: `step(params, x, y) -> (new_params, loss)`, params a list of (w, b).
    """

    def step(params, x, y):
        loss, grads = jax.value_and_grad(_mlp_loss)(params, x, y)
        return _sgd(params, grads), loss

    def make_args():
        params_key, x_key, y_key = jax.random.split(jax.random.key(_SEED), 3)
        params = _init_mlp(params_key, depth, width, dtype)
        x = jax.random.normal(x_key, (batch, width)).astype(dtype)
        y = jax.random.normal(y_key, (batch, width)).astype(dtype)
        return params, x, y

    dtype_name = jnp.dtype(dtype).name
    return step_case(f"mlp-d{depth}-w{width}-b{batch}-{dtype_name}", step, make_args)




def dp_sgd_mlp_case(depth=3, width=1024, batch=64, clip=1.0) -> StepCase:
    """A tanh MLP trained by DP-SGD: per-example gradients
    (`vmap(grad)`), each clipped to norm `clip`, averaged, plain SGD (no
    noise: a deterministic step). Each weight's per-example gradients are
    `batch` outer products, `batch * width**2` floats.

    Step: `step(params, x, y) -> (new_params, loss)`.
    """

    def per_example_loss(params, x, y):
        return _mlp_loss(params, x[None], y[None])

    def step(params, x, y):
        grads = jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0, 0))(params, x, y)
        norms = jnp.sqrt(sum(jnp.sum(g.reshape(batch, -1) ** 2, axis=1)
                             for g in jax.tree.leaves(grads)))
        scale = jnp.minimum(1.0, clip / (norms + 1e-6))
        mean = jax.tree.map(lambda g: jnp.tensordot(scale, g, 1) / batch, grads)
        return _sgd(params, mean), _mlp_loss(params, x, y)

    def make_args():
        params_key, x_key, y_key = jax.random.split(jax.random.key(_SEED), 3)
        params = _init_mlp(params_key, depth, width, jnp.float32)
        x = jax.random.normal(x_key, (batch, width))
        y = jax.random.normal(y_key, (batch, width))
        return params, x, y

    return step_case(f"dp-sgd-mlp-d{depth}-w{width}-b{batch}", step, make_args)


def _scanned_layer(h, layer):
    w, b = layer
    return jnp.tanh(h @ w + b), None


def scan_mlp_case(layers=16, width=2048, batch=4096, dtype=jnp.float32, optimizer=None,
                  remat=None) -> StepCase:
    """`layers` layers h <- tanh(h @ w_i + b_i) run by one `jax.lax.scan` over
    weights stacked along a leading axis; MSE against a random target.
    Plain SGD (learning rate 1e-2) unless an optax `optimizer` is given;
    `remat="nothing_saveable"` recomputes each layer in the backward pass.

    Step: `step(params, x, y) -> (new_params, loss)` without an optimizer,
    `step(params, opt_state, x, y) -> ((params, opt_state), loss)` with one;
    params `{"w": [layers, width, width], "b": [layers, width]}`.
    """
    layer = _scanned_layer
    if remat == "nothing_saveable":
        # Inside the scan the loop keeps XLA from merging the recomputation
        # with the forward pass, so CSE need not be blocked.
        layer = jax.checkpoint(_scanned_layer, policy=jax.checkpoint_policies.nothing_saveable,
                               prevent_cse=False)
    elif remat is not None:
        raise ValueError(f"scan_mlp_case takes remat None or 'nothing_saveable', got {remat!r}")

    def loss_fn(params, x, y):
        h, _ = jax.lax.scan(layer, x, (params["w"], params["b"]))
        return jnp.mean(jnp.square(h - y).astype(jnp.float32))

    def init(key):
        params_key, x_key, y_key = jax.random.split(key, 3)
        # 1/sqrt(width) keeps tanh out of saturation at any depth.
        w = jax.random.normal(params_key, (layers, width, width)) / math.sqrt(width)
        params = {"w": w.astype(dtype), "b": jnp.zeros((layers, width), dtype)}
        x = jax.random.normal(x_key, (batch, width)).astype(dtype)
        y = jax.random.normal(y_key, (batch, width)).astype(dtype)
        return params, x, y

    if optimizer is None:
        def step(params, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            return _sgd(params, grads), loss

        def make_args():
            return init(jax.random.key(_SEED))
    else:
        def step(params, opt_state, x, y):
            loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        def make_args():
            params, x, y = init(jax.random.key(_SEED))
            return params, optimizer.init(params), x, y

    name = (f"scan_mlp-l{layers}-w{width}-b{batch}-{jnp.dtype(dtype).name}"
            f"{'' if optimizer is None else '-optax'}{_remat_suffix(remat)}")
    return step_case(name, step, make_args)


# --- 2. Residual CNN at full resolution, Flax, BatchNorm, Adam ------------------


class _ResidualBlock(nn.Module):
    channels: int

    @nn.compact
    def __call__(self, x):
        h = nn.Conv(self.channels, (3, 3), padding="SAME", use_bias=False)(x)
        h = nn.BatchNorm(use_running_average=False, momentum=0.9)(h)
        h = nn.relu(h)
        h = nn.Conv(self.channels, (3, 3), padding="SAME", use_bias=False)(h)
        h = nn.BatchNorm(use_running_average=False, momentum=0.9)(h)
        return nn.relu(h + x)


class _FlatResNet(nn.Module):
    blocks: int
    channels: int
    num_classes: int
    remat: str | None = None
    named: bool = False

    @nn.compact
    def __call__(self, images):
        block = rematerialised(_ResidualBlock, self.remat)
        h = nn.Conv(self.channels, (3, 3), padding="SAME", name=_named(self, "stem"))(images)
        for index in range(self.blocks):
            h = block(self.channels, name=_named(self, f"block{index}"))(h)
        pooled = jnp.mean(h, axis=(1, 2))
        return nn.Dense(self.num_classes, name=_named(self, "head"))(pooled)


def resnet_case(
    blocks=16, channels=64, image_size=256, batch=8, num_classes=10, optimizer=None,
    remat=None, named=False,
) -> StepCase:
    """A residual CNN that never downsamples, so every block's activations are
    full size, trained with `optimizer` (default Adam, learning rate 1e-3).
    Each block is conv-BN-relu, conv-BN, plus its input, relu.

    Step: `step(params, batch_stats, opt_state, images, labels)
    -> ((params, batch_stats, opt_state), loss)`; images NHWC float32.
    """
    model = _FlatResNet(blocks, channels, num_classes, remat, named)
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer

    def loss_fn(params, batch_stats, images, labels):
        logits, updated = model.apply(
            {"params": params, "batch_stats": batch_stats}, images, mutable=["batch_stats"]
        )
        loss = cross_entropy(logits, labels)
        return loss, updated["batch_stats"]

    def step(params, batch_stats, opt_state, images, labels):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, images, labels
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, batch_stats, opt_state), loss

    def make_args():
        init_key, image_key, label_key = jax.random.split(jax.random.key(_SEED), 3)
        # Parameter shapes do not depend on the image size (global pooling), so
        # a tiny image keeps the eager init forward pass cheap at any size.
        variables = model.init(init_key, jnp.zeros((1, 8, 8, 3), jnp.float32))
        params, batch_stats = variables["params"], variables["batch_stats"]
        images = jax.random.normal(image_key, (batch, image_size, image_size, 3))
        labels = jax.random.randint(label_key, (batch,), 0, num_classes, jnp.int32)
        return params, batch_stats, optimizer.init(params), images, labels

    name = f"resnet-n{blocks}-c{channels}-i{image_size}-b{batch}{_remat_suffix(remat)}"
    return step_case(name, step, make_args)


# --- 3. GPT-style decoder, Flax, AdamW, optionally scanned over layers ----------


class _CausalSelfAttention(nn.Module):
    heads: int
    dtype: Any = None  # of activations and matmuls; None: Flax's promotion
    param_dtype: Any = jnp.float32
    named: bool = False

    @nn.compact
    def __call__(self, x):
        batch, seq, width = x.shape
        head_dim = width // self.heads
        kinds = dict(dtype=self.dtype, param_dtype=self.param_dtype)
        # No bias: a key bias has an exactly-zero gradient (softmax ignores
        # it), which Adam would turn into an update made of rounding noise.
        qkv = nn.Dense(3 * width, use_bias=False, name=_named(self, "qkv"), **kinds)(x)
        qkv = qkv.reshape(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        # A given compute dtype divides by a constant of its own; Flax's
        # promotion by a weakly typed Python float.
        scale = math.sqrt(head_dim)
        if self.dtype is not None:
            scale = jnp.asarray(scale, self.dtype)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / scale
        causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
        # The dtype's most negative value, not -inf: a fully masked row stays finite.
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        # Softmax in the compute dtype, as Flax's own attention does by default.
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, width)
        return nn.Dense(width, name=_named(self, "out"), **kinds)(attended)


#: Multi-head causal self-attention without masking beyond causality, as the
#: GPT decoder uses it (`heads`, compute `dtype`, `param_dtype`). The class
#: keeps its underscore: Flax numbers an unnamed submodule after its class
#: ("_CausalSelfAttention_0"), and that name orders the decoder's parameters.
CausalSelfAttention = _CausalSelfAttention


class _DecoderBlock(nn.Module):
    width: int
    heads: int
    dtype: Any = None
    named: bool = False

    @nn.compact
    def __call__(self, h, _unused=None):
        # The (carry, x) -> (carry, y) shape is what nn.scan requires.
        normed = nn.LayerNorm(dtype=self.dtype, name=_named(self, "ln_attention"))(h)
        attention = _CausalSelfAttention(self.heads, self.dtype, named=self.named,
                                         name=_named(self, "attention"))
        h = h + attention(normed)
        normed = nn.LayerNorm(dtype=self.dtype, name=_named(self, "ln_mlp"))(h)
        hidden = nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype, name=_named(self, "up"))(normed))
        h = h + nn.Dense(self.width, dtype=self.dtype, name=_named(self, "down"))(hidden)
        return h, None


class _GPT(nn.Module):
    layers: int
    width: int
    heads: int
    seq: int
    vocab: int
    scan_layers: bool
    dtype: Any = None
    remat: str | None = None
    named: bool = False

    @nn.compact
    def __call__(self, tokens):
        token_embedding = nn.Embed(self.vocab, self.width, dtype=self.dtype,
                                   name=_named(self, "embed"))
        positions = self.param(
            _named(self, "positions", "position_embedding"), nn.initializers.normal(0.02),
            (self.seq, self.width)
        )
        h = token_embedding(tokens)
        positions = positions[: tokens.shape[1]]
        h = h + (positions if self.dtype is None else positions.astype(self.dtype))
        block = rematerialised(_DecoderBlock, self.remat, scanned=self.scan_layers)
        if self.scan_layers:
            blocks = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            h, _ = blocks(self.width, self.heads, self.dtype, self.named,
                          name=_named(self, "layers", "blocks"))(h, None)
        else:
            for index in range(self.layers):
                h, _ = block(self.width, self.heads, self.dtype, self.named,
                             name=_named(self, f"layer{index}"))(h)
        h = nn.LayerNorm(dtype=self.dtype, name=_named(self, "ln_final"))(h)
        # Tied output projection: logits against the token embedding table.
        return token_embedding.attend(h)


def _language_model_step(model: nn.Module, optimizer, loss):
    """`step(params, opt_state, tokens) -> ((params, opt_state), loss)` of
    next-token prediction; `loss(logits, tokens)` compares the logits with
    `tokens[:, 1:]`."""

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return loss(logits, tokens)

    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), value

    return step


def gpt_case(
    layers=4, width=256, heads=4, seq=128, batch=4, vocab=1024, scan_layers=False,
    optimizer=None, compute_dtype=None, remat=None, named=False,
) -> StepCase:
    """A pre-LayerNorm GPT decoder with next-token cross-entropy (in float32),
    trained with `optimizer` (default AdamW, learning rate 1e-3).

    Activations and matmuls run in `compute_dtype` (None: float32 by Flax's
    promotion, and the name says no dtype); parameters and the optimizer
    state are float32 whatever it is.

    Step: `step(params, opt_state, tokens) -> ((params, opt_state), loss)`;
    tokens int32 [batch, seq + 1]. With `scan_layers` the blocks are one
    `nn.scan` and their params carry a leading axis of length `layers`.
    """
    if width % heads:
        raise ValueError(f"width {width} is not divisible by heads {heads}")
    dtype = None if compute_dtype is None else jnp.dtype(compute_dtype)
    model = _GPT(layers, width, heads, seq, vocab, scan_layers, dtype, remat, named)
    optimizer = optax.adamw(1e-3) if optimizer is None else optimizer

    def loss(logits, tokens):
        if dtype is not None:
            logits = logits.astype(jnp.float32)
        return cross_entropy(logits, tokens[:, 1:])

    def make_args():
        init_key, token_key = jax.random.split(jax.random.key(_SEED))
        # Parameter shapes do not depend on the batch, so one sequence suffices.
        params = model.init(init_key, jnp.zeros((1, seq), jnp.int32))["params"]
        tokens = jax.random.randint(token_key, (batch, seq + 1), 0, vocab, jnp.int32)
        return params, optimizer.init(params), tokens

    layout = "scan" if scan_layers else "unrolled"
    name = f"gpt-{layout}-l{layers}-w{width}-h{heads}-s{seq}-b{batch}-v{vocab}"
    if dtype is not None:
        name += f"-{dtype.name}"
    name += _remat_suffix(remat)
    return step_case(name, _language_model_step(model, optimizer, loss), make_args)


# --- 4. Control flow: scan, cond, while, checkpoint, custom_vjp, nested jit ----

_CONTROL_FLOW_SCANNED_LAYERS = 3


@jax.custom_vjp
def _softplus(x):
    return jnp.logaddexp(x, 0.0)


def _softplus_forward(x):
    # The input is the residual: it is an activation the backward pass needs.
    return _softplus(x), x


def _softplus_backward(x, cotangent):
    return (cotangent * jax.nn.sigmoid(x),)


_softplus.defvjp(_softplus_forward, _softplus_backward)


@jax.jit
def _project(w, h):
    # Jitted on its own so the step's jaxpr holds a nested jit equation.
    return h @ w


def _root_mean_square_by_newton(values):
    """sqrt(mean(values**2)) by Newton's method: a data-dependent while_loop."""
    mean_square = jnp.mean(jnp.square(values)) + 1e-6

    def not_converged(state):
        root, previous, iteration = state
        return (jnp.abs(root - previous) > 1e-6 * root) & (iteration < 64)

    def newton_update(state):
        root, _, iteration = state
        return 0.5 * (root + mean_square / root), root, iteration + 1

    start = jnp.maximum(mean_square, 1.0)
    root, _, _ = jax.lax.while_loop(
        not_converged, newton_update, (start, 2.0 * start + 1.0, jnp.int32(0))
    )
    return root


def _control_flow_loss(params, x, y):
    def scanned_layer(h, layer):
        return jnp.tanh(h @ layer["w"] + layer["b"]), None

    h, _ = jax.lax.scan(scanned_layer, x, params["scanned"])

    @jax.checkpoint
    def rematerialised_layer(layer, h):
        return jnp.tanh(h @ layer["w"] + layer["b"])

    h = rematerialised_layer(params["checkpointed"], h)
    # Which branch runs depends on the data, so neither can be specialised away.
    h = jax.lax.cond(
        jnp.mean(h) > 0.0,
        lambda h: _softplus(h @ params["positive_branch"]),
        lambda h: jnp.sin(h @ params["negative_branch"]),
        h,
    )
    # Used again outside the cond so the step has a custom_vjp at top level too.
    prediction = _project(params["head"], _softplus(h))
    # The scale is a constant to differentiation: while_loop has no reverse rule.
    scale = _root_mean_square_by_newton(jax.lax.stop_gradient(prediction))
    return jnp.mean(jnp.square(prediction / scale - y))


def control_flow_case(width=256, batch=64) -> StepCase:
    """An SGD step whose loss uses scan, cond, while_loop, checkpoint, custom_vjp and jit.

    Step: `step(params, x, y) -> (new_params, loss)`.
    """

    def step(params, x, y):
        loss, grads = jax.value_and_grad(_control_flow_loss)(params, x, y)
        return _sgd(params, grads), loss

    def make_args():
        keys = iter(jax.random.split(jax.random.key(_SEED), 8))
        scale = 1.0 / math.sqrt(width)

        def matrix(*leading):
            return scale * jax.random.normal(next(keys), (*leading, width, width))

        params = {
            "scanned": {
                "w": matrix(_CONTROL_FLOW_SCANNED_LAYERS),
                "b": jnp.zeros((_CONTROL_FLOW_SCANNED_LAYERS, width)),
            },
            "checkpointed": {"w": matrix(), "b": jnp.zeros((width,))},
            "positive_branch": matrix(),
            "negative_branch": matrix(),
            "head": matrix(),
        }
        x = jax.random.normal(next(keys), (batch, width))
        y = jax.random.normal(next(keys), (batch, width))
        return params, x, y

    return step_case(f"control_flow-w{width}-b{batch}", step, make_args)


# --- 5. A step with a very long jaxpr, for pass-scaling tests -------------------


def _many_ops_layer(h, w, b):
    # Several cheap elementwise ops per layer: equations multiply, FLOPs do not.
    z = h @ w + b
    return h + 0.1 * jnp.tanh(z) * jnp.cos(z) - 0.01 * jnp.square(z)


def _many_equations_loss(params, x):
    h = x
    for w, b in params:
        h = _many_ops_layer(h, w, b)
    return jnp.mean(jnp.square(h))


def many_equations_case(layers=450, width=8, batch=4) -> StepCase:
    """An unrolled tiny residual MLP whose step jaxpr has >= 15,000 top-level equations.

    Arrays are tiny so that tracing and jaxpr passes, not arithmetic, dominate.
    Step: `step(params, x) -> (new_params, loss)`.
    """

    def step(params, x):
        loss, grads = jax.value_and_grad(_many_equations_loss)(params, x)
        return _sgd(params, grads), loss

    def make_args():
        params_key, x_key = jax.random.split(jax.random.key(_SEED))
        params = _init_mlp(params_key, layers, width, jnp.float32)
        x = jax.random.normal(x_key, (batch, width))
        return params, x

    return step_case(f"many_equations-l{layers}-w{width}-b{batch}", step, make_args)


# --- 6. Attention written head by head (the serialization case) ---------------


def _per_head_attention(x, wq, wk, wv):
    heads = []
    for h in range(wq.shape[0]):
        q, k, v = x @ wq[h], x @ wk[h], x @ wv[h]
        scores = q @ jnp.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
        heads.append(jax.nn.softmax(scores, axis=-1) @ v)
    return jnp.concatenate(heads, -1)


def per_head_attention_case(layers=2, heads=8, width=512, seq=2048, batch=4) -> StepCase:
    """Residual self-attention layers whose heads are separate matmuls (as
    code written head by head is): many independent large products that
    XLA may keep resident together. SGD step; float32.

    Step: `step(params, x) -> (params, loss)`; x [batch, seq, width].
    """
    head_dim = width // heads

    def loss_fn(params, x):
        for wq, wk, wv in params:
            x = x + _per_head_attention(x, wq, wk, wv)
        return jnp.mean(x**2)

    def step(params, x):
        loss, grads = jax.value_and_grad(loss_fn)(params, x)
        return _sgd(params, grads), loss

    def make_args():
        keys = iter(jax.random.split(jax.random.key(_SEED), 3 * layers + 1))
        scale = 1 / math.sqrt(width)
        params = [
            tuple(jax.random.normal(next(keys), (heads, width, head_dim)) * scale for _ in range(3))
            for _ in range(layers)
        ]
        return params, jax.random.normal(next(keys), (batch, seq, width))

    return step_case(f"per-head-attention-l{layers}-h{heads}-w{width}-s{seq}-b{batch}", step, make_args)


#: Small copies of the families for tests, by name: each traces and
#: compiles in seconds on a CPU. The GPTs train with plain momentum SGD:
#: Adam divides by sqrt(v) + eps, which turns gradients that are zero up to
#: float32 rounding (e.g. of LayerNorm biases feeding a softmax) into
#: updates made of rounding noise.
SMALL_CASES = {
    "mlp": lambda: mlp_case(depth=6, width=128, batch=64),
    "resnet_bn_adam": lambda: resnet_case(blocks=2, channels=16, image_size=32, batch=4),
    "gpt": lambda: gpt_case(layers=2, width=64, heads=2, seq=32, batch=2, vocab=128,
                            optimizer=optax.sgd(1e-2, momentum=0.9)),
    "gpt_scan": lambda: gpt_case(layers=3, width=64, heads=2, seq=32, batch=2, vocab=128,
                                 scan_layers=True, optimizer=optax.sgd(1e-2, momentum=0.9)),
    "control_flow": lambda: control_flow_case(width=64, batch=16),
}


# --- 7. The zoo: ResNet-50, DenseNet-121, MobileNetV2, Inception-v3, 3D U-Net ---

_ZOO_SGD_LEARNING_RATE = 0.1
_SGD_MOMENTUM = 0.9
_ADAM_LEARNING_RATE = 1e-3
_UNET_LEARNING_RATE = 1e-2
_UNET_MOMENTUM = 0.99
_BATCH_NORM_MOMENTUM = 0.9

# Shared layers.


def _batch_norm():
    return nn.BatchNorm(use_running_average=False, momentum=_BATCH_NORM_MOMENTUM, epsilon=1e-5)


class _ConvBN(nn.Module):
    """Convolution (no bias), BatchNorm and an activation (None: linear)."""

    features: int
    kernel: Sequence[int]
    strides: int = 1
    groups: int = 1
    activation: Callable | None = nn.relu

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(
            self.features,
            tuple(self.kernel),
            strides=self.strides,
            padding="SAME",
            feature_group_count=self.groups,
            use_bias=False,
        )(x)
        x = _batch_norm()(x)
        return x if self.activation is None else self.activation(x)


def _max_pool(x, window=3, stride=2):
    return nn.max_pool(x, (window, window), (stride, stride), padding="SAME")


def _avg_pool_same(x):
    return nn.avg_pool(x, (3, 3), (1, 1), padding="SAME")


# ResNet-50.


class _Bottleneck(nn.Module):
    features: int
    strides: int

    @nn.compact
    def __call__(self, x):
        out_features = 4 * self.features
        h = _ConvBN(self.features, (1, 1))(x)
        h = _ConvBN(self.features, (3, 3), self.strides)(h)
        h = _ConvBN(out_features, (1, 1), activation=None)(h)
        if self.strides != 1 or x.shape[-1] != out_features:
            x = _ConvBN(out_features, (1, 1), self.strides, activation=None)(x)
        return nn.relu(h + x)


class _ResNet(nn.Module):
    num_classes: int
    remat: str | None
    stage_blocks: Sequence[int]

    @nn.compact
    def __call__(self, images):
        x = _max_pool(_ConvBN(64, (7, 7), 2)(images))
        block = rematerialised(_Bottleneck, self.remat)
        for stage, (blocks, features) in enumerate(zip(self.stage_blocks, (64, 128, 256, 512))):
            for index in range(blocks):
                strides = 2 if stage > 0 and index == 0 else 1
                x = block(features, strides, name=f"stage{stage}_block{index}")(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


# DenseNet-121.


class _DenseLayer(nn.Module):
    """BN-ReLU-1x1 conv-BN-ReLU-3x3 conv on the concatenation of every earlier
    feature map of its dense block; returns only the `growth` new channels."""

    growth: int

    @nn.compact
    def __call__(self, features):
        # Concatenating inside the unit lets a rematerialised layer keep the
        # shared feature maps, not one concatenated copy per layer.
        x = jnp.concatenate(features, axis=-1)
        h = nn.Conv(4 * self.growth, (1, 1), use_bias=False)(nn.relu(_batch_norm()(x)))
        return nn.Conv(self.growth, (3, 3), padding="SAME", use_bias=False)(
            nn.relu(_batch_norm()(h))
        )


class _DenseNet(nn.Module):
    num_classes: int
    remat: str | None
    block_layers: Sequence[int]
    growth: int = 32

    @nn.compact
    def __call__(self, images):
        x = _max_pool(_ConvBN(64, (7, 7), 2)(images))
        layer = rematerialised(_DenseLayer, self.remat)
        for index, layers in enumerate(self.block_layers):
            features = (x,)
            for layer_index in range(layers):
                name = f"block{index}_layer{layer_index}"
                features += (layer(self.growth, name=name)(features),)
            x = jnp.concatenate(features, axis=-1)
            if index < len(self.block_layers) - 1:
                # Transition: halve the channels (compression 0.5) and the side.
                x = nn.Conv(x.shape[-1] // 2, (1, 1), use_bias=False)(nn.relu(_batch_norm()(x)))
                x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(_batch_norm()(x))
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


# MobileNetV2.


class _InvertedResidual(nn.Module):
    features: int
    strides: int
    expansion: int

    @nn.compact
    def __call__(self, x):
        hidden = x.shape[-1] * self.expansion
        h = x
        if self.expansion != 1:
            h = _ConvBN(hidden, (1, 1), activation=nn.relu6)(h)
        h = _ConvBN(hidden, (3, 3), self.strides, groups=hidden, activation=nn.relu6)(h)
        h = _ConvBN(self.features, (1, 1), activation=None)(h)
        if self.strides == 1 and x.shape[-1] == self.features:
            h = h + x
        return h


# (expansion t, output channels c, repeats n, first stride s), Sandler et al. 2018, Table 2.
_MOBILENET_V2_STAGES = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


class _MobileNetV2(nn.Module):
    num_classes: int
    remat: str | None
    stage_repeats: Sequence[int]

    @nn.compact
    def __call__(self, images):
        x = _ConvBN(32, (3, 3), 2, activation=nn.relu6)(images)
        block = rematerialised(_InvertedResidual, self.remat)
        stages = zip(_MOBILENET_V2_STAGES, self.stage_repeats)
        for stage, ((expansion, features, _, strides), repeats) in enumerate(stages):
            for index in range(repeats):
                x = block(
                    features, strides if index == 0 else 1, expansion, name=f"stage{stage}_block{index}"
                )(x)
        x = _ConvBN(1280, (1, 1), activation=nn.relu6)(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


# Inception-v3 layout.


def _chain(x, *layers):
    for features, kernel, *strides in layers:
        x = _ConvBN(features, kernel, *strides)(x)
    return x


class _InceptionA(nn.Module):
    pool_features: int

    @nn.compact
    def __call__(self, x):
        return jnp.concatenate(
            [
                _chain(x, (64, (1, 1))),
                _chain(x, (48, (1, 1)), (64, (5, 5))),
                _chain(x, (64, (1, 1)), (96, (3, 3)), (96, (3, 3))),
                _chain(_avg_pool_same(x), (self.pool_features, (1, 1))),
            ],
            axis=-1,
        )


class _ReductionA(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.concatenate(
            [
                _chain(x, (384, (3, 3), 2)),
                _chain(x, (64, (1, 1)), (96, (3, 3)), (96, (3, 3), 2)),
                _max_pool(x),
            ],
            axis=-1,
        )


class _InceptionC(nn.Module):
    """Factorised 7x7 convolutions as 1x7 and 7x1 pairs."""

    channels_7x7: int

    @nn.compact
    def __call__(self, x):
        c = self.channels_7x7
        return jnp.concatenate(
            [
                _chain(x, (192, (1, 1))),
                _chain(x, (c, (1, 1)), (c, (1, 7)), (192, (7, 1))),
                _chain(x, (c, (1, 1)), (c, (7, 1)), (c, (1, 7)), (c, (7, 1)), (192, (1, 7))),
                _chain(_avg_pool_same(x), (192, (1, 1))),
            ],
            axis=-1,
        )


class _ReductionB(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.concatenate(
            [
                _chain(x, (192, (1, 1)), (320, (3, 3), 2)),
                _chain(x, (192, (1, 1)), (192, (1, 7)), (192, (7, 1)), (192, (3, 3), 2)),
                _max_pool(x),
            ],
            axis=-1,
        )


class _InceptionE(nn.Module):
    """Expanded filter bank: 3x3 convolutions split into parallel 1x3 and 3x1."""

    @nn.compact
    def __call__(self, x):
        wide = _chain(x, (384, (1, 1)))
        deep = _chain(x, (448, (1, 1)), (384, (3, 3)))
        return jnp.concatenate(
            [
                _chain(x, (320, (1, 1))),
                _chain(wide, (384, (1, 3))),
                _chain(wide, (384, (3, 1))),
                _chain(deep, (384, (1, 3))),
                _chain(deep, (384, (3, 1))),
                _chain(_avg_pool_same(x), (192, (1, 1))),
            ],
            axis=-1,
        )


class _Inception(nn.Module):
    num_classes: int
    remat: str | None
    block_counts: Sequence[int]  # of A, C and E blocks

    @nn.compact
    def __call__(self, images):
        x = _chain(images, (32, (3, 3), 2), (32, (3, 3)), (64, (3, 3)))
        x = _chain(_max_pool(x), (80, (1, 1)), (192, (3, 3)))
        x = _max_pool(x)
        count_a, count_c, count_e = self.block_counts
        # Inception-v3's widths, the first `count` of each kind.
        pool_features = (32, 64, 64)[:count_a]
        channels_7x7 = (128, 160, 160, 192)[:count_c]
        units = (
            *((_InceptionA, (f,)) for f in pool_features),
            (_ReductionA, ()),
            *((_InceptionC, (c,)) for c in channels_7x7),
            (_ReductionB, ()),
            *((_InceptionE, ()) for _ in range(count_e)),
        )
        for index, (unit, attributes) in enumerate(units):
            x = rematerialised(unit, self.remat)(*attributes, name=f"mixed{index}")(x)
        return nn.Dense(self.num_classes)(jnp.mean(x, axis=(1, 2)))


# 3D U-Net.


class _DoubleConv3D(nn.Module):
    """Two 3x3x3 convolutions with BatchNorm and ReLU on the concatenation of
    its inputs (the upsampled and skip maps on the way up)."""

    features: int

    @nn.compact
    def __call__(self, inputs):
        x = jnp.concatenate(inputs, axis=-1)
        for _ in range(2):
            x = nn.Conv(self.features, (3, 3, 3), padding="SAME", use_bias=False)(x)
            x = nn.relu(_batch_norm()(x))
        return x


class _UNet3D(nn.Module):
    num_classes: int
    remat: str | None
    levels: int
    base_features: int

    @nn.compact
    def __call__(self, volumes):
        block = rematerialised(_DoubleConv3D, self.remat)
        skips = []
        x = volumes
        for level in range(self.levels):
            x = block(self.base_features * 2**level, name=f"down{level}")((x,))
            if level < self.levels - 1:
                skips.append(x)
                x = nn.max_pool(x, (2, 2, 2), (2, 2, 2))
        for level in reversed(range(self.levels - 1)):
            features = self.base_features * 2**level
            x = nn.ConvTranspose(features, (2, 2, 2), strides=(2, 2, 2))(x)
            x = block(features, name=f"up{level}")((x, skips[level]))
        return nn.Conv(self.num_classes, (1, 1, 1))(x)


# The zoo's train steps.


_ONES = ("scale", "var")  # norm scales, BatchNorm running variances
_ZEROS = ("bias", "mean")  # biases, BatchNorm running means


def _init_variables(model: nn.Module, init_input, stacked: str | None = None):
    """Variables with the structure, shapes and dtypes of `model.init`'s,
    filled from one normal draw: kernels N(0, 1/fan_in) (fan_in: every axis
    but the last, and not the layer axis of a scanned block), embeddings
    N(0, 1/width), norm scales and running variances 1, biases and running
    means 0. `stacked` names the scanned block whose parameters carry a
    leading layer axis.

    Flax's own initialisers compile one truncated-normal sampler per
    parameter: ~40 s for ResNet-50 on a 2-core CPU, longer than its train
    step. One draw, sliced, within the jitted `make_args`, takes seconds.
    """
    shapes = jax.eval_shape(model.init, jax.random.key(_SEED), init_input)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    def scale_of(path, leaf):
        names = [getattr(entry, "key", None) for entry in path]
        kind = names[-1]
        if kind in _ONES or kind in _ZEROS:
            return None
        if kind == "kernel":
            fan_in_axes = leaf.shape[1:-1] if stacked in names else leaf.shape[:-1]
            return 1.0 / math.sqrt(math.prod(fan_in_axes))
        if kind.endswith("embedding"):
            return 1.0 / math.sqrt(leaf.shape[-1])
        raise ValueError(f"no initialisation rule for parameter {'/'.join(map(str, names))}")

    scales = [scale_of(path, leaf) for path, leaf in paths_and_leaves]
    sizes = [leaf.size for (_, leaf), scale in zip(paths_and_leaves, scales) if scale]
    normal = jax.random.normal(jax.random.key(_SEED), (sum(sizes),))
    offset, values = 0, []
    for (path, leaf), scale in zip(paths_and_leaves, scales):
        if scale is None:
            fill = 1.0 if path[-1].key in _ONES else 0.0
            values.append(jnp.full(leaf.shape, fill, leaf.dtype))
        else:
            chunk = normal[offset : offset + leaf.size]
            values.append((scale * chunk).reshape(leaf.shape).astype(leaf.dtype))
            offset += leaf.size
    return jax.tree.unflatten(treedef, values)


def _batch_norm_case(name, model, inputs_shape, labels_shape, num_classes, optimizer, init_shape):
    """A cross-entropy step of a BatchNorm network on synthetic data.

    Step: `step(params, batch_stats, opt_state, inputs, labels)
    -> ((params, batch_stats, opt_state), loss)`; the loss is the mean over
    every label (one per image, or one per voxel).
    """

    def loss_fn(params, batch_stats, inputs, labels):
        logits, updated = model.apply(
            {"params": params, "batch_stats": batch_stats}, inputs, mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updated["batch_stats"]

    def step(params, batch_stats, opt_state, inputs, labels):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, inputs, labels
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), batch_stats, opt_state), loss

    # One program: eagerly, the optimizer's init alone compiles one
    # zeros_like per parameter shape.
    @jax.jit
    def make_args():
        # Parameter shapes do not depend on the spatial size, so the smallest
        # input the network takes keeps initialisation cheap at any size.
        variables = _init_variables(model, jnp.zeros(init_shape, jnp.float32))
        params, batch_stats = variables["params"], variables["batch_stats"]
        input_key, label_key = jax.random.split(jax.random.key(_SEED))
        inputs = jax.random.normal(input_key, inputs_shape)
        labels = jax.random.randint(label_key, labels_shape, 0, num_classes, jnp.int32)
        return params, batch_stats, optimizer.init(params), inputs, labels

    return step_case(name, step, make_args)


def _suffix(remat: str | None) -> str:
    return "" if remat is None else f"-{remat}"


def _label(full_name: str, short_name: str, structure, full_structure) -> str:
    """`full_name` for the published structure, else the short name and the
    counts that differ from it (e.g. "resnet[1-1-1-1]")."""
    structure = tuple(structure)
    if structure == tuple(full_structure):
        return full_name
    return f"{short_name}[{'-'.join(map(str, structure))}]"


def _classifier(label, model, image_size, batch_size, remat, num_classes):
    return _batch_norm_case(
        f"{label}-i{image_size}-b{batch_size}{_remat_suffix(remat)}",
        model,
        (batch_size, image_size, image_size, 3),
        (batch_size,),
        num_classes,
        optax.sgd(_ZOO_SGD_LEARNING_RATE, momentum=_SGD_MOMENTUM),
        (1, 32, 32, 3),
    )


def _published_classifier(network, names, structure, published, image_size, batch_size, remat,
                          num_classes):
    """A classifier `network(num_classes, remat, structure)`, named
    `names[0]` at its `published` structure, else `names[1]` and the counts."""
    label = _label(*names, structure, published)
    model = network(num_classes, remat, tuple(structure))
    return _classifier(label, model, image_size, batch_size, remat, num_classes)


_RESNET50_STAGES = (3, 4, 6, 3)
_DENSENET121_BLOCKS = (6, 12, 24, 16)
_MOBILENET_V2_REPEATS = tuple(repeats for _, _, repeats, _ in _MOBILENET_V2_STAGES)
_INCEPTION_V3_BLOCKS = (3, 4, 2)


def resnet50_case(
    image_size=224, batch_size=8, remat=None, num_classes=1000, stage_blocks=_RESNET50_STAGES
) -> StepCase:
    """ResNet-50 (He et al. 2016) on NHWC images; SGD with momentum 0.9.

    `stage_blocks` (bottleneck blocks per stage) other than 3-4-6-3 gives a
    shallower or deeper ResNet, for quick tests.
    """
    return _published_classifier(_ResNet, ("resnet50", "resnet"), stage_blocks, _RESNET50_STAGES,
                                 image_size, batch_size, remat, num_classes)


def densenet121_case(
    image_size=224, batch_size=8, remat=None, num_classes=1000, block_layers=_DENSENET121_BLOCKS
) -> StepCase:
    """DenseNet-121 (Huang et al. 2017, growth 32, compression 0.5); SGD with
    momentum 0.9. `block_layers` are the dense layers of each block."""
    return _published_classifier(_DenseNet, ("densenet121", "densenet"), block_layers,
                                 _DENSENET121_BLOCKS, image_size, batch_size, remat, num_classes)


def mobilenet_v2_case(
    image_size=224, batch_size=8, remat=None, num_classes=1000, stage_repeats=_MOBILENET_V2_REPEATS
) -> StepCase:
    """MobileNetV2 (Sandler et al. 2018, width 1.0); SGD with momentum 0.9.
    `stage_repeats` are the inverted residuals of each of the seven stages."""
    if len(stage_repeats) != len(_MOBILENET_V2_STAGES):
        raise ValueError(f"stage_repeats needs {len(_MOBILENET_V2_STAGES)} counts")
    return _published_classifier(_MobileNetV2, ("mobilenetv2", "mobilenetv2"), stage_repeats,
                                 _MOBILENET_V2_REPEATS, image_size, batch_size, remat, num_classes)


def inception_case(
    image_size=299, batch_size=8, remat=None, num_classes=1000, block_counts=_INCEPTION_V3_BLOCKS
) -> StepCase:
    """The Inception-v3 layout (Szegedy et al. 2016): stem, A blocks, a
    reduction, C blocks, a reduction, E blocks, without the auxiliary head and
    with SAME padding throughout; SGD with momentum 0.9. `block_counts` are
    the numbers of A (at most 3), C (at most 4) and E blocks."""
    count_a, count_c, count_e = block_counts
    if not (1 <= count_a <= 3 and 1 <= count_c <= 4 and count_e >= 1):
        raise ValueError(f"block_counts must be 1-3 A, 1-4 C and 1+ E blocks, got {block_counts}")
    return _published_classifier(_Inception, ("inception", "inception"), block_counts,
                                 _INCEPTION_V3_BLOCKS, image_size, batch_size, remat, num_classes)


def unet3d_case(
    image_size=96, batch_size=1, remat=None, num_classes=3, levels=4, base_features=32
) -> StepCase:
    """A 3D U-Net (after Cicek et al. 2016) segmenting single-channel cubes of
    side `image_size` (a multiple of 2**(levels - 1)) into `num_classes`
    classes per voxel, `base_features` channels at full resolution, doubling
    per level; SGD with Nesterov momentum 0.99 and learning rate 0.01, as
    nnU-Net trains (Isensee et al. 2021)."""
    if image_size % 2 ** (levels - 1):
        raise ValueError(f"image_size {image_size} is not a multiple of {2 ** (levels - 1)}")
    side_shape = (image_size,) * 3
    return _batch_norm_case(
        f"unet3d-l{levels}-c{base_features}-i{image_size}-b{batch_size}{_remat_suffix(remat)}",
        _UNet3D(num_classes, remat, levels, base_features),
        (batch_size, *side_shape, 1),
        (batch_size, *side_shape),
        num_classes,
        optax.sgd(_UNET_LEARNING_RATE, momentum=_UNET_MOMENTUM, nesterov=True),
        (1, *(2 ** (levels - 1),) * 3, 1),
    )


def zoo_gpt_case(
    seq=1024, batch_size=8, remat=None, layers=12, width=768, heads=12, vocab=32768
) -> StepCase:
    """The GPT decoder of `gpt_case` (GPT-2 small widths by default) with its
    layers under one `nn.scan`, as the zoo builds its networks: sized by the
    sequence, optax's integer-label cross-entropy, AdamW, parameters from
    `_init_variables`.

    Step: `step(params, opt_state, tokens) -> ((params, opt_state), loss)`;
    tokens int32 [batch_size, seq + 1].
    """
    model = _GPT(layers, width, heads, seq, vocab, scan_layers=True, remat=remat)
    optimizer = optax.adamw(_ADAM_LEARNING_RATE)

    def loss(logits, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def make_args():
        params = _init_variables(model, jnp.zeros((1, seq), jnp.int32), stacked="blocks")["params"]
        tokens = jax.random.randint(jax.random.key(_SEED), (batch_size, seq + 1), 0, vocab, jnp.int32)
        return params, optimizer.init(params), tokens

    name = f"gpt-l{layers}-w{width}-s{seq}-b{batch_size}{_remat_suffix(remat)}"
    return step_case(name, _language_model_step(model, optimizer, loss), make_args)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A builder `build(size, batch_size, remat=..., **structure)`, the sizes
    it takes, and its smallest copy for tests."""

    build: Callable[..., StepCase]
    size_multiple: int  # sizes are searched in steps of this
    size_name: str  # what the size argument means
    #: size, batch_size and structure of the smallest copy that keeps every
    #: kind of unit the network has (stem, each block type, reductions, the
    #: scanned layer).
    tiny: dict

    def tiny_case(self, remat: str | None = None) -> StepCase:
        """The network at its `tiny` size and structure."""
        structure = dict(self.tiny)
        size, batch_size = structure.pop("size"), structure.pop("batch_size")
        return self.build(size, batch_size, remat=remat, **structure)


# The classifiers' tiny copies get 64x64 images and 4 of them so that their
# last BatchNorms still average 16 values per channel: over 2 values (32x32,
# batch 2) the step is so ill-conditioned that rounding differences grow to
# 1e-5.
ZOO = {
    "resnet50": ZooModel(resnet50_case, 32, "image side",
                         dict(size=64, batch_size=4, stage_blocks=(1, 1, 1, 1))),
    "densenet121": ZooModel(densenet121_case, 32, "image side",
                            dict(size=64, batch_size=4, block_layers=(2, 1, 1, 1))),
    "mobilenetv2": ZooModel(mobilenet_v2_case, 32, "image side",
                            dict(size=64, batch_size=4, stage_repeats=(1,) * 7)),
    "inception": ZooModel(inception_case, 32, "image side",
                          dict(size=64, batch_size=4, block_counts=(1, 1, 1))),
    "unet3d": ZooModel(unet3d_case, 8, "cube side",
                       dict(size=16, batch_size=2, levels=3, base_features=8)),
    "gpt": ZooModel(zoo_gpt_case, 64, "sequence length",
                    dict(size=64, batch_size=2, layers=2, width=64, heads=2, vocab=256)),
}
