"""Feature drafts shipped with the package, one directory per name `--draft` takes.

`default-feature/` reads the default target's hidden features (models/feature_draft.py): trained
here by `specdec train-draft --config cluster/training/feature-draft.yaml`, its acceptance head in
its `head/` when one is trained for it; its training report is docs/training.md. Its config records
the identity of its target, so loading it on another target fails.
"""

from __future__ import annotations

from pathlib import Path

DRAFTS_DIR = Path(__file__).resolve().parent
SHIPPED_FEATURE_DRAFTS = {"default-feature": DRAFTS_DIR / "default-feature"}  # name -> its directory


def draft_dir(source: str | Path) -> Path:
    """The directory a draft source names: a shipped feature draft's for its name, else the path."""
    shipped = SHIPPED_FEATURE_DRAFTS.get(str(source))
    return shipped if shipped is not None else Path(source).expanduser()
