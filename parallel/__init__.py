"""Data-parallel training strategies built on meshes and process groups."""

__all__: list[str] = []
