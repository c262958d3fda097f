"""pytest plugin (-p embedded_only): keep only tests that use the embedded SmolLM2 package (their source or a
fixture in their closure names it), to run on the GPU machine once the package is carried there."""
import inspect
import os

KEYS = ("smollm2", "embedded")


def _mentions(obj):
    try:
        src = inspect.getsource(obj).lower()
    except (OSError, TypeError):
        return False
    return any(k in src for k in KEYS)


def pytest_collection_modifyitems(session, config, items):
    keep, drop = [], []
    for item in items:
        hit = _mentions(getattr(item, "function", None))
        if not hit:
            for defs in getattr(item, "_fixtureinfo").name2fixturedefs.values():
                if any(d.argname != "chronicals_cache" and _mentions(d.func) for d in defs):
                    hit = True
                    break
        (keep if hit else drop).append(item)
    part = os.environ.get("EMBEDDED_PART")  # "i/n": every n-th kept test from the i-th, for n processes
    if part:
        i, n = map(int, part.split("/"))
        drop += [t for k, t in enumerate(keep) if k % n != i]
        keep = [t for k, t in enumerate(keep) if k % n == i]
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
