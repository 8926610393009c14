"""The four train steps of the frontier benchmark (issue 13) at its sizes,
each with and without per-layer rematerialisation.

The networks are the registry's (`benchmarks.models`); this module only
fixes the frontier's sizes and names. Every factory returns a
`models.StepCase` and takes `remat`: with it, every repeated unit (a
residual block, a decoder layer, a scanned MLP layer) is differentiated
under `jax.checkpoint` with `jax.checkpoint_policies.nothing_saveable`, so
the backward pass recomputes the unit from its input instead of reading
residuals kept from the forward pass. A case and its `remat` twin take
arguments of the same pytree structure, shapes and dtypes (the units are
named explicitly, `named=True`, so that wrapping them does not rename
parameters), so one set of arguments serves both.

- `resnet`: the 16-block BatchNorm ResNet of `models.resnet_case` (64
  channels, no downsampling, global pooling, Adam).
- `gpt`: `models.gpt_case`'s decoder with its layers under one `nn.scan`
  (12 layers, sequence 1024, width 512, 8 heads, batch 8, vocabulary 1024,
  AdamW), with a `compute_dtype` for activations and matmuls; parameters
  and optimizer state stay float32.
- `scan_mlp`: `models.scan_mlp_case`, `layers` tanh layers run by
  `jax.lax.scan` over stacked weights, MSE loss, plain SGD (or any optax
  optimizer).
"""

import dataclasses

import jax.numpy as jnp

from benchmarks import models

_REMAT = "nothing_saveable"


def _frontier_case(case: models.StepCase, remat: bool) -> models.StepCase:
    # The frontier's results call a remat twin "-remat".
    name = case.name.removesuffix(f"-{_REMAT}")
    return dataclasses.replace(case, name=name + ("-remat" if remat else ""))


def resnet(remat=False, image_size=256, batch=8, blocks=16, channels=64,
           num_classes=10, optimizer=None) -> models.StepCase:
    """`models.resnet_case` with named blocks; Adam (learning rate 1e-3) by
    default.

    Step: `step(params, batch_stats, opt_state, images, labels)
    -> ((params, batch_stats, opt_state), loss)`; images NHWC float32.
    """
    case = models.resnet_case(blocks, channels, image_size, batch, num_classes, optimizer,
                              remat=_REMAT if remat else None, named=True)
    return _frontier_case(case, remat)


def gpt(remat=False, compute_dtype=jnp.float32, layers=12, seq=1024, width=512,
        heads=8, batch=8, vocab=1024, optimizer=None) -> models.StepCase:
    """`models.gpt_case` under `nn.scan` with named layers, activations and
    matmuls in `compute_dtype`, the loss in float32; AdamW (learning rate
    1e-3) by default.

    Step: `step(params, opt_state, tokens) -> ((params, opt_state), loss)`;
    tokens int32 [batch, seq + 1].
    """
    case = models.gpt_case(layers, width, heads, seq, batch, vocab, scan_layers=True,
                           optimizer=optimizer, compute_dtype=compute_dtype,
                           remat=_REMAT if remat else None, named=True)
    return _frontier_case(case, remat)


def scan_mlp(remat=False, layers=16, width=2048, batch=4096, dtype=jnp.float32,
             optimizer=None) -> models.StepCase:
    """`models.scan_mlp_case`: plain SGD (learning rate 1e-2) unless an optax
    `optimizer` is given.

    Step: `step(params, x, y) -> (new_params, loss)` without an optimizer,
    `step(params, opt_state, x, y) -> ((params, opt_state), loss)` with one.
    """
    case = models.scan_mlp_case(layers, width, batch, dtype, optimizer,
                                remat=_REMAT if remat else None)
    return _frontier_case(case, remat)
