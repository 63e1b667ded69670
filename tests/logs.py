"""The gateway's log filters inside a test (`gateway_log_filters`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from middleware.ops.request_id import log_config


@contextlib.contextmanager
def gateway_log_filters() -> Iterator[None]:
    """The filters `log_config` puts on named loggers (`RedactUrls` on the MCP SDK's HTTP stack),
    installed for one test: applying the whole dictConfig would replace pytest's log capture."""
    config: dict[str, Any] = log_config("debug", json_lines=False)
    made = {name: spec["()"]() for name, spec in config["filters"].items()}
    installed = [
        (logging.getLogger(name), made[key])
        for name, spec in config["loggers"].items()
        for key in spec.get("filters", ())
    ]
    assert installed, "log_config installs the URL redaction filter"
    for logger, log_filter in installed:
        logger.addFilter(log_filter)
    try:
        yield
    finally:
        for logger, log_filter in installed:
            logger.removeFilter(log_filter)
