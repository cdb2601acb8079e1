"""pagecheck's system under test: the paged-attention operator (and, later, the pool,
cache and scheduler that drive it)."""

from .attention import paged_attention, paged_attention_now, paged_attention_with_metadata
from .errors import ContractViolation
from .merge import merge_states
from .runtime import amx_enabled, amx_supported, num_threads, set_amx, set_num_threads
from .validation import PagedMetadata

__all__ = [
    "ContractViolation",
    "amx_enabled",
    "amx_supported",
    "merge_states",
    "PagedMetadata",
    "num_threads",
    "paged_attention",
    "paged_attention_now",
    "paged_attention_with_metadata",
    "set_amx",
    "set_num_threads",
]
