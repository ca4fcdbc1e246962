"""Node addresses."""

from __future__ import annotations

from typing import NamedTuple, Tuple

__all__ = ["NodeAddr"]


class NodeAddr(NamedTuple):
    """A node: the ``ip:port`` it is reached at, and its id, which tells it
    from a restarted process at the same address. ``str(addr)`` is
    ``"ip:port/id"``; :meth:`parse` reads it back."""

    endpoint: str
    id: str

    @classmethod
    def parse(cls, text: str) -> "NodeAddr":
        """The address ``str(addr)`` printed."""
        endpoint, sep, node_id = text.rpartition("/")
        if not sep or not endpoint or not node_id:
            from ._errors import InvalidArgument

            raise InvalidArgument(f"{text!r} is not a node address (ip:port/id)")
        return cls(endpoint, node_id)

    def __str__(self) -> str:
        return f"{self.endpoint}/{self.id}"

    def _tuple(self) -> Tuple[str, str]:
        return (self.endpoint, self.id)
