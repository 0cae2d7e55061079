"""What the ``fedsdk`` command logs, at each verbosity (docs/operations.md, "Logging").

=========  ==========================================================================================
``-q``     warnings and errors only
default    warnings, errors and fedsdk's progress lines (``fedsdk.progress``): one line per round on
           the coordinator and on each device, a line when a long step starts and ends
``-v``     every fedsdk logger down to DEBUG (``fedsdk``, ``fedsdk_coordinator``, ``fedsdk_bench``)
``-vv``    the third-party loggers too (amqtt, transitions, paho, aiohttp, asyncio)
=========  ==========================================================================================

Below ``-vv`` the third-party loggers stay at WARNING, whatever the root level, and amqtt at ERROR: its
warnings are the embedded broker's and its clients' protocol chatter (a peer that closed its socket, a
discarded QoS 0 message, a PUBACK for a message already done), which fedsdk's own lines say in words where
it matters (a lost link, a refused connection). Everything goes to stderr, so a command's own output on
stdout (a table, ``--json``) stays clean.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["OWN", "PROGRESS", "QUIET_LIBRARIES", "THIRD_PARTY", "configure"]

PROGRESS = "fedsdk.progress"
OWN = ("fedsdk", "fedsdk_coordinator", "fedsdk_bench")
THIRD_PARTY = ("amqtt", "transitions", "paho", "aiohttp", "asyncio", "urllib3", "onnxruntime")
QUIET_LIBRARIES = {"amqtt": logging.ERROR}  # below -vv; the other libraries at WARNING
DETAIL = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Formatter(logging.Formatter):
    """A progress line as ``HH:MM:SS message``; any other record with its level and logger name."""

    def __init__(self) -> None:
        super().__init__(DETAIL)
        self._short = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO and record.name.startswith(PROGRESS):
            return self._short.format(record)
        return super().format(record)


def configure(verbose: int = 0, *, quiet: bool = False, whole_process: bool | None = None) -> None:
    """Set the loggers' levels for ``-v`` counted ``verbose`` times (or ``-q``), with a stderr handler.

    ``whole_process``: also set the root and the libraries' levels and add the handler. By default only
    when the root logger has no handler yet, as in the ``fedsdk`` command; a process that configured its
    logging already (an application or a test calling :func:`fedsdk.cli.main`) keeps its handlers and its
    root and library levels, and only fedsdk's own loggers are set."""
    verbose = 0 if quiet else min(max(int(verbose), 0), 2)
    root = logging.getLogger()
    if whole_process is None:
        whole_process = not root.handlers
    if whole_process:
        if not root.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(_Formatter() if verbose == 0 else logging.Formatter(DETAIL))
            root.addHandler(handler)
        root.setLevel(logging.DEBUG if verbose >= 2 else logging.WARNING)
        for name in THIRD_PARTY:
            quiet_level = QUIET_LIBRARIES.get(name, logging.WARNING)
            logging.getLogger(name).setLevel(logging.NOTSET if verbose >= 2 else quiet_level)
    for name in OWN:
        logging.getLogger(name).setLevel(logging.DEBUG if verbose >= 1 else logging.NOTSET)
    logging.getLogger(PROGRESS).setLevel(logging.WARNING if quiet else logging.INFO)
