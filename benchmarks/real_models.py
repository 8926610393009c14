"""Train steps of models as users get them from their libraries, unmodified.

`REAL_MODELS` maps a name to a builder; `REAL_MODELS[name](size)` returns
a `RealStep`. Each model is built from its library's own config class or
constructors with random weights (nothing is downloaded), and trained by
AdamW (optax) on a synthetic batch:

- "llama", "gpt2": Hugging Face `transformers` 4.x `FlaxLlamaForCausalLM`
  and `FlaxGPT2LMHeadModel` (with dropout), from `LlamaConfig` and
  `GPT2Config`; Python loops over layers.
- "bart": `transformers`' `FlaxBartForConditionalGeneration` from a
  `BartConfig` (with dropout): an encoder and a decoder that attends to
  it, each a Python loop of layers, trained on the next token of a
  target sequence.
- "resnet50": `transformers`' `FlaxResNetForImageClassification` from a
  `ResNetConfig` (bottleneck blocks, BatchNorm statistics updated).
- "nnx_transformer": a decoder written with Flax NNX layers
  (`nnx.MultiHeadAttention`, `nnx.Linear`, `nnx.LayerNorm`), its blocks
  made by `nnx.vmap` and run by `nnx.scan`, each building its causal
  mask (the idiom of Flax's NNX guides).
- "equinox_transformer": an Equinox decoder of `eqx.nn.MultiheadAttention`
  and `eqx.nn.MLP` blocks, stacked by `eqx.filter_vmap` and run by
  `jax.lax.scan` over the arrays that `eqx.partition` splits off.
- "gemma2": DeepMind's `gemma` package, a Gemma2 `gm.nn.Transformer`
  (local sliding and global attention alternating, logit soft-capping),
  bfloat16 parameters as the library makes them; its layers are a Python
  loop. `gemma` installs TensorFlow (through kauldron); importing it
  changes Flax for the whole process, so it is built last.

Sizes: "tiny" builds and runs a step in seconds on a CPU and is large
enough where it matters that every pass of jlms has something to do
(jlms._thresholds): values over 4 KiB to keep, remake or copy; loop
inputs (a causal mask) and scan residual stacks over 1 MiB; state leaves
over 64 KiB to keep on host, and some over 1 MiB, updated by a loop over
their rows (inside the backward scan where the layers are scanned).
"realistic" is the model at its published shape (or, for the NNX and
Equinox decoders, a typical one) with a batch it is trained at; use its
`abstract_args()`, for planning for a GPU without one.

What holds for each `RealStep`:

- `step` is a train step. Pure (`nnx` False): `step(state, *batch) ->
  (state, loss)`, the state a pytree of parameters, optimizer state (and a
  PRNG key where the model draws dropout), donated (`donate_argnums`).
  NNX (`nnx` True): `step(model, optimizer, *batch) -> loss`, which
  mutates the objects, as `nnx.jit` and `jlms.offload_nnx` take it.
- `make_args()` returns fresh concrete arguments, equal on every call (a
  donated state is consumed by each run); `abstract_args()` the same
  without allocating anything (`jax.ShapeDtypeStruct`s, or an NNX
  model and optimizer from `nnx.eval_shape`).
- `jitted()` is the reference (`jax.jit` with the donation, or
  `nnx.jit`), `offload(**options)` the step under jlms (`jlms.offload`
  with the donation, or `jlms.offload_nnx`).

`REAL_MODELS[name](size, remat=True)` is the same model with each block
(decoder layer, ResNet bottleneck) under Flax's `nn.remat`, nothing saved,
as a user would write per-block rematerialization: the peer jlms is held
to. The Python-loop libraries have no such option (the gemma, Llama,
GPT-2, BART and ResNet Flax ports), so their layer class is replaced by a
subclass that runs the library's own `__call__` under `nn.remat`, while
the step traces (`_blocks_rematerialized`; BART's encoder and decoder
layers both; gemma's while its `Transformer` sets up); the NNX decoder's
scanned
block runs under `nnx.remat`, the Equinox decoder's under
`jax.checkpoint`.

The model libraries (but Flax, a dependency of jlms) are imported inside
the builders: this module imports without them (`pip install -e
".[models]"` installs them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jlms
from benchmarks.models import cross_entropy

SIZES = ("tiny", "realistic")
_SEED = 0
# AdamW as optax makes it, at a learning rate of 1e-4: each parameter moves
# by about the learning rate a step whatever its gradient, so a gradient
# element of rounding size moves its parameter by up to that much; at 1e-3
# two legal compiles of jax.jit's own tiny Llama step (XLA CPU's LLVM at
# levels 0 and 3) differed by 4.6e-5 of their largest parameter after one
# step, at 1e-4 by a tenth of that.
_LEARNING_RATE = 1e-4
_WEIGHT_DECAY = 1e-2


@dataclasses.dataclass(frozen=True)
class RealStep:
    """A library model's train step and its arguments (see the module
    docstring)."""

    name: str
    step: Callable
    make_args: Callable[[], tuple]
    abstract_args: Callable[[], tuple]
    donate_argnums: tuple[int, ...] = ()
    nnx: bool = False
    #: The dtype the model computes in ("float32" or "bfloat16").
    compute_dtype: str = "float32"

    def jitted(self):
        """`jax.jit(step)` with the step's donation (`nnx.jit` for NNX)."""
        if self.nnx:
            return nnx.jit(self.step)
        return jax.jit(self.step, donate_argnums=self.donate_argnums)

    def offload(self, **options):
        """The step under `jlms.offload` with its donation (NNX:
        `jlms.offload_nnx`, which donates the split state itself)."""
        if self.nnx:
            return jlms.offload_nnx(self.step, **options)
        return jlms.offload(self.step, donate_argnums=self.donate_argnums,
                            **options)

    def next_args(self, args: tuple, outputs) -> tuple:
        """The arguments of the next step: the new state, the same batch
        (NNX: the same objects, which the step updated)."""
        if self.nnx:
            return args
        return (outputs[0], *args[1:])


