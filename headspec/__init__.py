"""The head contract: what a P-EAGLE head directory is, everywhere in the product.

Its configuration and tensor shapes (:mod:`headspec.config`), its files and manifest
(:mod:`headspec.files`), the checks a head passes before any replica loads it
(:mod:`headspec.validate`) and how a reference to one is resolved to a directory
(:mod:`headspec.resolve`). No torch and no vLLM: training, the registry, the swap
protocol, the bench and the controller all use these definitions.
"""

from headspec.config import DrafterConfig, shape_differences, shape_signature
from headspec.errors import HeadError
from headspec.files import MANIFEST, WEIGHTS, read_manifest, sha256_file, target_identity
from headspec.resolve import resolve_head
from headspec.validate import HeadInfo, validate_head

__all__ = ["DrafterConfig", "HeadError", "HeadInfo", "MANIFEST", "WEIGHTS", "read_manifest", "resolve_head",
           "sha256_file", "shape_differences", "shape_signature", "target_identity", "validate_head"]
