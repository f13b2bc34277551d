"""meshkit.plan: a parallelism planner. Describe or calibrate a machine, describe a model by its
layers, and predict each configuration's per-rank memory (exact: the strategies' own arithmetic)
and step time (an alpha-beta model of the collectives each step issues, compute, overlap and the
pipeline bubble), or search all configurations of a world size for the fastest that fits.

    machine = meshkit.plan.calibrate(mesh)          # collective: every rank of the mesh
    machine.save("calib.json")
    model = meshkit.plan.Model.load("model.json")
    ranked = meshkit.plan.search(model, 8, meshkit.plan.Machine.load("calib.json"), memory_cap=2**30)

Modules (docs/planner.md): ``machine.py`` (alpha-beta cost per link), ``calibrate.py`` (measures
a Machine on a mesh), ``model.py`` (a model by its layers, a configuration), ``estimate.py`` (memory as
``memory_report`` gives it, step time), ``search.py`` (a world size's configurations, fastest first),
``__main__.py`` (``python -m meshkit.plan``).
"""

from .calibrate import calibrate
from .estimate import Breakdown, Collective, estimate, predict_collectives, predict_memory, step_collectives
from .machine import KINDS, PATHS, Level, LinkCost, Machine, bus_bytes
from .model import Config, Layer, Model
from .search import PlanError, scaling, search

__all__ = ["calibrate", "estimate", "search", "Machine", "Level", "LinkCost", "Model", "Layer", "Config",
           "Breakdown", "Collective", "PlanError", "scaling", "KINDS", "PATHS", "bus_bytes", "predict_memory", "predict_collectives",
           "step_collectives"]
