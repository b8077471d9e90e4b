"""Drafters: everything that proposes tokens for the target to verify.

One protocol (`Drafter`), one registry. The decoding loop never branches on which drafter
it has; new drafters (MTP heads, ...) register here.
"""

from engine.drafters.base import DraftProposal, Drafter, DrafterSpec, build_drafter, drafter_names, register

__all__ = ["DraftProposal", "Drafter", "DrafterSpec", "build_drafter", "drafter_names", "register"]

# importing the modules registers their drafters
from engine.drafters import draft_model, early_exit, mtp, prompt_lookup  # noqa: E402,F401
