"""Tensor parallelism applied at load time, in the style of gpt-fast's tp.py: shard a loaded Transformer in place so
that each rank holds its share of every layer and one all-reduce joins the shares.

- Attention by heads: each rank takes a contiguous run of KV heads together with their query groups (GQA query head h
  reads KV head h // G), so attention needs nothing from the other ranks. The fused wqkv is split by output rows (q,
  k and v each keep their rank's heads); wo by input columns, so each rank's output is a partial sum over its heads,
  all-reduced.
- MLP: the fused w13 keeps the rank's columns of the gate half and of the up half; w2 its rows; one all-reduce of the
  output.
- The token embedding and the LM head are replicated. The embedding is a row gather that costs next to nothing. The
  head is kept whole because sampling needs the whole distribution on every rank (each rank samples the same token
  from identical logits, with no broadcast): a vocab-parallel head would compute 1/tp of the logits and all-gather B
  x q x vocab of them per forward. Replicated is the simpler choice, not the fastest one: half the head plus an
  all-gather of the logits costs less than the whole head, so a vocab-parallel head would shorten a TP=2 decode step
  (measured for SmolLM2-135M in benchmarks/README.md, "Tensor parallelism against one process"). It is the next step
  (see the planner's TP cost, which models the head as built: replicated).

Splits need not be even: KV heads (and the MLP's columns) go out as evenly as they divide, the first ranks taking one
more (SmolLM2-135M's 3 KV heads over 2 ranks: 2 + 1, query heads 6 + 3). Each rank's `model.cfg` becomes its local
shape, so the dense and sparse caches it allocates hold its KV heads only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from magicdec.config import ModelConfig
from magicdec.distributed.group import TPGroup
from magicdec.errors import InvalidRequestError
from magicdec.model import Attention, FeedForward, Transformer


def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank's share of n items, the first n % world_size ranks taking one more."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_shardable(cfg: ModelConfig, world_size: int, name: str = "the model") -> None:
    """Refuse, before any weight is loaded, a model that cannot be split over `world_size` ranks."""
    if world_size > cfg.n_kv_heads:
        raise InvalidRequestError(f"tensor parallelism over {world_size} ranks needs at least {world_size} KV heads "
                                  f"(each rank owns whole KV heads); {name} has {cfg.n_kv_heads}: start at most "
                                  f"{cfg.n_kv_heads} processes")
    if world_size > cfg.ffn_dim:
        raise InvalidRequestError(f"{name}'s MLP ({cfg.ffn_dim} columns) cannot be split over {world_size} ranks")


def local_config(cfg: ModelConfig, world_size: int, rank: int) -> ModelConfig:
    """The shape of rank's share of a model: its KV heads, their query heads and its MLP columns."""
    kv0, kv1 = shard_range(cfg.n_kv_heads, world_size, rank)
    f0, f1 = shard_range(cfg.ffn_dim, world_size, rank)
    groups = cfg.n_heads // cfg.n_kv_heads
    return dataclasses.replace(cfg, n_heads=(kv1 - kv0) * groups, n_kv_heads=kv1 - kv0, ffn_dim=f1 - f0,
                               head_dim=cfg.head_dim)


def _shard_linear(linear: nn.Linear, style: str, ranges: list[tuple[int, int]]) -> None:
    """Keep `ranges` of the output features ("colwise") or of the input features ("rowwise")."""
    dim = 0 if style == "colwise" else 1  # nn.Linear stores weight as [out_features, in_features]
    weight = torch.cat([linear.weight.narrow(dim, a, b - a) for a, b in ranges], dim)
    linear.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if linear.bias is not None:
        # a row-sharded bias would be added once per rank by the all-reduce
        assert style == "colwise", "a row-sharded linear layer cannot keep its bias"
        linear.bias = nn.Parameter(torch.cat([linear.bias[a:b] for a, b in ranges]), requires_grad=False)
    n = sum(b - a for a, b in ranges)
    if style == "colwise":
        linear.out_features = n
    else:
        linear.in_features = n


def _shard_attention(attn: Attention, full: ModelConfig, local: ModelConfig, kv0: int) -> None:
    hd, groups = full.head_dim, full.n_heads // full.n_kv_heads
    q = (kv0 * groups * hd, (kv0 * groups + local.n_heads) * hd)
    k = (full.n_heads * hd + kv0 * hd, full.n_heads * hd + (kv0 + local.n_kv_heads) * hd)
    v = (k[0] + full.n_kv_heads * hd, k[1] + full.n_kv_heads * hd)
    _shard_linear(attn.wqkv, "colwise", [q, k, v])
    _shard_linear(attn.wo, "rowwise", [q])
    attn.n_heads, attn.n_kv = local.n_heads, local.n_kv_heads


def _shard_ffn(ffn: FeedForward, full: ModelConfig, f0: int, f1: int) -> None:
    _shard_linear(ffn.w13, "colwise", [(f0, f1), (full.ffn_dim + f0, full.ffn_dim + f1)])  # gate, up
    _shard_linear(ffn.w2, "rowwise", [(f0, f1)])


def apply_tp(model: Transformer, tp: TPGroup) -> None:
    """Shard `model` in place for tp.rank of tp.world_size, and make its config the local one.

    Call it on the loaded weights before moving them to the device, so a rank only ever copies its share. The model
    keeps the whole model's config as `model.full_cfg` and the group as `model.tp`."""
    full = model.cfg
    check_shardable(full, tp.world_size)
    local = local_config(full, tp.world_size, tp.rank)
    kv0, _ = shard_range(full.n_kv_heads, tp.world_size, tp.rank)
    f0, f1 = shard_range(full.ffn_dim, tp.world_size, tp.rank)
    for block in model.layers:
        _shard_attention(block.attention, full, local, kv0)
        _shard_ffn(block.feed_forward, full, f0, f1)
    model.cfg = local
    add_all_reduces(model, tp, full)


def add_all_reduces(model: Transformer, tp: TPGroup, full: ModelConfig) -> None:
    """Join a rank's share of the model (`model.cfg` is local) with the others: all-reduce the output of every
    attention and MLP. Separate from the sharding so that a benchmark can build a local-shaped model of placeholder
    weights directly (magicdec.calibrate.timing.synthetic_model) instead of slicing a whole one."""
    for block in model.layers:
        block.attention.register_forward_hook(lambda _module, _input, output: tp.all_reduce_(output))
        block.feed_forward.register_forward_hook(lambda _module, _input, output: tp.all_reduce_(output))
    model.full_cfg, model.tp = full, tp
