"""The options chat, generate and serve share: one declaration of each flag, and one way from
flags to the options of `LLM`."""
from __future__ import annotations

from localrun.errors import UserError


def speculative_options(draft_model: str | None, spec: str | None) -> dict:
    """LLM options for --draft-model / --spec (one of them at most)."""
    if draft_model and spec:
        raise UserError("Give either --draft-model or --spec, not both.")
    if spec is not None and spec != "ngram":
        raise UserError(f"Unknown --spec {spec!r}; the one method without a draft model is 'ngram'.")
    return {"speculative": draft_model or spec}
