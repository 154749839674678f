"""argparse `type=` checks the commands share (sizes and durations are units.py's): each refuses a bad value with
its own one line, which argparse prints as `error: argument --x: <line>`, never its bare "invalid value"."""
from __future__ import annotations

import argparse

from .smp import paths


def job_id(text: str) -> str:
    """A --job: the name goes into paths and segment names, so a bad one is refused here, naming the option, not
    with a traceback where the first path is built."""
    try:
        return paths.check_job(text)
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
