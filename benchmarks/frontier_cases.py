"""The four train steps of the frontier benchmark (issue 13), each with and
without per-layer rematerialisation.

Every factory returns a `models.StepCase` and takes `remat`: with it, every
repeated unit (a residual block, a decoder layer, a scanned MLP layer) is
differentiated under `jax.checkpoint` with
`jax.checkpoint_policies.nothing_saveable`, so the backward pass recomputes
the unit from its input instead of reading residuals kept from the forward
pass. A case and its `remat` twin take arguments of the same pytree
structure, shapes and dtypes (the units are named explicitly so that
wrapping them does not rename parameters), so one set of arguments serves
both.

- `resnet`: the 16-block BatchNorm ResNet of `models.resnet_case` (64
  channels, no downsampling, global pooling, Adam), written here because
  that factory has no remat switch.
- `gpt`: a pre-LayerNorm GPT decoder whose layers are one `nn.scan` (12
  layers, sequence 1024, width 512, 8 heads, batch 8, vocabulary 1024,
  AdamW), with a `compute_dtype` for activations and matmuls; parameters
  and optimizer state stay float32.
- `scan_mlp`: `layers` tanh layers run by `jax.lax.scan` over stacked
  weights, MSE loss, plain SGD (or any optax optimizer).
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from benchmarks import models

_SEED = 0
_NOTHING_SAVEABLE = jax.checkpoint_policies.nothing_saveable


def _remat_suffix(remat: bool) -> str:
    return "-remat" if remat else ""


def _dtype_name(dtype) -> str:
    return jnp.dtype(dtype).name


# --- 1. BatchNorm ResNet without downsampling, Adam ---------------------------


class _FlatResNet(nn.Module):
    blocks: int
    channels: int
    num_classes: int
    remat: bool

    @nn.compact
    def __call__(self, images):
        # models' conv-BN-relu, conv-BN, plus input, relu block; named
        # explicitly so that the remat twin takes the same parameters.
        block = models._ResidualBlock
        if self.remat:
            block = nn.remat(block, policy=_NOTHING_SAVEABLE)
        h = nn.Conv(self.channels, (3, 3), padding="SAME", name="stem")(images)
        for index in range(self.blocks):
            h = block(self.channels, name=f"block{index}")(h)
        pooled = jnp.mean(h, axis=(1, 2))
        return nn.Dense(self.num_classes, name="head")(pooled)


def resnet(remat=False, image_size=256, batch=8, blocks=16, channels=64,
           num_classes=10, optimizer=None) -> models.StepCase:
    """The residual CNN of `models.resnet_case`: full-resolution blocks,
    BatchNorm in training mode, Adam (learning rate 1e-3) by default.

    Step: `step(params, batch_stats, opt_state, images, labels)
    -> ((params, batch_stats, opt_state), loss)`; images NHWC float32.
    """
    model = _FlatResNet(blocks, channels, num_classes, remat)
    optimizer = optax.adam(1e-3) if optimizer is None else optimizer

    def loss_fn(params, batch_stats, images, labels):
        logits, updated = model.apply(
            {"params": params, "batch_stats": batch_stats}, images,
            mutable=["batch_stats"])
        return models.cross_entropy(logits, labels), updated["batch_stats"]

    def step(params, batch_stats, opt_state, images, labels):
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, batch_stats, images, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, batch_stats, opt_state), loss

    def make_args():
        init_key, image_key, label_key = jax.random.split(jax.random.key(_SEED), 3)
        # Global pooling makes the parameters independent of the image size,
        # so a tiny image keeps the eager initialisation cheap.
        variables = model.init(init_key, jnp.zeros((1, 8, 8, 3), jnp.float32))
        params, batch_stats = variables["params"], variables["batch_stats"]
        images = jax.random.normal(image_key, (batch, image_size, image_size, 3))
        labels = jax.random.randint(label_key, (batch,), 0, num_classes, jnp.int32)
        return params, batch_stats, optimizer.init(params), images, labels

    name = (f"resnet-n{blocks}-c{channels}-i{image_size}-b{batch}"
            f"{_remat_suffix(remat)}")
    return models._case(name, step, make_args)


# --- 2. GPT decoder under nn.scan, AdamW, float32 or bfloat16 compute ---------


class _Attention(nn.Module):
    heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, x):
        batch, seq, width = x.shape
        head_dim = width // self.heads
        # No bias on q, k, v: a key bias has an exactly-zero gradient.
        qkv = nn.Dense(3 * width, use_bias=False, dtype=self.dtype, name="qkv")(x)
        qkv = qkv.reshape(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.asarray(
            math.sqrt(head_dim), self.dtype)
        causal = jnp.tril(jnp.ones((seq, seq), jnp.bool_))
        # The dtype's most negative finite value keeps a masked row finite.
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        # Softmax in the compute dtype, as Flax's own attention does by default.
        weights = jax.nn.softmax(scores, axis=-1)
        attended = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        return nn.Dense(width, dtype=self.dtype, name="out")(
            attended.reshape(batch, seq, width))


class _Layer(nn.Module):
    width: int
    heads: int
    dtype: jnp.dtype

    @nn.compact
    def __call__(self, h, _unused=None):
        # nn.scan wants (carry, x) -> (carry, y).
        normed = nn.LayerNorm(dtype=self.dtype, name="ln_attention")(h)
        h = h + _Attention(self.heads, self.dtype, name="attention")(normed)
        normed = nn.LayerNorm(dtype=self.dtype, name="ln_mlp")(h)
        hidden = nn.gelu(nn.Dense(4 * self.width, dtype=self.dtype, name="up")(normed))
        h = h + nn.Dense(self.width, dtype=self.dtype, name="down")(hidden)
        return h, None


class _ScanDecoder(nn.Module):
    layers: int
    width: int
    heads: int
    seq: int
    vocab: int
    dtype: jnp.dtype
    remat: bool

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(self.vocab, self.width, dtype=self.dtype, name="embed")
        positions = self.param("positions", nn.initializers.normal(0.02),
                               (self.seq, self.width))
        h = embed(tokens) + positions[: tokens.shape[1]].astype(self.dtype)
        layer = _Layer
        if self.remat:
            # Inside a scan the loop itself keeps XLA from merging the
            # recomputation with the forward pass, so CSE need not be blocked.
            layer = nn.remat(_Layer, policy=_NOTHING_SAVEABLE, prevent_cse=False)
        stack = nn.scan(layer, variable_axes={"params": 0},
                        split_rngs={"params": True}, length=self.layers)
        h, _ = stack(self.width, self.heads, self.dtype, name="layers")(h, None)
        h = nn.LayerNorm(dtype=self.dtype, name="ln_final")(h)
        # Tied output projection against the embedding table.
        return embed.attend(h)


def gpt(remat=False, compute_dtype=jnp.float32, layers=12, seq=1024, width=512,
        heads=8, batch=8, vocab=1024, optimizer=None) -> models.StepCase:
    """A pre-LayerNorm GPT decoder with its layers under `nn.scan`, next-token
    cross-entropy (in float32), AdamW (learning rate 1e-3) by default.

    Activations and matmuls run in `compute_dtype`; parameters and the
    optimizer state are float32 whatever it is.

    Step: `step(params, opt_state, tokens) -> ((params, opt_state), loss)`;
    tokens int32 [batch, seq + 1].
    """
    if width % heads:
        raise ValueError(f"width {width} is not divisible by heads {heads}")
    model = _ScanDecoder(layers, width, heads, seq, vocab,
                         jnp.dtype(compute_dtype), remat)
    optimizer = optax.adamw(1e-3) if optimizer is None else optimizer

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return models.cross_entropy(logits.astype(jnp.float32), tokens[:, 1:])

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, opt_state), loss

    def make_args():
        init_key, token_key = jax.random.split(jax.random.key(_SEED))
        # Parameter shapes do not depend on the batch: one sequence suffices.
        params = model.init(init_key, jnp.zeros((1, seq), jnp.int32))["params"]
        tokens = jax.random.randint(token_key, (batch, seq + 1), 0, vocab, jnp.int32)
        return params, optimizer.init(params), tokens

    name = (f"gpt-scan-l{layers}-w{width}-h{heads}-s{seq}-b{batch}-v{vocab}"
            f"-{_dtype_name(compute_dtype)}{_remat_suffix(remat)}")
    return models._case(name, step, make_args)


# --- 3. tanh MLP under jax.lax.scan, MSE, SGD ---------------------------------

_SGD_LEARNING_RATE = 1e-2


def _scanned_layer(h, layer):
    w, b = layer
    return jnp.tanh(h @ w + b), None


def scan_mlp(remat=False, layers=16, width=2048, batch=4096, dtype=jnp.float32,
             optimizer=None) -> models.StepCase:
    """`layers` layers h <- tanh(h @ w_i + b_i) run by one `jax.lax.scan` over
    weights stacked along a leading axis; MSE against a random target.
    Plain SGD (learning rate 1e-2) unless an optax `optimizer` is given.

    Step: `step(params, x, y) -> (new_params, loss)` without an optimizer,
    `step(params, opt_state, x, y) -> ((params, opt_state), loss)` with one;
    params `{"w": [layers, width, width], "b": [layers, width]}`.
    """
    layer = _scanned_layer
    if remat:
        layer = jax.checkpoint(_scanned_layer, policy=_NOTHING_SAVEABLE,
                               prevent_cse=False)

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
            params = jax.tree.map(lambda p, g: p - _SGD_LEARNING_RATE * g,
                                  params, grads)
            return params, loss

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

    name = (f"scan_mlp-l{layers}-w{width}-b{batch}-{_dtype_name(dtype)}"
            f"{'' if optimizer is None else '-optax'}{_remat_suffix(remat)}")
    return models._case(name, step, make_args)
