"""argparse `type=` checks the commands share (sizes and durations are units.py's): each refuses a bad value with
its own one line, which argparse prints as `error: argument --x: <line>`, never its bare "invalid value"; and the
parser the commands (`inmem-ft`, `python -m inmem_ft.smp`) share."""
from __future__ import annotations

import argparse
import re

from .jobid import check_job


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`inmem-ft smp start: error: ...`), and with values such as -5GiB
    taken as a value to reject, not as an unknown option."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # argparse's own pattern (private, stable since 3.2) accepts only plain numbers like -5 as values.
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def job_id(text: str) -> str:
    """A --job: the name goes into paths and segment names, so a bad one is refused here, naming the option, not
    with a traceback where the first path is built."""
    try:
        return check_job(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def bounded(kind, message: str, *, minimum=None, above=None, maximum=None, not_a_number: str | None = None):
    """A `kind` (int, float) within the bounds (`above`: exclusive); `message` (with {text!r}) says what is wanted,
    `not_a_number` what is wrong with text that is no number at all (default: `message`)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError((not_a_number or message).format(text=text)) from None
        if ((minimum is not None and value < minimum) or (above is not None and value <= above)
                or (maximum is not None and value > maximum)):
            raise argparse.ArgumentTypeError(message.format(text=text))
        return value
    return parse


# --node: an index from 0 (a negative one would name a socket node-1.sock)
node_id = bounded(int, "node id {text!r} must be an integer >= 0", minimum=0)
