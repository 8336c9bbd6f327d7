"""Errors of the network layer."""

from __future__ import annotations


class NetworkError(Exception):
    """Creating or removing a network slot failed."""


class NoFreeSlot(NetworkError):
    """Every slot address of the configured range is in use."""
