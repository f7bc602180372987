"""The token pool: pages of ``page_size`` tokens, ``size`` tokens in all (a padding page
beside them in the buffers, as SGLang keeps page 0 out of use)."""

from __future__ import annotations


class KVCache:
    """The pool's buffers: K and V for every layer, ``size + page_size`` token slots."""

    def __init__(self, slots: int, bytes_per_token: int) -> None:
        self.slots, self.bytes_per_token = slots, bytes_per_token

    def get_kv_size_bytes(self) -> tuple[int, int]:
        half = self.slots * self.bytes_per_token // 2
        return half, half


class PagedTokenToKVPoolAllocator:
    def __init__(self, size: int, page_size: int, bytes_per_token: int) -> None:
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.free_pages: list[int] = list(range(1, self.num_pages + 1))  # page 0 pads
        self._kvcache = KVCache(size + page_size, bytes_per_token)

    def get_kvcache(self) -> KVCache:
        return self._kvcache

    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size

    def alloc(self, pages: int) -> list[int] | None:
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return taken

    def free(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)
