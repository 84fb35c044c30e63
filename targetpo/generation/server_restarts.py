"""A generation server that goes away mid-run and comes back.

A server killed (the out-of-memory killer, a preempted node, its supervisor) loses the requests in flight and, once
restarted, holds the weights it loaded from disk. With ``vllm_server_restart_grace_period`` above 0 the trainer waits
that long for it to answer its health check again; then the backend opens a new weight transfer, pushes the current
weights and sends the lost requests again, so that no rollout is sampled from other weights than the policy's. A
server that is not back in time stops every process with :class:`ServerNotBack`, naming it.

A restart the trainer did not see (the server killed and back between two requests) is told by the weights' labels:
vLLM labels its weights, and every token it samples, with the version the trainer last finished pushing, and a
restarted server's own weights are labelled otherwise ("default"). Such a completion, or a push to a server whose
weights are not the ones pushed before, counts as the server going away.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

#: Seconds at most between two health checks of a server that went away.
CHECK_INTERVAL = 1.0
#: How many times work lost with the server (a rollout's requests, a weight push) is done again once it is back; lost
#: once more, it stops training (a server that the work itself kills each time, say out of memory).
TRIES_AFTER_A_LOSS = 3


class ServerNotBack(TimeoutError):
    """A server that went away mid-run did not answer again within ``vllm_server_restart_grace_period``."""


def foreign_labels(weight_versions: Iterable[Sequence[str | None]]) -> list[str]:
    """The labels, among those of each completion's tokens, of weights the trainer never pushed (it pushes integer
    versions, the optimiser steps): a server that restarted since the last push holds its own."""
    labels = {str(label) for versions in weight_versions for label in versions if label is not None}
    return sorted(label for label in labels if not label.lstrip("-").isdigit())


class ServerRestarts:
    """How long to wait for the server at ``base_url`` to come back, and how often it has (``count``)."""

    def __init__(self, base_url: str, grace_period: float):
        self.base_url = base_url
        self.grace_period = grace_period
        self.count = 0

    @property
    def survived(self) -> bool:
        """Whether work lost with the server is done again (else the loss stops training)."""
        return self.grace_period > 0

    def wait_for_return(self, answers: Callable[[], bool], lost: BaseException) -> float:
        """Seconds until ``answers()`` (the server's health check) holds again after ``lost``, the error that told the
        server went away; ``lost`` itself is raised where no restart is waited for, :class:`ServerNotBack` after the
        grace period."""
        if not self.survived:
            raise lost
        logger.warning(
            "The vLLM server at %s went away (%s). Waiting up to %g s for it to answer again "
            "(vllm_server_restart_grace_period).",
            self.base_url,
            lost,
            self.grace_period,
        )
        started = time.monotonic()
        while not answers():
            waited = time.monotonic() - started
            if waited >= self.grace_period:
                raise ServerNotBack(
                    f"The vLLM server at {self.base_url} went away mid-run and did not answer again within "
                    f"vllm_server_restart_grace_period={self.grace_period:g} s (it went away with: {lost}). Restart "
                    "it (its log, and `dmesg` for the out-of-memory killer, say why it stopped) and resume training "
                    "from the last checkpoint, or raise the grace period to give its supervisor more time."
                ) from lost
            time.sleep(min(CHECK_INTERVAL, self.grace_period - waited))
        self.count += 1
        return time.monotonic() - started

    def log_return(self, waited: float, pushed_version: int | None, held: bool, lost_requests: int) -> None:
        """Log a server's return after ``waited`` seconds: the weights of ``pushed_version`` pushed to it again (or
        ``held`` by it still), and ``lost_requests`` sent again."""
        if pushed_version is None:
            weights = "no weights had been pushed yet"
        elif held:
            weights = f"it still held the weights of step {pushed_version}"
        else:
            weights = f"the weights of step {pushed_version} were pushed again"
        logger.warning(
            "The vLLM server at %s answered again after %.0f s (restart %d of this run): %s, and %d lost requests "
            "were sent again.",
            self.base_url,
            waited,
            self.count,
            weights,
            lost_requests,
        )
