"""Known-harmless third-party warnings and log lines, filtered once by the entry points (never by importing the
library). Each filter names the exact message and says why it is noise for a mega_depth user; any other warning
(a real deprecation in our own use, a numerical issue) still shows.
"""

from __future__ import annotations

import logging
import warnings

# (message regex, category): why it cannot be acted on
_WARNINGS = (
    # megatron-core / deepspeed without Transformer Engine or Apex fall back to torch implementations: our choice.
    (r".*Transformer Engine and Apex are not installed.*", UserWarning),
    (r".*Apex is not installed.*", UserWarning),
    (r".*[Aa]pex.*not.*(found|installed|available).*", UserWarning),
    (r".*Transformer Engine.*not.*installed.*", UserWarning),
    # a TransformerConfig default that megatron-core itself warns about
    (r".*cuda_graph_scope.*", UserWarning),
    # deprecations inside megatron-core / deepspeed / torch, not in our code
    (r".*torch\.cuda\.amp.*deprecated.*", FutureWarning),
    (r".*`torch\.distributed\._.*` is deprecated.*", FutureWarning),
)

# (logger name, message fragment): why it cannot be acted on
_LOG_LINES = (
    # without --data-cache-path the sample indexes live in memory, which is what we want for small data
    ("megatron.core.datasets.gpt_dataset", "because path_to_cache is None"),
    ("megatron.core.datasets.blended_dataset", "because path_to_cache is None"),
    # a checkpoint writer's failure, logged before it is raised: the save reports it (a full disk in one line)
    ("megatron.core.dist_checkpointing.strategies.filesystem_async", "encountered an error"),
)


class _DropMessages(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_known_warnings() -> None:
    for message, category in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    for name, fragment in _LOG_LINES:
        logging.getLogger(name).addFilter(_DropMessages(fragment))
