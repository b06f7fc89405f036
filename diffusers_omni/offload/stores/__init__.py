"""Block stores (see ``base``): the pinned host copy, the file-backed block and the lossless (coded) host copy,
registered on import."""

from .base import BlockStore, StoreContext, register_store, registered_stores, store_for, unregister_store
from .file import FileStore
from .lossless import LosslessStore
from .pinned import PinnedStore

__all__ = [
    "BlockStore",
    "FileStore",
    "LosslessStore",
    "PinnedStore",
    "StoreContext",
    "register_store",
    "registered_stores",
    "store_for",
    "unregister_store",
]
