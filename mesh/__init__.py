"""Device meshes: N-dimensional arrangements of ranks with one process group per dimension."""

__all__: list[str] = []
