"""Multi-turn rollouts on `model.generate` with the KV cache continued from turn to turn vs re-prefilled every turn.

One rollout is the trainer's tool loop (`ToolLoop`) on the transformers backend: `--samples` conversations of
`--turns` turns, each turn `--turn_tokens` digits and EOS (a call of the tool), each tool result about
`--result_tokens` characters (a little more or less per sample, so contexts differ in length), after a prompt of
`--prompt_tokens` characters. The model's weights are scripted (as in the tests) so that every turn has exactly that
length and every sample calls the tool every turn: both settings do the same work. The two settings alternate, from
the same seed, `--repeats` times after a warm-up of each; the seconds per rollout (median), the prefilled and reused
context tokens, the ratio (also of the fastest repeats, the least disturbed on a shared machine), and whether both
settings sampled the same tokens are reported.

    python benchmarks/multi_turn_kv.py --output docs/benchmarks/multi_turn_kv.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's targetpo, whatever else is installed
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' weight scripts

import torch  # noqa: E402
from machine import MODEL_SIZES, add_quiet_arguments, environment, report, run_when_quiet  # noqa: E402
from scripted_policies import place_tokens  # noqa: E402

from targetpo.demo import GUESS_DIGITS, build_tiny_causal_lm, guessing_tokenizer  # noqa: E402
from targetpo.episodes.chat_template import ConversationTemplate  # noqa: E402
from targetpo.episodes.multi_turn import ToolLoop, left_pad  # noqa: E402
from targetpo.episodes.tools import Toolbox, environment_tools  # noqa: E402
from targetpo.generation import SamplingSettings, TransformersBackend  # noqa: E402

MODELS = {name: MODEL_SIZES[name] for name in ("demo", "small", "medium")}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "small"], choices=list(MODELS))
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--prompt_tokens", type=int, default=200)
    parser.add_argument("--turn_tokens", type=int, default=16)
    parser.add_argument("--result_tokens", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=5)
    add_quiet_arguments(parser)
    parser.add_argument("--output", default=None, help="Also write the results as JSON here.")
    return parser.parse_args()


class Notes:
    """A tool whose answer is a long text of the sample's own length."""

    def __init__(self, length: int):
        self.length = length

    def guess(self, number: int) -> str:
        """Look something up.

        Args:
            number: what to look up.
        """
        return "x" * self.length


def scripted_model(tokenizer, hidden_size: int, num_layers: int, num_heads: int, max_positions: int):
    """A digit after ``<assistant>``, ``<eos>`` after a digit: with ``min_new_tokens`` every turn is that many digits
    and ``<eos>``, which the guessing tokenizer reads as one call."""
    model = build_tiny_causal_lm(tokenizer, hidden_size, num_layers, num_heads, max_positions=max_positions, seed=0)
    points = {tokenizer.convert_tokens_to_ids(digit): (0.0, 1.0) for digit in GUESS_DIGITS}
    points |= {tokenizer.convert_tokens_to_ids("<assistant>"): (1.0, 0.0), tokenizer.eos_token_id: (-2.0, 3.0)}
    return place_tokens(model, points).eval()


def main() -> None:
    args = parse_args()
    torch.set_grad_enabled(False)
    tokenizer = guessing_tokenizer()
    allowed = {tokenizer.convert_tokens_to_ids(digit) for digit in GUESS_DIGITS} | {tokenizer.eos_token_id}
    settings = SamplingSettings(
        max_new_tokens=10**6, eos_token_ids=(tokenizer.eos_token_id,), pad_token_id=tokenizer.pad_token_id,
        generation_kwargs={"suppress_tokens": [i for i in range(len(tokenizer)) if i not in allowed],
                           "min_new_tokens": args.turn_tokens},
    )
    lengths = [args.result_tokens + 7 * (sample % 5) - 14 for sample in range(args.samples)]
    template = ConversationTemplate(tokenizer, Toolbox(environment_tools(Notes(1))).schemas, [tokenizer.eos_token_id])
    prompts = [template.render([{"role": "user", "content": "?" * (args.prompt_tokens + sample % 3)}], True)
               for sample in range(args.samples)]
    ids, mask = left_pad([tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts], tokenizer.pad_token_id,
                         torch.device("cpu"))
    budget = args.turns * (args.turn_tokens + 1 + max(lengths) + 4)
    loop = ToolLoop(template, budget, args.turns - 1, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    toolboxes = [Toolbox(environment_tools(Notes(length))) for length in lengths]
    results, disturbed = [], []
    for name in args.models:
        hidden_size, num_layers, num_heads = MODELS[name]
        model = scripted_model(tokenizer, hidden_size, num_layers, num_heads, max_positions=ids.size(1) + budget + 8)
        backends = {
            reuse: TransformersBackend(settings, lambda model=model: contextlib.nullcontext(model), reuse_kv_cache=reuse)
            for reuse in (True, False)
        }

        def rollout(reuse: bool, backends=backends):
            torch.manual_seed(0)
            started = time.perf_counter()
            played = loop.run(backends[reuse], ids, mask, toolboxes)
            return time.perf_counter() - started, played

        def repeat(attempt: int) -> dict:
            (seconds_on, on), (seconds_off, off) = rollout(True), rollout(False)
            same = torch.equal(on.completions.ids, off.completions.ids) and on.turns == off.turns
            return {"seconds_on": seconds_on, "seconds_off": seconds_off, "same_tokens": same,
                    "turns": on.turns, "completion_tokens": int(on.completions.lengths.sum())}

        repeat(0)  # warm-up
        for backend in backends.values():
            backend.cache_reuse.__init__()  # count the timed rollouts only
        repeats = [run_when_quiet(repeat, args, disturbed) for _ in range(args.repeats)]
        reuse = backends[True].cache_reuse
        on = statistics.median(r["seconds_on"] for r in repeats)
        off = statistics.median(r["seconds_off"] for r in repeats)
        # Other work on a shared machine only adds time: the fastest repeat of each is the least disturbed.
        best_on, best_off = min(r["seconds_on"] for r in repeats), min(r["seconds_off"] for r in repeats)
        result = {
            "model": name, "hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads,
            "parameters": sum(p.numel() for p in model.parameters()),
            "seconds_kv_reuse": round(on, 3), "seconds_re_prefill": round(off, 3),
            "re_prefill_over_kv_reuse": round(off / on, 2),
            "fastest_seconds_kv_reuse": round(best_on, 3), "fastest_seconds_re_prefill": round(best_off, 3),
            "re_prefill_over_kv_reuse_fastest": round(best_off / best_on, 2),
            "same_tokens_every_repeat": all(r["same_tokens"] for r in repeats),
            "turns_per_sample": repeats[0]["turns"][0],
            "completion_tokens_per_sample": repeats[0]["completion_tokens"] / args.samples,
            "prefilled_tokens_per_rollout": reuse.prefilled_tokens // args.repeats,
            "reused_tokens_per_rollout": reuse.reused_tokens // args.repeats,
            "prefilled_tokens_per_rollout_re_prefill": backends[False].cache_reuse.prefilled_tokens // args.repeats,
            "repeats": repeats,
        }
        print(json.dumps({key: value for key, value in result.items() if key != "repeats"}), flush=True)
        results.append(result)
    loop.close()
    settings_used = {key: getattr(args, key) for key in
                     ("samples", "turns", "prompt_tokens", "turn_tokens", "result_tokens", "repeats")}
    report(environment(), {"settings": settings_used, "models": results, "disturbed_runs_redone": disturbed},
           args.output)


if __name__ == "__main__":
    main()
