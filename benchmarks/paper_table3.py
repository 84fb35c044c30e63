"""Table 3 of the TPO paper (Kaddour 2026, arXiv 2604.06159), terminal reward, prompt-matched, on the Hugging Face
stack: exact-match error (%) of TPO and GRPO reversing H bits, and the paper's group-size (K) sweep at H = 8.

The paper's settings, from its JAX reference (JeanKaddour/tpo, ``src/tpo``: the task and optimiser in
``experiments/_trial.py``, the model in ``models.py``, the settings in ``config.py``; where the paper's text and its code
differ, as on the number of heads, the code is followed). This repository's ``paper_task.py`` holds the task, model and
optimiser as ported:

- Task: reverse H uniform random bits (V = 2, no separator), reward 1 only for the exact reversal; fresh prompts every
  step. Table 3: H = 7, 8, 9, 10.
- Model: 2-layer, 2-head, d_model 64 pre-norm causal transformer, learned positions, MLP 4 x 64 (GELU).
- Each step: B = 100 prompts x K = 8 completions sampled at temperature 1, then 4 full-batch gradient steps on that
  rollout ("epochs"); 2,000 steps. Optimiser: optax's Muon (Adam for non-matrix weights), learning rate 1e-3,
  constant, no clipping, no weight decay.
- TPO: sequence log-prob = the sum of the token log-probs, q = softmax(log_softmax(l_old) + u / eta), eta = 1, u the
  group's z-scored rewards (0 for a group with equal rewards); loss -sum q log softmax(l), mean over groups.
- GRPO: clipped surrogate, epsilon 0.2, z-scored advantages (population std + 1e-8), plus beta = 0.04 times the KL
  estimate exp(r) - r - 1 (r = log p_ref - log p) to the rollout's own snapshot (Appendix F), not to the initial model.
- Error: the share of a step's B x K sampled completions with any wrong bit; Table 3 gives the last step's value,
  averaged over 20 seeds. The K sweep (Section 4.2) uses B = 256 and 30 seeds, K in 4, 8, 16, 32, 64.

Methods, each on the same model (the same initial weights for a seed), prompts, optimiser and settings:

- ``targetpo-tpo``: targetpo's TPO with the paper's summed log-probs (``tpo_length_normalize_logps=False``).
- ``targetpo-grpo``: targetpo's GRPO loss with the paper's beta = 0.04 and KL estimator, its reference moved to the
  policy before every rollout (``sync_ref_model``, mixing weight 1, every ``num_iterations`` optimiser steps), so the
  KL is to the rollout's snapshot as in the paper.
- ``targetpo-dapo``: targetpo's DAPO loss as DAPO sets it (no KL, clip range 0.2 low / 0.28 high); no row in the paper.
- ``trl-grpo``: TRL's GRPOTrainer, loss ``grpo``, with the same KL to the rollout's snapshot as ``targetpo-grpo``.

What differs from the paper:

- Both libraries' GRPO losses work per token: a token's importance ratio is clipped, the KL estimate is taken per
  token and averaged over the completion, and each completion's loss is its tokens' mean. The paper's GRPO uses one
  ratio and one KL estimate per completion, from the summed log-probs: a different objective, not a different
  normalisation. Its trust region is tighter: the paper clips a completion's probability ratio at 1 +- 0.2, while a
  per-token clip lets it reach 1.2^H before every token is clipped. TPO has no ratio: its loss is the paper's.
- The paper's GRPO loss sums over a group's K completions and averages over prompts, and clamps the log-ratio to
  +-20; both libraries average over all B x K completions (a loss K times smaller, which Muon's normalised update
  and Adam all but ignore) and do not clamp (which matters only at extreme ratios).
- TRL z-scores with the sample std (over K - 1) + 1e-4 (the paper: population std + 1e-8): advantages about 6%
  smaller at K = 8.
- The model (``paper_task.py``): Hugging Face's GPT-2 architecture in the reference's shape, without the output
  head's bias; strict float32 torch (on a CPU, or a GPU) instead of JAX on a GPU, whose float32 products may have run
  in TF32 (the reference sets no precision).
- Seeds: the paper averages 20 (Table 3) or 30 (the K sweep); the examples below run 5, so each mean carries the
  standard error (sample standard deviation / sqrt(seeds)) the report gives.
- The paper draws B fresh prompts at every step; here a dataset of steps x B independent uniform prompts is read in
  a shuffled order, which is the same distribution.
- Besides the paper's estimator (``final_error``: the last rollout's sampled error), each run records
  ``expected_error``: that estimator's expectation under the final weights, computed exactly from a teacher-forced
  pass over every prompt (no sampling noise), and, with ``--eval_every``, its curve. The report adds the mean error
  over the last tenth of the steps, steadier than one step where training oscillates (GRPO's does).

Every finished run is appended to ``--output`` (a JSON file, under a lock, so runs of separate invocations merge);
a run already in the file is not run again. With ``--checkpoints DIR`` each run saves its state there every
``--checkpoint_every`` rollouts (weights, optimiser, random state, curves), so a run stopped before its end (a killed
process, an ended session, or ``--time_limit``, which stops each run at a rollout's end once the invocation has run
that long) resumes from its last checkpoint when asked again, to the record it would have had uninterrupted.
``--report_only`` writes the tables beside the paper's numbers and two plots (error against H, against K) next to
the file. ``--steps`` is the number of rollouts (2,000 in the paper); each trains ``--num_iterations`` optimiser
steps. ``--jobs N`` runs N at a time, each in a process of its own (one thread each: one per core); ``--device cuda``
trains on one GPU, in float32 as on the CPU, where several runs can share the GPU (``--jobs``). ``--share_prompts``
has targetpo's methods read each prompt once for its group (``share_prompt_forward``): the same log-probs to float
rounding, so, as a run on a GPU, the same measurement by another arithmetic path, and faster at large K.

    python benchmarks/paper_table3.py --lengths 7 8 --seeds 0 1 2 3 4
    python benchmarks/paper_table3.py --lengths 8 --num_generations 4 8 16 32 --prompts_per_step 256 \\
        --methods targetpo-tpo targetpo-grpo --seeds 0 1 2 3 4
    python benchmarks/paper_table3.py --report_only
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import fcntl
import importlib.metadata
import io
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from learning_efficiency import METHODS, make_trainer  # noqa: E402
from paper_task import (  # noqa: E402
    bit_tokenizer,
    exact_match_error,
    expected_exact_match_error,
    paper_prompts,
    reference_model,
    reference_optimizer,
)
from transformers import GPT2LMHeadModel, TrainerCallback  # noqa: E402

import targetpo  # noqa: E402
from targetpo.demo import exact_reversal_reward  # noqa: E402

# --------------------------------------------------------------------------------------------- the paper's numbers
#: Table 3, prompt-matched: exact-match error (%) at the last step, 20 seeds (B = 100, K = 8).
PAPER_BY_LENGTH = {"TPO": {7: 6.9, 8: 8.6, 9: 6.1, 10: 7.4}, "GRPO": {7: 14.5, 8: 27.6, 9: 30.0, 10: 50.4}}
#: Section 4.2, group-size sweep at H = 8 (B = 256, 30 seeds): exact-match error (%) at the last step.
PAPER_BY_GROUP_SIZE = {
    "TPO": {4: 8.9, 8: 5.2, 16: 5.1, 32: 2.6, 64: 0.36},
    "GRPO": {4: 19.4, 8: 19.8, 16: 9.2, 32: 4.4, 64: 5.6},
}
#: The paper's row each method reproduces.
PAPER_ROW = {"targetpo-tpo": "TPO", "targetpo-grpo": "GRPO", "trl-grpo": "GRPO", "targetpo-dapo": None}

# --------------------------------------------------------------------------------------------- the settings
#: Trainer settings every method shares (beyond the per-run sizes).
SHARED_SETTINGS = dict(
    temperature=1.0,
    epsilon=0.2,
    lr_scheduler_type="constant",
    max_grad_norm=0.0,  # no clipping
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
)
#: What each method sets on top. ``sync_ref_model`` with mixing weight 1 makes the KL reference the rollout's policy.
METHOD_SETTINGS = {
    "targetpo-tpo": dict(tpo_target_temperature=1.0, tpo_length_normalize_logps=False),
    "targetpo-grpo": dict(beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=1.0),
    "targetpo-dapo": dict(epsilon_high=0.28),
    "trl-grpo": dict(loss_type="grpo", beta=0.04, sync_ref_model=True, ref_model_mixup_alpha=1.0),
}
#: The fields that make two runs the same measurement.
RUN_KEY = ("method", "H", "K", "B", "seed", "steps", "num_iterations", "learning_rate")
#: The file beside each checkpoint that holds the run's curves and training time so far.
PROGRESS = "paper_table3_progress.json"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[7, 8, 9, 10], help="H, the number of bits")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=2000, help="Rollouts per run (the paper: 2,000).")
    parser.add_argument("--num_generations", type=int, nargs="+", default=[8], help="K, completions per prompt.")
    parser.add_argument("--prompts_per_step", type=int, default=100, help="B, prompts per rollout.")
    parser.add_argument("--num_iterations", type=int, default=4, help="Optimiser steps per rollout (the paper: 4).")
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--eval_every", type=int, default=100,
                        help="Rollouts between two exact evaluations of the expected error (0: only at the end).")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run. One by default: with a core busy elsewhere, a multi-threaded op "
                        "of this small model waits on it; run one run per core instead (--jobs).")
    parser.add_argument("--jobs", type=int, default=1,
                        help="Runs at a time, each in a process of its own (one per core on a CPU; several share one "
                        "GPU, since each is small).")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="Where the runs train: the CPU (float32), or one GPU (float32 too, so a run on either "
                        "is the same measurement: the file keeps one per method, H, K, B and seed, whichever device "
                        "trained it, and records which).")
    parser.add_argument("--share_prompts", action="store_true",
                        help="targetpo's methods read each prompt once for its group's completions "
                        "(share_prompt_forward): the same log-probs to float rounding, so the same measurement, about "
                        "1.35x faster at K = 16 and 1.6x at K = 32 on a CPU. TRL has no such setting (refused with "
                        "trl-grpo).")
    parser.add_argument("--checkpoints", default=None,
                        help="A folder for runs' checkpoints (weights, optimiser, random state and curves so far): "
                        "a run that stops before its end resumes from its last one when asked again; a finished "
                        "run's are removed. Unset: runs keep nothing and a stopped one starts over.")
    parser.add_argument("--checkpoint_every", type=int, default=100, help="Rollouts between two checkpoints.")
    parser.add_argument("--time_limit", type=float, default=None,
                        help="Seconds from the invocation's start after which each run saves a checkpoint at the end "
                        "of its rollout and stops, to resume later (needs --checkpoints): for calls with a deadline. "
                        "A run that starts after it trains one rollout.")
    parser.add_argument("--output", default="docs/benchmarks/paper_table3.json")
    parser.add_argument("--quiet", action="store_true",
                        help="Print only each run's summary line: no training logs, no report.")
    parser.add_argument("--report_only", action="store_true", help="Only write the tables and plots of --output.")
    return parser.parse_args()


# --------------------------------------------------------------------------------------------- one run
class RecordedReward:
    """The task's reward (1 for the exact reversal) that also keeps each training rollout's exact-match error."""

    __name__ = "exact_reversal"

    def __init__(self):
        self.errors: list[float] = []

    def __call__(self, completions: list[str], target: list[str], **kwargs) -> list[float]:
        self.errors.append(exact_match_error(completions, target))
        return exact_reversal_reward(completions, target)


class EvaluateExpectedError(TrainerCallback):
    """Appends [optimiser step, expected exact-match error] to ``curve`` every ``every`` optimiser steps (0: never)."""

    def __init__(self, length: int, every: int, curve: list):
        self.length, self.every, self.curve = length, every, curve

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            self.curve.append([state.global_step, round(expected_exact_match_error(model, self.length), 4)])


class Checkpoints(TrainerCallback):
    """Keeps the run's curves and its training and wall time beside each checkpoint, and, once ``deadline`` (a
    ``time.time()``) has passed, saves a checkpoint at the end of the rollout and stops the run there.

    The times add up over a resumed run's segments: each from the checkpoint it resumed, plus its own (the wall time
    from ``wall_started``, a ``time.perf_counter()`` at the segment's start, model building included)."""

    def __init__(self, reward: RecordedReward, eval_curve: list, progress: dict, wall_started: float,
                 iterations: int, deadline: float | None, kept: dict):
        self.reward, self.eval_curve, self.iterations, self.deadline = reward, eval_curve, iterations, deadline
        self.seconds_before, self.kept = progress.get("train_seconds", 0.0), kept
        # A checkpoint from before wall time was kept counts its segments' training time instead.
        self.wall_before = progress.get("wall_seconds", self.seconds_before)
        self.wall_started = wall_started

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()

    def train_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started

    def wall_seconds(self) -> float:
        return self.wall_before + time.perf_counter() - self.wall_started

    def on_step_end(self, args, state, control, **kwargs):
        at_a_rollouts_end = state.global_step % self.iterations == 0 and state.global_step < state.max_steps
        if self.deadline is not None and at_a_rollouts_end and time.time() >= self.deadline:
            control.should_save = control.should_training_stop = True

    def on_save(self, args, state, control, **kwargs):
        """The progress file is written last, whole (a rename), so it marks a complete checkpoint; only then are the
        older checkpoints removed: a process killed during a save leaves the previous one to resume from."""
        progress = {"errors": self.reward.errors, "eval_curve": self.eval_curve, "train_seconds": self.train_seconds(),
                    "wall_seconds": self.wall_seconds(), **self.kept}
        saved = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        partial = saved / f"{PROGRESS}.partial"
        partial.write_text(json.dumps(progress))
        os.replace(partial, saved / PROGRESS)
        for older in Path(args.output_dir).glob("checkpoint-*"):
            if older != saved:
                shutil.rmtree(older)