def _adamw():
    return optax.adamw(_LEARNING_RATE, weight_decay=_WEIGHT_DECAY)


def _pure(name, step, make_args, compute_dtype="float32") -> RealStep:
    # The abstract arguments are make_args traced, so the two agree by
    # construction (as in `benchmarks.models`).
    return RealStep(name, step, make_args,
                    functools.partial(jax.eval_shape, make_args),
                    donate_argnums=(0,), compute_dtype=compute_dtype)


def _tokens(batch, seq, vocab, key=1):
    return jax.random.randint(jax.random.key(key), (batch, seq), 0, vocab,
                              jnp.int32)


def _next_token_loss(logits, tokens):
    """Mean cross-entropy of each position's logits against the next token,
    in float32."""
    return cross_entropy(logits[:, :-1].astype(jnp.float32), tokens[:, 1:])


def _check_size(size):
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, not {size!r}")


def _rematerialized(layer_class):
    """`layer_class` (a Flax linen module) whose `__call__` runs under
    `nn.remat`: its array arguments are the checkpoint's inputs, anything
    else (flags such as `deterministic`, a None cache) stays Python."""
    import flax.linen as nn

    class Rematerialized(layer_class):
        def __call__(self, *args, **kwargs):
            leaves, tree = jax.tree.flatten((args, kwargs),
                                            is_leaf=lambda x: x is None)
            arrays = [i for i, leaf in enumerate(leaves)
                      if isinstance(leaf, jax.Array)]

            def run(module, *values):
                given = list(leaves)
                for i, value in zip(arrays, values):
                    given[i] = value
                args, kwargs = jax.tree.unflatten(tree, given)
                return layer_class.__call__(module, *args, **kwargs)

            return nn.remat(run)(self, *(leaves[i] for i in arrays))

    Rematerialized.__name__ = layer_class.__name__
    return Rematerialized


def _blocks_rematerialized(step, module, class_name: str):
    """`step` that, while it runs (traces), finds `module.class_name`
    rematerialized, so the model's `setup` builds its blocks under
    `nn.remat`."""
    @functools.wraps(step)
    def rematerialized(*args):
        layer_class = getattr(module, class_name)
        setattr(module, class_name, _rematerialized(layer_class))
        try:
            return step(*args)
        finally:
            setattr(module, class_name, layer_class)

    return rematerialized


def _setup_rematerialized(model_class, module, class_name: str):
    """A subclass of the Flax module `model_class` whose `setup` builds its
    blocks of `module.class_name` rematerialized. A class of its own, not
    a patched step: gemma's `Transformer.__call__` is an `nn.jit` whose
    cache would hand an equal module's trace back."""
    class Rematerialized(model_class):
        def setup(self):
            layer_class = getattr(module, class_name)
            setattr(module, class_name, _rematerialized(layer_class))
            try:
                super().setup()
            finally:
                setattr(module, class_name, layer_class)

    return Rematerialized


