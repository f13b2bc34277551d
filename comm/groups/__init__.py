"""comm's group room: a process group and the parts it holds, and the world that holds the groups.

:class:`~.group.ProcessGroup` checks a call, hands it to its queue (:mod:`.execution`), which
starts it on the engine and waits under the group's timeout (:mod:`.work`, :mod:`.progress`),
records a failure (:mod:`.failures`) and compares the call fingerprint (:mod:`.call_fingerprint`).
This room may import the engine room, never the set-up room. See :mod:`meshkit.comm` for the map.
"""

__all__: list[str] = []  # a room, not an API: its modules are imported by path
