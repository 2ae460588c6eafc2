"""Planner: hardware profiles, a roofline cost model, an acceptance model and the choice of strategy, draft budget
and draft length. Pure Python; it does not import torch."""

from magicdec.planner.acceptance import AcceptanceTable, expected_max_normal, expected_tokens
from magicdec.planner.cost import (ForwardCost, Workload, decode_step_time, draft_time, forward_cost, selection_time,
                                   verify_step_time)
from magicdec.planner.hardware import PRESETS, HardwareProfile, get_profile
from magicdec.planner.models import MODEL_PRESETS, ModelShape, get_model_shape
from magicdec.planner.plan import DRAFT_CACHES, STRATEGIES, Plan, plan, plan_table, round_time, strategy_kv_bytes
from magicdec.planner.report import format_table, plot_speedup

__all__ = ["AcceptanceTable", "DRAFT_CACHES", "ForwardCost", "HardwareProfile", "MODEL_PRESETS", "ModelShape", "PRESETS",
           "Plan", "STRATEGIES", "decode_step_time", "draft_time", "expected_max_normal", "expected_tokens",
           "forward_cost", "format_table", "get_model_shape", "get_profile", "plan", "plan_table", "plot_speedup",
           "round_time", "selection_time", "strategy_kv_bytes", "verify_step_time", "Workload"]
