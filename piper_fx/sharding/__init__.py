"""Placement: the device mesh, sharded parameter layout and placement specs."""
