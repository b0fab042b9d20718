"""Several processes as one mesh: process 0 schedules, every process runs the same steps.

jax's multi-controller runtime needs every process to launch the same jitted
computations in the same order, with the same inputs. Process 0 holds the
scheduler (and the HTTP server); before each device call its runner sends a
header (what to run, at which shape) and then the packed inputs, both with
`broadcast_one_to_all` (a psum over every device, so it needs no other channel).
Every other process runs `follow`: receive, run the same call, repeat, until
process 0 sends STOP. Each shape's broadcast compiles once, during warm-up.

A process that dies is noticed by jax's coordination service (missing
heartbeats); the others then end with its error instead of waiting forever.
"""

import logging

import jax
import numpy as np

log = logging.getLogger(__name__)

STEP, SCORE, STOP = 1, 2, 3


def initialize(
    coordinator: str, num_processes: int, process_id: int, heartbeat_timeout_s: int = 30
) -> None:
    """Join the `num_processes` processes of one run (call before any other jax use).

    On CPU the collectives go through gloo, the implementation this jax supports there.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=120,
        heartbeat_timeout_seconds=heartbeat_timeout_s,
    )
    log.info(
        "process %d of %d joined %s: %d devices, %d local",
        process_id, num_processes, coordinator, jax.device_count(), jax.local_device_count(),
    )


def is_leader() -> bool:
    """This process schedules and serves (process 0, or the only one)."""
    return jax.process_index() == 0


class StepChannel:
    """Process 0's side: announce each device call, then its inputs."""

    def send(self, kind: int, shape: tuple[int, int], inputs: object) -> None:
        _broadcast(np.array([kind, *shape], np.int32))
        _broadcast(inputs)

    def stop(self) -> None:
        """Release the followers (they return from `follow`)."""
        _broadcast(np.array([STOP, 0, 0], np.int32))


def follow(runner) -> None:
    """Run process 0's device calls on this process until it sends STOP."""
    header = np.zeros(3, np.int32)
    while True:
        kind, a, b = (int(x) for x in _broadcast(header))
        if kind == STOP:
            log.info("process 0 sent STOP")
            return
        if kind == STEP:
            runner.dispatch_step(_broadcast(runner.empty_step_inputs((a, b))), (a, b))
        elif kind == SCORE:
            runner.dispatch_score(_broadcast(runner.empty_score_inputs(a)), a)
        else:
            raise RuntimeError(f"unknown command {kind} from process 0")


def _broadcast(tree: object) -> object:
    """Process 0's `tree` on every process, each leaf keeping its dtype (the psum under
    `broadcast_one_to_all` turns booleans into integers)."""
    from jax.experimental.multihost_utils import broadcast_one_to_all

    out = broadcast_one_to_all(tree)
    return jax.tree.map(lambda got, like: np.asarray(got).astype(np.asarray(like).dtype), out, tree)
