"""jlms: Large Model Support for JAX.

Wrap a train step with `jlms.offload` and its large activations live in
pinned host memory between their forward and backward uses; `jlms.xla_memory`
measures what XLA's GPU compiler makes of it, with or without a GPU.
"""

from jlms._arguments import on_device as on_device
from jlms._compat import UnsupportedJaxError as UnsupportedJaxError
from jlms._config import OffloadConfig as OffloadConfig
from jlms._config import SyncMode as SyncMode
from jlms._fallback import FallbackWarning as FallbackWarning
from jlms._fallback import OffloadError as OffloadError
from jlms._offload import OffloadedStep as OffloadedStep
from jlms._offload import StateOnDeviceWarning as StateOnDeviceWarning
from jlms._offload import offload as offload
from jlms._nnx import OffloadedNnxStep as OffloadedNnxStep
from jlms._nnx import offload_nnx as offload_nnx
from jlms._plan import OffloadedValue as OffloadedValue
from jlms._plan import Plan as Plan
from jlms._replan import ReplanWarning as ReplanWarning
from jlms._tradeoff import Tradeoff as Tradeoff
from jlms._tradeoff import TradeoffPoint as TradeoffPoint
from jlms._budget import BudgetError as BudgetError
from jlms._stats import MemoryStats as MemoryStats
from jlms._stats import memory_stats as memory_stats
from jlms._verify import MemoryComparison as MemoryComparison
from jlms._verify import OffloadIneffectiveWarning as OffloadIneffectiveWarning
from jlms._verify import compare_memory as compare_memory
from jlms._xla_memory import DevicelessUnavailableError as DevicelessUnavailableError
from jlms._xla_memory import XlaMemory as XlaMemory
from jlms._xla_memory import target_devices as target_devices
from jlms._xla_memory import xla_memory as xla_memory

__version__ = "0.1.0"
