"""Fakes for tests. There is exactly one: a fake NVML (fake_nvml.py), fed by recorded values under nvml/."""
