"""Hugging Face repository ids as model names: `owner/repo`, `owner/repo@revision`, and for GGUF
repositories a file selector, `owner/repo:Q4_K_M` (a quantisation) or `owner/repo:file.gguf`.

Both may be given, revision first: `owner/repo@v1.0:Q8_0`. An `hf:` prefix is accepted (the form
card fields have used for sidecars and assistants). Whether the repository exists is the hub's
answer, asked later (models/hub_repos.py); this module only reads the name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# owner/repo, then @revision (a branch, tag or commit: no ':' in a git ref), then :selector
_SPEC = re.compile(r"(?:hf:)?(?P<repo>[^/@:\s]+/[^/@:\s]+)"
                   r"(?:@(?P<revision>[A-Za-z0-9][\w./-]*))?"
                   r"(?::(?P<selector>[A-Za-z0-9][\w./+-]*))?")


@dataclass(frozen=True)
class RepoRef:
    """A repository named as a model: the repo id, the revision asked for (None: the hub's
    default branch) and, for GGUF repositories, the selector (a quantisation or a file name)."""

    repo: str
    revision: str | None = None
    selector: str | None = None

    @property
    def id(self) -> str:
        """The name as the cluster knows the model: the spec, without an `hf:` prefix."""
        return (self.repo + (f"@{self.revision}" if self.revision else "")
                + (f":{self.selector}" if self.selector else ""))

    @property
    def selects_file(self) -> bool:
        """The selector names a file (`x.gguf`), not a quantisation."""
        return bool(self.selector) and str(self.selector).lower().endswith(".gguf")


def parse_repo_ref(spec: str) -> RepoRef | None:
    """The repository `spec` names, or None when it is not a repository id (the hub's own rules
    for the `owner/repo` part: huggingface_hub.utils.validate_repo_id)."""
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        return None
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(m.group("repo"))
    except HFValidationError:
        return None
    revision, selector = m.group("revision"), m.group("selector")
    for part in (revision, selector):
        if part is not None and (".." in part.split("/") or part.endswith("/")):
            return None
    return RepoRef(m.group("repo"), revision, selector)


def store_name(ref: RepoRef, file: str = "") -> str:
    """A folder name for what the store makes of a repository (a GGUF converted for MLX):
    `hf--owner--repo[@revision][--file stem]`, safe on any filesystem."""
    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._@-]", "_", text)

    owner, name = ref.repo.split("/", 1)
    out = f"hf--{safe(owner)}--{safe(name)}"
    if ref.revision:
        out += f"@{safe(ref.revision)}"
    if file:
        stem = file.rsplit("/", 1)[-1]
        out += f"--{safe(stem[:-5] if stem.lower().endswith('.gguf') else stem)}"
    return out
