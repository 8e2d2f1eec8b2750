"""Fuzzing of every parser on the edge (hypothesis).

Each module takes one area: arbitrary input either parses or raises the module's
documented error, and a C helper gives what its pure-Python twin gives. A crash
found here becomes an explicit example next to the property it broke.

The profile (tests/fuzz/conftest.py) is brief by default, for CI;
``CHANGESTREAMER_FUZZ_PROFILE=long`` (``scripts/fuzz``) runs many more examples.
"""
