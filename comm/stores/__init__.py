"""Key-value stores (torch.distributed's ``Store``): how processes find each other before a process
group exists, and what ``init_process_group(store=...)`` builds on.

``HashStore`` (threads of one process), ``FileStore`` (a shared file), ``TCPStore`` (a server in the
master process) and ``PrefixStore`` (a namespace in another store) share one semantics, in
``store.py``.

Modules: ``store.py`` (``Store``, the one semantics), ``hash_store.py``, ``file_store.py`` (exclusive,
the user's permissions), ``tcp_store.py`` (the client), ``tcp_server.py`` (the master's server
thread, bounded), ``wire.py`` (TCPStore's protocol and size limits), ``auth.py`` (the mutual
handshake), ``limits.py`` (the server's bounds and their variables), ``prefix_store.py``.
"""

from .file_store import FileStore
from .hash_store import HashStore
from .prefix_store import PrefixStore
from .store import QueueEmptyError, Store
from .tcp_store import TCPStore

__all__ = ["Store", "HashStore", "FileStore", "TCPStore", "PrefixStore", "QueueEmptyError"]
