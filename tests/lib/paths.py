"""Where things are: the repository, the tests and their data, whatever folder a test lives in."""

from __future__ import annotations

from pathlib import Path

LIB = Path(__file__).resolve().parent
TESTS = LIB.parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
