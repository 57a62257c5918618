"""Test utilities shared by integration, e2e and crash tests."""
