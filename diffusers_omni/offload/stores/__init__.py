"""Block stores (see ``base``): the pinned host copy, the file-backed block, the lossless (coded) host copy and the
rank's 1/N shard (AllGather), registered on import."""

from .base import BlockStore, StoreContext, register_store, registered_stores, store_for, unregister_store
from .file import FileStore
from .lossless import LosslessStore
from .pinned import PinnedStore
from .shard import ShardGroup, ShardStore

__all__ = [
    "BlockStore",
    "FileStore",
    "LosslessStore",
    "PinnedStore",
    "ShardGroup",
    "ShardStore",
    "StoreContext",
    "register_store",
    "registered_stores",
    "store_for",
    "unregister_store",
]
