"""Typed exceptions. The CLI turns each into a one-line message and a non-zero exit."""


class MagicDecError(Exception):
    """Base class of every error magicdec raises on purpose."""


class ModelLoadError(MagicDecError):
    """A checkpoint is missing, truncated, corrupt or unreadable."""


class UnsupportedModelError(MagicDecError):
    """The checkpoint is readable but its architecture or a feature of it is not supported."""


class InvalidRequestError(MagicDecError):
    """A prompt or a sampling parameter is invalid (empty prompt, too long, bad temperature, ...)."""


class OutOfMemoryError(MagicDecError):
    """A batch cannot fit in the memory of the device; raised before anything is allocated."""


class DistributedError(MagicDecError):
    """A tensor-parallel collective failed or timed out: another rank died, hung, or cannot be reached."""


class MagicDecWarning(UserWarning):
    """Something worked, but not as well as it should (e.g. the converted-weights cache is not writable)."""
