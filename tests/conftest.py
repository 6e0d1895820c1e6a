"""Shared test set-up. ``tests/`` is on sys.path (pytest's rootdir conftest), so tests
import their helpers as ``helpers.<module>``; spawned ranks inherit that path."""
