"""Device-placement planner: memory and time per GPU per phase, and the decisions that follow.

Pure Python (no torch at import): runs on a machine with no GPU and no weights.
"""

from .components import OFFICIAL, ComponentSizes, bf16_sizes, read_safetensors_tensor_bytes
from .hardware import (
    PROFILES,
    GPUSpec,
    HardwareProfile,
    LinkSpec,
    detect_hardware,
    get_profile,
    list_profiles,
    spec_for_name,
)
from .memory import BlockDims, ChunkSettings, block_activation_peak, choose_chunks
from .plan import (
    ChunkPlan,
    DualSagePlan,
    LoaderPlan,
    Plan,
    PlanRequest,
    PrefetchPlan,
    plan_job,
)

__all__ = [
    "OFFICIAL",
    "PROFILES",
    "BlockDims",
    "ChunkPlan",
    "ChunkSettings",
    "ComponentSizes",
    "DualSagePlan",
    "GPUSpec",
    "HardwareProfile",
    "LinkSpec",
    "LoaderPlan",
    "Plan",
    "PlanRequest",
    "PrefetchPlan",
    "bf16_sizes",
    "block_activation_peak",
    "choose_chunks",
    "detect_hardware",
    "get_profile",
    "list_profiles",
    "plan_job",
    "read_safetensors_tensor_bytes",
    "spec_for_name",
]
