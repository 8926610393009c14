"""The names the docs' code blocks take from their page, defined for real.

A block in README.md or docs/*.md that uses names its page defines in prose
(`train_step`, `state`, `batch`, a `Model`) is preceded by the comment
`<!-- jlms-doc: setup=NAME -->`, NAME a function here; test_docs runs the
block in a namespace that `NAME()` returns. Each is as small as it can be
and still be what the page describes: a train step with its state, a Flax
model with BatchNorm and dropout. Nothing here is imported by jlms.
"""

import jax
import jax.numpy as jnp

import jlms


def _mlp_loss(params, batch):
  hidden = jnp.tanh(batch["x"] @ params["w1"])
  return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def train_step() -> dict:
  """`train_step(state, batch) -> (state, loss)`: a two-layer MLP and SGD,
  its state 64 KiB and 16 KiB of parameters, a batch of 64 rows (a multiple
  of 8, so it splits over eight devices); `args` and `abstract_args` are
  `(state, batch)`, the latter as `jax.ShapeDtypeStruct`s; `any_fn` and
  `shape_dtype_structs` name them as the getting-started page does."""
  w1, w2, x, y = jax.random.split(jax.random.key(0), 4)
  state = {"w1": jax.random.normal(w1, (64, 256)) / 8,
           "w2": jax.random.normal(w2, (256, 16)) / 16}
  batch = {"x": jax.random.normal(x, (64, 64)),
           "y": jax.random.normal(y, (64, 16))}

  def train_step(state, batch):
    loss, grads = jax.value_and_grad(_mlp_loss)(state, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, state, grads), loss

  args = (state, batch)
  return dict(jax=jax, jnp=jnp, jlms=jlms, train_step=train_step,
              state=state, batch=batch, args=args,
              abstract_args=_abstract(args),
              shape_dtype_structs=_abstract(args), any_fn=train_step)


def params_and_optimizer() -> dict:
  """`train_step(params, opt_state, batch) -> ((params, opt_state), loss)`
  with Adam (optax), and `batches`, three batches to train on."""
  import optax

  names = train_step()
  params, optimizer = names["state"], optax.adam(1e-3)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_mlp_loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss

  batch = names["batch"]
  return dict(jax=jax, jlms=jlms, optax=optax, train_step=step,
              params=params, opt_state=optimizer.init(params), batch=batch,
              batches=[batch] * 3)


def _images_and_labels():
  images = jax.random.normal(jax.random.key(1), (16, 32))
  return images, jax.random.randint(jax.random.key(2), (16,), 0, 10)


def flax_linen() -> dict:
  """`Model`, a linen module `Model()(images, train=...)` with BatchNorm and
  dropout, and `images`, `labels` for it."""
  import flax.linen as nn
  import optax

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
      x = nn.Dense(64, use_bias=False)(x)
      x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
      x = nn.Dropout(0.2, deterministic=not train)(x)
      return nn.Dense(10)(x)

  images, labels = _images_and_labels()
  return dict(jax=jax, jlms=jlms, optax=optax, Model=Model, images=images,
              labels=labels)


def flax_nnx() -> dict:
  """`Model`, an NNX module `Model(nnx.Rngs(0, dropout=1))` with BatchNorm
  and dropout, and `images`, `labels` for it."""
  from flax import nnx
  import optax

  class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.hidden = nnx.Linear(32, 64, use_bias=False, rngs=rngs)
      self.norm = nnx.BatchNorm(64, rngs=rngs)
      self.dropout = nnx.Dropout(0.2, rngs=rngs)
      self.out = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
      return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))

  images, labels = _images_and_labels()
  return dict(jax=jax, jlms=jlms, optax=optax, Model=Model, images=images,
              labels=labels)
