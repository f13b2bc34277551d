"""state's seams: box arithmetic and loading that ``parallel`` and ``checkpoint`` share, not user API."""

from .boxes import box_view, flat_range_boxes, load_pieces, optimizer_state_views

__all__ = ["flat_range_boxes", "box_view", "load_pieces", "optimizer_state_views"]
