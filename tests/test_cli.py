"""The command line's parser: --help in sections by concern, no abbreviations, mistakes as one error message."""

import dataclasses

import pytest
from transformers import TrainingArguments

from targetpo import GRPOConfig, TargetPOConfig
from targetpo.cli import TRAINER_FLAG_GROUP, FlagParser
from targetpo.config.fields import FLAG_GROUPS, close_names


def help_sections(text: str) -> dict[str, list[str]]:
    """Each section of a --help text, in order, with the flags it lists (each option line's first flag, no dashes)."""
    sections = {}
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            listed = sections.setdefault(line[:-1], [])
        elif line.startswith("  --"):
            listed.append(line.split()[0].rstrip(",")[2:])
    return sections


def flag_names(*dataclass_types) -> set[str]:
    """Every flag the parser should list: each field, and `no_<field>` for a switch that is on by default."""
    specs = [spec for dtype in dataclass_types for spec in dataclasses.fields(dtype) if spec.init]
    return {spec.name for spec in specs} | {f"no_{spec.name}" for spec in specs if spec.default is True}


def refusal(parser: FlagParser, argv: list[str], capsys) -> str:
    """What the parser prints when it refuses `argv` (it exits with argparse's usage-error status, 2)."""
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args_into_dataclasses(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_help_lists_each_flag_once_in_its_section_tpo_first():
    sections = help_sections(FlagParser(TargetPOConfig).format_help())
    assert sections["options"] == [], "fields in no section: name each in targetpo.config.fields.FLAG_GROUPS"
    titles = [title for title, listed in sections.items() if listed]
    assert titles == [*FLAG_GROUPS, TRAINER_FLAG_GROUP] and titles[0] == "TPO"  # the Trainer's last
    listed = [name for names in sections.values() for name in names]
    assert sorted(listed) == sorted(flag_names(TargetPOConfig))  # each exactly once
    trainer_fields = {spec.name for spec in dataclasses.fields(TrainingArguments)}
    for title, names in sections.items():
        fields = {name for name in names if name in flag_names(TargetPOConfig) and not name.startswith("no_")}
        expected = set(FLAG_GROUPS.get(title, ())) or trainer_fields - {n for g in FLAG_GROUPS.values() for n in g}
        assert fields == (expected if names else set()), title
    assert "learning_rate" in sections[TRAINER_FLAG_GROUP] and "no_disable_dropout" in sections["model"]


def test_a_script_s_own_flags_join_the_sections_it_names():
    @dataclasses.dataclass
    class ScriptFlags:
        model_name_or_path: str = "m"
        dataset_name: str = "d"
        unlisted: int = 0

    parser = FlagParser((ScriptFlags, GRPOConfig), groups={"model": ("model_name_or_path",), "data": ("dataset_name",)})
    sections = help_sections(parser.format_help())
    assert sections["model"][0] == "model_name_or_path" and sections["data"][0] == "dataset_name"
    assert sections["options"] == ["unlisted"]
    assert [title for title, listed in sections.items() if listed][1] == "TPO"  # GRPOConfig's loss_type


def test_close_names_read_misspellings_initials_and_beginnings():
    fields = [spec.name for spec in dataclasses.fields(TargetPOConfig)]
    assert close_names("num_generation", fields)[:2] == ["num_generations", "num_generations_eval"]
    assert close_names("lr", fields)[0] == "learning_rate"  # its initials
    assert close_names("vllm_gpu_mem", fields)[0] == "vllm_gpu_memory_utilization"  # its beginning
    assert close_names("tpo_target_temprature", fields)[0] == "tpo_target_temperature"  # its spelling
    assert close_names("zzyzx", fields) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num_generation", "8"], "error: --num_generation is not a flag: did you mean --num_generations, "),
        (["--num-generation=8"], "error: --num-generation is not a flag: did you mean --num_generations, "),
        # No abbreviations: --lr names the flags it may have meant instead of choosing one of the --lr_* flags.
        (["--lr", "1e-5"], "error: --lr is not a flag: did you mean --learning_rate, "),
        (["--num_generations", "4", "--zzyzx", "1"], "error: --zzyzx is not a flag (see --help)."),
        (["stray"], "error: unrecognized arguments: stray"),
    ],
)
def test_an_unknown_flag_is_one_error_naming_the_closest_flags(tmp_path, capsys, argv, message):
    err = refusal(FlagParser(TargetPOConfig), [*argv, "--output_dir", str(tmp_path)], capsys)
    assert message in err
    assert len(err.splitlines()) == 2 and "Traceback" not in err  # the usage line and the error


def test_a_misspelt_flag_is_named_before_the_settings_it_leaves_wrong(tmp_path, capsys):
    # --num_generation 4 leaves num_generations at 8, which 4 completions per step would refuse.
    argv = ["--num_generation", "4", "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path)]
    assert "--num_generation is not a flag" in refusal(FlagParser(TargetPOConfig), argv, capsys)


def test_a_refused_setting_is_the_config_s_message_without_a_traceback(tmp_path, capsys):
    argv = ["--num_generations", "3", "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path)]
    with pytest.raises(ValueError) as raised:  # the same settings in Python
        TargetPOConfig(num_generations=3, per_device_train_batch_size=4, output_dir=str(tmp_path))
    err = refusal(FlagParser(TargetPOConfig), argv, capsys)
    assert err.splitlines()[-1].endswith(f"error: {raised.value}") and "whole prompt groups" in err
    assert len(err.splitlines()) == 2


def test_known_flags_and_remaining_strings_parse_as_before(tmp_path):
    parser = FlagParser(TargetPOConfig)
    (args,) = parser.parse_args_into_dataclasses(["--tpo_target_temperature", "0.5", "--output_dir", str(tmp_path)])
    assert args.tpo_target_temperature == 0.5
    args, remaining = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--other", "1"], return_remaining_strings=True
    )
    assert remaining == ["--other", "1"]
