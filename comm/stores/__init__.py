"""Key-value stores (torch.distributed's ``Store``): how processes find each other before a process
group exists, and what ``init_process_group(store=...)`` builds on.

``HashStore`` (threads of one process), ``FileStore`` (a shared file), ``TCPStore`` (a server in the
master process) and ``PrefixStore`` (a namespace in another store) share one semantics, in
``store.py``; ``wire.py`` is TCPStore's protocol and its limits.
"""

from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .store import QueueEmptyError, Store
from .tcp_store import TCPStore

__all__ = ["Store", "HashStore", "FileStore", "TCPStore", "PrefixStore", "QueueEmptyError"]
