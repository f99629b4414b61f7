"""densepass: dense passage retrieval training, indexing and evaluation."""

from densepass.errors import DensepassError

__all__ = ["DensepassError"]
__version__ = "0.1.0"
