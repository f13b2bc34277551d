"""A strategy's member that is a part's own, declared in one line: :class:`forward_to`, :func:`forward_attribute`.

Strategies are built of parts they hold, not of base classes: DDP and ZeRO hold their gradient
reducer (``self.reducer``, :mod:`~meshkit.parallel.data_parallelism.reducer`), ZeRO and FSDP their
flat shards' surface (``self.shards``, :mod:`~meshkit.parallel.data_parallelism.sharded`). Much of a
strategy's surface is a part's: ``ddp.mark_grad_ready`` is its reducer's. A forwarding method
(``def mark_grad_ready(self, name, grad=None): return self.reducer.mark_grad_ready(name, grad)``)
restates the target's signature and docstring by hand, and costs a call frame on every call, where
``mark_grad_ready`` is the hot path (per gradient per step) and the first of the five frames from
DDP to MPI that ``tests/test_structure.py`` pins. So the member is declared instead::

    class DistributedDataParallel:
        mark_grad_ready = forward_to("reducer", GradientReducer.mark_grad_ready)
        grads = forward_attribute("reducer", "grads", doc="...")

``ddp.mark_grad_ready`` *is* ``ddp.reducer.mark_grad_ready``, the part's bound method: calling it
runs no frame of ours. The first access stores that bound method in the instance's ``__dict__``
(a non-data descriptor, as :class:`functools.cached_property`), where every later lookup finds it
as any attribute, so that after it an access costs what a plain method's does: the part is the
strategy's for life (assigned once, in ``__init__``). On the class the member carries the target's
name, docstring and signature (``inspect.signature``, ``help()``, and the
:class:`~meshkit.parallel.strategy.Strategy` Protocol's check read the target's), and calling it
unbound, ``DistributedDataParallel.mark_grad_ready(ddp, name, grad)``, calls the part's.

:func:`forward_attribute` forwards a value that changes (an attribute or property of the part), read
at every access through a property whose getter is :func:`operator.attrgetter` (no Python frame
either); it is read-only on the strategy.

A member keeps its target's name (declaring ``step = forward_to("reducer", GradientReducer.sync_gradients)``
raises ``TypeError`` when the class is made), so the strategy's surface reads as the part's.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import Any, Callable, Concatenate, Generic, ParamSpec, TypeVar, overload

__all__ = ["forward_to", "forward_attribute"]

P = ParamSpec("P")
R = TypeVar("R")


def _check_name(cls: type, name: str, target: str, part: str) -> None:
    if name != target:
        raise TypeError(f"meshkit.parallel: {cls.__qualname__}.{name} forwards to self.{part}.{target}: a forwarded "
                        f"member keeps its target's name (declare {target} = ..., or write a method)")


class forward_to(Generic[P, R]):
    """A method of a strategy that is its part's: ``strategy.name`` is ``strategy.<part>.name``.

    Args:
        part: the attribute holding the part (``"reducer"``, ``"shards"``).
        target: the part's method, from its class (``GradientReducer.mark_grad_ready``): the
            member's name, docstring and signature are its.

    Example::

        class ZeroRedundancyOptimizer:
            state_dict = forward_to("shards", Shards.state_dict)

        zero.state_dict()             # runs Shards.state_dict(zero.shards): no frame of ZeRO's
        inspect.signature(ZeroRedundancyOptimizer.state_dict)   # (self) -> dict[str, Any], Shards'

    Raises:
        TypeError: ``target`` is not a function; the member is bound to another name than the target's.
    """

    def __init__(self, part: str, target: Callable[Concatenate[Any, P], R]) -> None:
        if not (isinstance(part, str) and part.isidentifier()):
            raise TypeError(f"meshkit.parallel: forward_to: part must be an attribute name, got {part!r}")
        if not inspect.isfunction(inspect.unwrap(target)):
            raise TypeError(f"meshkit.parallel: forward_to: target must be a method of the part's class (a function), "
                            f"got {type(target).__name__}; forward values with forward_attribute")
        functools.update_wrapper(self, target)  # __name__, __doc__, __wrapped__ (inspect.signature follows it)
        self.part, self.name = part, target.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        _check_name(owner, name, self.name, self.part)
        self.__qualname__ = f"{owner.__qualname__}.{name}"

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> forward_to[P, R]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> Callable[P, R]: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        bound = getattr(getattr(instance, self.part), self.name)
        instance.__dict__[self.name] = bound  # found first from now on: no descriptor call, no frame
        return bound

    def __call__(self, instance: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Called on the class, ``Strategy.name(instance, ...)``: the part's method."""
        return getattr(getattr(instance, self.part), self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.__qualname__}: forwarded to self.{self.part}.{self.name}>"


class _ForwardedAttribute(property):
    """A read-only property reading ``<part>.<name>`` (its getter an :func:`operator.attrgetter`)."""

    def __init__(self, part: str, name: str, doc: str | None) -> None:
        super().__init__(operator.attrgetter(f"{part}.{name}"))
        self.__doc__ = doc  # a property subclass's instance keeps its own (else the class docstring shadows it)
        self.part, self.name = part, name

    def __set_name__(self, owner: type, name: str) -> None:
        _check_name(owner, name, self.name, self.part)


def forward_attribute(part: str, target: str | property | Callable[[Any], Any], *, doc: str | None = None) -> Any:
    """A read-only attribute of a strategy that is its part's, read at every access.

    Args:
        part: the attribute holding the part.
        target: the part's attribute name, or its property (``GradientReducer.buckets``: the
            name and docstring are its; a type checker reads a property on the class as a callable).
        doc: the docstring (for an attribute named by a string; a property's own by default).

    Raises:
        TypeError: ``target`` is neither; the member is bound to another name than the target's.
    """
    if not (isinstance(part, str) and part.isidentifier()):
        raise TypeError(f"meshkit.parallel: forward_attribute: part must be an attribute name, got {part!r}")
    if isinstance(target, property) and target.fget is not None:
        return _ForwardedAttribute(part, target.fget.__name__, doc or target.__doc__)
    if isinstance(target, str) and target.isidentifier():
        return _ForwardedAttribute(part, target, doc)
    raise TypeError(f"meshkit.parallel: forward_attribute: target must be an attribute name or a property, got "
                    f"{target!r}")
