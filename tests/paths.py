"""Where the checkout and the shared fixtures are, for test modules at any depth under tests/."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = REPO_ROOT.parent / "shared"
DATACAPTURE = SHARED / "fixtures" / "datacapture"
