"""An insertion-ordered sequence of weakly held items with successor lookup."""

from __future__ import annotations

import weakref
from typing import Generic, Iterator, Optional, TypeVar

T = TypeVar("T")


class IndexedOrder(Generic[T]):
    """Insertion order of items, held weakly so an order never keeps a deleted model alive.

    ``next_after(x)`` is O(1): the prefetch path asks it once per module per step.
    """

    def __init__(self) -> None:
        self._items: list[weakref.ref] = []
        self._index: dict[int, int] = {}

    def append(self, item: T) -> None:
        if id(item) in self._index:
            raise ValueError(f"{item!r} is already in this order")
        self._index[id(item)] = len(self._items)
        self._items.append(weakref.ref(item))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: object) -> bool:
        return id(item) in self._index and self._items[self._index[id(item)]]() is item

    def __iter__(self) -> Iterator[T]:
        for ref in self._items:
            item = ref()
            if item is not None:
                yield item

    def index(self, item: T) -> int:
        if item not in self:
            raise KeyError(f"{item!r} is not in this order")
        return self._index[id(item)]

    def next_after(self, item: T, distance: int = 1) -> Optional[T]:
        """The item ``distance`` places after ``item``, or None past the end."""
        position = self.index(item) + distance
        if position >= len(self._items):
            return None
        return self._items[position]()
