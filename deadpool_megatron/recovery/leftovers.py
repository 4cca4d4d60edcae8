"""Generations a process left behind that a collection did not free, and what still holds them.

Each generation's model is a reference cycle that holds every process group of that
generation (listeners, connections, threads). After a recovery's collection, the model of
every generation before the current one must be gone; one that is not keeps its groups open
until whatever holds it lets go. Tracked with weak references (tracking keeps nothing alive),
and a survivor is reported with one referrer chain from it to what roots it (a frame, a
module, a thread's stack), so the log names the holder.
"""

from __future__ import annotations

import gc
import sys
import threading
import types
import weakref


class LeftBehind:
    """Weak references to the model of each generation this process built or ran. Shared by
    the recovery (which tracks) and its collection thread (which asks): guarded by a lock."""

    def __init__(self) -> None:
        self._models: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()

    def track(self, generation: int, model: object) -> None:
        """`model` belongs to `generation`, and no longer to an older one it was kept from
        (tracking it keeps nothing alive)."""
        with self._lock:
            self._models = {g: r for g, r in self._models.items() if r() is not model}
            self._models[generation] = weakref.ref(model)

    def survivors(self, before: int) -> dict[int, weakref.ref]:
        """The models of generations older than `before` that are still alive; freed ones
        are forgotten."""
        with self._lock:
            self._models = {g: r for g, r in self._models.items() if r() is not None}
            return {g: r for g, r in self._models.items() if g < before}


def describe(obj: object) -> str:
    """A short name for one link of a referrer chain."""
    if isinstance(obj, types.FrameType):
        code = obj.f_code
        return f"frame {code.co_name} ({code.co_filename}:{obj.f_lineno})"
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, dict) and obj.get("__name__") in sys.modules:
        return f"globals of {obj['__name__']}"
    if isinstance(obj, types.FunctionType):
        return f"function {obj.__qualname__}"
    return type(obj).__qualname__


def _is_root(obj: object) -> bool:
    return isinstance(obj, (types.FrameType, types.ModuleType)) or (
        isinstance(obj, dict) and obj.get("__name__") in sys.modules
    )


def _ours(frame: types.FrameType) -> bool:
    """A frame of this module: it holds only what the walk itself needs."""
    return frame.f_code.co_filename == __file__


def _stack_locals() -> dict[int, str]:
    """id of every object a running frame of any thread holds in a local variable -> where.
    Running frames are not found among referrers (they are not tracked by the collector)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    held: dict[int, str] = {}
    frames = sys._current_frames()
    try:
        for ident, frame in frames.items():
            while frame is not None:
                if not _ours(frame):
                    for name, value in frame.f_locals.items():
                        held.setdefault(id(value), f"thread {names.get(ident, ident)}: "
                                        f"{describe(frame)} local {name!r}")  # fmt: skip
                frame = frame.f_back
    finally:
        del frames, frame  # a frame object kept here would hold the walk's own locals
    return held


def referrer_chain(ref: weakref.ref, max_depth: int = 12, max_width: int = 2000) -> list[str]:
    """Descriptions from the nearest root (a running frame's local, a module, a frame) inwards
    along references to the object `ref` points to, breadth first over referrers (one scan of
    the heap per level); when no root is found within the limits, from where the search
    stopped. Debug-time cost only: called when a generation survived its collection."""
    stacks = _stack_locals()
    target = ref()
    if target is None:
        return []
    seen: dict[int, object] = {id(target): target}  # id -> object, kept alive while walking
    link: dict[int, int | None] = {id(target): None}  # id -> id of the object it refers to
    frontier: list = [target]
    own = {id(seen), id(link), id(stacks)}
    root, top = None, None
    for _ in range(max_depth):
        held = [id(o) for o in frontier if id(o) in stacks]
        if held:
            root, top = held[0], stacks[held[0]]
            break
        ids = {id(o) for o in frontier}
        following: list = []
        referrers = gc.get_referrers(*frontier)
        own.update((id(frontier), id(following), id(referrers)))
        for r in referrers:
            if id(r) in seen or id(r) in own or (isinstance(r, types.FrameType) and _ours(r)):
                continue
            inner = next((id(x) for x in gc.get_referents(r) if id(x) in ids), None)
            if inner is None:
                continue
            seen[id(r)] = r
            link[id(r)] = inner
            if _is_root(r):
                root = id(r)
                break
            following.append(r)
            if len(following) >= max_width:
                break
        if root is not None or not following:
            break
        frontier = following
    end = root if root is not None else id(frontier[-1])
    chain = [top] if top else []
    while end is not None:
        chain.append(describe(seen[end]))
        end = link[end]
    return chain
