"""Collectives: their lowering to functional collectives, and graph emission."""