def _remat_name(name: str, remat: bool) -> str:
    return f"{name}-remat" if remat else name


# --- Gemma2 (DeepMind's gemma package) ------------------------------------


def gemma2(size: str = "tiny", remat: bool = False) -> RealStep:
    """Gemma2, a `gemma.gm.nn.Transformer` of a `TransformerConfig`: tiny
    is 2 layers (one local sliding window of 128, one global), width 64,
    MLP 128, 2 query heads and 1 key/value head of 32, vocabulary 8192
    (the embedding 1 MiB, updated in chunks of rows), batch 2 x sequence
    512 (each layer's attention weights 2 MiB); realistic is Gemma2-2B
    (26 layers, width 2304, MLP 9216, 8 heads and 4 key/value heads of
    256, vocabulary 256128) at batch 16 x sequence 2048. Parameters are
    bfloat16, as the library makes them.

    Importing `gemma` (3.3.0) replaces `flax.linen.Module.param` for the
    whole process by a wrapper that passes `dtype=None` on to every init
    function: a Flax model whose init functions take no dtype, such as
    `transformers`' `FlaxLlamaRMSNorm`, then fails to initialize
    (TypeError). Build the other models first."""
    _check_size(size)
    from gemma import gm

    sliding, full = (gm.nn.config.AttentionType.LOCAL_SLIDING,
                     gm.nn.config.AttentionType.GLOBAL)
    if size == "tiny":
        config = gm.nn.config.TransformerConfig(
            num_embed=8192, embed_dim=64, hidden_dim=128, num_heads=2,
            head_dim=32, num_kv_heads=1, final_logit_softcap=30.0,
            attention_types=(sliding, full), use_post_attn_norm=True,
            use_post_ffw_norm=True, attn_logits_soft_cap=50.0,
            sliding_window_size=128)
        batch, seq = 2, 512
    else:
        # `gm.nn.Gemma2_2B`'s config, written out: that class cannot be
        # imported with kauldron 1.4 (its module imports gemma.gm.ckpts,
        # which subclasses kd.ckpts.AbstractPartialLoader, gone from
        # kauldron 1.4), and kauldron 1.3, which has it, fails on JAX
        # 0.10.2 (jax._src.random._check_prng_key).
        config = gm.nn.config.TransformerConfig(
            num_embed=256128, embed_dim=2304, hidden_dim=9216, num_heads=8,
            head_dim=256, num_kv_heads=4, final_logit_softcap=30.0,
            attention_types=(sliding, full) * 13, use_post_attn_norm=True,
            use_post_ffw_norm=True, attn_logits_soft_cap=50.0,
            sliding_window_size=4096)
        batch, seq = 16, 2048
    model_class = gm.nn.Transformer
    if remat:
        from gemma.gm.nn import _modules
        model_class = _setup_rematerialized(model_class, _modules, "Block")
    model = model_class(config=config)
    vocab = model.config.num_embed
    optimizer = _adamw()

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens).logits
        return _next_token_loss(logits, tokens)

    def step(state, tokens):
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    def make_args():
        # Parameter shapes do not depend on the sequence: a short one keeps
        # the init cheap.
        params = model.init(jax.random.key(_SEED),
                            jnp.zeros((1, 8), jnp.int32))["params"]
        return (params, optimizer.init(params)), _tokens(batch, seq, vocab)

    return _pure(_remat_name(f"gemma2-{size}", remat), step, make_args,
                 "bfloat16")


# --- Hugging Face transformers (Flax) --------------------------------------


def _causal_lm_step(model, optimizer, dropout: bool):
    """A Hugging Face Flax causal LM's step, as their Flax examples write
    it: `model(input_ids, params=..., dropout_rng=..., train=True)`."""

    def loss_fn(params, tokens, key):
        if dropout:
            logits = model(tokens, params=params, dropout_rng=key,
                           train=True).logits
        else:
            logits = model(tokens, params=params).logits
        return _next_token_loss(logits, tokens)

    def step(state, tokens):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, dropout_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    return step


