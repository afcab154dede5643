"""Builders, stand-ins and fixtures the test suites share (one place for every fake)."""