def run_settings(method: str, length: int, group_size: int, args: argparse.Namespace, output_dir: str) -> dict:
    """The trainer settings of one run: the shared ones, the run's sizes, then the method's own."""
    settings = dict(
        SHARED_SETTINGS,
        output_dir=output_dir,
        per_device_train_batch_size=args.prompts_per_step * group_size,  # one rollout, whole, per optimiser step
        num_generations=group_size,
        max_completion_length=length,
        num_iterations=args.num_iterations,
        max_steps=args.steps * args.num_iterations,
        logging_steps=args.num_iterations,
        learning_rate=args.learning_rate,  # also the optimiser's own
        use_cpu=args.device == "cpu",
        **METHOD_SETTINGS[method],
    )
    if args.share_prompts:
        settings["share_prompt_forward"] = True
    if settings.get("sync_ref_model"):
        settings["ref_model_sync_steps"] = args.num_iterations  # the reference becomes each rollout's policy
    if args.checkpoints:  # at rollouts' ends, where the reference is the policy; Checkpoints removes older ones
        settings.update(save_strategy="steps", save_steps=args.checkpoint_every * args.num_iterations)
    return settings


def checkpoint_folder(method: str, length: int, group_size: int, seed: int, args: argparse.Namespace) -> Path:
    """Where a run keeps its checkpoints: named by every field of its key."""
    return Path(args.checkpoints) / (f"{method}-H{length}-K{group_size}-B{args.prompts_per_step}-seed{seed}-"
                                     f"steps{args.steps}-i{args.num_iterations}-lr{args.learning_rate:g}")


