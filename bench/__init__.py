"""Benchmarks run by ``make bench``: they print figures and ratios, they are not tests."""
