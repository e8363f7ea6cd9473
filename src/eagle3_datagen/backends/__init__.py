"""Inference backends for the responses stage, side by side behind `responses.Backend`."""
