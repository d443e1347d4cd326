"""What accelerate leaves to us on CPU: FSDP2 over gloo."""

from __future__ import annotations

import os
from typing import Any


def enable_fsdp_on_cpu(accelerator: Any) -> bool:
    """accelerate turns FSDP on only for accelerator devices; with an FSDP launch config on CPU it falls back to
    plain multi-process CPU (DDP). Install the FSDP plugin (read from the launcher's FSDP_* variables) so that
    ``prepare()`` shards the model with FSDP2 over gloo, the code path GPUs take. Returns whether it did."""
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    wants_fsdp = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if not wants_fsdp or accelerator.distributed_type != DistributedType.MULTI_CPU:
        return False
    accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin()
    accelerator.state.distributed_type = DistributedType.FSDP
    return True
