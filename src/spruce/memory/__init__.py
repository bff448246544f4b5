"""Paged KV memory: page allocator, request-to-page table, KV pools with tree scratch."""

from spruce.memory.kv_pool import KVPool
from spruce.memory.page_allocator import PageAllocator
from spruce.memory.page_table import PageTable

__all__ = ["KVPool", "PageAllocator", "PageTable"]
