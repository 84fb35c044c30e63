"""KV cache reuse across the turns of a multi-turn rollout on ``model.generate``: the rollout is the one re-prefilling
every turn gives, and the cache is continued only where it can be.

The model is a real tiny Qwen2 with scripted weights (``scripted_policies``): after ``<assistant>`` it writes one digit,
after a digit ``<eos>``, so every turn is one call of the tool whatever the random weights prefer; which digit stays
the model's own choice. The tool's result is as long as the sample's own size plus the digit, so contexts differ in
length and samples run out of room, and go inactive, at different turns.
"""

import contextlib
import copy

import pytest
import torch
from scripted_policies import place_tokens
from transformers import Qwen2Config, Qwen2ForCausalLM

from targetpo.demo import GUESS_DIGITS, build_tiny_causal_lm, digits_only_generation_kwargs, guessing_tokenizer
from targetpo.episodes.chat_template import ConversationTemplate
from targetpo.episodes.multi_turn import ToolLoop, left_pad
from targetpo.episodes.tools import Toolbox, environment_tools
from targetpo.generation import SamplingSettings, TransformersBackend
from targetpo.modeling.logps import completion_logps

MAX_COMPLETION_LENGTH = 70
PROMPTS = ["?", "????", "12", "7?7?7?7", "", "3"]


class Echo:
    """Answers a guess with ``size + number`` pluses: tool turns of each sample's own length."""

    def __init__(self, size: int):
        self.size = size

    def guess(self, number: int) -> str:
        """Guess a digit.

        Args:
            number: the guess.
        """
        return "+" * (self.size + number)


def scripted_model(tokenizer, model=None):
    """One digit after ``<assistant>`` (each at logit 0, ``<eos>`` at -50), ``<eos>`` after a digit (75, digits 25)."""
    if model is None:
        model = build_tiny_causal_lm(tokenizer, hidden_size=32, num_layers=2, num_heads=2, max_positions=256, seed=0)
    points = {tokenizer.convert_tokens_to_ids(digit): (0.0, 1.0) for digit in GUESS_DIGITS}
    points |= {tokenizer.convert_tokens_to_ids("<assistant>"): (1.0, 0.0), tokenizer.eos_token_id: (-2.0, 3.0)}
    return place_tokens(model, points).eval()


def play(model, tokenizer, reuse, greedy, seed=0):
    """One rollout of the tool loop on the transformers backend: the rollout, the logits of every generation step
    (the head's output at each sampled position) and the backend."""
    settings = SamplingSettings(
        max_new_tokens=MAX_COMPLETION_LENGTH, eos_token_ids=(tokenizer.eos_token_id,),
        pad_token_id=tokenizer.pad_token_id, generation_kwargs=digits_only_generation_kwargs(tokenizer),
    )
    backend = TransformersBackend(settings, lambda: contextlib.nullcontext(model), reuse_kv_cache=reuse)
    if greedy:
        backend.generation_config.do_sample = False
    tools = [Toolbox(environment_tools(Echo(size))) for size in range(3, 3 + 5 * len(PROMPTS), 5)]
    template = ConversationTemplate(tokenizer, tools[0].schemas, [tokenizer.eos_token_id])
    loop = ToolLoop(template, MAX_COMPLETION_LENGTH, None, [tokenizer.eos_token_id], tokenizer.pad_token_id)
    rendered = [tokenizer(template.render([{"role": "user", "content": p}], True), add_special_tokens=False)
                for p in PROMPTS]
    ids, mask = left_pad([row["input_ids"] for row in rendered], tokenizer.pad_token_id, torch.device("cpu"))
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: logits.append(output[:, -1].clone()))
    torch.manual_seed(seed)
    try:
        rollout = loop.run(backend, ids, mask, tools)
    finally:
        hook.remove()
        loop.close()
    return rollout, logits, backend, (ids, mask)


def assert_same_rollout(ours, theirs):
    for field in ("ids", "attention_mask", "loss_mask", "truncated"):
        assert torch.equal(getattr(ours.completions, field), getattr(theirs.completions, field)), field
    assert ours.conversations == theirs.conversations
    assert ours.turns == theirs.turns and ours.tool_calls == theirs.tool_calls


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_continuing_the_cache_gives_the_rollout_re_prefilling_gives(greedy):
    tokenizer = guessing_tokenizer()
    model = scripted_model(tokenizer)
    continued, continued_logits, backend, (prompt_ids, prompt_mask) = play(model, tokenizer, True, greedy)
    prefilled, prefilled_logits, plain, _ = play(model, tokenizer, False, greedy)

    turns = continued.turns
    assert max(turns) >= 4 and len(set(turns)) > 1, "samples must go on for several turns and end at different ones"
    assert_same_rollout(continued, prefilled)
    # Every turn after the first continued the cache: of the same contexts, part came from it.
    reuse = backend.cache_reuse
    assert reuse.continued_turns == max(turns) - 1 and reuse.fallback is None
    assert reuse.reused_tokens + reuse.prefilled_tokens == plain.cache_reuse.prefilled_tokens
    assert reuse.reused_tokens > 0
    assert plain.cache_reuse.continued_turns == plain.cache_reuse.reused_tokens == 0
    # The logits of every step are the re-prefill's up to float rounding.
    assert len(continued_logits) == len(prefilled_logits)
    for ours, theirs in zip(continued_logits, prefilled_logits):
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    # The trainer's log-probs are a pass over the tokens alone: the same tokens give the same values.
    logps = [completion_logps(model, prompt_ids, prompt_mask, rollout.completions.ids,
                              rollout.completions.attention_mask)[0] for rollout in (continued, prefilled)]
    assert torch.equal(*logps)


