"""Helpers that tests and bench scripts share: personas and real processes on loopback.

Not part of the gateway: nothing under the apps imports it.
"""