def kept_on_resume(args: argparse.Namespace) -> dict:
    """What a resumed run must keep from its start, as its checkpoints record it."""
    return {"device": device_name(args.device), "eval_every": args.eval_every, "share_prompts": args.share_prompts}


def resume_point(method: str, length: int, group_size: int, seed: int,
                 args: argparse.Namespace) -> tuple[str | None, dict]:
    """The run's checkpoint to resume from (None: start fresh) and its progress. The newest checkpoint whose progress
    file was written is complete (a save writes it last); a run started on another kind of device, or with another
    ``--eval_every`` or ``--share_prompts``, is refused: resumed here it would be neither run."""
    if not args.checkpoints:
        return None, {}
    folder = checkpoint_folder(method, length, group_size, seed, args)
    complete = [path for path in folder.glob("checkpoint-*") if (path / PROGRESS).is_file()]
    if not complete:
        return None, {}
    resume = max(complete, key=lambda path: int(path.name.rpartition("-")[2]))
    progress = json.loads((resume / PROGRESS).read_text())
    # A checkpoint older than a field is taken as made with this invocation's value, but for share_prompts, which
    # came later: runs before it did not share.
    kept = kept_on_resume(args)
    saved = dict(kept, share_prompts=False) | {field: progress[field] for field in kept if field in progress}
    changed = [f"{field} {saved[field]!r} (here: {kept[field]!r})" for field in kept if saved[field] != kept[field]]
    if changed:
        raise SystemExit(
            f"{folder} holds a run started with {', '.join(changed)}: resumed here it would be neither run (another "
            "device's random stream and arithmetic, another evaluation cadence or log-prob path). Resume it with "
            "what it started with, or delete the folder to start it over here."
        )
    return str(resume), progress


