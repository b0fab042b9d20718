"""Faults that tests inject through the environment, never through a request.

    JAXSERVE_FAULT=step:raise:N   the engine's Nth step (counting from 1) raises
    JAXSERVE_FAULT=step:hang:N    the engine's Nth step never returns
    JAXSERVE_FAULT=emit:raise:ID  post-processing request ID's tokens raises, every step

Read once, at import; with the variable unset every hook is a no-op.
"""

import os
import threading


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


def _parse(spec: str) -> tuple[str, str, str] | None:
    if not spec:
        return None
    point, action, target = spec.split(":", 2)
    if (point, action) not in (("step", "raise"), ("step", "hang"), ("emit", "raise")):
        raise ValueError(f"JAXSERVE_FAULT: unknown fault {spec!r}")
    return point, action, target


_FAULT = _parse(os.environ.get("JAXSERVE_FAULT", ""))


def before_step(index: int) -> None:
    """Called by the engine before its `index`th step runs on the device."""
    if _FAULT is None or _FAULT[0] != "step" or str(index) != _FAULT[2]:
        return
    if _FAULT[1] == "raise":
        raise InjectedFault(f"injected fault at step {index}")
    threading.Event().wait()  # hang: nothing ever sets it


def before_emit(request_id: str) -> None:
    """Called by the engine before it post-processes one request's tokens."""
    if _FAULT is not None and _FAULT[0] == "emit" and request_id == _FAULT[2]:
        raise InjectedFault(f"injected fault while post-processing {request_id}")
