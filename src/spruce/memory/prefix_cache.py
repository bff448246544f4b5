"""Prefix cache: a radix tree over committed full pages, shared by every request and by the target's and the
draft's KV (their pools share page slots).

A node is one page of one token sequence. Its key is the page's `page_size` tokens plus the token after them:
a page's target KV depends on the tokens up to its last position, but its draft KV at that last position
comes from the pair (feature at p, token at p + 1), so the next token is part of what the page holds. With
that key, every matched page holds exactly what the new request would have computed, target and draft alike,
and the request prefills from the first unmatched position (a partial last page is never shared).

Pages in the tree are held by the allocator like any other. A request that matched a path holds a reference
on each node (`lock`) until its row is released; unreferenced leaves are evicted least recently used first
when the allocator runs short. Requests only ever write positions past their matched prefix, so a shared page
is never written after it enters the tree. (Adaptive speculation's collapsed requests may cache pages with stale
draft KV: speculative/adaptive.py says why that only lowers acceptance.)
"""

from __future__ import annotations

import itertools

from spruce.errors import InvariantError
from spruce.memory.page_allocator import PageAllocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "refs", "last_use")

    def __init__(self, key: tuple[int, ...], page: int, parent: "_Node | None"):
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.refs = 0  # running requests holding this node (and so its page)
        self.last_use = 0


class PrefixCache:
    """The tree."""

    def __init__(self, page_size: int, allocator: PageAllocator):
        self.page_size = page_size
        self.allocator = allocator
        self.root = _Node((), -1, None)
        self.num_pages = 0  # pages held by the tree
        self._clock = itertools.count(1)
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self.queried_tokens = 0  # prompt tokens looked up, since start

    def _key(self, tokens: list[int], k: int) -> tuple[int, ...] | None:
        """Key of page k of `tokens`: its tokens and the one after (None when the sequence is too short)."""
        ps = self.page_size
        if len(tokens) < (k + 1) * ps + 1:
            return None
        return tuple(tokens[k * ps:(k + 1) * ps + 1])

    def match(self, tokens: list[int]) -> list[_Node]:
        """The longest cached path of full pages for `tokens` (at least one token is always left over)."""
        path, node, k = [], self.root, 0
        while (key := self._key(tokens, k)) is not None and key in node.children:
            node = node.children[key]
            path.append(node)
            k += 1
        return path

    def lock(self, path: list[_Node]) -> None:
        """A request starts using `path` (its first len(path) pages): no eviction takes them meanwhile."""
        now = next(self._clock)
        for node in path:
            node.refs += 1
            node.last_use = now

    def unlock(self, path: list[_Node]) -> None:
        for node in path:
            if node.refs <= 0:
                raise InvariantError(f"prefix cache: unlock of page {node.page} that no request holds")
            node.refs -= 1

    def count_lookup(self, hit_tokens: int, tokens: int) -> None:
        """An admitted request's lookup: `hit_tokens` of its `tokens` came from the cache."""
        self.hit_tokens += hit_tokens
        self.queried_tokens += tokens

    def release(self, path: list[_Node], tokens: list[int], pages: list[int], valid: int) -> list[int]:
        """A request gives its row back: unlock its matched `path`, insert its own full pages whose KV is valid
        (below position `valid`, each page with its next token known); return the pages to free (those not kept
        by the tree)."""
        self.unlock(path)
        if pages[:len(path)] != [n.page for n in path]:
            raise InvariantError(f"prefix cache: a request's first pages {pages[:len(path)]} are not its matched "
                                 f"path {[n.page for n in path]}")
        node, now = (path[-1] if path else self.root), next(self._clock)
        for n in path:
            n.last_use = now
        to_free = []
        for k in range(len(path), len(pages)):
            key = self._key(tokens, k)
            if key is None or (k + 1) * self.page_size > valid:
                to_free.extend(pages[k:])
                break
            child = node.children.get(key)
            if child is None:  # new content: the tree takes this page
                child = _Node(key, pages[k], node)
                node.children[key] = child
                self.num_pages += 1
            else:  # the same content is cached already (another request's page): ours is a duplicate
                to_free.append(pages[k])
            child.last_use = now
            node = child
        return to_free

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` pages of unreferenced leaves, least recently used first; returns how many."""
        freed = 0
        while freed < num_pages:
            leaves = [n for n in self._nodes() if not n.children and n.refs == 0]
            if not leaves:
                break
            leaves.sort(key=lambda n: n.last_use)
            for leaf in leaves:
                if freed >= num_pages:
                    break
                del leaf.parent.children[leaf.key]
                self.allocator.free([leaf.page])
                self.num_pages -= 1
                freed += 1
        return freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def held_pages(self) -> set[int]:
        return {n.page for n in self._nodes()}

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
