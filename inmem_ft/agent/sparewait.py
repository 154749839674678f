"""Waiting for a node to join before a restart: the ranks exited with SPARE_EXIT (the job cannot go on at this node
count: on_shrink "refuse", inmem_ft/globalbatch.py), so a restart at the same count would only fail again. The
agent holds its restart until torch's rendezvous has a node waiting to join (the lost one back, or a spare), with
a line every SPARE_SAY_S; torch's keep-alives run on their own thread meanwhile, so the other agents keep this
node in the job."""
from __future__ import annotations

import time

SPARE_SAY_S = 30.0
POLL_S = 0.5


def wait(waiting, say, say_every_s: float = SPARE_SAY_S, poll_s: float = POLL_S) -> float:
    """Until `waiting()` (torch's count of nodes waiting to join) is above 0; returns the seconds waited."""
    start = said = time.monotonic()
    say("spare_wait", text="the ranks cannot go on at this node count (their log says why): the restart waits for "
                           "a node to join")
    while not waiting():
        time.sleep(poll_s)
        if time.monotonic() - said >= say_every_s:
            said = time.monotonic()
            say("spare_wait", waited_s=round(said - start), text="still no node waiting to join")
    waited = time.monotonic() - start
    say("spare_joined", waited_s=round(waited, 1), text="a node waits to join: the ranks restart with it")
    return waited
