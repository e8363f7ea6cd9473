"""Tiny target models for the demo and the tests, built from configs (nothing downloaded)."""
