"""The drafts of speculative rollouts, one file each behind one interface (`base.py`): which cached keys a draft's
decode query reads. Importing this package registers every draft: a new one is a file here plus its line below."""

from . import block, window  # noqa: F401 - each registers its draft
from .base import DRAFTS, DenseDraft, build_draft, draft_from_config, register_draft  # noqa: F401
from .window import WindowDraft  # noqa: F401
