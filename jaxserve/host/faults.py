"""Faults that tests inject through the environment, never through a request.

    JAXSERVE_FAULT=step:raise:N   the engine's Nth step (counting from 1) raises
    JAXSERVE_FAULT=step:hang:N    the engine's Nth step never returns
    JAXSERVE_FAULT=emit:raise:ID  post-processing request ID's tokens raises, every step
    JAXSERVE_FAULT=sample:raise:ID  setting up request ID's sampling for a step raises
    JAXSERVE_FAULT=serialize:raise:ID  the server's writing of request ID's answer raises

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
    points = ("step", "raise"), ("step", "hang"), ("emit", "raise"), ("sample", "raise"), (
        "serialize", "raise")
    if (point, action) not in points:
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
    _raise_for("emit", request_id, "post-processing")


def before_sampling(request_id: str) -> None:
    """Called by the engine before it sets up one request's sampling for a step."""
    _raise_for("sample", request_id, "setting up the sampling of")


def before_serialize(request_id: str) -> None:
    """Called by the server before it writes one request's tokens into its answer."""
    _raise_for("serialize", request_id, "serializing the answer of")


def _raise_for(point: str, request_id: str, what: str) -> None:
    if _FAULT is not None and _FAULT[0] == point and request_id == _FAULT[2]:
        raise InjectedFault(f"injected fault while {what} {request_id}")
