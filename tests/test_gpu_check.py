"""scripts/gpu_check.sh's plan fits a lent device: every call's parts, with their kill grace, add
up within the call's timeout_s (at most 300 s), and the three calls of a first session within 11
minutes of the 15 a session has (its machine's start included)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_each_call_s_part_limits_add_up_within_its_timeout_and_the_first_three_within_11_minutes() -> None:
    plan = subprocess.run(["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=30)
    assert plan.returncode == 0, plan.stderr
    calls = re.findall(r"^call (\d): (.*) = (\d+) s, (\w+) its timeout_s (\d+)$", plan.stdout, re.M)
    assert [c[0] for c in calls] == ["1", "2", "3", "4"], plan.stdout
    for number, terms, total, verdict, timeout_s in calls:
        limits = [int(a) + int(b) for a, b in re.findall(r"\w[\w-]* (\d+)\+(\d+)", terms)]
        fixed = [int(n) for n in re.findall(r"(?:setup|end) (\d+)", terms)]
        assert sum(limits) + sum(fixed) == int(total) <= int(timeout_s) <= 300, f"call {number}: {terms}"
        assert verdict == "within"
    assert sum(int(c[4]) for c in calls[:3]) <= 660


def test_a_call_it_does_not_know_is_refused_naming_the_choices() -> None:
    done = subprocess.run(["bash", str(SCRIPT), "--call", "9"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--call 1|2|3|4" in done.stdout
