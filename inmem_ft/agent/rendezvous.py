"""How often the agent's c10d rendezvous polls its store, scaled with the job.

torch's dynamic rendezvous waits for the other nodes by re-reading the shared state from the store once a
second (`_DistributedRendezvousOpExecutor.run` sleeps `_delay(seconds=1)` on every SYNC action), and serves
that state from a cache for a second as well (`_BackendRendezvousStateHolder`, which the agent's monitor also
reads to notice a peer waiting for a new round). The fixed second protects the store at thousands of nodes;
on a few nodes it is most of a restart: each of the round's steps waits up to a second for the next poll.

Here both scale with the number of nodes: poll = clamp(nodes x 1 ms, 50 ms, 1 s). Every agent reads the state
at most once per poll, so the store sees at most nodes / poll reads a second: 1000 a second from 50 nodes up
(what torch's fixed second gives at 1000 nodes), fewer below, and torch's own load above 1000 nodes.

Only this agent's handler changes, and only in those two places: its executor runs torch's own `run` (whatever
torch version is installed) with `_delay` bound to the poll, and its state holder's cache lasts one poll.
torch's other delays (keep-alives, timeouts) are left as they are, and so is the random skew of 0-0.3 s before a
node joins while the state is at round 0, but only at the job's start (skew_first_join_only): the round number
advances once every participant of a complete round has left, so the first restart's joins are at round 0
too, and each node waited its skew in turn (0.2-0.3 s each measured, in series: the healthy node leaves only
after the failed one waits in the new round).
"""
from __future__ import annotations

import types
from datetime import timedelta

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

PER_NODE_S = 0.001
MIN_S = 0.05
MAX_S = 1.0  # torch's own


def default_poll(nodes: int) -> float:
    return min(max(nodes * PER_NODE_S, MIN_S), MAX_S)


def scale_polling(handler, poll_s: float | None) -> tuple[float, int] | None:
    """Make `handler` (the agent's rendezvous handler) poll every `poll_s` seconds (None: default_poll of its
    --nnodes maximum). Returns (poll, nodes), or None where the handler is not torch's dynamic rendezvous
    (static rendezvous: nothing polls) or torch's executor no longer sleeps through `_delay`."""
    if not isinstance(handler, dynamic_rendezvous.DynamicRendezvousHandler):
        return None
    executor, holder = getattr(handler, "_op_executor", None), getattr(handler, "_state_holder", None)
    run = getattr(type(executor), "run", None)
    if run is None or "_delay" not in run.__code__.co_names or not hasattr(holder, "_cache_duration"):
        return None
    nodes = handler.settings.max_nodes
    poll = default_poll(nodes) if poll_s is None else poll_s

    def delay(seconds) -> None:  # the SYNC poll is the only `_delay` in `run`
        dynamic_rendezvous._delay(poll)

    executor.run = types.MethodType(_with_delay(run, delay), executor)
    holder._cache_duration = poll
    return poll, nodes


def set_last_call(handler, seconds: float) -> bool:
    """From now on, a round of `handler` that has its minimum of nodes waits `seconds` for more (torch's
    last_call_timeout, which torch reads once, at the handler's creation, for every round). False where the
    handler is not torch's dynamic rendezvous or keeps its timeouts elsewhere now."""
    timeout = getattr(getattr(handler, "_settings", None), "timeout", None)
    if not isinstance(handler, dynamic_rendezvous.DynamicRendezvousHandler) or not hasattr(timeout, "_last_call"):
        return False
    timeout._last_call = timedelta(seconds=seconds)
    return True


class LastCall:
    """When this agent's rounds waited for more nodes than their minimum: torch's dynamic rendezvous sets the
    round's state `deadline` (UTC) to now + last_call when its minimum of nodes has joined, and completes the
    round there unless the maximum joins first; completing clears it. Every state the join sees passes through
    here, so the newest deadline seen is when that round's wait for a spare began (deadline - last_call) and
    was to end. Read from the state torch syncs anyway: nothing here touches the store."""

    def __init__(self, handler):
        self.handler, self._deadline = handler, None
        executor = getattr(handler, "_op_executor", None)
        self.active = isinstance(handler, dynamic_rendezvous.DynamicRendezvousHandler) and callable(
            getattr(executor, "run", None))
        if self.active:
            run = executor.run  # torch's, or scale_polling's (whichever was bound last)

            def watched(state_handler, deadline, update_deadline=None):
                return run(self._watching(state_handler), deadline, update_deadline)

            executor.run = watched

    def _watching(self, state_handler):
        def handle(ctx, deadline):
            action = state_handler(ctx, deadline)
            if getattr(ctx.state, "deadline", None) is not None:
                self._deadline = ctx.state.deadline
            return action
        return handle

    def take(self) -> tuple[float, float] | None:
        """(start, end) in time.time() of the last round's wait for more nodes, or None where it did not wait
        (the maximum joined); forgets it, so that the next round starts afresh."""
        deadline, self._deadline = self._deadline, None
        if deadline is None:
            return None
        end = deadline.timestamp()
        return end - self.handler._settings.timeout.last_call.total_seconds(), end


def skew_first_join_only(handler) -> bool:
    """Make `handler` skew its join by torch's random delay at its first rendezvous only (the job's start, when
    every node joins at once), not at a restart that still finds the state at round 0: a restart joins as
    torch's joins at round 1 and later do. Its `next_rendezvous` is torch's own (whatever torch version is
    installed) with `_delay` bound to a function that waits only before the first join. False where the
    handler is not torch's dynamic rendezvous or its next_rendezvous no longer delays through `_delay`."""
    if not isinstance(handler, dynamic_rendezvous.DynamicRendezvousHandler):
        return False
    join = getattr(type(handler), "next_rendezvous", None)
    if join is None or "_delay" not in join.__code__.co_names:
        return False
    joined: list[bool] = []

    def delay(seconds) -> None:  # the skew is the only `_delay` in `next_rendezvous`
        if not joined:
            dynamic_rendezvous._delay(seconds)

    skewed = _with_delay(join, delay)

    def next_rendezvous():
        info = skewed(handler)
        joined.append(True)
        return info

    handler.next_rendezvous = next_rendezvous
    return True


def _with_delay(function, delay):
    """torch's `function` with its module's `_delay` bound to `delay`, in a copy of its globals (torch's module
    keeps its own `_delay`)."""
    scoped = {**function.__globals__, "_delay": delay}
    return types.FunctionType(function.__code__, scoped, function.__name__, function.__defaults__,
                              function.__closure__)
