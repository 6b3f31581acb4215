"""Where the tests find the repository: its root (the launcher's working directory) and tests/data."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
