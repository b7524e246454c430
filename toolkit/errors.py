"""Errors edgeprobe raises on bad input.

Every message says what is wrong and what to do about it. Each class also derives from the
built-in exception a caller would expect (FileNotFoundError, ValueError), so generic handlers work.
"""


class EdgeprobeError(Exception):
    """Base class of every error edgeprobe raises on purpose."""


class ModelNotFoundError(EdgeprobeError, FileNotFoundError):
    """A model name is not built in, or a model path does not exist."""


class ModelFormatError(EdgeprobeError, ValueError):
    """A model file exists but is not a readable checkpoint (not GGUF, truncated, corrupt)."""


class UnsupportedModelError(EdgeprobeError, ValueError):
    """A readable checkpoint whose architecture or tensor type edgeprobe does not implement."""


class TextError(EdgeprobeError, ValueError):
    """An evaluation text that cannot be used (empty, shorter than one window)."""


class WindowError(EdgeprobeError, ValueError):
    """An evaluation window length that cannot be used."""


class TokenRangeError(EdgeprobeError, ValueError):
    """Token ids outside the model's vocabulary, or more tokens than the cache holds."""


class CorpusNotFoundError(EdgeprobeError, FileNotFoundError):
    """The bundled corpus is missing (rebuild it with datasets/build_corpus.py)."""


class StatsMismatchError(EdgeprobeError, ValueError):
    """Two profiles that cannot be merged (different model, kind or thresholds)."""


class StatsFileError(EdgeprobeError, ValueError):
    """A saved profile that cannot be loaded (damaged, another format version, another kind)."""


class UnknownSchemeError(EdgeprobeError, ValueError):
    """A quantization scheme name that edgeprobe does not implement."""


class ManifestError(EdgeprobeError, ValueError):
    """A quantized model whose manifest or blobs are missing, damaged or inconsistent."""


class ClusterError(EdgeprobeError, RuntimeError):
    """A Ray cluster that cannot be reached or used, or a profile shard that failed on it."""


class FarmError(EdgeprobeError, RuntimeError):
    """Devices of a farm that could not be opened or used (each named with its reason)."""


class DeviceError(EdgeprobeError, RuntimeError):
    """The agent answered a request with an error; `code` names it (see docs/protocol.md)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{message} [{code}]")
        self.code = code


class AgentLostError(EdgeprobeError, ConnectionError):
    """The agent stopped answering (killed, network cut) within the heartbeat timeout."""


class AgentUnreachableError(AgentLostError):
    """Nothing listens at a --device tcp:// address (no agent was ever there): start one or use --device local."""


class NotAnAgentError(AgentUnreachableError):
    """Something listens at a --device tcp:// address but does not speak the agent's protocol (ZeroMQ ZMTP)."""


class DeployError(EdgeprobeError, RuntimeError):
    """The SSH deployment failed; the message says at which step and what to check."""


class NotSSHServerError(DeployError):
    """The --device ssh:// port answers, but not with an SSH banner (an HTTP server, an agent's port)."""


class SSHTimeoutError(DeployError):
    """The --device ssh:// port accepts connections but sends no SSH banner within the timeout."""
