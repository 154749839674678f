"""End a distributed trainer with its own exit code, never an abort (issue 23).

A gloo process group still alive when the interpreter finalizes can abort the process with SIGABRT ("terminate
called without an active exception"): a worker thread of the group (pt_gloo_runloop) releases a finished
collective's tensors only after the caller's wait returned, and when that release asks for the GIL of an
interpreter that is finalizing, Python ends the thread by a forced unwind through a noexcept destructor. A group
destroyed while the interpreter lives has its threads joined first (~ProcessGroupGloo), so none is left.

`run_main(main)` runs a script's main function and then, on every path (return, exception, sys.exit):

1. inmem_ft's own groups are destroyed (what Snapshotter.close does; the atexit handler would do it later);
2. every process group is destroyed (torch.distributed.destroy_process_group: local for gloo, no collective;
   but ~ProcessGroupGloo joins the group's worker threads, and one still in a collective waits for its peers or
   the group's timeout, so the destroy is bounded: bounded());
3. the exception's traceback is printed (an InmemFTError gets one line instead: its message says what is wrong
   and what to do) and dropped, and a collection run, so the frames it held (a DeepSpeed engine and the group
   handles it keeps) let the groups go now, while the interpreter lives;
4. if a gloo worker thread is still alive after that (a group something else still holds), the process ends
   with os._exit after flushing stdio and logging, the one way that cannot meet that thread during
   finalization; otherwise it exits normally (sys.exit), atexit handlers and all.

The exit code is the script's: main's return value (None: 0), SystemExit's code, 1 for an exception (as Python
itself would), 130 for KeyboardInterrupt."""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import sys
import threading
import time
import traceback

from .errors import InmemFTError

log = logging.getLogger("inmem_ft.teardown")
# Destroying a gloo group takes milliseconds: it is local. One that takes longer waits on something outside this
# rank (a group's worker thread still in a collective, or a connection held up by a peer), which may not end
# before the group's own timeout: the exit goes on.
DESTROY_TIMEOUT_S = 30.0
# A gloo worker thread frees a finished collective's work under its group's mutex, and with it the Python object
# of a tensor that Python let go of first, for which it takes the GIL. ~ProcessGroupGloo waits for that mutex, and
# on torch 2.6 the binding runs it holding the GIL: a destroy right after a collective then waits forever (a
# DeepSpeed ZeRO-3 rank of the tests/compat torch-2.6 combination hung at exit so). Before a destroy the GIL is
# let go this long, so that the worker threads finish first; no collective of ours is in flight by then (close()
# waits for them).
SETTLE_S = 0.1
# A destroy that waits holding the GIL all the same stops every thread of ours, the one bounding it too: then
# faulthandler's watchdog (a thread of its own, in C) ends the process this long after the bound, every thread's
# stack in the log, with exit code 1. It replaces a faulthandler.dump_traceback_later of the application's.
WATCHDOG_GRACE_S = 15.0


def gloo_threads() -> int:
    """How many gloo worker threads (those of every live gloo group) this process has."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except OSError:  # a thread that ended meanwhile
            pass
    return count


# How to destroy the groups inmem_ft's layers made, registered by the layer when it makes its first one
# (capture/agreement.py): this module, which they use to bound their destroys, knows none of them.
_own_groups: list = []


def destroy_first(destroy) -> None:
    """Have destroy_process_groups call `destroy()` before it destroys the world's group."""
    if destroy not in _own_groups:
        _own_groups.append(destroy)


def destroy_process_groups() -> None:
    """Destroy inmem_ft's groups and then every group torch knows; local only, never a collective."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    for destroy in list(_own_groups):
        destroy()
    if dist.is_available() and dist.is_initialized():
        bounded(dist.destroy_process_group, "the world process group", dist.get_rank())


def bounded(destroy, what: str, rank: int) -> None:
    """Run `destroy()` on a thread of its own, after SETTLE_S, waiting at most DESTROY_TIMEOUT_S, and raise what it
    raised. A destroy that cannot end (a worker thread in a collective with a peer that never joins) holds up
    nothing but that daemon thread once it waits without the GIL: the rank goes on to exit and says so in one line
    (run_main then ends the process with os._exit, as it does for any gloo thread left)."""
    failed: list[BaseException] = []

    def run():
        try:
            time.sleep(SETTLE_S)
            destroy()
        except BaseException as e:  # raised in the caller's thread below
            failed.append(e)

    worker = threading.Thread(target=run, name="inmem_ft-destroy", daemon=True)
    with watchdog(DESTROY_TIMEOUT_S + WATCHDOG_GRACE_S):
        worker.start()
        worker.join(DESTROY_TIMEOUT_S)
    if worker.is_alive():
        log.warning("teardown rank=%d event=teardown_stuck: destroying %s did not end in %.0f s; exiting without "
                    "waiting for it", rank, what, DESTROY_TIMEOUT_S)
    elif failed:
        raise failed[0]


@contextlib.contextmanager
def watchdog(seconds: float):
    """End the process (faulthandler: every thread's stack, exit code 1) if the block has not ended after
    `seconds`, even where no Python thread can run any more. The outermost block's bound holds for those inside."""
    global _watching
    if _watching:
        yield
        return
    _watching = True
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        _watching = False


_watching = False


def _code_of(exit: SystemExit) -> int:
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code
    print(exit.code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def run_main(main, *args, **kwargs) -> None:
    """Run `main(*args, **kwargs)` and exit with its code, the process groups destroyed on every path."""
    code = 0
    try:
        result = main(*args, **kwargs)
        code = result if isinstance(result, int) else 0
    except SystemExit as e:
        code = _code_of(e)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = 130
    except InmemFTError as e:  # says what is wrong and what to do: one line, no traceback
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        code = getattr(e, "exit_code", 1)  # errors.STOP_EXIT: the supervisor must not restart
    except BaseException:
        traceback.print_exc()
        code = 1
    # The traceback is gone with the except clause: the frames it held, and the group handles in them, too.
    # Two bounded destroys (ours, the world's), then the collection that frees the groups the script still held.
    with watchdog(2 * DESTROY_TIMEOUT_S + WATCHDOG_GRACE_S):
        try:
            destroy_process_groups()
        except Exception:
            traceback.print_exc()  # the exit code stays the script's: a teardown failure must not hide its error
            code = code or 1
        gc.collect()
    if "torch.distributed" in sys.modules and gloo_threads():
        # A gloo group that something still holds: finalization could meet its threads. Skip it.
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
