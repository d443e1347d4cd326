"""What accelerate leaves to us on CPU: FSDP2 and DeepSpeed over gloo, the code paths GPUs take."""

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


def deepspeed_requested() -> bool:
    """Launched with a DeepSpeed accelerate config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def deepspeed_on_cpu_kwargs(cuda: bool) -> dict[str, Any]:
    """``Accelerator`` arguments that run DeepSpeed on a CPU-only machine: accelerate builds its DeepSpeed state
    only when not told to use the CPU, and without a GPU it finds no process-group backend of its own, so it is
    told to use gloo (which DeepSpeed's CPU accelerator uses too). Empty on GPUs and for other launchers."""
    if cuda or not deepspeed_requested():
        return {}
    from accelerate.utils import InitProcessGroupKwargs
    return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
