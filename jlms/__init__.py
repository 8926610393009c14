"""jlms: Large Model Support for JAX.

Wrap a train step with `jlms.offload` and its large activations live in
pinned host memory between their forward and backward uses; `jlms.xla_memory`
measures what XLA's GPU compiler makes of it, with or without a GPU.
"""

from jlms._config import OffloadConfig as OffloadConfig
from jlms._config import SyncMode as SyncMode
from jlms._offload import OffloadedStep as OffloadedStep
from jlms._offload import offload as offload
from jlms._plan import OffloadedValue as OffloadedValue
from jlms._plan import Plan as Plan

__version__ = "0.1.0"