def _causal_lm_accumulating_step(model, optimizer, microbatches: int):
    """`_causal_lm_step` (no dropout) over `microbatches` equal microbatches
    of its batch, their gradients added up in float32 by `jax.lax.scan`
    (gradient accumulation as users write it) before one update."""

    def loss_fn(params, tokens):
        return _next_token_loss(model(tokens, params=params).logits, tokens)

    def step(state, tokens):
        params, opt_state, key = state
        micro = tokens.reshape(microbatches, -1, tokens.shape[-1])

        def one(total, part):
            loss, grads = jax.value_and_grad(loss_fn)(params, part)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = jax.lax.scan(one, zero, micro)
        grads = jax.tree.map(lambda g: g / microbatches, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss / microbatches

    return step


def _causal_lm_args(model, optimizer, batch, seq, vocab):
    def make_args():
        params = model.init_weights(jax.random.key(_SEED), (1, 8))
        state = (params, optimizer.init(params), jax.random.key(2))
        return state, _tokens(batch, seq, vocab)

    return make_args


def _causal_lm(name, model_class, config, batch, seq, dropout: bool,
               remat_layer=None, microbatches: int = 1) -> RealStep:
    """A Hugging Face Flax causal LM of `config`, float32, trained by
    AdamW on `batch` x `seq` tokens; `remat_layer` (module, class name):
    that layer class rematerialized; `microbatches` > 1: their gradients
    accumulated by `jax.lax.scan` (`_causal_lm_accumulating_step`, no
    dropout)."""
    model = model_class(config, dtype=jnp.float32, _do_init=False)
    optimizer = _adamw()
    if microbatches > 1:
        step = _causal_lm_accumulating_step(model, optimizer, microbatches)
        name += f"-accumulating{microbatches}"
    else:
        step = _causal_lm_step(model, optimizer, dropout=dropout)
    make_args = _causal_lm_args(model, optimizer, batch, seq,
                                config.vocab_size)
    if remat_layer is not None:
        step = _blocks_rematerialized(step, *remat_layer)
    return _pure(_remat_name(name, remat_layer is not None), step,
                 make_args)


def llama(size: str = "tiny", remat: bool = False,
          batch: int | None = None, microbatches: int = 1) -> RealStep:
    """`FlaxLlamaForCausalLM` from a `LlamaConfig`, float32: tiny is 2
    layers of width 64 (4 heads, 2 key/value heads, MLP 128), vocabulary
    4096 (the embedding and the head 1 MiB each), batch 2 x sequence 256
    (attention weights 2 MiB a layer); realistic is Llama-3.2-3B's shape
    (28 layers, width 3072, 24 heads, 8 key/value heads, MLP 8192,
    vocabulary 128256, tied embeddings) at batch 4 x sequence 2048.
    `batch`: another batch (one that a mesh's devices divide);
    `microbatches`: the step adds up the gradients of that many parts of
    it by `jax.lax.scan` before its update."""
    _check_size(size)
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    if size == "tiny":
        config = LlamaConfig(vocab_size=4096, hidden_size=64,
                             intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256)
        rows, seq = 2, 256
    else:
        config = LlamaConfig(vocab_size=128256, hidden_size=3072,
                             intermediate_size=8192, num_hidden_layers=28,
                             num_attention_heads=24, num_key_value_heads=8,
                             max_position_embeddings=2048,
                             rope_theta=500000.0, tie_word_embeddings=True)
        rows, seq = 4, 2048
    from transformers.models.llama import modeling_flax_llama
    return _causal_lm(
        f"llama-{size}", FlaxLlamaForCausalLM, config, batch or rows, seq,
        dropout=False,
        remat_layer=((modeling_flax_llama, "FlaxLlamaDecoderLayer")
                     if remat else None), microbatches=microbatches)


def gpt2(size: str = "tiny", remat: bool = False) -> RealStep:
    """`FlaxGPT2LMHeadModel` from a `GPT2Config`, float32, dropout on (0.1,
    drawn from a key in the state): tiny is 2 layers of width 64, 4 heads,
    vocabulary 4096 (the tied embedding 1 MiB), batch 2 x sequence 256
    (attention weights 2 MiB a layer); realistic is GPT-2 medium (24
    layers, width 1024, 16 heads, vocabulary 50257) at batch 8 x sequence
    1024."""
    _check_size(size)
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    if size == "tiny":
        config = GPT2Config(vocab_size=4096, n_positions=256, n_embd=64,
                            n_layer=2, n_head=4)
        batch, seq = 2, 256
    else:
        config = GPT2Config(n_embd=1024, n_layer=24, n_head=16)
        batch, seq = 8, 1024
    from transformers.models.gpt2 import modeling_flax_gpt2
    return _causal_lm(
        f"gpt2-{size}", FlaxGPT2LMHeadModel, config, batch, seq,
        dropout=True,
        remat_layer=((modeling_flax_gpt2, "FlaxGPT2Block") if remat
                     else None))


def bart(size: str = "tiny", remat: bool = False) -> RealStep:
    """`FlaxBartForConditionalGeneration` from a `BartConfig`, float32,
    dropout on (0.1, drawn from a key in the state): the encoder reads a
    source sequence, the decoder a target one and the encoder's output,
    and the loss is the decoder's next-token cross-entropy. Tiny is 2
    encoder and 2 decoder layers of width 64, 4 heads, FFN 128, vocabulary
    4096 (the tied embedding 1 MiB), batch 2 x sequence 256 each way;
    realistic is BART-large (12 + 12 layers, width 1024, 16 heads, FFN
    4096, vocabulary 50265) at batch 8 x sequence 1024 each way."""
    _check_size(size)
    from transformers import BartConfig, FlaxBartForConditionalGeneration
    from transformers.models.bart import modeling_flax_bart

    if size == "tiny":
        config = BartConfig(vocab_size=4096, d_model=64, encoder_layers=2,
                            decoder_layers=2, encoder_attention_heads=4,
                            decoder_attention_heads=4, encoder_ffn_dim=128,
                            decoder_ffn_dim=128, max_position_embeddings=256)
        batch, seq = 2, 256
    else:
        config = BartConfig(vocab_size=50265, d_model=1024, encoder_layers=12,
                            decoder_layers=12, encoder_attention_heads=16,
                            decoder_attention_heads=16, encoder_ffn_dim=4096,
                            decoder_ffn_dim=4096, max_position_embeddings=1024)
        batch, seq = 8, 1024
    model = FlaxBartForConditionalGeneration(config, dtype=jnp.float32,
                                             _do_init=False)
    optimizer = _adamw()

    def loss_fn(params, source, target, key):
        logits = model(input_ids=source, decoder_input_ids=target,
                       params=params, dropout_rng=key, train=True).logits
        return _next_token_loss(logits, target)

    def step(state, source, target):
        params, opt_state, key = state
        key, dropout_key = jax.random.split(key)
        loss, grads = jax.value_and_grad(loss_fn)(params, source, target,
                                                  dropout_key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, key), loss

    def make_args():
        params = model.init_weights(jax.random.key(_SEED), (1, 8))
        state = (params, optimizer.init(params), jax.random.key(2))
        return (state, _tokens(batch, seq, config.vocab_size),
                _tokens(batch, seq, config.vocab_size, key=3))

    if remat:
        for layer in ("FlaxBartEncoderLayer", "FlaxBartDecoderLayer"):
            step = _blocks_rematerialized(step, modeling_flax_bart, layer)
    return _pure(_remat_name(f"bart-{size}", remat), step, make_args)


def resnet50(size: str = "tiny", remat: bool = False) -> RealStep:
    """`FlaxResNetForImageClassification` from a `ResNetConfig` (bottleneck
    blocks, BatchNorm statistics updated each step), float32: tiny is one
    block a stage, widths 32, 64, 128 and 1024 (the last 3x3 kernel 2.25
    MiB), 10 classes, batch 4 at 128x128; realistic is ResNet-50 (the
    config's defaults: 3, 4, 6 and 3 blocks, widths 256 to 2048), 1000
    classes, batch 128 at 1024x1024."""
    _check_size(size)
    from transformers import FlaxResNetForImageClassification, ResNetConfig

    if size == "tiny":
        config = ResNetConfig(embedding_size=16,
                              hidden_sizes=[32, 64, 128, 1024],
                              depths=[1, 1, 1, 1], num_labels=10)
        batch, image = 4, 128
    else:
        config = ResNetConfig(num_labels=1000)
        batch, image = 128, 1024
    model = FlaxResNetForImageClassification(config, _do_init=False)
    optimizer = _adamw()

    def loss_fn(params, batch_stats, images, labels):
        outputs, updated = model(images, params={
            "params": params, "batch_stats": batch_stats}, train=True)
        return cross_entropy(outputs.logits, labels), updated["batch_stats"]

    def step(state, images, labels):
        params, batch_stats, opt_state = state
        (loss, batch_stats), grads = jax.value_and_grad(
            loss_fn, has_aux=True)(params, batch_stats, images, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return (params, batch_stats, opt_state), loss

    def make_args():
        # Parameter shapes do not depend on the image size (global pooling).
        variables = model.init_weights(jax.random.key(_SEED), (1, 32, 32, 3))
        params, batch_stats = variables["params"], variables["batch_stats"]
        image_key, label_key = jax.random.split(jax.random.key(1))
        # Channels first, as the model takes `pixel_values`.
        images = jax.random.normal(image_key, (batch, 3, image, image))
        labels = jax.random.randint(label_key, (batch,), 0,
                                    config.num_labels, jnp.int32)
        return (params, batch_stats, optimizer.init(params)), images, labels

    if remat:
        from transformers.models.resnet import modeling_flax_resnet
        step = _blocks_rematerialized(step, modeling_flax_resnet,
                                      "FlaxResNetBottleNeckLayer")
    return _pure(_remat_name(f"resnet50-{size}", remat), step, make_args)


# --- Flax NNX ------------------------------------------------------------------


def nnx_transformer(size: str = "tiny", remat: bool = False) -> RealStep:
    """A decoder of Flax NNX layers, its blocks under `nnx.scan`, each
    making its causal mask from its input (`nnx.make_causal_mask`),
    float32: tiny is 4 blocks of width 128 (each MLP kernel stack 1 MiB),
    4 heads, vocabulary 512, batch 4 x sequence 256 (each mask 1 MiB);
    realistic is 12 blocks of width 768, 12 heads, vocabulary 32000, batch
    8 x sequence 2048."""
    _check_size(size)
    if size == "tiny":
        vocab, width, heads, depth, batch, seq = 512, 128, 4, 4, 4, 256
    else:
        vocab, width, heads, depth, batch, seq = 32000, 768, 12, 12, 8, 2048

    class Block(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.attention_norm = nnx.LayerNorm(width, rngs=rngs)
            # No bias: a key bias has an exactly-zero gradient (softmax
            # ignores it), which AdamW turns into updates made of rounding.
            self.attention = nnx.MultiHeadAttention(
                num_heads=heads, in_features=width, use_bias=False,
                decode=False, rngs=rngs)
            self.mlp_norm = nnx.LayerNorm(width, rngs=rngs)
            self.up = nnx.Linear(width, 4 * width, rngs=rngs)
            self.down = nnx.Linear(4 * width, width, rngs=rngs)

        def __call__(self, x):
            mask = nnx.make_causal_mask(x[..., 0])
            x = x + self.attention(self.attention_norm(x), mask=mask)
            return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))

    class Decoder(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.embed = nnx.Embed(vocab, width, rngs=rngs)

            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs: nnx.Rngs):
                return Block(rngs)

            self.blocks = make_blocks(rngs)
            self.norm = nnx.LayerNorm(width, rngs=rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def run(x, block):
                if remat:
                    return nnx.remat(lambda b, y: b(y))(block, x)
                return block(x)

            x = run(self.embed(tokens), self.blocks)
            return self.embed.attend(self.norm(x))

    def step(model, optimizer, tokens):
        def loss_fn(model):
            return _next_token_loss(model(tokens), tokens)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    def make_objects():
        model = Decoder(nnx.Rngs(_SEED))
        return model, nnx.Optimizer(model, _adamw(), wrt=nnx.Param)

    def make_args():
        return (*make_objects(), _tokens(batch, seq, vocab))

    def abstract_args():
        objects = nnx.eval_shape(make_objects)
        return (*objects, jax.ShapeDtypeStruct((batch, seq), jnp.int32))

    return RealStep(_remat_name(f"nnx_transformer-{size}", remat), step,
                    make_args,
                    abstract_args, nnx=True)


# --- Equinox -------------------------------------------------------------------


def equinox_transformer(size: str = "tiny", remat: bool = False
                        ) -> RealStep:
    """An Equinox decoder: blocks of `eqx.nn.LayerNorm`,
    `eqx.nn.MultiheadAttention` (causal) and `eqx.nn.MLP`, stacked by
    `eqx.filter_vmap` and run by `jax.lax.scan`, batched by `jax.vmap`,
    float32: tiny is 4 blocks of width 128 (each MLP weight stack 1 MiB),
    4 heads, vocabulary 512, batch 4 x sequence 256 (the mask broadcast to
    the heads 1 MiB); realistic is 24 blocks of width 1024, 16 heads,
    vocabulary 32000, batch 8 x sequence 2048."""
    _check_size(size)
    import equinox as eqx

    if size == "tiny":
        vocab, width, heads, depth, batch, seq = 512, 128, 4, 4, 4, 256
    else:
        vocab, width, heads, depth, batch, seq = 32000, 1024, 16, 24, 8, 2048

    class Block(eqx.Module):
        attention_norm: eqx.nn.LayerNorm
        attention: eqx.nn.MultiheadAttention
        mlp_norm: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key):
            attention_key, mlp_key = jax.random.split(key)
            self.attention_norm = eqx.nn.LayerNorm(width)
            self.attention = eqx.nn.MultiheadAttention(heads, width,
                                                       key=attention_key)
            self.mlp_norm = eqx.nn.LayerNorm(width)
            self.mlp = eqx.nn.MLP(width, width, 4 * width, depth=1,
                                  activation=jax.nn.gelu, key=mlp_key)

        def __call__(self, x, mask):
            h = jax.vmap(self.attention_norm)(x)
            x = x + self.attention(h, h, h, mask=mask)
            return x + jax.vmap(self.mlp)(jax.vmap(self.mlp_norm)(x))

    class Decoder(eqx.Module):
        embedding: eqx.nn.Embedding
        blocks: Block
        norm: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            embedding_key, blocks_key, head_key = jax.random.split(key, 3)
            self.embedding = eqx.nn.Embedding(vocab, width, key=embedding_key)
            self.blocks = eqx.filter_vmap(Block)(
                jax.random.split(blocks_key, depth))
            self.norm = eqx.nn.LayerNorm(width)
            self.head = eqx.nn.Linear(width, vocab, use_bias=False,
                                      key=head_key)

        def __call__(self, tokens):  # one sequence
            x = jax.vmap(self.embedding)(tokens)
            length = tokens.shape[0]
            mask = jnp.tril(jnp.ones((length, length), bool))
            arrays, static = eqx.partition(self.blocks, eqx.is_array)

            def layer(x, block_arrays):
                return eqx.combine(block_arrays, static)(x, mask), None

            if remat:
                layer = jax.checkpoint(layer)
            x, _ = jax.lax.scan(layer, x, arrays)
            return jax.vmap(self.head)(jax.vmap(self.norm)(x))

    optimizer = _adamw()
    # The model's static part (activations, shapes), fixed; the state is
    # its arrays.
    static = eqx.filter(
        eqx.filter_eval_shape(Decoder, jax.random.key(_SEED)),
        lambda leaf: isinstance(leaf, jax.ShapeDtypeStruct), inverse=True)

    def loss_fn(model, tokens):
        return _next_token_loss(jax.vmap(model)(tokens), tokens)

    def step(state, tokens):
        arrays, opt_state = state
        model = eqx.combine(arrays, static)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, arrays)
        arrays = eqx.filter(eqx.apply_updates(model, updates), eqx.is_array)
        return (arrays, opt_state), loss

    def make_args():
        arrays = eqx.filter(Decoder(jax.random.key(_SEED)), eqx.is_array)
        return (arrays, optimizer.init(arrays)), _tokens(batch, seq, vocab)

    return _pure(_remat_name(f"equinox_transformer-{size}", remat), step,
                 make_args)


#: The builders, by name: `REAL_MODELS[name](size)` is a `RealStep`.
#: Gemma is last: build it after the others in one process (see `gemma2`).
REAL_MODELS: dict[str, Callable[[str], RealStep]] = {
    "llama": llama,
    "gpt2": gpt2,
    "bart": bart,
    "resnet50": resnet50,
    "nnx_transformer": nnx_transformer,
    "equinox_transformer": equinox_transformer,
    "gemma2": gemma2,
}

#: The package each builder imports, for `pytest.importorskip`.
LIBRARY: dict[str, str] = {
    "gemma2": "gemma",
    "llama": "transformers",
    "gpt2": "transformers",
    "bart": "transformers",
    "resnet50": "transformers",
    "nnx_transformer": "flax",
    "equinox_transformer": "equinox",
}
