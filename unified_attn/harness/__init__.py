"""Conformance suite, migration harness and benchmark helpers."""
