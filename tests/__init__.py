"""The test suite, one package per topic (`python -m pytest` from the repository root; see the README's Development)."""
