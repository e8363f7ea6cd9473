"""Helpers behind `rules/common.smk`: settings per rule, cluster requests."""
