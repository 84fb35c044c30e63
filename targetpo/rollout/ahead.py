"""The rollout generated ahead (``async_rollouts``) that a checkpoint is written beside, kept with it.

With ``async_rollouts`` the next rollout is under way while the current one trains: generated on the server
(:class:`UpcomingRollout`), or its episodes played on a thread of their own (:class:`EpisodesAhead`). A checkpoint
written meanwhile waits for it to finish (it goes on as it would have, after the weight push of the step just taken;
it is not cancelled) and holds, per process, what it made: the completions, with the sampler's log-probs and each
one's weight version, and the prompts they were made for; or the episodes as played and the dataset rows they were
played for. A resumed run takes it back as the rollout under way, so it trains on the samples of the run straight
through and records their staleness as that run did. A checkpoint with no rollout ahead holds none.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from ..faults.checkpoints import NotTheWrite
from ..generation import PendingCompletions
from .scheduler import EpisodesAhead, RolloutScheduler, UpcomingRollout

FILE = "rollout_ahead_{rank}.pt"


@dataclass
class RolloutAhead:
    """Saves, once finished, and restores the rollout ``scheduler`` generates ahead on this process of
    ``accelerator``."""

    scheduler: RolloutScheduler
    accelerator: Any

    def save(self, output_dir: str) -> None:
        """Wait for the rollout under way ahead, if any (every process together: the server's reply is collective),
        and write what it made. One that cannot be pickled (an environment holding a connection) is left out, with
        a warning: the resumed run makes that rollout again."""
        upcoming = self.scheduler.upcoming
        if upcoming is None:  # the same on every process
            return
        try:
            finished = self._finished(upcoming)
        except Exception as error:  # the rollout's failure, not the checkpoint's
            raise NotTheWrite() from error
        if finished is None:
            return
        state = {"made_with": self._made_with(), "rollout": finished}
        written = io.BytesIO()
        try:  # pickled before the file is opened: a full disk is the checkpoint's error, not this one
            torch.save(state, written)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            warnings.warn(
                f"The rollout generated ahead (async_rollouts) cannot be saved with the checkpoint "
                f"({type(error).__name__}: {error}): a run resumed from this checkpoint samples it again at the resumed "
                "weights, so it trains on other samples than this run.",
                stacklevel=2,
            )
            return
        with open(self._path(output_dir), "wb") as file:
            file.write(written.getbuffer())

    def load(self, checkpoint: str) -> None:
        """The checkpoint's rollout generated ahead, as the rollout under way, where it was made as this run would
        make it; else it is made again, with a warning. Collective with ``async_rollouts``: every process takes it
        back, or none does (a process without it would skip the gather the others' take of it makes)."""
        if self.scheduler.lookahead_use is None:  # async_rollouts=False: nothing is generated ahead
            if os.path.exists(self._path(checkpoint)):
                self._warn_not_taken(
                    checkpoint, "it was made with async_rollouts=True, and this run has async_rollouts=False"
                )
            return
        restored = self._restored(checkpoint)
        device = self.accelerator.device
        if not bool(self.accelerator.gather(torch.tensor([restored is not None], device=device)).all()):
            if restored is not None:
                self._warn_not_taken(checkpoint, "some processes of this run have their share of it and some do not")
            return
        self.scheduler.upcoming = restored

    # ------------------------------------------------------------------------------------------------ saving
    def _finished(self, upcoming: UpcomingRollout | EpisodesAhead) -> dict[str, Any] | None:
        """What the rollout under way made, once it has finished; training later takes the same, not made twice.
        None where its episodes were lost with a server that may come back: they are played again when needed, as
        :meth:`RolloutScheduler.take_played` does."""
        context, scheduler = self.scheduler.context, self.scheduler
        if isinstance(upcoming, EpisodesAhead):
            played, lost = None, False
            with context.guard("playing the episodes ahead"):
                try:
                    played = upcoming.played.result()
                except Exception as error:
                    if not scheduler.backend.recovers_from(error):
                        raise
                    lost = True
            if bool(context.accelerator.gather(torch.tensor([lost], device=context.accelerator.device)).any()):
                scheduler.upcoming = None  # the same on every process: played again, now, when it is needed
                return None
            return {"indices": upcoming.indices, "played": played}
        with context.guard("generating the completions ahead", local=not self.scheduler.backend.collective):
            completions = upcoming.pending.result()
        upcoming.pending = PendingCompletions(completions)
        return {
            "prompt_ids": upcoming.prompt_ids,
            "prompt_mask": upcoming.prompt_mask,
            "images": upcoming.images,
            "completions": completions,
        }

    def _made_with(self) -> dict[str, Any]:
        """The settings a rollout generated ahead depends on: who made it, when it started, and how."""
        return {
            "processes": self.accelerator.num_processes,
            "lookahead_use": self.scheduler.lookahead_use,
            "plays_episodes": self.scheduler.source.plays_episodes,
        }

    # ------------------------------------------------------------------------------------------------ loading
    def _restored(self, checkpoint: str) -> UpcomingRollout | EpisodesAhead | None:
        path = self._path(checkpoint)
        if not os.path.exists(path):
            return None
        # The file is one this class wrote: completions and played episodes are records, not only tensors.
        state = torch.load(path, map_location=self.accelerator.device, weights_only=False)
        differences = _differences(state["made_with"], self._made_with())
        if differences:
            self._warn_not_taken(checkpoint, f"it was made {differences}")
            return None
        rollout = state["rollout"]
        if "played" in rollout:
            played: Future = Future()
            played.set_result(rollout["played"])
            return EpisodesAhead(rollout["indices"], played, self.scheduler.check_plays_ahead(), threading.Event())
        pending = PendingCompletions(rollout["completions"])
        return UpcomingRollout(rollout["prompt_ids"], rollout["prompt_mask"], pending, rollout["images"])

    def _warn_not_taken(self, checkpoint: str, why: str) -> None:
        warnings.warn(
            f"{checkpoint} holds the rollout that was being generated ahead (async_rollouts) when it was saved, which "
            f"this run does not take: {why}. That rollout is sampled again at the resumed weights, so this run trains "
            "on other samples than the run it resumes would have.",
            stacklevel=2,
        )

    def _path(self, directory: str) -> str:
        return os.path.join(directory, FILE.format(rank=self.accelerator.process_index))


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> str:
    """How the settings a rollout ahead was made with differ from this run's, in words ('' where they agree)."""
    differences = []
    if saved["processes"] != now["processes"]:
        differences.append(f"by {saved['processes']} processes, and this run has {now['processes']}")
    if saved["lookahead_use"] != now["lookahead_use"]:
        differences.append(
            f"from micro-step {saved['lookahead_use']} of the rollout before it, and this run starts it at micro-step "
            f"{now['lookahead_use']} (max_staleness, steps_per_generation, num_iterations or "
            "gradient_accumulation_steps changed)"
        )
    if saved["plays_episodes"] != now["plays_episodes"]:
        kinds = {True: "by episodes played ahead", False: "by generation alone"}
        differences.append(f"{kinds[saved['plays_episodes']]}, and this run's are made {kinds[now['plays_episodes']]}")
    return "; ".join(differences)
