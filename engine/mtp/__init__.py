"""Drafting from the target's own hidden state: multi-token prediction (MTP).

- heads.py: Medusa-style MTP heads trained by `python -m engine.train mtp-heads` (weights ship
  in engine/weights/); the MTP drafter (engine/drafters/mtp.py) drafts a chain or a tree with them.
- native.py: a target's own MTP layers (DeepSeek-V3 design) where its config declares them.
- tree.py + trees.yaml: token trees verified in one target forward, and the named tree shapes.
- distilled.py: the small draft model distilled from the target (its first layers, trained
  by `python -m engine.train draft-model`), loaded as the draft spec "distilled:<name>".
"""
