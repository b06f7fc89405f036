"""Block stores (see ``base``): the pinned host copy, the file-backed block, the lossless (coded) host copy, the
block read coded from ``compression_cache_dir``, the block read as DFloat11's code from the checkpoint a model was
loaded from (``load_dfloat11``) and the rank's 1/N shard (AllGather), registered on import."""

from .base import BlockStore, StoreContext, register_store, registered_stores, store_for, unregister_store
from .coded_file import CodedFileStore
from .dfloat11_file import DFloat11FileStore
from .file import FileStore
from .lossless import LosslessStore
from .pinned import PinnedStore
from .shard import ShardGroup, ShardStore

__all__ = [
    "BlockStore",
    "CodedFileStore",
    "DFloat11FileStore",
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
