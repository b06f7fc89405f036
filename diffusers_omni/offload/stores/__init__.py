"""Block stores (see ``base``): the pinned host copy and the file-backed block, registered on import."""

from .base import BlockStore, StoreContext, register_store, registered_stores, store_for, unregister_store
from .file import FileStore
from .pinned import PinnedStore

__all__ = [
    "BlockStore",
    "FileStore",
    "PinnedStore",
    "StoreContext",
    "register_store",
    "registered_stores",
    "store_for",
    "unregister_store",
]
