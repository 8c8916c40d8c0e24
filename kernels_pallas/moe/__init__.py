"""Grouped MoE (routed experts + shared expert) as Pallas-Triton kernels; see api.py."""

from kernels_pallas.moe.api import Plan, SharedExpert, moe, plan
from kernels_pallas.moe.config import Config
from kernels_pallas.moe.decode import decode_stack
from kernels_pallas.moe.reference import clamped_swiglu, moe_reference, swiglu_expert
from kernels_pallas.moe.quantized_weights import (QUANTIZED_FORMATS, QuantizedExpertWeights, dequantize_to_dense,
                                                  expert_weights)
from kernels_pallas.moe.gate_up_wgmma import RING_BOX, ring_layout
from kernels_pallas.moe.routing import Routing, check_routes, route
from kernels_pallas.moe.weights import (DenseWeights, ExpertWeights, RingLayoutWeights, as_expert_weights,
                                        decoded_in_kernel)

__all__ = ["Config", "DenseWeights", "ExpertWeights", "Plan", "QUANTIZED_FORMATS", "QuantizedExpertWeights",
           "RING_BOX", "RingLayoutWeights", "Routing", "SharedExpert", "as_expert_weights", "check_routes",
           "clamped_swiglu", "decode_stack", "decoded_in_kernel", "dequantize_to_dense", "expert_weights", "moe",
           "moe_reference", "plan", "ring_layout", "route", "swiglu_expert"]
