"""A zoo of well-known Flax (linen) networks as train steps on synthetic data.

Every builder returns a `models.StepCase` (`name`, `step`, `make_args`,
`abstract_args`) with the guarantees stated in `benchmarks/models.py`: the
step is pure and jittable, `make_args()` is deterministic, and
`abstract_args()` (`jax.eval_shape(make_args)`) allocates nothing, so a case
with tens of GiB of activations can be traced and compiled deviceless.
The `jlms` command line plans any builder, its arguments given with
`--arg`, e.g. from the repository's root:

    jlms plan benchmarks.zoo:gpt_case --arg layers=2 --arg seq=256 \\
        --target h100 --budget 1.5GiB --html gpt.html

Networks (the size argument is the image side, the cube side for the 3D
U-Net, the sequence length for GPT):

| builder | network | loss | optimizer |
|---|---|---|---|
| `resnet50_case` | ResNet-50: bottleneck blocks 3-4-6-3, BatchNorm | cross-entropy | SGD, momentum 0.9 |
| `densenet121_case` | DenseNet-121: dense blocks 6-12-24-16, growth 32 | cross-entropy | SGD, momentum 0.9 |
| `mobilenet_v2_case` | MobileNetV2: inverted residuals, depthwise convs, ReLU6 | cross-entropy | SGD, momentum 0.9 |
| `inception_case` | Inception-v3 layout: 3 A, 4 C, 2 E blocks and two reductions, parallel branches concatenated | cross-entropy | SGD, momentum 0.9 |
| `unet3d_case` | 3D U-Net: 4 levels of two 3x3x3 Conv3D + BatchNorm, 1 input channel | voxelwise cross-entropy | SGD, Nesterov momentum 0.99 |
| `gpt_case` | GPT decoder, layers under `nn.scan` | next-token cross-entropy | AdamW |

BatchNorm always normalises with batch statistics (training mode) and the
step returns the updated `batch_stats`. The 2D networks pad "SAME"
throughout, so they take any image side; the U-Net takes multiples of
2**(levels - 1). `ZOO[name].size_multiple` is the step in which benchmarks
search sizes. Every builder also takes the network's depth (blocks per
stage, layers, levels) so that tests can build small copies quickly; the
defaults are the published networks.

Parameters are drawn with the shapes flax's `init` gives, but not by its
initialisers (see `_init_variables`); each repeated unit has an explicit
name, so the three `remat` variants of a network share one parameter tree
and, from one seed, the same values.

`remat` chooses how the repeated unit (a bottleneck block, a dense layer,
an inverted residual, an Inception block, a U-Net double convolution, a
decoder layer) is differentiated:

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
import math
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from benchmarks.models import StepCase, _case, _DecoderBlock

_SEED = 0
REMAT_MODES = (None, "nothing_saveable", "offload")
BOUNDARY_NAME = "block_input"

_SGD_LEARNING_RATE = 0.1
_SGD_MOMENTUM = 0.9
_ADAM_LEARNING_RATE = 1e-3
_UNET_LEARNING_RATE = 1e-2
_UNET_MOMENTUM = 0.99
_BATCH_NORM_MOMENTUM = 0.9


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


# --- shared layers -------------------------------------------------------------


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


# --- ResNet-50 -------------------------------------------------------------------


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


# --- DenseNet-121 ----------------------------------------------------------------


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


# --- MobileNetV2 -----------------------------------------------------------------


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


# --- Inception-v3 layout ---------------------------------------------------------


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


# --- 3D U-Net --------------------------------------------------------------------


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


# --- GPT decoder under nn.scan -------------------------------------------------------


class _ScannedGPT(nn.Module):
    layers: int
    width: int
    heads: int
    seq: int
    vocab: int
    remat: str | None

    @nn.compact
    def __call__(self, tokens):
        token_embedding = nn.Embed(self.vocab, self.width)
        positions = self.param(
            "position_embedding", nn.initializers.normal(0.02), (self.seq, self.width)
        )
        h = token_embedding(tokens) + positions[: tokens.shape[1]]
        blocks = nn.scan(
            rematerialised(_DecoderBlock, self.remat, scanned=True),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
        )
        h, _ = blocks(self.width, self.heads, name="blocks")(h, None)
        return token_embedding.attend(nn.LayerNorm()(h))


# --- train steps -------------------------------------------------------------------


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

    return _case(name, step, make_args)


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
        f"{label}-i{image_size}-b{batch_size}{_suffix(remat)}",
        model,
        (batch_size, image_size, image_size, 3),
        (batch_size,),
        num_classes,
        optax.sgd(_SGD_LEARNING_RATE, momentum=_SGD_MOMENTUM),
        (1, 32, 32, 3),
    )


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
    label = _label("resnet50", "resnet", stage_blocks, _RESNET50_STAGES)
    model = _ResNet(num_classes, remat, tuple(stage_blocks))
    return _classifier(label, model, image_size, batch_size, remat, num_classes)


def densenet121_case(
    image_size=224, batch_size=8, remat=None, num_classes=1000, block_layers=_DENSENET121_BLOCKS
) -> StepCase:
    """DenseNet-121 (Huang et al. 2017, growth 32, compression 0.5); SGD with
    momentum 0.9. `block_layers` are the dense layers of each block."""
    label = _label("densenet121", "densenet", block_layers, _DENSENET121_BLOCKS)
    model = _DenseNet(num_classes, remat, tuple(block_layers))
    return _classifier(label, model, image_size, batch_size, remat, num_classes)


def mobilenet_v2_case(
    image_size=224, batch_size=8, remat=None, num_classes=1000, stage_repeats=_MOBILENET_V2_REPEATS
) -> StepCase:
    """MobileNetV2 (Sandler et al. 2018, width 1.0); SGD with momentum 0.9.
    `stage_repeats` are the inverted residuals of each of the seven stages."""
    if len(stage_repeats) != len(_MOBILENET_V2_STAGES):
        raise ValueError(f"stage_repeats needs {len(_MOBILENET_V2_STAGES)} counts")
    label = _label("mobilenetv2", "mobilenetv2", stage_repeats, _MOBILENET_V2_REPEATS)
    model = _MobileNetV2(num_classes, remat, tuple(stage_repeats))
    return _classifier(label, model, image_size, batch_size, remat, num_classes)


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
    label = _label("inception", "inception", block_counts, _INCEPTION_V3_BLOCKS)
    model = _Inception(num_classes, remat, tuple(block_counts))
    return _classifier(label, model, image_size, batch_size, remat, num_classes)


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
        f"unet3d-l{levels}-c{base_features}-i{image_size}-b{batch_size}{_suffix(remat)}",
        _UNet3D(num_classes, remat, levels, base_features),
        (batch_size, *side_shape, 1),
        (batch_size, *side_shape),
        num_classes,
        optax.sgd(_UNET_LEARNING_RATE, momentum=_UNET_MOMENTUM, nesterov=True),
        (1, *(2 ** (levels - 1),) * 3, 1),
    )


def gpt_case(
    seq=1024, batch_size=8, remat=None, layers=12, width=768, heads=12, vocab=32768
) -> StepCase:
    """A pre-LayerNorm GPT decoder (GPT-2 small widths by default) whose layers
    are one `nn.scan`, next-token cross-entropy, AdamW.

    Step: `step(params, opt_state, tokens) -> ((params, opt_state), loss)`;
    tokens int32 [batch_size, seq + 1].
    """
    model = _ScannedGPT(layers, width, heads, seq, vocab, remat)
    optimizer = optax.adamw(_ADAM_LEARNING_RATE)

    def loss_fn(params, tokens):
        logits = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    @jax.jit
    def make_args():
        params = _init_variables(model, jnp.zeros((1, seq), jnp.int32), stacked="blocks")["params"]
        tokens = jax.random.randint(jax.random.key(_SEED), (batch_size, seq + 1), 0, vocab, jnp.int32)
        return params, optimizer.init(params), tokens

    name = f"gpt-l{layers}-w{width}-s{seq}-b{batch_size}{_suffix(remat)}"
    return _case(name, step, make_args)


@dataclasses.dataclass(frozen=True)
class ZooModel:
    """A builder `build(size, batch_size, remat=..., **structure)` and the
    sizes it takes."""

    build: Callable[..., StepCase]
    size_multiple: int  # sizes are searched in steps of this
    size_name: str  # what the size argument means


ZOO = {
    "resnet50": ZooModel(resnet50_case, 32, "image side"),
    "densenet121": ZooModel(densenet121_case, 32, "image side"),
    "mobilenetv2": ZooModel(mobilenet_v2_case, 32, "image side"),
    "inception": ZooModel(inception_case, 32, "image side"),
    "unet3d": ZooModel(unet3d_case, 8, "cube side"),
    "gpt": ZooModel(gpt_case, 64, "sequence length"),
}