def train_once(method: str, length: int, group_size: int, seed: int, args: argparse.Namespace) -> dict | None:
    """One run from fresh weights, or from its last checkpoint; returns its record, or None where the deadline
    stopped it (its checkpoint kept)."""
    started = time.perf_counter()
    folder = checkpoint_folder(method, length, group_size, seed, args) if args.checkpoints else None
    resume, progress = resume_point(method, length, group_size, seed, args)
    with tempfile.TemporaryDirectory(prefix=f"paper_table3-{method}-H{length}-") as workdir:
        # Loaded from a directory, so TRL can build its reference model (beta > 0) from the same weights: a resumed
        # run's are the checkpoint's, as the reference is the policy at a rollout's end.
        (GPT2LMHeadModel.from_pretrained(resume) if resume else reference_model(length, seed)).save_pretrained(
            f"{workdir}/initial"
        )
        model = GPT2LMHeadModel.from_pretrained(f"{workdir}/initial", dtype=torch.float32)
        settings = run_settings(method, length, group_size, args, output_dir=str(folder or f"{workdir}/trainer"))
        reward, eval_curve = RecordedReward(), [list(point) for point in progress.get("eval_curve", [])]
        reward.errors = list(progress.get("errors", []))
        checkpoints = Checkpoints(reward, eval_curve, progress, started, args.num_iterations, args.deadline,
                                  kept_on_resume(args))
        trainer = make_trainer(
            method,
            dict(settings, seed=seed),
            model=model,
            reward_funcs=reward,
            train_dataset=paper_prompts(length, args.steps * args.prompts_per_step, seed),
            processing_class=bit_tokenizer(),
            optimizers=(reference_optimizer(model, args.learning_rate), None),
            callbacks=[EvaluateExpectedError(length, args.eval_every * args.num_iterations, eval_curve), checkpoints],
        )
        trainer.train(resume_from_checkpoint=resume)
        if trainer.state.global_step < settings["max_steps"]:
            return None  # stopped at the deadline: its checkpoint resumes it
        train_seconds = checkpoints.train_seconds()
        expected = expected_exact_match_error(trainer.model, length)
    return {
        "method": method, "H": length, "K": group_size, "B": args.prompts_per_step, "seed": seed,
        "steps": args.steps, "num_iterations": args.num_iterations, "learning_rate": args.learning_rate,
        "final_error": round(reward.errors[-1], 4),
        "expected_error": round(expected, 4),
        "curve": [round(error, 3) for error in reward.errors],  # one per rollout
        "eval_curve": [[step // args.num_iterations, error] for step, error in eval_curve],  # [rollout, expected]
        "train_seconds": round(train_seconds, 2),
        "seconds_per_step": round(train_seconds / args.steps, 4),
        "wall_seconds": round(checkpoints.wall_seconds(), 2),
        "resumed": bool(progress),
        "settings": {key: value for key, value in settings.items() if key != "output_dir"},
        "environment": environment(args.device),
    }


def environment(device: str) -> dict:
    """Versions and machine, for the record."""
    return {"torch": torch.__version__, "transformers": transformers.__version__, "trl": _version("trl"),
            "targetpo": targetpo.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "device": device_name(device)}


def device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# --------------------------------------------------------------------------------------------- the records
@contextlib.contextmanager
def locked_records(path: Path) -> Iterator[list[dict]]:
    """The file's records, to change in place; written back atomically, under a lock, on leaving."""
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)  # the lock: the folder, as the file itself is replaced
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # another invocation may be appending to the same file
        records = read_records(path)
        yield records
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps({"runs": records}, indent=1))
        os.replace(temporary, path)
    finally:
        os.close(folder)


