"""Checks to run on a GPU node."""
