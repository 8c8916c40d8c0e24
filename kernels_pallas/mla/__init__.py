"""Sparse MLA attention of DeepSeek-V4 (window / HCA / CSA, one shared K = V latent head) as Pallas-Triton
kernels; see api.py."""

from kernels_pallas.mla.api import IMPLS, V4_FLASH_MLA, kernel_name, lowering_cases, sparse_mla
from kernels_pallas.mla.config import Config, default_platform
from kernels_pallas.mla.reference import check_inputs, sparse_mla_reference

__all__ = ["Config", "IMPLS", "V4_FLASH_MLA", "check_inputs", "default_platform", "kernel_name", "lowering_cases",
           "sparse_mla", "sparse_mla_reference"]
