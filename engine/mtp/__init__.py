"""Drafting from the target's own hidden state: multi-token prediction (MTP).

- tree.py + trees.yaml: token trees verified in one target forward, and the named tree shapes.
"""
