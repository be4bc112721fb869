"""The distributed layer's error and exit status (no MLX import: the CLI parser reads these)."""

from __future__ import annotations

from edgespec.errors import EdgespecError

# Exit status of a rank that ends because a peer died (mlx.launch then stops the rest).
EXIT_PEER_LOST = 75


class DistributedError(EdgespecError):
    """The group cannot be formed, a rank was lost, or the model cannot be split as asked."""
