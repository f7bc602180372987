"""The radix cache, page by page: a node per cached page, keyed by the tokens up to its end;
``lock_ref`` counts the running requests that hold it (SGLang's inc/dec_lock_ref along a
request's path). Unlocked leaves are evictable, least recently used first."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator


@dataclass
class Node:
    page: int
    parent: tuple[int, ...] | None
    lock_ref: int = 0
    children: int = 0
    last_access: int = 0


class RadixCache:
    def __init__(self, allocator: PagedTokenToKVPoolAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.nodes: dict[tuple[int, ...], Node] = {}
        self.clock = 0

    def _keys(self, tokens: list[int], pages: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[: (k + 1) * self.page_size]) for k in range(pages)]

    def match_prefix(self, tokens: list[int]) -> list[tuple[int, ...]]:
        """The keys of the cached pages that ``tokens`` starts with (whole pages only, the
        last token left to compute)."""
        out = []
        for key in self._keys(tokens, (len(tokens) - 1) // self.page_size):
            node = self.nodes.get(key)
            if node is None:
                break
            self.clock += 1
            node.last_access = self.clock
            out.append(key)
        return out

    def page(self, key: tuple[int, ...]) -> int:
        return self.nodes[key].page

    def insert(self, tokens: list[int], pages: list[int], upto: int) -> tuple[list[int], list[int]]:
        """Cache the first ``upto`` pages of a request; returns (its pages now, duplicates
        to free): a page whose tokens another node holds already is the node's."""
        pages = list(pages)
        duplicates = []
        parent = None
        for k, key in enumerate(self._keys(tokens, upto)):
            node = self.nodes.get(key)
            if node is None:
                self.nodes[key] = Node(pages[k], parent)
                if parent is not None:
                    self.nodes[parent].children += 1
            elif node.page != pages[k]:
                duplicates.append(pages[k])
                pages[k] = node.page
            parent = key
        return pages, duplicates

    def lock(self, keys: list[tuple[int, ...]]) -> None:
        for key in keys:
            self.nodes[key].lock_ref += 1

    def unlock(self, keys: list[tuple[int, ...]]) -> None:
        for key in keys:
            self.nodes[key].lock_ref -= 1
            assert self.nodes[key].lock_ref >= 0

    def evictable_size(self) -> int:
        return sum(self.page_size for n in self.nodes.values() if n.lock_ref == 0)

    def protected_size(self) -> int:
        return sum(self.page_size for n in self.nodes.values() if n.lock_ref > 0)

    def evict(self, pages: int) -> int:
        """Free up to ``pages`` unlocked leaves, least recently used first."""
        freed = 0
        while freed < pages:
            leaves = [(n.last_access, key) for key, n in self.nodes.items() if n.lock_ref == 0 and n.children == 0]
            if not leaves:
                break
            _, key = min(leaves)
            node = self.nodes.pop(key)
            if node.parent is not None:
                self.nodes[node.parent].children -= 1
            self.allocator.free([node.page])
            freed += 1
        return freed
