"""comm's engine room: the engines a process group drives, and what they share.

An engine moves bytes between the ranks of one communicator (MPI, NCCL, the in-process ``local``
engine, the store engine) and answers the interface of :mod:`.engine`. Nothing here knows of
process groups, their queue or their failures: this room imports only comm's shared leaves and
``comm.stores`` (tests/test_structure.py holds it to that). See :mod:`meshkit.comm` for the map.
"""

__all__: list[str] = []  # a room, not an API: its modules are imported by path
