"""Hugging Face integration: config, SDAR backbone, MRP head, model class and decoding loop.

These files double as a checkpoint's remote code: they import only torch, transformers, einops,
mrp_triton and each other (relatively).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_sdar_mrp import SDARMRPConfig
from .decode_engine import DecodeStats
from .decoding import SDARGenerateOutput
from .generation_settings import GenerationSettings
from .modeling_sdar_mrp import SDARMRPForCausalLM, SDARMRPPreTrainedModel

AutoConfig.register(SDARMRPConfig.model_type, SDARMRPConfig, exist_ok=True)
AutoModel.register(SDARMRPConfig, SDARMRPForCausalLM, exist_ok=True)
AutoModelForCausalLM.register(SDARMRPConfig, SDARMRPForCausalLM, exist_ok=True)

__all__ = ["DecodeStats", "GenerationSettings", "SDARGenerateOutput", "SDARMRPConfig", "SDARMRPForCausalLM",
           "SDARMRPPreTrainedModel"]
