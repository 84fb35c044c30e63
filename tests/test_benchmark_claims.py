"""What the docs claim of a recorded benchmark is what its record says: the learning-efficiency table in
docs/benchmarks.md and the README's row are recomputed here from docs/benchmarks/learning_efficiency.json, runs and
all (final success = mean of each run's last three logs), and the README row says where the comparison is not like for
like. The Table 3 report's claims are checked in test_paper_table3.py."""

import json
import re
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "docs" / "benchmarks" / "learning_efficiency.json").read_text())
NAMES = {"targetpo-tpo": "targetpo TPO", "targetpo-grpo": "targetpo GRPO", "trl-grpo": "TRL GRPOTrainer"}


def recomputed():
    """(H, method) -> (seeds, final mean, final min, final max, mean over training), from the runs' curves."""
    table = {}
    for (length, method) in sorted({(run["length"], run["method"]) for run in RECORD["runs"]}):
        curves = [[value for _, value in run["curve"]] for run in RECORD["runs"]
                  if (run["length"], run["method"]) == (length, method)]  # fmt: skip
        finals = [statistics.fmean(curve[-3:]) for curve in curves]
        overall = statistics.fmean(value for curve in curves for value in curve)
        table[length, method] = (len(curves), statistics.fmean(finals), min(finals), max(finals), overall)
    return table


def test_the_learning_efficiency_table_is_its_record():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    section = text[text.index("## Learning efficiency under a terminal reward") :]
    rows = re.findall(r"^\| (\d) \| \**([^|*]+?)\** \| (\d) \| \**([\d.]+)\** \[([\d.]+), ([\d.]+)\] \| \**([\d.]+)\** \|$",
                      section, flags=re.MULTILINE)  # fmt: skip
    assert len(rows) == len(recomputed()) == 6
    for length, name, seeds, final, low, high, overall in rows:
        method = next(method for method, shown in NAMES.items() if shown == name)
        expected = recomputed()[int(length), method]
        assert int(seeds) == expected[0], (length, name)
        for shown, value in zip((final, low, high, overall), expected[1:]):
            assert float(shown) == round(value, 3), (length, name, shown, value)


def test_the_readme_row_is_the_records_h8_finals_and_says_it_is_not_like_for_like():
    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if "8-bit reversal after 1,500" in line)
    tpo, grpo, trl = (round(recomputed()[8, method][1], 3) for method in ("targetpo-tpo", "targetpo-grpo", "trl-grpo"))
    assert f"**{tpo}** (TPO); {grpo} with the GRPO loss | {trl} |" in row
    assert "5 seeds" in row and recomputed()[8, "trl-grpo"][0] == 5
    assert "**Not like for like**" in row and "dapo" in row and "all 6 tokens" in row
