"""A vLLM logits processor that leaves logits alone and rests a millisecond before every decoding step.

Loaded into a test server with ``--logits-processors paced_vllm_steps:PacedSteps`` (this folder on its PYTHONPATH).
On a 2-core machine the engine's busy loop can starve the API server for whole seconds, so a pause sent while a
request decodes may only be handled once it has finished; resting between steps hands the cores back each step and
keeps a long request in flight long enough, on any machine, for the pause to land in the middle of it.
"""

import time

from vllm.v1.sample.logits_processor import LogitsProcessor

#: Seconds of rest before each step: 4,000 tokens take about 4 s longer.
REST_S = 0.001


class PacedSteps(LogitsProcessor):
    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self):
        return True  # the logits are untouched

    def update_state(self, batch_update):
        time.sleep(REST_S)  # called once per step, before the forward pass, whatever the requests

    def apply(self, logits):
        return logits
