"""What a tool prints: results on stdout (a table, or JSON with --json), nothing else; logs and warnings on stderr.

DeepSpeed's logger writes to stdout (``deepspeed/utils/logging.py``: ``StreamHandler(stream=sys.stdout)``), and its
first import already logs: without ``DS_ACCELERATOR`` set, ``real_accelerator.py`` warns that it falls back to the
CPU. So ``tools/plan.py --json | jq`` would read that warning before the JSON. A tool whose work imports DeepSpeed
calls ``deepspeed_logs_to_stderr()`` first; the warnings still print, on stderr.
"""

from __future__ import annotations

import contextlib
import logging
import sys

from common.deepspeed_internals import deepspeed_logger


class _CurrentStderr:
    """Whatever sys.stderr is at each write: a handler outlives the streams that tests (capsys) swap in and close."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def deepspeed_logs_to_stderr() -> None:
    """Point DeepSpeed's log handler at stderr, importing DeepSpeed's logger here if nothing has yet.

    The import runs with stdout pointed at stderr: the handler DeepSpeed creates binds to the stream it finds, and
    the accelerator warning its import logs lands there. A handler created by an earlier import is repointed too.
    """
    with contextlib.redirect_stdout(sys.stderr):
        logger = deepspeed_logger()
    for handler in logger.handlers:
        if type(handler) is logging.StreamHandler:  # not a FileHandler someone added on purpose
            handler.setStream(_CurrentStderr())
