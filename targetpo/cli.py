"""The command line: config fields as flags, listed by concern, with mistakes reported in one message."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

from transformers import HfArgumentParser, TrainingArguments

from .config.fields import FLAG_GROUPS, close_names, either

#: The last section of --help: the fields of transformers' TrainingArguments (optimiser, schedule, saving, ...).
TRAINER_FLAG_GROUP = "the Trainer's (TrainingArguments)"


class FlagParser(HfArgumentParser):
    """An `HfArgumentParser` whose --help lists the flags in sections (`FLAG_GROUPS`' order, TPO first, the Trainer's
    last), that takes no abbreviations (`--lr` is refused, not read as some `--lr_*`), and that reports an unknown flag
    with the closest real ones, and a config's refusal (its ValueError), as one error message.

    `groups` places the flags of a script's own dataclasses: section title -> field names. A field no table names is
    listed under argparse's "options".
    """

    def __init__(self, dataclass_types, groups: Mapping[str, Iterable[str]] | None = None, **kwargs):
        groups = groups or {}
        trainer_fields = {spec.name for spec in dataclasses.fields(TrainingArguments)}
        self._flag_group = dict.fromkeys(trainer_fields, TRAINER_FLAG_GROUP)
        for table in (FLAG_GROUPS, groups):
            self._flag_group.update({name: title for title, names in table.items() for name in names})
        self._group_titles = list(dict.fromkeys([*FLAG_GROUPS, *groups, TRAINER_FLAG_GROUP]))
        self._sections = {}  # title -> argument group, made when the first field is added
        kwargs.setdefault("usage", "%(prog)s [--flag value ...]  (--help lists every flag)")
        super().__init__(dataclass_types, allow_abbrev=False, **kwargs)

    def add_argument(self, *flags, **kwargs):
        """Add a flag to its field's section (HfArgumentParser adds every field's flags through this)."""
        title = self._flag_group.get(kwargs.get("dest") or flags[0].lstrip("-"))
        if title is None:
            return super().add_argument(*flags, **kwargs)
        if not self._sections:  # made all at once, so that --help lists them in their order
            self._sections = {each: self.add_argument_group(each) for each in self._group_titles}
        return self._sections[title].add_argument(*flags, **kwargs)

    def parse_args_into_dataclasses(self, args=None, return_remaining_strings=False, **kwargs):
        """The dataclasses, or exit with an error message (no traceback) for an unknown flag or a refused value."""
        if not return_remaining_strings:
            self.refuse_unknown_flags(self.parse_known_args(args)[1])
        try:
            return super().parse_args_into_dataclasses(args, return_remaining_strings, **kwargs)
        except ValueError as error:  # a config's check: its message names the setting and the fix
            self.error(str(error))

    def refuse_unknown_flags(self, unknown: list[str]) -> None:
        """Exit with a line per unknown flag naming the closest real ones; a stray value is named as it is."""
        if not unknown:
            return
        known = [spec.name for dtype in self.dataclass_types for spec in dataclasses.fields(dtype) if spec.init]
        lines = []
        for flag in (arg.split("=", 1)[0] for arg in unknown if arg.startswith("-")):
            close = close_names(flag.lstrip("-").replace("-", "_"), known)
            hint = f": did you mean {either([f'--{name}' for name in close])}?" if close else " (see --help)."
            lines.append(f"{flag} is not a flag{hint}")
        self.error("\n".join(lines) or f"unrecognized arguments: {' '.join(unknown)}")
