"""Plumbing shared by every service, below them all: the Redis registry, server helpers, TLS identities,
the tensor channel. Imports no service."""
