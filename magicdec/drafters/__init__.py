"""Drafters: propose tokens cheaply for the target to verify."""

from magicdec.drafters.base import Drafter
from magicdec.drafters.model_draft import ModelDrafter
from magicdec.drafters.self_quant import SelfQuantDrafter
from magicdec.drafters.self_spec import SelfSpecDrafter
from magicdec.drafters.vegas import VegasDrafter

__all__ = ["Drafter", "ModelDrafter", "SelfQuantDrafter", "SelfSpecDrafter", "VegasDrafter"]
