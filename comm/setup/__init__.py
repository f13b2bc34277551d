"""comm's set-up room: how a world starts and ends, and how groups are made in it.

``init_process_group`` and ``destroy_process_group`` (:mod:`.lifecycle`), the rendezvous
(:mod:`.init_methods`), the backends' registry (:mod:`.backends`) and the world's groups by rank
set (:mod:`.registry`). It may import both other rooms; they import nothing of it. See
:mod:`meshkit.comm` for the map.
"""

__all__: list[str] = []  # a room, not an API: its modules are imported by path
