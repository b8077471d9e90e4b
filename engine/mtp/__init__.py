"""Drafting from the target's own hidden state: multi-token prediction (MTP), and the small
draft model distilled from the target.

- heads.py: Medusa-style MTP heads trained by `python -m engine.train mtp-heads`; the "mtp"
  drafter (engine/drafters/mtp.py) drafts a chain or a tree with them.
- native.py: a target's own MTP layers (DeepSeek-V3 design) where its config declares them.
- tree.py + trees.yaml: token trees verified in one target forward, and the named tree shapes.
- distilled.py: the draft model made of the target's first layers, trained by
  `python -m engine.train draft-model`, loaded as the draft spec "distilled:<name>".
- weights.py: storing only the trained parameters + a JSON card (shipped in engine/weights/).
"""
