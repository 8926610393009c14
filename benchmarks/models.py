"""Train-step cases for jlms's tests, benchmarks and demo.

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

All sizes are factory arguments; the defaults are the sizes the benchmarks use.
"""

import dataclasses
import functools
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

_SEED = 0
_SGD_LEARNING_RATE = 1e-2

#: TFLMS's rules with the knobs jlms used by default before budgets became
#: the default: the benchmarks and tests of those rules pass them.
TFLMS_KNOBS = dict(min_bytes=1 << 20, swapout_threshold=20)


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


def _case(name: str, step: Callable, make_args: Callable[[], tuple]) -> StepCase:
    # Deriving the abstract inputs from make_args itself keeps the two in
    # agreement by construction rather than by a second hand-written spec.
    return StepCase(name, step, make_args, functools.partial(jax.eval_shape, make_args))


def count_equations(case: StepCase) -> int:
    """Number of top-level equations in the jaxpr of `case.step`, traced abstractly."""
    return len(jax.make_jaxpr(case.step)(*case.abstract_args()).jaxpr.eqns)


def _sgd(params, grads):
    return jax.tree.map(lambda p, g: p - _SGD_LEARNING_RATE * g, params, grads)


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
    return _case(f"mlp-d{depth}-w{width}-b{batch}-{dtype_name}", step, make_args)


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


class _ResNet(nn.Module):
    blocks: int
    channels: int
    num_classes: int

    @nn.compact
    def __call__(self, images):
        h = nn.Conv(self.channels, (3, 3), padding="SAME")(images)
        for _ in range(self.blocks):
            h = _ResidualBlock(self.channels)(h)
        pooled = jnp.mean(h, axis=(1, 2))
        return nn.Dense(self.num_classes)(pooled)


def resnet_case(
    blocks=16, channels=64, image_size=256, batch=8, num_classes=10, optimizer=None
) -> StepCase:
    """A residual CNN that never downsamples, so every block's activations are
    full size, trained with `optimizer` (default Adam, learning rate 1e-3).

    Step: `step(params, batch_stats, opt_state, images, labels)
    -> ((params, batch_stats, opt_state), loss)`; images NHWC float32.
    """
    model = _ResNet(blocks, channels, num_classes)
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

    name = f"resnet-n{blocks}-c{channels}-i{image_size}-b{batch}"
    return _case(name, step, make_args)


# --- 3. GPT-style decoder, Flax, AdamW, optionally scanned over layers ----------


class _CausalSelfAttention(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        batch, seq, width = x.shape
        head_dim = width // self.heads
        # No bias: a key bias has an exactly-zero gradient (softmax ignores
        # it), which Adam would turn into an update made of rounding noise.
        qkv = nn.Dense(3 * width, use_bias=False)(x).reshape(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
        # The dtype's most negative value, not -inf: a fully masked row stays finite.
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, width)
        return nn.Dense(width)(attended)


class _DecoderBlock(nn.Module):
    width: int
    heads: int

    @nn.compact
    def __call__(self, h, _unused=None):
        # The (carry, x) -> (carry, y) shape is what nn.scan requires.
        h = h + _CausalSelfAttention(self.heads)(nn.LayerNorm()(h))
        mlp = nn.Dense(4 * self.width)(nn.LayerNorm()(h))
        h = h + nn.Dense(self.width)(nn.gelu(mlp))
        return h, None


class _GPT(nn.Module):
    layers: int
    width: int
    heads: int
    seq: int
    vocab: int
    scan_layers: bool

    @nn.compact
    def __call__(self, tokens):
        token_embedding = nn.Embed(self.vocab, self.width)
        positions = self.param(
            "position_embedding", nn.initializers.normal(0.02), (self.seq, self.width)
        )
        h = token_embedding(tokens) + positions[: tokens.shape[1]]
        if self.scan_layers:
            blocks = nn.scan(
                _DecoderBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=self.layers,
            )
            h, _ = blocks(self.width, self.heads, name="blocks")(h, None)
        else:
            for _ in range(self.layers):
                h, _ = _DecoderBlock(self.width, self.heads)(h)
        # Tied output projection: logits against the token embedding table.
        return token_embedding.attend(nn.LayerNorm()(h))


def gpt_case(
    layers=4, width=256, heads=4, seq=128, batch=4, vocab=1024, scan_layers=False,
    optimizer=None,
) -> StepCase:
    """A pre-LayerNorm GPT decoder with next-token cross-entropy, trained with
    `optimizer` (default AdamW, learning rate 1e-3).

    Step: `step(params, opt_state, tokens) -> ((params, opt_state), loss)`;
    tokens int32 [batch, seq + 1]. With `scan_layers` the blocks are one
    `nn.scan` and their params carry a leading axis of length `layers`.
    """
    if width % heads:
        raise ValueError(f"width {width} is not divisible by heads {heads}")
    model = _GPT(layers, width, heads, seq, vocab, scan_layers)
    optimizer = optax.adamw(1e-3) if optimizer is None else optimizer

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        targets = tokens[:, 1:]
        return cross_entropy(logits, targets)

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss

    def make_args():
        init_key, token_key = jax.random.split(jax.random.key(_SEED))
        # Parameter shapes do not depend on the batch, so one sequence suffices.
        params = model.init(init_key, jnp.zeros((1, seq), jnp.int32))["params"]
        tokens = jax.random.randint(token_key, (batch, seq + 1), 0, vocab, jnp.int32)
        return params, optimizer.init(params), tokens

    layout = "scan" if scan_layers else "unrolled"
    name = f"gpt-{layout}-l{layers}-w{width}-h{heads}-s{seq}-b{batch}-v{vocab}"
    return _case(name, step, make_args)


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

    return _case(f"control_flow-w{width}-b{batch}", step, make_args)


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

    return _case(f"many_equations-l{layers}-w{width}-b{batch}", step, make_args)


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

    return _case(f"per-head-attention-l{layers}-h{heads}-w{width}-s{seq}-b{batch}", step, make_args)
