"""Per-session KV prefix cache of the torch engine: turn ``k + 1`` of a conversation skips the prefill
of everything turn ``k`` already computed.

When a completion of a request with a ``session_id`` finishes, the engine copies its slot's K/V
(prompt + response, minus the last sampled token, which was never fed back) into a
:class:`PrefixStore` entry under :func:`miles.types.session_key`. A later request with that
``session_id`` whose prompt starts with the entry's token ids (and runs under the same weight version
and adapter) copies the K/V back into its slot and prefills only the rest of its prompt
(:meth:`miles.rollout.slot_cache.SlotCache.extend`). The store is an LRU bounded in tokens
(``prefix_cache_tokens``); a weight update empties it (its K/V came from the old weights), and an entry
is only written when no update happened while its row ran. Logits after a reused prefix equal a full
prefill's to float rounding (the suffix is computed in a differently shaped forward), not bitwise.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class PrefixEntry:
    """K/V of ``ids`` for every layer: ``k[l], v[l]: [kv_heads, len(ids), head_dim]``."""

    ids: tuple[int, ...]
    k: tuple[Tensor, ...]
    v: tuple[Tensor, ...]
    version: int
    adapter: str | None
    images: tuple[str, ...] = ()
    """Digests of the images whose placeholder tokens are among ``ids``, in order: a later prompt reuses
    the entry only if its own first images have these digests (equal ids, other pictures: a miss)."""


class PrefixStore:
    """LRU of :class:`PrefixEntry` by session key, at most ``capacity_tokens`` tokens in all."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, PrefixEntry] = OrderedDict()
        self.tokens = 0
        self.hit_tokens = 0  # prompt tokens whose prefill was skipped
        self.prompt_tokens = 0  # prompt tokens of every prefilled prompt (reused or not)
        self.hits = self.misses = self.evictions = self.stored = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_tokens > 0

    def lookup(self, key: str | None, prompt: tuple[int, ...], version: int, adapter: str | None,
               images: tuple[str, ...] = ()) -> PrefixEntry | None:
        """The entry under ``key`` if ``prompt`` extends its ids by at least one token, under the same
        weight version and adapter, and ``images`` (the prompt's image digests) start with the entry's;
        counts the hit or miss (no key: not counted)."""
        if key is None or not self.enabled:
            return None
        entry = self._entries.get(key)
        n = len(entry.ids) if entry is not None else 0
        if (entry is None or entry.version != version or entry.adapter != adapter or n >= len(prompt)
                or prompt[:n] != entry.ids or images[: len(entry.images)] != entry.images):
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        self.hit_tokens += n
        return entry

    def put(self, key: str, entry: PrefixEntry) -> None:
        """Store ``entry`` under ``key`` (replacing that key's), evicting least recently used entries to fit;
        an entry longer than the whole capacity is not stored."""
        if not self.enabled or len(entry.ids) > self.capacity_tokens or not entry.ids:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.tokens -= len(old.ids)
        while self._entries and self.tokens + len(entry.ids) > self.capacity_tokens:
            _, gone = self._entries.popitem(last=False)
            self.tokens -= len(gone.ids)
            self.evictions += 1
        self._entries[key] = entry
        self.tokens += len(entry.ids)
        self.stored += 1

    def clear(self) -> None:
        """Drop every entry (the weights changed or the memory was released); the counters stay."""
        self._entries.clear()
        self.tokens = 0

    def stats(self) -> dict[str, int | float]:
        return {"capacity_tokens": self.capacity_tokens, "entries": len(self._entries), "tokens": self.tokens,
                "hits": self.hits, "misses": self.misses, "stored": self.stored, "evictions": self.evictions,
                "hit_tokens": self.hit_tokens, "prompt_tokens": self.prompt_tokens,
                "hit_share": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0}
