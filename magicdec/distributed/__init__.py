"""Tensor parallelism over torch.distributed, launched with torchrun (see README, "Tensor parallelism")."""

from magicdec.distributed.group import (DEFAULT_TIMEOUT_S, DistributedError, TPGroup, init_tp, launched_world_size,
                                        shutdown_tp)
from magicdec.distributed.tp import add_all_reduces, apply_tp, check_shardable, local_config, shard_range

__all__ = ["DEFAULT_TIMEOUT_S", "add_all_reduces", "DistributedError", "TPGroup", "apply_tp", "check_shardable", "init_tp",
           "launched_world_size", "local_config", "shard_range", "shutdown_tp"]
