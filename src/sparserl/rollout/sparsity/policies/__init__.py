"""KV compression policies, one file each, behind one interface (`base.py`). Importing this package registers
every policy: a new one is a file here plus its line below."""

from . import h2o, pyramidkv, rkv, snapkv, streamingllm  # noqa: F401 - each registers its policy
from .base import (  # noqa: F401
                   POLICIES,
                   KVPolicy,
                   PolicyOption,
                   ScoringInputs,
                   additive_mask,
                   build_policy,
                   host_reads_are_cheap,
                   policy_options,
                   register,
                   select_slots,
)
from .h2o import H2O  # noqa: F401
from .pyramidkv import PyramidKV  # noqa: F401
from .rkv import RKV  # noqa: F401
from .snapkv import SnapKV  # noqa: F401
from .streamingllm import StreamingLLM  # noqa: F401
