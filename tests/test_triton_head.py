"""``logps_head_kernel="triton"``: the Triton kernels of the output head, where they run and where they are refused.

Triton's kernels run on a GPU, or on the CPU in Triton's interpreter, which must be on (``TRITON_INTERPRET=1``)
before Triton is first imported, and this process imported it at start-up (through transformers). So the numerical
checks, ``tests/scripts/triton_head_checks.py``, run in a process of their own: in the interpreter on a CPU, with
the compiled kernels on a CUDA GPU. The checks here need no kernel to run.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import count_letters_reward, make_config

from targetpo import TargetPOConfig, TargetPOTrainer
from targetpo.modeling.loading import cast_output_head_to_fp32
from targetpo.modeling.logps import triton_head_problem
from targetpo.step.forward import PolicyLogps

triton_head = pytest.importorskip("targetpo.modeling.triton_head", reason="needs Triton: pip install triton")

ROOT = Path(__file__).resolve().parents[1]


def test_the_kernels_against_float64_references_and_a_training_step(request):
    """Runs tests/scripts/triton_head_checks.py; its training step is marked slow and follows this run's ``-m``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    command = [sys.executable, "-m", "pytest", "tests/scripts/triton_head_checks.py", "-q", "-p", "no:cacheprovider"]
    markers = request.config.getoption("markexpr")
    if markers:
        command += ["-m", markers]
    result = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@pytest.mark.skipif(triton_head.runs_interpreted(), reason="the interpreter's kernels are not compiled")
def test_the_kernels_compile_for_a_gpu():
    # Without a GPU: Triton's compiler, down to the machine code of an H100 (sm_90), checks what the interpreter
    # lets pass (types of values carried round the loops, of loads and stores).
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    types = {"row_stride": "i32", "token_ids_ptr": "*i64", "vocab_size": "i32", "inv_temperature": "fp32"}
    types |= {"BLOCK": "constexpr", "ENTROPY_GRAD": "constexpr"}  # every other argument: a float32 pointer
    kernels = [(triton_head._stats_kernel, {})]
    kernels += [(triton_head._grad_kernel, {"ENTROPY_GRAD": flag}) for flag in (False, True)]
    for dtype in ("*bf16", "*fp16", "*fp32"):
        for kernel, constants in kernels:
            signature = {name: dtype if name == "logits_ptr" else types.get(name, "*fp32") for name in kernel.arg_names}
            source = ASTSource(kernel, signature=signature, constexprs={"BLOCK": 4096, **constants})
            compiled = compile(
                source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "enable_fp_fusion": True}
            )
            assert compiled.asm["cubin"], (kernel, dtype)


def test_liger_and_the_triton_head_are_not_asked_for_together(tmp_path):
    with pytest.raises(ValueError, match="use_liger_kernel=True .* logps_head_kernel='triton'"):
        make_config(tmp_path, use_liger_kernel=True, logps_head_kernel="triton")
    assert TargetPOConfig(output_dir=str(tmp_path)).logps_head_kernel == "auto"
    make_config(tmp_path, use_liger_kernel=True)  # "auto" leaves the head to Liger


@pytest.mark.skipif(
    torch.cuda.is_available() or triton_head.runs_interpreted(), reason="Triton's kernels can run in this process"
)
def test_the_triton_head_is_refused_where_its_kernels_cannot_run(
    tmp_path, tiny_model, tokenizer, prompt_dataset, monkeypatch
):
    def trainer():
        args = make_config(tmp_path, logps_head_kernel="triton")
        TargetPOTrainer(
            tiny_model, count_letters_reward, args=args, train_dataset=prompt_dataset, processing_class=tokenizer
        )

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="need a GPU and this run is on the CPU.*TRITON_INTERPRET=1"):
        trainer()
    # Set now, it comes too late: Triton was imported without its interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="set after Triton was imported"):
        trainer()
    with pytest.raises(RuntimeError, match="logps_head_kernel='triton': .*set after Triton was imported"):
        triton_head.logits_stats(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), 1.0)


def logps_settings(model, chunk_size=512, sharded=False):
    return PolicyLogps.for_model(
        model, model, 1.0, set(), torch.device("cpu"), sharded, False, chunk_size, rows_per_pass=8,
        head_kernel="triton",
    )  # fmt: skip


def test_where_the_triton_head_cannot_apply_a_warning_says_why_and_torch_computes_it(tiny_model):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain head: no warning
        assert logps_settings(tiny_model).head_kernel == "triton"
    for settings, reason in (
        ({"chunk_size": 0}, "logps_chunk_size=0 asks for one full logits tensor"),
        ({"sharded": True}, "the weights are sharded"),
    ):
        with pytest.warns(UserWarning, match=f"logps_head_kernel='triton': .*torch instead because {reason}"):
            assert logps_settings(tiny_model, **settings).head_kernel == "torch"
    head = tiny_model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda module, args: None)  # as offloading hooks do
    with pytest.warns(UserWarning, match="has hooks or a replaced forward"):
        assert logps_settings(tiny_model).head_kernel == "torch"
    handle.remove()
    assert triton_head_problem(tiny_model) is None
    head.double()
    assert "torch.float64, which the kernels would round to float32" in triton_head_problem(tiny_model)
    head.float()
    tiny_model.config.final_logit_softcapping = 30.0
    assert "post-processes its logits" in triton_head_problem(tiny_model)
    tiny_model.config.final_logit_softcapping = None
    cast_output_head_to_fp32(tiny_model)  # a Float32OutputHead, computed in float32 (tied or not)
    assert "is a Float32OutputHead, not a plain torch.nn.Linear" in triton_head_problem(tiny_model)


def test_a_head_that_changes_after_set_up_is_computed_by_torch_with_a_warning(tiny_model):
    from targetpo.modeling.logps import _head_in_chunks

    assert logps_settings(tiny_model).head_kernel == "triton"  # plain at set-up
    head = tiny_model.get_output_embeddings()
    hidden = torch.randn(6, head.in_features, requires_grad=True, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([1, 4, 2, 7, 3, 5])
    expected, _ = _head_in_chunks(head, hidden, tokens, 0.7, None, 4, False, head_kernel="torch")
    head.register_forward_hook(lambda module, args, output: None)  # hooked later, as a debugging tool would
    with pytest.warns(UserWarning, match="logps_head_kernel='triton': torch computes .* changed after .* has hooks"):
        logps, _ = _head_in_chunks(head, hidden, tokens, 0.7, None, 4, False, head_kernel="triton")
    torch.testing.assert_close(logps, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
def test_an_adapted_head_is_no_plain_linear_head(tiny_model):
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(tiny_model, LoraConfig(r=2, target_modules=["lm_head"]))
    assert "is a Linear, not a plain torch.nn.Linear" in triton_head_problem(adapted)  # peft's LoRA Linear
