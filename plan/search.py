def search(*a, **k): raise NotImplementedError
class PlanError(ValueError): pass
