"""Which nodes' SMPs a job with a node range (--nnodes MIN:MAX) runs on after each rendezvous, told to this node's
SMP so that erasure coding protects new steps by groups formed over them (a shrink onto the survivors of a node
loss, a grow: cluster/protection.py, Protector.regroup).

Each agent of the round writes its SMP's node id into the round's store (torch's rendezvous gives every round a
store of its own, which torch's agent also assigns the ranks through) and reads every other agent's.
"""
from __future__ import annotations

from datetime import timedelta

from ..errors import InmemFTError
from ..smp import control

KEY = "inmem_ft/smp_node/"
WAIT_S = 60.0  # every agent of the round writes its id right after the rendezvous, before its ranks start


def exchange(store, group_rank: int, group_world_size: int, node: int, wait_s: float = WAIT_S) -> list[int]:
    """The SMP node ids of every agent of the round (`store`: its store), sorted."""
    store.set(f"{KEY}{group_rank}", str(node))
    keys = [f"{KEY}{r}" for r in range(group_world_size)]
    store.wait(keys, timedelta(seconds=wait_s))
    return sorted(int(v) for v in store.multi_get(keys))


def regroup(worker_group, node: int, socket: str, say) -> list[int] | None:
    """The nodes of this round, told to this node's SMP (tell); None where the agents could not exchange them
    (the groups stay as they were: the steps are then protected only while every member of the old groups is
    there), with one line saying so."""
    try:
        nodes = exchange(worker_group.store, worker_group.group_rank, worker_group.group_world_size, node)
    except (RuntimeError, ValueError) as e:  # torch's store raises DistStoreError, a RuntimeError
        say("ec_groups_unchanged", text=f"the nodes of this round could not be learnt from the rendezvous store "
                                        f"({e}); the SMP's erasure-coding groups stay as they were")
        return None
    tell(socket, nodes, say)
    return nodes


def tell(socket: str, nodes: list[int], say) -> None:
    """This node's SMP runs its erasure coding over `nodes` from now on (smp/daemon.py op_members), with one line
    of what changed, or of why it did not."""
    try:
        reply = control.call(socket, "members", nodes=nodes)
    except InmemFTError as e:
        say("ec_groups_unchanged", text=f"the SMP did not form its erasure-coding groups over nodes {nodes} ({e}); "
                                        f"they stay as they were")
        return
    if reply.get("changed"):
        say("ec_groups", nodes=",".join(map(str, nodes)), group=",".join(map(str, reply.get("group") or [])) or
            "none", text=reply.get("text", ""))