def test_a_call_outside_a_session_and_a_sliding_window_cache_re_prefill():
    tokenizer = guessing_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=256, use_sliding_window=True, sliding_window=16,
        max_window_layers=0, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    sliding = scripted_model(tokenizer, Qwen2ForCausalLM(config))
    continued, _, backend, _ = play(sliding, tokenizer, True, greedy=True)
    prefilled, _, _, _ = play(sliding, tokenizer, False, greedy=True)
    assert_same_rollout(continued, prefilled)
    assert backend.cache_reuse.continued_turns == 0
    assert "DynamicSlidingWindowLayer" in backend.cache_reuse.fallback

    model = scripted_model(tokenizer)
    rollout, _, backend, (prompt_ids, prompt_mask) = play(model, tokenizer, True, greedy=True)
    assert backend._turn_cache is None  # the session's cache went with it
    backend.generate(prompt_ids, prompt_mask)  # outside a session: nothing is kept, nothing continued
    backend.generate(prompt_ids, prompt_mask)
    assert backend.cache_reuse.continued_turns == max(rollout.turns) - 1 and backend._turn_cache is None


def test_a_generate_that_returns_the_bare_sequences_re_prefills_every_turn_and_says_why(monkeypatch):
    """A wrapped or patched ``model.generate`` (scripts patch it to force tool calls) may return the sequences alone
    whatever it is asked for: there is no cache to continue, so every turn re-prefills and gives that rollout."""
    from targetpo.generation.transformers_backend import PLAIN_TENSOR_OUTPUT

    tokenizer = guessing_tokenizer()
    model = scripted_model(tokenizer)
    prefilled, _, _, _ = play(model, tokenizer, False, greedy=True)
    generate = model.generate

    def sequences_only(*args, **kwargs):
        output = generate(*args, **kwargs)
        return output if torch.is_tensor(output) else output.sequences

    monkeypatch.setattr(model, "generate", sequences_only)
    bare, _, backend, _ = play(model, tokenizer, True, greedy=True)
    assert max(bare.turns) >= 4
    assert_same_rollout(bare, prefilled)
    assert backend.cache_reuse.continued_turns == 0 and backend.cache_reuse.fallback == PLAIN_TENSOR_OUTPUT


def test_settings_that_change_the_cache_or_the_decoding_are_refused_for_continuation():
    from targetpo.generation.kv_cache import continuation_problem

    tokenizer = guessing_tokenizer()
    model = scripted_model(tokenizer)
    base = SamplingSettings(max_new_tokens=8, eos_token_ids=(tokenizer.eos_token_id,),
                            pad_token_id=tokenizer.pad_token_id).generation_config()
    assert continuation_problem(model, base, with_images=False, synced_gpus=False) is None
    changes = {"use_cache": False, "cache_implementation": "static", "prefill_chunk_size": 4, "num_beams": 2}
    for key, value in changes.items():
        config = copy.deepcopy(base)
        setattr(config, key, value)
        assert continuation_problem(model, config, with_images=False, synced_gpus=False) is not None, key
    assert "images" in continuation_problem(model, base, with_images=True, synced_gpus=False)
    assert "synced_gpus" in continuation_problem(model, base, with_images=False, synced_gpus=True)


def test_a_lora_adapted_policy_continues_the_cache_too():
    from peft import LoraConfig, get_peft_model

    tokenizer = guessing_tokenizer()
    adapters = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # they change outputs
    adapted = get_peft_model(scripted_model(tokenizer), adapters).eval()
    continued, _, backend, _ = play(adapted, tokenizer, True, greedy=True)
    prefilled, _, _, _ = play(adapted, tokenizer, False, greedy=True)
    assert_same_rollout(continued, prefilled)
    assert backend.cache_reuse.continued_turns == max(continued.turns) - 1 > 0


def test_vision_language_models_and_prompt_learning_adapters_re_prefill():
    from peft import PrefixTuningConfig, get_peft_model
    from transformers.generation.configuration_utils import GenerationConfig
    from vlm_models import build_tiny_vlm

    from targetpo.generation.kv_cache import continuation_problem

    sampling = GenerationConfig(do_sample=True)
    vlm, _ = build_tiny_vlm("qwen2_vl")
    assert "vision-language" in continuation_problem(vlm, sampling, with_images=False, synced_gpus=False)
    prefixed = get_peft_model(scripted_model(guessing_tokenizer()), PrefixTuningConfig(task_type="CAUSAL_LM",
                                                                                        num_virtual_tokens=2))
    assert "prompt-learning" in continuation_problem(prefixed, sampling, with_images=False, synced_gpus=False)
