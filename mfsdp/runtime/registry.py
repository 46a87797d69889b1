"""Which module owns which parameter, kept outside the Parameter objects and held weakly."""

from __future__ import annotations

import weakref
from typing import Any, Optional


class IdentityWeakMap:
    """A map keyed by object identity that holds keys and values weakly.

    ``WeakKeyDictionary`` compares keys with ``==``, which tensors overload elementwise. Values are
    weak too: a parameter's group holds the parameter, so a strong value would keep its own key, and
    with it the whole model, alive for ever.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref, Any]] = {}

    def __setitem__(self, key: object, value: Any) -> None:
        ident = id(key)

        def forget(_ref, ident=ident, entries=self._entries):
            entry = entries.get(ident)
            if entry is not None and entry[0]() is None:
                del entries[ident]

        self._entries[ident] = (weakref.ref(key, forget), weakref.ref(value))

    def get(self, key: object, default: Optional[Any] = None) -> Any:
        entry = self._entries.get(id(key))
        if entry is None or entry[0]() is not key:
            return default
        value = entry[1]()
        return default if value is None else value

    def __contains__(self, key: object) -> bool:
        entry = self._entries.get(id(key))
        return entry is not None and entry[0]() is key


# Original and sharded parameters -> owning FsdpModule; sharded parameter -> its group.
OWNER_OF_PARAMETER = IdentityWeakMap()
GROUP_OF_SHARDED = IdentityWeakMap()
