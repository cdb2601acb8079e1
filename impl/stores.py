"""Where the scheduler's requests keep their K/V: paged (`PagedStore`) or dense (`DenseStore`).

| store         | admission holds room for          | grows by                     | when full           |
|---------------|-----------------------------------|------------------------------|---------------------|
| `PagedStore`  | the prompt's pages (plus what running prefills still need) | a page when the tail is full | `PoolExhausted` -> preemption |
| `DenseStore`  | a static slot of `slot_tokens` positions (serving before paging), or prompt + max_new_tokens when no slot size is set | concatenation, every step | never (reserved) |

Serving before paging kept a `[max_batch, max_seq_len]` K/V cache: every admitted request
took a slot of the model's maximum sequence length, whatever its prompt and output turn
out to be. `slot_tokens=None` is a kinder dense server that knows each request's bound and
reserves exactly prompt + max_new_tokens; `fitted_bytes()` reports that figure either way.
"""

from __future__ import annotations

from .cache import PagedCache
from .errors import PoolExhausted, ServingError
from .pool import PagePool


class PagedStore:
    def __init__(self, pool: PagePool):
        self.pool = pool
        self.caches: dict[int, PagedCache] = {}

    def pages_for(self, positions: int) -> int:
        return -(-positions // self.pool.page_size)

    def could_ever_hold(self, req) -> bool:
        return self.pages_for(req.prompt_len + req.max_new_tokens) <= self.pool.num_pages

    def can_admit(self, req, running) -> bool:
        still_needed = sum(self.pages_for(r.prefill_target) - len(self.caches[r.rid].pages)
                           for r in running if r.in_prefill)
        return self.pool.allocator.num_free >= self.pages_for(req.prefill_target) + still_needed

    def admit(self, req) -> None:
        self.caches[req.rid] = PagedCache(self.pool)

    def reserve(self, req, n: int) -> None:
        self.caches[req.rid].reserve(n)

    def release(self, req) -> None:
        self.caches.pop(req.rid).release()

    def tail_waste_slots(self) -> int:
        return sum(c.tail_free_slots for c in self.caches.values())

    def kv_bytes(self) -> int:
        return self.pool.allocator.num_live * self.pool.bytes_per_page

    def held_bytes(self) -> int:
        """K/V memory committed to requests: the live pages."""
        return self.kv_bytes()

    def fitted_bytes(self) -> int:
        return self.kv_bytes()  # pages are already fitted to what is written

    def leaked_pages(self) -> int:
        """Live pages that no request's block table names."""
        held = {p for c in self.caches.values() for p in c.pages}
        return sum(1 for p in range(self.pool.num_pages) if self.pool.ref_count(p) and p not in held)


class DenseStore:
    """Per-request dense K/V (`[Hkv, S, D]` per layer), grown by concatenation."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype, budget_tokens: int,
                 slot_tokens: int | None = None):
        if budget_tokens < 1:
            raise ServingError("capacity", f"budget_tokens must be >= 1, got {budget_tokens}")
        if slot_tokens is not None and slot_tokens < 1:
            raise ServingError("capacity", f"slot_tokens must be >= 1 or None, got {slot_tokens}")
        self.slot_tokens = slot_tokens
        self.num_layers, self.kv_heads, self.head_dim, self.dtype = num_layers, kv_heads, head_dim, dtype
        self.budget_tokens = budget_tokens
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * dtype.size
        self.reserved: dict[int, int] = {}         # rid -> positions held for it
        self.bounds: dict[int, int] = {}           # rid -> prompt + max_new_tokens
        self.lengths: dict[int, int] = {}
        self.kv: dict[int, list[list]] = {}        # rid -> per layer [keys, values] or None

    @staticmethod
    def _bound(req) -> int:
        return req.prompt_len + req.max_new_tokens

    def _reservation(self, req) -> int:
        return self.slot_tokens if self.slot_tokens is not None else self._bound(req)

    def could_ever_hold(self, req) -> bool:
        return self._bound(req) <= self._reservation(req) <= self.budget_tokens

    def can_admit(self, req, running) -> bool:
        return sum(self.reserved.values()) + self._reservation(req) <= self.budget_tokens

    def admit(self, req) -> None:
        self.reserved[req.rid] = self._reservation(req)
        self.bounds[req.rid] = self._bound(req)
        self.lengths[req.rid] = 0
        self.kv[req.rid] = [[None, None] for _ in range(self.num_layers)]

    def reserve(self, req, n: int) -> None:
        if self.lengths[req.rid] + n > self.reserved[req.rid]:
            raise PoolExhausted(f"request {req.rid} outgrew its dense reservation of {self.reserved[req.rid]}")
        self.lengths[req.rid] += n

    def release(self, req) -> None:
        for d in (self.reserved, self.bounds, self.lengths, self.kv):
            d.pop(req.rid)

    def tail_waste_slots(self) -> int:
        return sum(self.reserved[r] - self.lengths[r] for r in self.reserved)

    def kv_bytes(self) -> int:
        return sum(x.nbytes for layers in self.kv.values() for pair in layers for x in pair if x is not None)

    def reserved_bytes(self) -> int:
        return sum(self.reserved.values()) * self.bytes_per_token

    def held_bytes(self) -> int:
        """K/V memory committed to requests: each one's up-front reservation (what a
        pre-paging server allocates so a request can never run out), at least the
        bytes its arrays hold."""
        return max(self.reserved_bytes(), self.kv_bytes())

    def fitted_bytes(self) -> int:
        """What the reservations would be if each were exactly prompt + max_new_tokens."""
        return max(sum(self.bounds.values()) * self.bytes_per_token, self.kv_bytes())

    def leaked_pages(self) -> int:
        return 0  # no pages: a released request's arrays are dropped with it
