"""The zoo of well-known Flax (linen) networks, by the names the `jlms`
command line and the documentation give them. The networks are defined in
the registry, `benchmarks.models` (`ZOO` there); this module only names
them. From the repository's root:

    jlms plan benchmarks.zoo:gpt_case --arg layers=2 --arg seq=256 \\
        --target h100 --budget 1.5GiB --html gpt.html

| builder | network | loss | optimizer |
|---|---|---|---|
| `resnet50_case` | ResNet-50: bottleneck blocks 3-4-6-3, BatchNorm | cross-entropy | SGD, momentum 0.9 |
| `densenet121_case` | DenseNet-121: dense blocks 6-12-24-16, growth 32 | cross-entropy | SGD, momentum 0.9 |
| `mobilenet_v2_case` | MobileNetV2: inverted residuals, depthwise convs, ReLU6 | cross-entropy | SGD, momentum 0.9 |
| `inception_case` | Inception-v3 layout: 3 A, 4 C, 2 E blocks and two reductions, parallel branches concatenated | cross-entropy | SGD, momentum 0.9 |
| `unet3d_case` | 3D U-Net: 4 levels of two 3x3x3 Conv3D + BatchNorm, 1 input channel | voxelwise cross-entropy | SGD, Nesterov momentum 0.99 |
| `gpt_case` | GPT decoder, layers under `nn.scan` (`models.zoo_gpt_case`) | next-token cross-entropy | AdamW |

Each builder takes the size (the image side, the cube side for the 3D
U-Net, the sequence length for GPT), `batch_size`, `remat` (one of
`models.REMAT_MODES`) and the network's depth (blocks per stage, layers,
levels); the defaults are the published networks.
"""

from benchmarks.models import ZOO as ZOO
from benchmarks.models import densenet121_case as densenet121_case
from benchmarks.models import inception_case as inception_case
from benchmarks.models import mobilenet_v2_case as mobilenet_v2_case
from benchmarks.models import resnet50_case as resnet50_case
from benchmarks.models import unet3d_case as unet3d_case
from benchmarks.models import zoo_gpt_case as gpt_case

__all__ = ["ZOO", "densenet121_case", "gpt_case", "inception_case", "mobilenet_v2_case",
           "resnet50_case", "unet3d_case"]
