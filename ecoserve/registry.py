"""A tiny name -> object registry, so the CLI and configs can pick parts by name."""
from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def add(self, name: str, item: T) -> T:
        key = name.lower()
        if key in self._items:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._items[key] = item
        return item

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(item: T) -> T:
            return self.add(name, item)
        return wrap

    def get(self, name: str) -> T:
        try:
            return self._items[name.lower()]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name.lower() in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