def read_records(path: Path) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def run_key(record: dict) -> tuple:
    return tuple(record[field] for field in RUN_KEY)


# --------------------------------------------------------------------------------------------- the report
def mean_and_error(values: list[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (0 for a single value)."""
    spread = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.mean(values), spread


def paper_value(method: str, length: int, group_size: int, batch: int) -> float | None:
    """The paper's error (%) for ``method`` at this H, K and B, where the paper ran that configuration."""
    row = PAPER_ROW[method]
    if row is not None and group_size == 8 and batch == 100:
        return PAPER_BY_LENGTH[row].get(length)
    if row is not None and length == 8 and batch == 256:
        return PAPER_BY_GROUP_SIZE[row].get(group_size)
    return None


def late_error(curve: list[float]) -> float:
    """The mean rollout error over the last tenth of a run: steadier than the last step's where training oscillates."""
    tail = curve[-max(1, len(curve) // 10) :]
    return statistics.mean(tail)


def summarise(records: list[dict]) -> list[dict]:
    """One row per method and configuration (H, K, B, steps, epochs): the errors over seeds, the paper's value."""
    groups: dict[tuple, list[dict]] = {}
    for record in records:
        key = (record["method"], record["H"], record["K"], record["B"], record["steps"], record["num_iterations"])
        groups.setdefault(key, []).append(record)
    rows = []
    for (method, length, group_size, batch, steps, iterations), chosen in groups.items():
        finals = [record["final_error"] for record in chosen]
        final, final_se = mean_and_error(finals)
        expected, expected_se = mean_and_error([record["expected_error"] for record in chosen])
        late, late_se = mean_and_error([late_error(record["curve"]) for record in chosen])
        rows.append({
            "method": method, "H": length, "K": group_size, "B": batch, "steps": steps, "epochs": iterations,
            "seeds": len(chosen), "final_error": final, "final_error_se": final_se,
            "final_error_range": [min(finals), max(finals)],
            "expected_error": expected, "expected_error_se": expected_se, "late_error": late, "late_error_se": late_se,
            "paper": paper_value(method, length, group_size, batch),
            "seconds_per_step": statistics.mean(record["seconds_per_step"] for record in chosen),
        })
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a markdown table."""
    lines = [
        "| method | H | K | B | steps | seeds | error % at the last step [min, max] | expected error % at the end "
        "| error % over the last tenth | paper % | s / step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        low, high = row["final_error_range"]
        paper = "—" if row["paper"] is None else f"{row['paper']:g}"
        lines.append(
            f"| {row['method']} | {row['H']} | {row['K']} | {row['B']} | {row['steps']} | {row['seeds']} "
            f"| {_mean_text(row, 'final_error')} [{low:.1f}, {high:.1f}] | {_mean_text(row, 'expected_error')} "
            f"| {_mean_text(row, 'late_error')} | {paper} | {row['seconds_per_step']:.2f} |"
        )
    lines.append("")
    lines.append("Means over seeds ± standard error (none for one seed). The paper's value is its error at the last "
                 "step, 20 seeds (Table 3) or 30 (the K sweep), where its H, K and B match.")
    return "\n".join(lines)


def _mean_text(row: dict, name: str) -> str:
    """A summary row's mean of ``name`` with its standard error, which one seed does not have."""
    return f"{row[name]:.1f}" + (f" ± {row[name + '_se']:.1f}" if row["seeds"] > 1 else "")


def views(rows: list[dict]) -> dict[str, list[dict]]:
    """The rows by H (every configuration) and by K (H = 8, where more than one K ran), in reading order."""
    order = {method: index for index, method in enumerate(METHODS)}
    by_length = sorted(rows, key=lambda r: (r["K"], r["B"], r["steps"], r["epochs"], r["H"], order[r["method"]]))
    at_eight = [row for row in rows if row["H"] == 8]
    by_group_size = sorted(at_eight, key=lambda r: (r["B"], r["steps"], r["epochs"], order[r["method"]], r["K"]))
    return {"H": by_length, "K": by_group_size if len({row["K"] for row in at_eight}) > 1 else []}


def plot(rows: list[dict], by: str, path: Path) -> None:
    """Error against ``by`` ("H" or "K"), a line per method and budget, the paper's values as open markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"targetpo-tpo": "tab:blue", "targetpo-grpo": "tab:orange", "targetpo-dapo": "tab:red",
               "trl-grpo": "tab:green"}
    other = "H" if by == "K" else "K"  # what stays fixed along a line
    lines: dict[tuple, list[dict]] = {}
    for row in rows:
        lines.setdefault((row["method"], row[other], row["B"], row["steps"]), []).append(row)
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for (method, fixed, batch, steps), line in lines.items():
        axis.errorbar([row[by] for row in line], [row["final_error"] for row in line],
                      yerr=[row["final_error_se"] for row in line], color=colours[method], marker="o", capsize=3,
                      label=f"{method} ({other}={fixed}, B={batch}, {steps} steps)")
        for row in line:  # a mean of few seeds, as it stands while a sweep runs, is marked as such
            if row["seeds"] < 3:
                axis.annotate(f"{row['seeds']} seed{'s' if row['seeds'] > 1 else ''}", (row[by], row["final_error"]),
                              textcoords="offset points", xytext=(6, 4), fontsize=7, color=colours[method])
    paper = PAPER_BY_LENGTH if by == "H" else PAPER_BY_GROUP_SIZE
    setting = "K = 8, B = 100" if by == "H" else "H = 8, B = 256"
    for name, colour in (("TPO", "tab:blue"), ("GRPO", "tab:orange")):
        axis.plot(*zip(*sorted(paper[name].items())), linestyle="--", marker="o", markerfacecolor="none",
                  color=colour, alpha=0.6, label=f"paper: {name} ({setting})")
    if by == "K":
        axis.set_xscale("log", base=2)
    axis.set_xlabel({"H": "H, bits to reverse", "K": "K, completions per prompt (H = 8)"}[by])
    axis.set_ylabel("exact-match error at the last step (%)")
    axis.set_ylim(bottom=0)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def report(records: list[dict], output: Path) -> str:
    """The markdown report of ``records``, also written next to ``output`` with the plots (where matplotlib is)."""
    if not records:
        return f"No runs in {output}."
    titles = {"H": "Exact-match error by method and H", "K": "Exact-match error by method and K (H = 8)"}
    tables = {by: rows for by, rows in views(summarise(records)).items() if rows}
    text = "\n\n".join(f"### {titles[by]}\n\n{markdown_table(rows)}" for by, rows in tables.items())
    output.with_suffix(".md").write_text(text + "\n")
    try:
        for by, rows in tables.items():
            plot(rows, by, output.with_name(f"{output.stem}_by_{'length' if by == 'H' else 'group_size'}.png"))
    except ImportError:  # a note, not part of the report: stdout stays the report the .md file holds
        print("matplotlib is not installed, so no plots were drawn (pip install matplotlib).", file=sys.stderr)
    return text


# --------------------------------------------------------------------------------------------- main
def _version(package: str) -> str | None:
    """An installed package's version; None where it is not installed (trl runs only the ``trl-grpo`` method)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def pending_runs(args: argparse.Namespace, output: Path) -> list[tuple[str, int, int, int]]:
    """The (method, H, K, seed) runs asked for that ``output`` does not hold yet, in the order they run."""
    runs = []
    for length in args.lengths:
        for group_size in args.num_generations:
            for seed in args.seeds:
                for method in args.methods:  # paired: the methods of a seed start from the same weights
                    key = run_key({"method": method, "H": length, "K": group_size, "B": args.prompts_per_step,
                                   "seed": seed, "steps": args.steps, "num_iterations": args.num_iterations,
                                   "learning_rate": args.learning_rate})
                    if any(run_key(record) == key for record in read_records(output)):
                        print(f"already in {output}: {dict(zip(RUN_KEY, key))}", flush=True)
                    else:
                        runs.append((method, length, group_size, seed))
    return runs


def run_and_append(run: tuple[str, int, int, int], args: argparse.Namespace, output: Path) -> None:
    """One run, its record appended to ``output``; prints the record's summary line."""
    with contextlib.redirect_stdout(io.StringIO()) if args.quiet else contextlib.nullcontext():  # the trainer's logs
        record = train_once(*run, args)
    if record is None:
        print(f"stopped at the time limit, to resume from {checkpoint_folder(*run, args)}: {run}", flush=True)
        return
    with locked_records(output) as records:
        records.append(record)
    if args.checkpoints:  # only once its record is saved: a process killed in between resumes at the last checkpoint
        shutil.rmtree(checkpoint_folder(*run, args), ignore_errors=True)
    print(json.dumps({field: record[field] for field in (*RUN_KEY, "final_error", "expected_error",
                                                         "seconds_per_step")}), flush=True)


def run_in_processes(runs: list[tuple[str, int, int, int]], args: argparse.Namespace) -> None:
    """Each run in a process of its own (this script, for that one run), ``args.jobs`` at a time: each appends its
    record under the file's lock, as separate invocations do. A failed run is reported with the end of its output."""
    shared = ["--steps", str(args.steps), "--prompts_per_step", str(args.prompts_per_step),
              "--num_iterations", str(args.num_iterations), "--learning_rate", str(args.learning_rate),
              "--eval_every", str(args.eval_every), "--threads", str(args.threads), "--device", args.device,
              "--output", args.output, "--quiet", *(["--share_prompts"] if args.share_prompts else [])]
    if args.checkpoints:
        shared += ["--checkpoints", args.checkpoints, "--checkpoint_every", str(args.checkpoint_every)]

    def one(run: tuple[str, int, int, int]) -> bool:
        method, length, group_size, seed = run
        command = [sys.executable, __file__, "--methods", method, "--lengths", str(length),
                   "--num_generations", str(group_size), "--seeds", str(seed), *shared]
        if args.deadline is not None:  # the same deadline: what is left of it when this run starts
            command += ["--time_limit", str(max(0.0, args.deadline - time.time()))]
        done = subprocess.run(command, capture_output=True, text=True)
        print(done.stdout.strip() if done.returncode == 0 else f"{run} failed:\n{done.stderr[-3000:]}", flush=True)
        return done.returncode == 0

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        failed = [run for run, finished in zip(runs, pool.map(one, runs)) if not finished]
    if failed:
        raise SystemExit(f"{len(failed)} of {len(runs)} runs failed: {failed}")


def main() -> None:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():  # the Trainer would quietly train on the CPU
        raise SystemExit("--device cuda: torch sees no GPU here.")
    if args.time_limit is not None and not args.checkpoints:
        raise SystemExit("--time_limit stops runs before their end, which only --checkpoints lets resume: set both.")
    if args.share_prompts and "trl-grpo" in args.methods:
        raise SystemExit("--share_prompts is targetpo's share_prompt_forward, which TRL's trainer has no equivalent of: "
                         "run trl-grpo in an invocation without it.")
    if args.checkpoint_every < 1:
        raise SystemExit(f"--checkpoint_every {args.checkpoint_every}: a checkpoint every N >= 1 rollouts.")
    args.deadline = None if args.time_limit is None else time.time() + args.time_limit
    output = Path(args.output)
    torch.set_num_threads(args.threads)
    if not args.report_only:
        runs = pending_runs(args, output)
        for run in runs:  # a checkpoint this invocation cannot resume is refused before any run trains
            resume_point(*run, args)
        if args.jobs > 1 and len(runs) > 1:
            run_in_processes(runs, args)
        else:
            for run in runs:
                run_and_append(run, args, output)
    if not args.quiet:
        print(report(read_records(output), output))


if __name__ == "__main__":
    main()
