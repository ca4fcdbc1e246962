"""ferry: one-sided READ/WRITE transfers between processes, over same-host
shared memory, RDMA or TCP, with notifications, messages and RPC.

>>> import ferry, numpy
>>> with ferry.Node() as node:
...     blocks = numpy.zeros((64, 4096), dtype=numpy.uint8)
...     region = node.register(blocks)
...     handle = region.remote().to_bytes()   # give it to a peer

A peer turns ``handle`` back into a :class:`RemoteRegion` and reads or
writes it (:meth:`Node.read`, :meth:`Node.write`, :meth:`Node.submit`), or
prepares descriptor lists once and posts transfer requests over them
(:meth:`Node.prepare_remote`, :meth:`Node.make_xfer`), as KV-cache
connectors do; or each side declares how its tensors lie in memory
(:class:`TensorLayout`, :class:`RankLayout`), the node plans once
(:meth:`Node.plan_transfer`) and each request names only block tables
(:meth:`TransferPlan.request`). Weight sets go from a trainer's ranks
to inference processes of another sharding, version after version, behind
a fence (:class:`Publisher`, :class:`Subscriber`). Every error is a
:class:`FerryError`.
"""

import ctypes as _ctypes

# rdma-core's libibverbs, where the host has it, loaded now (locally, as
# ferry's own dlopen does later) rather than when the first node starts.
# ferry needs it only then, but NIXL 1.5.1's wheel carries its own copy of
# libnl, and a process in which the host's libibverbs (and with it the
# host's libnl) is loaded after NIXL's UCX started crashes at exit in
# NIXL's libnl (rtnl_tc_unregister), with or without ferry; loaded first,
# as when ferry linked libibverbs, it does not. Without rdma-core this
# fails, and ferry runs without ibverbs, saying why.
try:
    _ctypes.CDLL("libibverbs.so.1")
except OSError:
    pass

from ._addr import NodeAddr
from ._ferry import __version__ as __version__
from ._errors import *  # noqa: F401,F403
from ._errors import __all__ as _errors_all
from ._layout import MemorySpan, Paged, RankLayout, TensorLayout
from ._nixl_plan import NixlPlan, nixl_plan
from ._node import Delivery, Node, Op, TransportStatus
from ._plan import TransferPlan
from ._weights import Publisher, ReadGuard, Subscriber, Update, WriteGuard
from ._region import Region, RemoteRegion
from ._xfer import Estimate, LocalDescs, PreparedRemote, RemoteDescs, Strided, Xfer, XferStatus

__all__ = [
    "Node",
    "NodeAddr",
    "Region",
    "RemoteRegion",
    "Op",
    "Delivery",
    "TransportStatus",
    "Strided",
    "LocalDescs",
    "RemoteDescs",
    "PreparedRemote",
    "Xfer",
    "XferStatus",
    "Estimate",
    "TensorLayout",
    "RankLayout",
    "Paged",
    "MemorySpan",
    "TransferPlan",
    "NixlPlan",
    "nixl_plan",
    "Publisher",
    "WriteGuard",
    "Subscriber",
    "ReadGuard",
    "Update",
    *_errors_all,
]
