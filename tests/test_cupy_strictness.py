"""tests/doubles/fake_cupy.py and tests/doubles/nccl_double.py refuse what the real CuPy refuses.

The fake binds every call to the signature of the real CuPy function of the same name where CuPy
is installed (the cuda12 CI job installs it: cupy-cuda12x imports without a GPU), else to a table
recorded from CuPy 14.2. Here, with the real CuPy: each call below is refused (or taken) by the
real CuPy as written down, on real CuPy arrays made over memory CuPy does not own (CuPy refuses a
call before it touches a GPU, so none is needed; on a GPU machine they are real allocations); the
fake refuses the same calls with the same error, reading the real module and reading the table;
the table, the ufunc keywords and methods are the installed CuPy's; the doubles' own functions take
no argument the real ones lack. Without CuPy only the table's half runs.
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import numpy as np
import pytest

from doubles import fake_cupy
from doubles import nccl_double as double

# Each call, with what CuPy 14.2 does with it: None where it takes the call (on a machine without
# a GPU it then fails reaching the device: accepted all the same), else the exception it raises
# and the names its message quotes. ``x`` is a float64 array of 4, ``i`` an int64 array [0, 1].
CALLS = {
    "np.take(mode=)": (lambda xp, x, i: np.take(x, i, mode="raise"), TypeError, ["mode"]),
    "np.take(axis=)": (lambda xp, x, i: np.take(x, i, axis=0), None, []),
    "np.take_along_axis without axis": (lambda xp, x, i: np.take_along_axis(x, i), TypeError, ["axis"]),
    "np.take_along_axis(arr=)": (lambda xp, x, i: np.take_along_axis(arr=x, indices=i, axis=0), TypeError, ["arr"]),
    "np.add(where=)": (lambda xp, x, i: np.add(x, x, where=True), TypeError, ["where"]),
    "np.add(order=)": (lambda xp, x, i: np.add(x, x, order="C"), TypeError, ["order"]),
    "np.add(casting=)": (lambda xp, x, i: np.add(x, x, casting="unsafe"), None, []),
    "np.maximum(out=)": (lambda xp, x, i: np.maximum(x, x, out=x), None, []),
    "np.maximum.reduce": (lambda xp, x, i: np.maximum.reduce(x), NotImplementedError, []),
    "np.add.reduce(initial=)": (lambda xp, x, i: np.add.reduce(x, initial=0.0), TypeError, ["initial"]),
    "np.add.reduce(axis=)": (lambda xp, x, i: np.add.reduce(x, axis=0), None, []),
    "np.matmul(where=)": (lambda xp, x, i: np.matmul(x, x, where=True), TypeError, ["where"]),
    "x.sum(initial=)": (lambda xp, x, i: x.sum(initial=0.0), TypeError, ["initial"]),
    "x.sum(axis=)": (lambda xp, x, i: x.sum(axis=0), None, []),
    "x.max(where=)": (lambda xp, x, i: x.max(where=True), TypeError, ["where"]),
    "x.resize": (lambda xp, x, i: x.resize(8), AttributeError, ["resize"]),
    "np.concatenate(casting=)": (lambda xp, x, i: np.concatenate([x, x], casting="same_kind"), None, []),
    "np.insert": (lambda xp, x, i: np.insert(x, 0, 1.0), TypeError, ["numpy.insert"]),
    "xp.errstate": (lambda xp, x, i: xp.errstate(all="ignore"), AttributeError, ["errstate"]),
    "xp.sum(initial=)": (lambda xp, x, i: xp.sum(x, initial=0.0), TypeError, ["initial"]),
    "xp.zeros_like(prototype=)": (lambda xp, x, i: xp.zeros_like(prototype=x), TypeError, ["prototype"]),
    "xp.zeros_like(a=)": (lambda xp, x, i: xp.zeros_like(a=x), None, []),
    "xp.empty_like(a=)": (lambda xp, x, i: xp.empty_like(a=x), TypeError, ["a"]),
    "x.device_id": (lambda xp, x, i: x.device_id, AttributeError, ["device_id"]),
    "x.device.id": (lambda xp, x, i: x.device.id, None, []),
    "x.set(float32)": (lambda xp, x, i: x.set(np.zeros(4, np.float32)), TypeError, []),
    "x.set(other shape)": (lambda xp, x, i: x.set(np.zeros(7)), ValueError, []),
    "x.set(list)": (lambda xp, x, i: x.set([0.0] * 4), TypeError, []),
    "x.astype(casting=)": (lambda xp, x, i: x.astype(np.float32, casting="unsafe"), TypeError, ["casting"]),
    "x.astype(subok=)": (lambda xp, x, i: x.astype(np.float32, subok=False), TypeError, ["subok"]),
    "x.astype(copy=)": (lambda xp, x, i: x.astype(np.float32, copy=False), None, []),
    "x.reshape(copy=)": (lambda xp, x, i: x.reshape(2, 2, copy=None), None, []),
}
#: What a call CuPy refuses raises; anything else (CUDARuntimeError without a driver, ImportError
#: of a CUDA library it loads at first use) came from reaching for the device: the call was taken.
REFUSED = (TypeError, ValueError, NotImplementedError, AttributeError, IndexError)


def real_cupy():
    """The installed CuPy; skips only where CuPy is not installed (a broken one fails at import)."""
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("CuPy is not installed here: pip install 'meshkit[cuda12]' (it imports without a GPU)")
    assert fake_cupy.REAL is not None
    return fake_cupy.REAL


def real_arrays(cp):
    """``x`` and ``i`` as real CuPy arrays: device memory on a GPU machine, else arrays over memory
    CuPy does not own (never read: every call either is refused or fails reaching the device)."""
    try:
        if cp.cuda.runtime.getDeviceCount() > 0:
            return cp.arange(4.0), cp.arange(2)
    except cp.cuda.runtime.CUDARuntimeError:
        pass

    def unowned(shape, dtype):
        memory = cp.cuda.UnownedMemory(0x1000, 64, None, device_id=0)
        return cp.ndarray(shape, dtype, memptr=cp.cuda.MemoryPointer(memory, 0))
    return unowned((4,), np.float64), unowned((2,), np.int64)


def outcome(call, xp, x, i):
    """``(exception type or None, message)`` of one call."""
    try:
        call(xp, x, i)
    except REFUSED as exc:
        return type(exc), str(exc)
    except Exception as exc:  # noqa: BLE001 (the device was reached: the call itself was taken)
        return None, f"{type(exc).__name__}: {exc}"
    return None, ""


def check_against(want: dict, got: dict, who: str) -> None:
    for name, (_, kind, quoted) in CALLS.items():
        raised, message = got[name]
        assert raised is kind, f"{who}: {name}: expected {kind and kind.__name__}, got {raised} ({message})"
        for word in quoted:
            assert word in message, f"{who}: {name}: {word!r} not in {message!r}"


def on_fake(ref):
    with fake_cupy.installed() as cp, fake_cupy.reference(ref):
        x, i = cp.asarray(np.arange(4.0)), cp.asarray(np.arange(2))
        return {name: outcome(call, cp, x, i) for name, (call, _, _) in CALLS.items()}


def test_the_real_cupy_refuses_the_calls_as_written_down():
    cp = real_cupy()
    x, i = real_arrays(cp)
    got = {name: outcome(call, cp, x, i) for name, (call, _, _) in CALLS.items()}
    check_against(CALLS, got, f"CuPy {cp.__version__}")


def test_the_fake_reading_the_real_cupy_refuses_the_same_calls_with_its_errors():
    cp = real_cupy()
    x, i = real_arrays(cp)
    real = {name: outcome(call, cp, x, i) for name, (call, _, _) in CALLS.items()}
    fake = on_fake(fake_cupy.Reference(cp))
    check_against(CALLS, fake, "fake_cupy over the real CuPy")
    for name, (raised, message) in real.items():
        if raised is not None:  # the real message's quoted names are in the fake's
            for word in re.findall(r"'([\w.]+)'", message):
                assert word in fake[name][1], (name, message, fake[name][1])


def test_the_fake_reading_the_recorded_table_refuses_the_same_calls(cupy):
    """What runs where no CuPy is installed: the table alone decides."""
    check_against(CALLS, on_fake(fake_cupy.Reference(None)), "fake_cupy over the recorded table")
    with fake_cupy.reference(fake_cupy.Reference(None)):
        x = cupy.asarray(np.arange(4.0))
        with pytest.raises(LookupError, match=r"whether CuPy has cupy\.geomspace is not recorded.*pip install "
                                              r"'meshkit\[cuda12\]'"):
            np.geomspace(x, x)


def test_the_recorded_table_is_the_installed_cupys():
    cp = real_cupy()
    ref = fake_cupy.Reference(cp)
    stale = {path: (spec, fake_cupy.spec_of(ref.signature(path))) for path, spec in fake_cupy.SIGNATURES.items()
             if fake_cupy.spec_of(ref.signature(path)) != spec}
    assert not stale, f"recorded from CuPy {fake_cupy.RECORDED_FROM}, CuPy {cp.__version__} has: {stale}"
    for name in fake_cupy.UFUNCS:
        kind = type(getattr(cp, name)).__name__
        assert kind == ("_GUFunc" if name in fake_cupy.GUFUNCS else "ufunc"), (name, kind)
    present = [name for name in fake_cupy.ABSENT if ref.has(name)]
    assert not present, f"CuPy {cp.__version__} has {present} (recorded as absent)"


def test_ufunc_keywords_and_methods_are_the_installed_cupys():
    cp = real_cupy()
    x, i = real_arrays(cp)
    given = {"out": x, "dtype": np.float64, "casting": "unsafe"}
    for kw in fake_cupy.UFUNC_KWARGS:
        assert outcome(lambda xp, x, i: cp.add(x, x, **{kw: given[kw]}), cp, x, i)[0] is None, kw
    for kw in ("where", "order", "subok", "signature", "initial"):
        assert kw not in fake_cupy.UFUNC_KWARGS
        raised, message = outcome(lambda xp, x, i: cp.add(x, x, **{kw: None}), cp, x, i)
        assert raised is TypeError and message.startswith("Wrong arguments"), (kw, message)
    for kw in fake_cupy.GUFUNC_KWARGS:
        raised, message = outcome(lambda xp, x, i: cp.matmul(x, x, **{kw: None}), cp, x, i)
        assert "unexpected keyword" not in message, (kw, message)
    for kw in ("where", "subok"):
        assert outcome(lambda xp, x, i: cp.matmul(x, x, **{kw: None}), cp, x, i)[0] is TypeError, kw
    args = {"reduce": (x,), "accumulate": (x,), "reduceat": (x, i), "outer": (x, x)}
    for method, supported in fake_cupy.UFUNC_METHODS.items():
        for name in fake_cupy.UFUNCS:
            if name in fake_cupy.GUFUNCS:
                continue
            if method == "at":  # ufunc.at: a scatter op, or NotImplementedError (its dtypes are not modelled)
                assert (getattr(cp, name)._scatter_op is not None) == (name in supported), name
                continue
            raised, message = outcome(lambda xp, x, i: getattr(getattr(cp, name), method)(*args[method]), cp, x, i)
            refused = raised is NotImplementedError
            assert refused == (supported is not None and name not in supported), (name, method, message)


def _takes_no_more(fake, real) -> list[str]:
    """What ``fake`` accepts that ``real`` refuses: a positional parameter at a place where the real
    one has another, a keyword it lacks, ``*args``/``**kwargs`` it lacks."""
    f = [p for p in fake.parameters.values() if p.name != "self"]
    r = [p for p in real.parameters.values() if p.name != "self"]
    real_names = {p.name: p for p in r}
    real_var = {p.kind for p in r} & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    bad = []
    positional = [p for p in r if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for k, p in enumerate(x for x in f if x.kind in (x.POSITIONAL_ONLY, x.POSITIONAL_OR_KEYWORD)):
        if k >= len(positional) and inspect.Parameter.VAR_POSITIONAL not in real_var or \
                k < len(positional) and positional[k].name != p.name:
            bad.append(f"positional #{k} {p.name}")
    for p in f:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if p.kind not in real_var:
                bad.append(str(p))
        elif p.kind is not p.POSITIONAL_ONLY and p.name not in real_names and \
                inspect.Parameter.VAR_KEYWORD not in real_var:
            bad.append(f"keyword {p.name}")
    return bad


def test_the_fakes_own_functions_take_no_argument_cupys_lack():
    cp = real_cupy()
    fm = fake_cupy.module
    pairs = {name: (getattr(fm, name), getattr(cp, name)) for name in (
        "empty", "zeros", "ones", "full", "empty_like", "zeros_like", "ones_like", "asarray", "array", "asnumpy",
        "get_array_module")}
    pairs["random.default_rng"] = (fm.random.default_rng, cp.random.default_rng)
    for name in ("standard_normal", "random"):
        pairs[f"random.Generator.{name}"] = (getattr(fm.random.Generator, name), getattr(cp.random.Generator, name))
    for name in ("reshape", "ravel", "view", "copy", "astype", "fill", "get", "set", "item", "tolist"):
        pairs[f"ndarray.{name}"] = (getattr(fake_cupy.ndarray, name), getattr(cp.ndarray, name))
    for name in ("use",):
        pairs[f"cuda.Device.{name}"] = (getattr(fake_cupy.Device, name), getattr(cp.cuda.Device, name))
    wrong = {name: _takes_no_more(inspect.signature(fake), fake_cupy.real_signature(real))
             for name, (fake, real) in pairs.items()}
    assert not {k: v for k, v in wrong.items() if v}, wrong
    for attr in ("id", "__int__", "__enter__", "__exit__"):
        assert hasattr(cp.cuda.Device, attr), attr
    assert not hasattr(cp.ndarray, "device_id") and not hasattr(fake_cupy.ndarray, "device_id")


def test_the_nccl_doubles_module_functions_take_what_the_real_ones_take():
    cp = real_cupy()
    from cupy.cuda import nccl

    for name in ("groupStart", "groupEnd", "get_unique_id", "get_version"):
        fake = inspect.signature(getattr(double.fake_nccl, name))
        assert not _takes_no_more(fake, fake_cupy.real_signature(getattr(nccl, name))), name
    assert cp.cuda.nccl is nccl


def test_a_broken_cupy_fails_the_fake_instead_of_loosening_it(monkeypatch):
    """fake_cupy reads the real CuPy where one is installed; one that is installed and fails to
    import fails there (every fake_cupy test with it), not a fake that accepts anything."""
    import importlib.machinery
    import sys
    import types

    broken = types.ModuleType("cupy")
    broken.__spec__ = importlib.machinery.ModuleSpec("cupy", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert fake_cupy._load_real() is None  # not installed: the table
    monkeypatch.setitem(sys.modules, "cupy", broken)

    def failing(name, *args, **kwargs):
        raise ImportError("libcudart.so.12: cannot open shared object file")
    monkeypatch.setattr(importlib, "import_module", failing)
    with pytest.raises(ImportError, match="libcudart"):
        fake_cupy._load_real()
