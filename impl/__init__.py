"""pagecheck's system under test: the paged-attention operator (and, later, the pool,
cache and scheduler that drive it)."""

from .attention import paged_attention, paged_attention_with_metadata
from .errors import ContractViolation
from .runtime import num_threads, set_num_threads
from .validation import PagedMetadata

__all__ = [
    "ContractViolation",
    "PagedMetadata",
    "num_threads",
    "paged_attention",
    "paged_attention_with_metadata",
    "set_num_threads",
]
