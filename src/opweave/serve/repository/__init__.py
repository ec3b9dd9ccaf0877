"""The model repository (Triton's layout and repository extension): what a repository is on disk and what a config
says (:mod:`.layout`), the models that come and go while the server runs (:mod:`.repository`), and a model written
as an entry of one (:mod:`.export`, ``opweave export``)."""

from opweave.serve.repository.repository import CONTROL_MODES, Repository

__all__ = ["CONTROL_MODES", "Repository"]
