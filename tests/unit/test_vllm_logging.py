"""kvbridge's log records in a vLLM server (``kvbridge.adapters.vllm.share_vllm_log_handlers``):
vLLM configures only its ``vllm`` logger, so kvbridge borrows its handlers and level;
a ``kvbridge`` logger the application configured, or a vLLM that configured nothing,
is left alone. (The real thing: the engine tests assert on connector lines in vLLM's logs.)"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvbridge.adapters.vllm import share_vllm_log_handlers


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger]]:
    ours, vllm = logging.getLogger("kvbridge"), logging.getLogger("vllm")
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate) for lg in (ours, vllm)]
    for lg in (ours, vllm):
        lg.handlers.clear()
        lg.setLevel(logging.NOTSET)
    yield ours, vllm
    for lg, handlers, level, propagate in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def test_kvbridge_info_lines_go_to_vllms_handler(
    loggers: tuple[logging.Logger, logging.Logger],
) -> None:
    ours, vllm = loggers
    out = io.StringIO()
    vllm.addHandler(logging.StreamHandler(out))
    vllm.setLevel(logging.INFO)
    share_vllm_log_handlers()
    share_vllm_log_handlers()  # idempotent: one handler, each line once
    logging.getLogger("kvbridge.adapters.vllm.connector").info("kvbridge: hello")
    logging.getLogger("kvbridge.runtime.node").debug("not at INFO")
    assert out.getvalue() == "kvbridge: hello\n"
    assert ours.propagate is False


def test_configured_kvbridge_logger_is_left_alone(
    loggers: tuple[logging.Logger, logging.Logger],
) -> None:
    ours, vllm = loggers
    mine = logging.StreamHandler(io.StringIO())
    ours.addHandler(mine)
    vllm.addHandler(logging.StreamHandler(io.StringIO()))
    share_vllm_log_handlers()
    assert ours.handlers == [mine] and ours.propagate


def test_nothing_happens_when_vllm_configured_no_logging(
    loggers: tuple[logging.Logger, logging.Logger],
) -> None:
    ours, _ = loggers
    share_vllm_log_handlers()
    assert ours.handlers == [] and ours.propagate and ours.level == logging.NOTSET
