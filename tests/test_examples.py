import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_classic_question_example_runs():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "classic_question.py"), "--num-samples", "100"],
        capture_output=True, text=True, check=True, timeout=600,
    )
    assert "speed-up" in out.stdout
